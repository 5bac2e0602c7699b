"""The trainer's logprobs of sampled tokens: one teacher-forced forward of prompt + completion.

Sequences are left-padded so that every completion ends at the last position; with
``logits_to_keep = max_new_tokens + 1`` the LM head then runs only over the positions that
predict completion tokens (the LM head of a small model is a large share of its FLOPs), and the
kept width is the same every step, so a compiled model does not recompile for it. Position ids
count real tokens only, so RoPE sees each sequence exactly as the rollout engine did.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def token_logprobs(
    model: nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    *,
    pad_token_id: int = 0,
    max_new_tokens: int | None = None,
) -> list[torch.Tensor]:
    """``log p(completion[t] | prompt, completion[:t])`` under ``model``, one float32 tensor per
    sequence. Differentiable (wrap in ``torch.no_grad()`` to only measure). ``max_new_tokens``
    fixes the kept logits width (default: the longest completion)."""
    if len(prompts) != len(completions):
        raise ValueError(f"token_logprobs: {len(prompts)} prompts but {len(completions)} completions")
    longest = max(len(c) for c in completions)
    keep = (max_new_tokens if max_new_tokens is not None else longest) + 1
    if longest + 1 > keep:
        raise ValueError(f"token_logprobs: a completion of {longest} tokens exceeds max_new_tokens={keep - 1}")
    device = next(model.parameters()).device
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(max(len(s) for s in seqs), keep)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
        logits_to_keep=keep, use_cache=False,
    ).logits  # (B, keep, V): positions width-keep .. width-1
    logprobs = logits[:, :-1].float().log_softmax(-1)  # position j predicts the token at j + 1
    targets = ids[:, width - keep + 1 :].to(device)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, keep - 1)
    return [picked[i, picked.shape[1] - len(c):] for i, c in enumerate(completions)]
