"""Exact mode inside vLLM: the running engine computes the same function as an exact-mode trainer
(``jetrl_compile.exact``), so every logprob vLLM reports is bitwise the one the trainer recomputes
(docs/design.md, section 8).

``VllmEngine`` calls ``make_exact`` on its in-process model once vLLM has started (before any
request) when the trainer is in exact mode. Each vLLM layer of the model then runs the trainer's
invariant function for it:

- linears of our ``jetrl`` method: ``fp8_linear(..., exact=...)`` on the weight's fixed-point
  operand (``JetrlLinearMethod.set_exact``; remade whenever vLLM reloads the weights);
- linears left unquantized and the logits head: ``invariant.linear`` (one fixed-point block per row);
- ``RMSNorm`` (with or without the fused residual add): the residual added in the model's dtype,
  as transformers adds it, then ``invariant.rms_norm``;
- ``SiluAndMul``: ``invariant.silu(gate) * up``;
- rotary embeddings: the trainer's own cos/sin table (looked up by position), applied as
  transformers applies it;
- attention: ``ExactAttention`` replaces the layer's backend implementation (vLLM's CPU backend;
  on a GPU its Triton or FlashAttention backend, whose caches share one layout): it writes keys
  and values into the paged cache and attends every query to its sequence's keys with
  ``invariant.attention``;
- the sampler's logprobs: ``invariant.log_softmax``.

A model with any other layer (LayerNorm, GELU, sliding windows, ALiBi, soft-capping, a quantized KV
cache...) is refused by name.
"""

from __future__ import annotations

import torch

from ..runtime import invariant
from . import _vllm_compat
from ._vllm_compat import plugin_api
from .vllm_plugin import JetrlLinearMethod

