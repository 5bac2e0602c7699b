"""GRPO's two formulas: group-normalised advantages and the clipped policy loss.

For a prompt with G sampled completions and rewards ``r_1..r_G``, each completion's advantage is
``(r_i - mean(r)) / (std(r) + eps)``, shared by all its tokens. The loss is PPO's clipped
surrogate per token, with the importance ratio taken against the rollout engine's logprobs of
the sampled tokens (``old``): under one precision flow and one update per batch that ratio is 1
up to the measured engine/trainer mismatch. Tokens are averaged over the whole batch
(token-level mean), so long completions are not down-weighted. An optional KL penalty to a
reference policy uses the k3 estimator. Optional per-token ``weights`` (rollout correction,
``correction.py``) scale each token's surrogate term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``rewards`` of shape (prompts, G) -> advantages of the same shape. A group whose
    completions all scored the same gets zero advantages (it carries no signal)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"group_advantages needs (prompts, G >= 2) rewards; got shape {tuple(rewards.shape)}")
    rewards = rewards.double()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return ((rewards - mean) / (std + eps)).float()


@dataclass
class LossParts:
    """The sum of per-token losses of one micro-batch and what to log about it."""

    loss_sum: torch.Tensor
    tokens: int
    clipped: int


def clipped_policy_loss(
    new_logprobs: list[torch.Tensor],
    old_logprobs: list[torch.Tensor],
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    ref_logprobs: list[torch.Tensor] | None = None,
    beta: float = 0.0,
    weights: list[torch.Tensor] | None = None,
) -> LossParts:
    """Sum over tokens of ``-w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + beta * k3``
    (``w`` = ``weights``, 1 where not given).

    Divide ``loss_sum`` by the batch's total token count for the token-level mean (done by the
    caller, so that micro-batches accumulate into the same mean).
    """
    if not (len(new_logprobs) == len(old_logprobs) == advantages.numel()):
        raise ValueError(
            f"clipped_policy_loss: {len(new_logprobs)} new, {len(old_logprobs)} old logprob sequences, "
            f"{advantages.numel()} advantages"
        )
    device = new_logprobs[0].device
    new = torch.cat(new_logprobs)
    old = torch.cat([o.to(device, torch.float32) for o in old_logprobs])
    adv = torch.cat([a.expand(len(n)) for a, n in zip(advantages.to(device).unbind(), new_logprobs)])
    ratio = torch.exp(new - old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * torch.cat([w.to(device, torch.float32) for w in weights])
    if beta and ref_logprobs is not None:
        ref = torch.cat([r.to(device, torch.float32) for r in ref_logprobs])
        d = ref - new
        per_token = per_token + beta * (torch.expm1(d) - d)
    return LossParts(per_token.sum(), int(new.numel()), int((clipped < unclipped).sum()))  # where the clip binds
