"""The trainer's logprobs of sampled tokens: one teacher-forced forward per GRPO group, the prompt once.

The G completions of a prompt share it, so a group is packed into one row and the prompt runs
once instead of G times::

    row:   [pad .. pad | prompt | c_1 | c_2 | ... | c_G | pad .. pad]
    sees:    nothing    causal   prompt + its own causal prefix, never another completion

A 4D attention mask lets each completion token attend to the prompt and to the earlier tokens of
its own completion only, and position ids restart after the prompt for every completion, so each
token sees exactly the context (and the RoPE positions) the rollout engine gave it: the function
computed is the one of G separate sequences, at about a third of the FLOPs on GRPO shapes
(prompt ~70 tokens, G = 8 completions of up to 32). Prompts are left-padded to the longest in
the batch, so the kept LM-head positions (``logits_to_keep``: from the last prompt token on) are
the same for every row; the LM head of a small model is a large share of its FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..exact import ATTN_IMPLEMENTATION, logprobs_of

_MASKS = {"sdpa": "bool", "eager": "additive", ATTN_IMPLEMENTATION: "bool"}


def group_logprobs(
    model: nn.Module,
    prompts: list[list[int]],
    groups: list[list[list[int]]],
    *,
    pad_token_id: int = 0,
    forward: nn.Module | None = None,
) -> list[torch.Tensor]:
    """``log p(c[t] | prompt, c[:t])`` under ``model`` for every completion ``c`` of every group
    (``groups[i]`` are completions of ``prompts[i]``), one float32 tensor per completion, in order
    (group by group). Differentiable (wrap in ``torch.no_grad()`` to only measure). Empty
    completions give empty tensors. ``forward``: the module to call when it wraps ``model``
    (DDP around it); ``model`` itself by default."""
    if len(prompts) != len(groups):
        raise ValueError(f"group_logprobs: {len(prompts)} prompts but {len(groups)} groups")
    if any(not p for p in prompts):
        raise ValueError("group_logprobs: an empty prompt (the first completion token needs a context)")
    device = next(model.parameters()).device
    _check_context_length(model, prompts, groups)
    ids, positions, segment, prompt_width = _pack(prompts, groups, pad_token_id)
    keep = torch.arange(prompt_width - 1, ids.shape[1] - 1)  # last prompt token .. last completion token
    logits = (forward if forward is not None else model)(
        input_ids=ids.to(device), attention_mask=_attention_mask(model, segment).to(device),
        position_ids=positions.to(device), logits_to_keep=keep.to(device), use_cache=False,
    ).logits  # (rows, len(keep), V): kept position k is row position prompt_width - 1 + k

    # kept position 0 (the last prompt token) predicts every completion's first token; a token at
    # row position prompt_width + o + t predicts the token after it, at offset o + t + 1
    spans = [(row, j, offset, c) for row, group in enumerate(groups) for j, offset, c in _offsets(group)]
    first = torch.zeros((len(groups), max(map(len, groups))), dtype=torch.long)
    later = torch.zeros(logits.shape[:2], dtype=torch.long)
    for row, j, offset, c in spans:
        if c:
            first[row, j] = c[0]
            later[row, offset + 1 : offset + len(c)] = torch.tensor(c[1:], dtype=torch.long)
    first_lp = logprobs_of(model, logits[:, :1].expand(-1, first.shape[1], -1), first.to(device))
    later_lp = logprobs_of(model, logits, later.to(device))
    return [
        torch.cat([first_lp[row, j : j + 1], later_lp[row, offset + 1 : offset + len(c)]])[: len(c)]
        for row, j, offset, c in spans
    ]


def _offsets(group: list[list[int]]):
    """``(j, offset, c)`` for each completion of a group: where it starts after the prompt."""
    offset = 0
    for j, c in enumerate(group):
        yield j, offset, c
        offset += len(c)


def token_logprobs(
    model: nn.Module, prompts: list[list[int]], completions: list[list[int]], *, pad_token_id: int = 0
) -> list[torch.Tensor]:
    """``group_logprobs`` with one completion per prompt."""
    if len(prompts) != len(completions):
        raise ValueError(f"token_logprobs: {len(prompts)} prompts but {len(completions)} completions")
    return group_logprobs(model, prompts, [[c] for c in completions], pad_token_id=pad_token_id)


def _pack(prompts, groups, pad_token_id):
    """Token ids, position ids and segment ids (-1 padding, 0 prompt, j + 1 completion j) of the
    packed rows, and the common prompt width."""
    prompt_width = max(len(p) for p in prompts)
    width = prompt_width + max(sum(len(c) for c in g) for g in groups)
    shape = (len(prompts), width)
    ids = torch.full(shape, pad_token_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    segment = torch.full(shape, -1, dtype=torch.long)
    for row, (prompt, group) in enumerate(zip(prompts, groups)):
        start = prompt_width - len(prompt)
        ids[row, start:prompt_width] = torch.tensor(prompt, dtype=torch.long)
        positions[row, start:prompt_width] = torch.arange(len(prompt))
        segment[row, start:prompt_width] = 0
        for j, offset, c in _offsets(group):
            at = prompt_width + offset
            ids[row, at : at + len(c)] = torch.tensor(c, dtype=torch.long)
            positions[row, at : at + len(c)] = torch.arange(len(prompt), len(prompt) + len(c))
            segment[row, at : at + len(c)] = j + 1
    return ids, positions, segment, prompt_width


def _attention_mask(model: nn.Module, segment: torch.Tensor) -> torch.Tensor:
    """(rows, 1, L, L) mask: a query attends to earlier-or-same keys of the prompt or of its own
    completion; a padding query attends to itself only (no empty softmax rows)."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in _MASKS:
        raise ValueError(
            f"group_logprobs: the model uses attn_implementation={impl!r}, which takes no custom 4D mask; "
            f"load it with attn_implementation='sdpa' (or one of {sorted(_MASKS)})"
        )
    width = segment.shape[1]
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (key >= 0) & ((key == 0) | (key == query))
    allowed |= torch.eye(width, dtype=torch.bool)
    allowed = allowed[:, None]
    if _MASKS[impl] == "bool":
        return allowed
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)


def _check_context_length(model, prompts, groups) -> None:
    """The packed mask is a plain causal one within each sequence: refuse sequences that a
    sliding-window layer would have cut."""
    window = getattr(model.config, "sliding_window", None)
    longest = max(len(p) + max((len(c) for c in g), default=0) for p, g in zip(prompts, groups))
    if window and longest > window:
        raise ValueError(
            f"group_logprobs: a sequence of {longest} tokens exceeds the model's sliding window of {window}; "
            "the packed mask does not model sliding-window attention"
        )
