"""How far the rollout engine's sampling distribution is from the trainer's, on sampled tokens.

For each sampled token, ``d = log p_trainer - log p_rollout``. With samples drawn from the
rollout policy, ``r = exp(d)`` is the importance ratio the policy loss divides by; on-policy
means ``r == 1``. Reported:

- ``logprob_abs_diff_mean`` / ``logprob_abs_diff_max``: mean and max ``|d|``;
- ``mismatch_kl``: the k3 estimator of KL(rollout || trainer), ``r - 1 - log r``, token mean
  (unbiased, always >= 0; Schulman's "Approximating KL divergence");
- ``ratio_outside_frac``: fraction of tokens with ``r`` outside [0.5, 2], i.e. ``|d| > ln 2``,
  the tokens a clipped or truncated importance weight would distort the most.
"""

from __future__ import annotations

import math

import torch

_LN2 = math.log(2.0)


def mismatch_metrics(rollout_logprobs, trainer_logprobs) -> dict[str, float]:
    """Mismatch of two equally long sequences of sampled-token logprobs (lists or tensors,
    flat or nested per completion)."""
    rollout, trainer = _flat(rollout_logprobs), _flat(trainer_logprobs)
    if rollout.shape != trainer.shape:
        raise ValueError(f"mismatch_metrics: {rollout.numel()} rollout logprobs but {trainer.numel()} trainer logprobs")
    if rollout.numel() == 0:
        raise ValueError("mismatch_metrics: no tokens to compare")
    d = trainer - rollout
    k3 = torch.expm1(d) - d
    return {
        "tokens": int(d.numel()),
        "logprob_abs_diff_mean": d.abs().mean().item(),
        "logprob_abs_diff_max": d.abs().max().item(),
        "mismatch_kl": k3.mean().item(),
        "ratio_outside_frac": (d.abs() > _LN2).double().mean().item(),
    }


def _flat(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().double().flatten().cpu()
    items = [_flat(v) if isinstance(v, (list, tuple, torch.Tensor)) else torch.tensor([float(v)], dtype=torch.float64)
             for v in x]
    return torch.cat(items) if items else torch.zeros(0, dtype=torch.float64)


def rollout_mismatch(model, engine, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 64,
                     temperature: float = 1.0, seed: int = 0, pad_token_id: int = 0,
                     batch_size: int = 16) -> dict[str, float]:
    """Sample with ``engine``, recompute the sampled tokens' logprobs with ``model`` (no grad, in
    batches of about ``batch_size`` sequences, whole groups) and return ``mismatch_metrics`` of the two."""
    from .logprobs import group_logprobs

    groups = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    per_batch = max(1, batch_size // n)
    rollout, trainer = [], []
    with torch.no_grad():
        for i in range(0, len(prompts), per_batch):
            chunk = [[c for c in g if c.token_ids] for g in groups[i : i + per_batch]]
            trainer += group_logprobs(model, prompts[i : i + per_batch], [[c.token_ids for c in g] for g in chunk],
                                      pad_token_id=pad_token_id)
            rollout += [c.logprobs for g in chunk for c in g]
    return mismatch_metrics(rollout, trainer)
