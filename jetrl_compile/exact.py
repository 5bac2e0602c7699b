"""Exact mode: every op of a causal LM between the embedding and the logprob runs the invariant
numerics of ``runtime/invariant.py`` (docs/design.md, section 8), so that a sampled token's
logprob is bitwise the same whether the model computes it while decoding against its KV cache
(``HfEngine``) or teacher-forced inside a packed GRPO group (the trainer).

``unify(model, recipe, exact=True)`` calls ``patch`` after making the linears the recipe's
(whose GEMMs then run ``invariant.gemm`` too). What changes in the model, all undone by
``restore``:

- every ``*RMSNorm`` module: ``invariant.rms_norm``;
- every MLP's SiLU ``act_fn``: ``invariant.silu``;
- rotary embeddings: cos/sin looked up in a table made once for every position, instead of
  ``cos``/``sin`` of a tensor whose shape changes with the batch;
- attention: ``config._attn_implementation = "jetrl_exact"``, registered with transformers'
  ``AttentionInterface`` (and boolean masks, as for SDPA): ``invariant.attention``;
- linears the recipe leaves unquantized (``lm_head``, skip patterns): ``invariant.linear`` in the
  model's dtype.

Architectures outside that (LayerNorm, GELU, RoPE that rescales with the sequence length) are
refused by name instead of running inexactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .runtime import invariant
from .runtime.weight_cache import WeightCache
from .state import STATE_ATTR

ATTN_IMPLEMENTATION = "jetrl_exact"
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def is_exact(model: nn.Module) -> bool:
    """Whether ``model`` was unified with ``exact=True``."""
    state = getattr(model, STATE_ATTR, None)
    return bool(state is not None and state.exact)


def logprobs_of(model: nn.Module, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[tokens]`` in float32 as ``model`` defines it: the invariant function
    in exact mode (the engine and the trainer both call this), torch's otherwise."""
    if is_exact(model):
        return invariant.token_logprobs(logits, tokens)
    return logits.float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function interface: (B, H, Tq, D) queries against (B, Hkv, Tk, D)
    keys and values; returns (B, Tq, H, D) and no weights."""
    if dropout:
        raise ValueError("exact mode has no attention dropout; call model.eval() or set attention_dropout=0")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    visible = _visible(attention_mask, query, key)
    out = invariant.attention(query, key, value, visible, scaling)
    return out.transpose(1, 2).contiguous(), None


def _visible(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(B, Tq, Tk) bool from transformers' mask: None means causal with the queries last."""
    b, tq, tk = query.shape[0], query.shape[2], key.shape[2]
    if mask is None:
        causal = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        return causal.expand(b, tq, tk)
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (tq, tk):
        raise ValueError(
            f"exact attention takes a (B, 1, {tq}, {tk}) mask for {tq} queries and {tk} keys; got shape "
            f"{tuple(mask.shape)} (a static or paged KV cache is not supported in exact mode)"
        )
    visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    return visible.expand(b, tq, tk)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


class ExactSiLU(nn.Module):
    """The MLP activation in exact mode."""

    def forward(self, x):
        return invariant.silu(x)


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _rope_table(module: nn.Module, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's own cos/sin for positions 0..positions-1, in float32, made by one call."""
    inv_freq = module.inv_freq
    dummy = torch.zeros(1, dtype=torch.float32, device=inv_freq.device)
    cos, sin = module.__class__.forward(module, dummy, torch.arange(positions, device=inv_freq.device)[None])
    return cos[0], sin[0]


def rope_table(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin table exact mode's rotary embedding looks positions up in, (max positions,
    head_dim) float32 each (a vLLM engine in exact mode uses the same one)."""
    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(rotaries) != 1:
        raise ValueError(
            f"exact mode expects one rotary embedding in {type(model).__name__}, found {len(rotaries)}"
        )
    return _rope_table(rotaries[0], int(model.config.max_position_embeddings))


def patch(model: nn.Module, unquantized: list[nn.Linear], cache: WeightCache) -> list:
    """Make ``model`` exact (module docstring); returns the undo list ``unpatch`` takes."""
    config = model.config
    problems, undo = [], []
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for m in model.modules():
        if isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("LayerNorm"):
            problems.append(f"{type(m).__name__} (exact mode implements RMSNorm)")
        act = getattr(m, "act_fn", None)
        if isinstance(act, nn.Module) and not _is_silu(act):
            problems.append(f"activation {type(act).__name__} (exact mode implements SiLU)")
        rope_type = getattr(m, "rope_type", "default")
        if type(m).__name__.endswith("RotaryEmbedding") and rope_type not in _STATIC_ROPE_TYPES:
            problems.append(f"rope_type {m.rope_type!r} (its frequencies change with the sequence length)")
    if problems:
        raise ValueError(
            f"exact mode cannot make {type(model).__name__} exact: it has {'; '.join(sorted(set(problems)))}. "
            "Use exact=False for this model"
        )

    for norm in norms:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        norm.forward = lambda x, norm=norm, eps=eps: invariant.rms_norm(x, norm.weight, eps)
        undo.append(("forward", norm, None))
    for m in model.modules():
        act = getattr(m, "act_fn", None)
        if isinstance(act, nn.Module):
            m.act_fn = ExactSiLU()
            undo.append(("act_fn", m, act))
    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            cos_table, sin_table = _rope_table(m, int(config.max_position_embeddings))

            def rotary(x, position_ids, cos_table=cos_table, sin_table=sin_table):
                return cos_table[position_ids].to(x.dtype), sin_table[position_ids].to(x.dtype)

            m.forward = rotary
            undo.append(("forward", m, None))
    for linear in unquantized:

        def forward(x, linear=linear):
            fixed = cache.get_fixed(linear.weight, "raw") if invariant.needs_fixed_point(x.device) else None
            return invariant.linear(x, linear.weight, linear.bias, fixed)

        linear.forward = forward
        undo.append(("forward", linear, None))
    _register_attention()
    undo.append(("attn", config, config._attn_implementation))
    config._attn_implementation = ATTN_IMPLEMENTATION
    return undo


def unpatch(undo: list) -> None:
    """Undo ``patch``."""
    for kind, obj, previous in reversed(undo):
        if kind == "forward":
            del obj.forward
        elif kind == "act_fn":
            obj.act_fn = previous
        else:
            obj._attn_implementation = previous