# The attention implementations whose KV caches ExactAttention reads and writes, and how each holds
# a layer's keys and values in its cache, logically (blocks, kv heads, block size, 2 x head size)
# in vLLM 0.32 whatever the physical stride order: the CPU backend stores per block and head the
# block's keys, then its values ("slots"); the GPU backends store each slot's key, then its value
# ("features"). ExactAttention writes every cache it reads, so only this split has to match.
KV_SPLITS = {"CPUAttentionBackendImpl": "slots", "TritonAttentionImpl": "features", "FlashAttentionImpl": "features"}
# the backend an exact engine asks vLLM for on a GPU: any CUDA GPU and every dtype a trainer holds
# (FlashAttention's has no float32); ExactAttention does the computing
GPU_ATTENTION_BACKEND = "TRITON_ATTN"
# leaf modules that compute nothing a logprob depends on
_HARMLESS = ("PPMissingLayer", "Identity")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ExactAttention:
    """Stands in for a vLLM attention layer's ``impl``: the same KV cache tensor, keys and values
    stored as the backend stores them (``KV_SPLITS``), and every query attended with
    ``invariant.attention`` to keys 0..its position of its own sequence (found through the block
    table)."""

    def __init__(self, impl, layer_name: str):
        problems = []
        if getattr(impl, "alibi_slopes", None) is not None:
            problems.append("ALiBi")
        if getattr(impl, "sliding_window", -1) not in (-1, None):
            problems.append("a sliding window")
        if getattr(impl, "logits_soft_cap", 0):
            problems.append("logit soft-capping")
        if getattr(impl, "sinks", None) is not None:
            problems.append("attention sinks")
        if getattr(impl, "is_fp8_kv_cache", False):
            problems.append("an FP8 KV cache")
        if getattr(impl, "attn_type", "decoder") != "decoder":  # a str enum in vLLM 0.32
            problems.append(f"attention type {impl.attn_type}")
        if problems:
            raise ValueError(f"exact mode in vLLM: {layer_name} has {', '.join(problems)}, which it does not implement")
        if type(impl).__name__ not in KV_SPLITS:
            raise ValueError(
                f"exact mode in vLLM reads the KV caches of {', '.join(KV_SPLITS)}; {layer_name} runs "
                f"{type(impl).__name__}. Start vLLM with attention_backend={GPU_ATTENTION_BACKEND!r} "
                "(VllmEngine does in exact mode) or sample with the hf engine (make_engine(model, 'hf'))"
            )
        self.original = impl
        self.split = KV_SPLITS[type(impl).__name__]
        self.num_heads, self.num_kv_heads = impl.num_heads, impl.num_kv_heads
        self.head_size, self.scale = impl.head_size, float(impl.scale)

    def __getattr__(self, name):  # everything else vLLM asks of its impl (reload hooks, flags)
        return getattr(self.__dict__["original"], name)

    def _halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value caches, each (blocks, kv heads, block size, head size), as views."""
        blocks, heads, block_size, content = kv_cache.shape
        if content != 2 * self.head_size:
            raise ValueError(f"exact attention: a KV cache of {content} features per slot, not 2 x {self.head_size}")
        if self.split == "features":
            return kv_cache.split(self.head_size, dim=-1)
        return kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = self._halves(kv_cache)
        block_size = key_cache.shape[2]
        slots = slot_mapping[: key.shape[0]].long()
        real = slots >= 0
        slots, key, value = slots[real], key[: real.numel()][real], value[: real.numel()][real]
        key_cache[slots // block_size, :, slots % block_size] = key
        value_cache[slots // block_size, :, slots % block_size] = value

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("exact attention does not fuse output quantization")
        if attn_metadata is None:  # vLLM's warm-up
            return output
        if not getattr(attn_metadata, "causal", True):
            raise ValueError("exact attention in vLLM implements causal decoder attention only")
        tokens = attn_metadata.num_actual_tokens
        starts = attn_metadata.query_start_loc.long()
        query_lens = starts[1:] - starts[:-1]
        seq_lens = attn_metadata.seq_lens.long()[: query_lens.numel()]
        max_q, max_k = int(query_lens.max()), int(seq_lens.max())

        # queries padded to (B, H, max_q, D); keys and values of positions 0..max_k-1 of each sequence
        q_index = torch.arange(max_q, device=query.device)
        q_real = q_index[None] < query_lens[:, None]  # (B, max_q)
        rows = (starts[:-1, None] + q_index[None]).clamp(max=max(tokens - 1, 0))
        q = query[rows].transpose(1, 2)
        key_cache, value_cache = self._halves(kv_cache)
        block_size = key_cache.shape[2]
        positions = torch.arange(max_k, device=query.device)
        table = attn_metadata.block_table[: query_lens.numel()].long()
        blocks = table[:, (positions // block_size).clamp(max=table.shape[1] - 1)]  # (B, max_k)
        k = key_cache[blocks, :, positions % block_size].transpose(1, 2)  # (B, Hkv, max_k, D)
        v = value_cache[blocks, :, positions % block_size].transpose(1, 2)

        q_positions = (seq_lens - query_lens)[:, None] + q_index[None]  # absolute position of each query
        visible = (positions[None, None] <= q_positions[:, :, None]) & q_real[:, :, None]
        out = invariant.attention(q, k, v, visible, self.scale)  # (B, H, max_q, D)
        output[:tokens] = out.transpose(1, 2)[q_real].to(output.dtype)
        return output


class ExactVllm:
    """The exact-mode patches applied to one running vLLM model (``make_exact``); ``refresh``
    after the engine reloads weights."""

    def __init__(self, llm, cos_table: torch.Tensor, sin_table: torch.Tensor):
        self.model = _vllm_compat.model(llm)
        self.sampler = _vllm_compat.sampler(llm)
        self.cos_table, self.sin_table = cos_table, sin_table
        self._fixed: dict[int, invariant.FixedPoint] = {}

    # --- the layers ---

    def patch(self) -> ExactVllm:
        kinds = {k: plugin_api(k) for k in (
            "LinearBase", "UnquantizedLinearMethod", "RMSNorm", "SiluAndMul", "RotaryEmbeddingBase", "Attention",
            "LogitsProcessor", "VocabParallelEmbedding",
        )}
        problems, handled = [], []
        for name, m in self.model.named_modules():
            if any(name.startswith(h + ".") for h in handled):
                continue  # inside a module whose forward is replaced as a whole
            handled.append(name)  # taken back below for containers, whose children are checked one by one
            if isinstance(m, kinds["LinearBase"]):
                if isinstance(m.quant_method, JetrlLinearMethod):
                    m.quant_method.set_exact(m, True)
                elif isinstance(m.quant_method, kinds["UnquantizedLinearMethod"]):
                    m.quant_method.apply = self._linear
                else:
                    problems.append(f"{name} ({type(m.quant_method).__name__})")
            elif isinstance(m, kinds["RMSNorm"]):
                if not getattr(m, "has_weight", True) or getattr(m, "variance_size_override", None):
                    problems.append(f"{name} (an RMSNorm without weight or over part of the features)")
                m.forward = self._norm(m)
            elif isinstance(m, kinds["SiluAndMul"]):
                m.forward = _silu_and_mul
            elif isinstance(m, kinds["RotaryEmbeddingBase"]):
                if not m.is_neox_style or m.rotary_dim != m.head_size:
                    problems.append(f"{name} (rotary embedding over part of the head or interleaved)")
                m.forward = self._rotary
            elif isinstance(m, kinds["Attention"]):
                m.impl = ExactAttention(m.impl, name)
            elif isinstance(m, kinds["LogitsProcessor"]):
                if m.soft_cap is not None or m.scale != 1.0 or m.logits_as_input:
                    problems.append(f"{name} (scaled or soft-capped logits)")
                m._apply_head = self._linear
            elif isinstance(m, kinds["VocabParallelEmbedding"]) or type(m).__name__ in _HARMLESS:
                pass  # a lookup (the logits head's GEMM is the logits processor's)
            else:
                handled.pop()
                if not any(True for _ in m.children()):
                    problems.append(f"{name} ({type(m).__name__})")
        if problems:
            raise ValueError(
                f"exact mode cannot make vLLM's {type(self.model).__name__} exact: it has "
                f"{'; '.join(problems)}. Sample with the hf engine or turn exact mode off"
            )
        self.sampler.compute_logprobs = invariant.log_softmax
        return self

    def refresh(self) -> None:
        """Forget the fixed-point copies of unquantized weights (after a reload)."""
        self._fixed.clear()

    def _fixed_of(self, weight: torch.Tensor) -> invariant.FixedPoint:
        key = weight.data_ptr()
        if key not in self._fixed:
            self._fixed[key] = invariant.FixedPoint(weight.detach(), block=None)
        return self._fixed[key]

    def _linear(self, layer, x, bias=None):
        """An unquantized linear's ``quant_method.apply`` and the logits processor's
        ``_apply_head(lm_head, hidden_states, embedding_bias)``: the trainer's ``invariant.linear``."""
        fixed = self._fixed_of(layer.weight) if invariant.needs_fixed_point(x.device) else None
        return invariant.linear(x, layer.weight, bias, fixed)

    @staticmethod
    def _norm(norm):
        eps = norm.variance_epsilon

        def forward(x, residual=None):
            if residual is None:
                return invariant.rms_norm(x, norm.weight, eps)
            x = residual + x  # transformers' ``residual + hidden_states``, in the model's dtype
            return invariant.rms_norm(x, norm.weight, eps), x

        return forward

    def _rotary(self, positions, query, key=None):
        positions = positions.flatten()
        cos = self.cos_table[positions].to(query.dtype)[:, None]  # (T, 1, D)
        sin = self.sin_table[positions].to(query.dtype)[:, None]

        def rotate(x):
            shape = x.shape
            x = x.view(positions.numel(), -1, self.cos_table.shape[-1])
            return ((x * cos) + (_rotate_half(x) * sin)).reshape(shape)

        return rotate(query), None if key is None else rotate(key)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return invariant.silu(x[..., :d]) * x[..., d:]


def make_exact(llm, cos_table: torch.Tensor, sin_table: torch.Tensor) -> ExactVllm:
    """Patch the in-process vLLM ``llm`` to compute exact mode's function (module docstring), with
    the trainer's rotary table (``exact.rope_table``)."""
    return ExactVllm(llm, cos_table, sin_table).patch()
