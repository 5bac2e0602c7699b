"""The one FP8 quantizer (docs/design.md, section 2). Trainer, exporter and rollout engine all call it.

- Format: ``torch.float8_e4m3fn``, largest finite value 448, saturating cast.
- Scale of a group: ``s = 2 ** ceil(log2(amax / 448))``, the smallest power of two with
  ``amax <= 448 * s`` (UE8M0-style); ``amax == 0`` gives ``s = 1``. Scales are float32.
- Payload ``q = e4m3(x / s)``; dequantized value ``q * s``. Since ``s`` is a power of two, the
  division is exact and ``q * s`` is exactly representable in BF16: an FP8 GEMM can be emulated
  exactly by one BF16 GEMM (``kernels.bf16_gemm``) over dequantized operands.
- Weights: 128 x 128 blocks; activations: 1 x 128 groups along the last dim. A dimension that is
  not a multiple of 128 ends in a partial group; scales have ``ceil(n / 128)`` entries along it.
- Non-finite input is never laundered into finite numbers: a group holding NaN or inf gets a
  non-finite scale, so every element of that group dequantizes to NaN, and the NaN reaches the
  loss (the GRPO loop then refuses the step). ``JETRL_CHECK_FINITE=1`` makes eager calls raise
  instead, naming the tensor.
- Scales are clamped to ``[2**-126, 2**127]`` so they stay normal float32 numbers; a group whose
  amax is below ``448 * 2**-126`` (about 5e-36) underflows to zeros and FP8 subnormals.

The scale and the saturating cast are torchao's float8 utilities (``amax_to_scale`` with
power-of-two rounding, ``to_fp8_saturated``). torchao's scale, inverted, is ours for every amax
from ``1e-12`` up, once one rounding case is corrected (amax just above ``448 * 2**k``, where it
would saturate); below ``1e-12`` (zero included) torchao clamps the amax and our own rule
(``_exact_power_of_two_scale``) keeps the contract (docs/design.md, section 2.1).

Implementation note (docs/design.md, pitfall 1): padding to a multiple of 128 with ``F.pad``,
reducing per group and slicing back compiled to a loop that wrote only the first block. So full
groups and the partial tail group are handled as two separate tensors and joined with
``torch.cat``; tests check partial groups compiled as well as eager.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch

from . import switches
from .format import FP8_DTYPE, FP8_MAX, GROUP, block_scale_shape, group_scale_shape

_MIN_EXP, _MAX_EXP = -126, 127
# torchao clamps amax to at least this before taking 448 / amax; below it our rule takes over
TORCHAO_MIN_AMAX = 1e-12


class Quantized(NamedTuple):
    """An FP8 payload and its float32 power-of-two scales (one per group or block)."""

    data: torch.Tensor  # float8_e4m3fn, same shape as the input
    scale: torch.Tensor  # float32, ceil(n / 128) per grouped dimension


def _split_last(x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(full groups as ``(..., n_full, 128)``, partial tail as ``(..., 1, tail)``) of the last dim."""
    n = x.shape[-1]
    n_full = n // GROUP * GROUP
    full = x[..., :n_full].unflatten(-1, (n_full // GROUP, GROUP)) if n_full else None
    tail = x[..., n_full:].unsqueeze(-2) if n_full < n else None
    return full, tail


def _group_amax_last(x: torch.Tensor) -> torch.Tensor:
    """Max of |x| over each group of 128 along the last dim: shape ``(..., ceil(n / 128))``."""
    parts = [p.abs().amax(dim=-1) for p in _split_last(x) if p is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _per_group_last(x: torch.Tensor, scale: torch.Tensor, op) -> torch.Tensor:
    """``op(x_group, s_group)`` for each 128-wide group of the last dim, back in ``x``'s shape.

    ``scale`` is ``(..., ceil(n / 128))`` and broadcasts against ``x``'s leading dims; full groups
    and the partial tail are separate tensors joined by ``cat`` (see the module docstring).
    """
    n_full_groups = x.shape[-1] // GROUP
    full, tail = _split_last(x)
    parts = []
    if full is not None:
        parts.append(op(full, scale[..., :n_full_groups].unsqueeze(-1)).flatten(-2))
    if tail is not None:
        parts.append(op(tail, scale[..., n_full_groups:].unsqueeze(-1)).flatten(-2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _per_block(w: torch.Tensor, scale: torch.Tensor, op) -> torch.Tensor:
    """``op`` over 128 x 128 blocks of a 2-D ``(N, K)`` tensor with ``(ceil(N/128), ceil(K/128))`` scales."""
    n_full_groups = w.shape[0] // GROUP
    full, tail = _split_last(w.t())  # row groups, as (K, n_groups, 128) and (K, 1, tail)
    parts = []
    if full is not None:
        rows = full.permute(1, 2, 0)  # (n_full_groups, 128, K)
        parts.append(_per_group_last(rows, scale[:n_full_groups].unsqueeze(1), op).flatten(0, 1))
    if tail is not None:
        rows = tail.permute(1, 2, 0)  # (1, tail, K)
        parts.append(_per_group_last(rows, scale[n_full_groups:].unsqueeze(1), op).flatten(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _quantize_op(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return cast_saturated(x.float() / s)


def _dequantize_op(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s


def _power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(amax / 448))`` as float32, exact; 1 where amax is 0; NaN/inf propagate.

    From ``amax >= 1e-12`` up this is torchao's power-of-two scale ``2 ** floor(log2(448 / amax))``
    inverted, with one correction: just above ``448 * 2**k`` the float32 quotient and ``log2``
    land torchao's scale one power too small, and the group would saturate. Smaller amax (and 0),
    which torchao clamps, take our own rule (docs/design.md, section 2.1).
    """
    from torchao.float8.float8_utils import amax_to_scale  # on first use: importing torchao loads torch._dynamo

    amax = amax.float()
    torchao_scale = _one_power_off_fixed(1.0 / amax_to_scale(amax, FP8_DTYPE, round_scales_to_power_of_2=True), amax)
    return torch.where(amax >= TORCHAO_MIN_AMAX, torchao_scale, _exact_power_of_two_scale(amax))


def _exact_power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """Our own rule, valid for every amax: ``2 ** ceil(log2(amax / 448))`` within ``[2**-126,
    2**127]``, 1 for a zero group; a non-finite amax is returned as the scale."""
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(_MIN_EXP, _MAX_EXP)
    s = _one_power_off_fixed(torch.exp2(exponent), amax)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    # A non-finite amax becomes the scale itself (NaN or inf), so the group cannot turn finite:
    # x / inf and inf / inf give 0 and NaN payloads, and q * inf dequantizes every element to NaN.
    return torch.where(torch.isfinite(amax), s, amax)


def _one_power_off_fixed(s: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """A power-of-two scale computed through a rounded quotient and ``log2`` can land one power
    off when the quotient rounds onto a power of two; one comparison against the exact product
    ``448 * s`` fixes it in either direction."""
    s = torch.where(amax > FP8_MAX * s, s * 2, s)  # rounded down: the group would saturate
    return torch.where((amax <= FP8_MAX * (s / 2)) & (s > 2.0**_MIN_EXP), s / 2, s)  # rounded up


def cast_saturated(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 with saturation at +-448 (NaN stays NaN): torchao's ``to_fp8_saturated``,
    whose clamp is explicit so the result does not depend on each backend's out-of-range cast."""
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(x, FP8_DTYPE)


def _check_finite(x: torch.Tensor, what: str) -> None:
    if not torch.compiler.is_compiling() and switches.check_finite():
        if not torch.isfinite(x).all():
            bad = (~torch.isfinite(x)).sum().item()
            raise FloatingPointError(
                f"{what}: {bad} non-finite value(s) in a tensor of shape {tuple(x.shape)} being "
                "quantized to FP8 (JETRL_CHECK_FINITE=1). Look for a diverged step or a bad input."
            )


def quantize_groupwise(x: torch.Tensor) -> Quantized:
    """FP8 payload and scales of ``x`` in 1 x 128 groups along its last dim (activations).

    ``scale`` has shape ``(*x.shape[:-1], ceil(K / 128))``.
    """
    _check_finite(x, "quantize_groupwise")
    scale = _power_of_two_scale(_group_amax_last(x))
    return Quantized(_per_group_last(x, scale, _quantize_op), scale)


def quantize_blockwise(w: torch.Tensor) -> Quantized:
    """FP8 payload and scales of a 2-D weight ``(N, K)`` in 128 x 128 blocks.

    ``scale`` has shape ``(ceil(N / 128), ceil(K / 128))``. The blocks are symmetric, so the
    quantization of ``W^T`` is the transpose of this one (the FP8 dgrad GEMM relies on it).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise takes a 2-D weight (N, K); got shape {tuple(w.shape)}")
    _check_finite(w, "quantize_blockwise")
    row_group_amax = _group_amax_last(w)  # (N, ceil(K/128))
    block_amax = _group_amax_last(row_group_amax.t()).t()  # (ceil(N/128), ceil(K/128))
    scale = _power_of_two_scale(block_amax).contiguous()
    return Quantized(_per_block(w, scale, _quantize_op), scale)


def fake_quantize_groupwise(
    x: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, along_tokens: bool = False
) -> torch.Tensor:
    """``dequantize(*quantize_groupwise(x), dtype)``: what an emulated FP8 GEMM multiplies by
    (``dtype`` is the GEMM's operand dtype, BF16 or FP32; the values are the same).

    Called eagerly (the eager trainer, the vLLM plugin), it runs as one Inductor-fused kernel
    instead of some 25 small eager ops per linear. Bitwise the eager ops: the arithmetic is exact
    (power-of-two scales, one rounding to e4m3) and the scale rule corrects any ulp of ``log2``; a
    test and the vLLM identity tests compare the two. Inside a graph being compiled it is the
    plain ops, for the surrounding graph to fuse. ``JETRL_FUSED_QUANTIZE=0`` turns the fused
    kernels off.

    The kernel is compiled on first use for each length of the last dim (a linear's in- or
    out-features) and dtype, one graph for any number of rows (leading dims are flattened).
    ``along_tokens=True`` is for operands whose last dim is the token count, which changes from
    batch to batch (the FP8 wgrad's ``dy^T``): their kernel keeps every dim dynamic.
    """
    return _eager_or_fused(_fake_quantize, x, dtype, along_tokens=along_tokens)


def fused_quantize_groupwise(x: torch.Tensor, *, along_tokens: bool = False) -> Quantized:
    """``quantize_groupwise(x)`` as one fused kernel when called eagerly (for a real FP8 GEMM, and
    the FP8 wgrad's ``x^T``); ``along_tokens`` as in ``fake_quantize_groupwise``."""
    return _eager_or_fused(quantize_groupwise, x, along_tokens=along_tokens)


def _fake_quantize(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize(*quantize_groupwise(x), dtype)


def _eager_or_fused(fn, x: torch.Tensor, *args, along_tokens: bool):
    if torch.compiler.is_compiling() or not switches.fused_quantize():
        return fn(x, *args)
    _check_finite(x, "quantize_groupwise")  # skipped inside the compiled function
    if along_tokens:
        return _compiled(fn, along_tokens=True)(x, *args)
    # As contiguous rows of the group length: a new tensor (the caller's is never marked), whose
    # row count is unbacked, so that one graph takes any number of rows, 0 and 1 (decode) included.
    # Exact elementwise arithmetic per group: reshaping changes no value.
    rows = x.contiguous().reshape(-1, x.shape[-1])
    torch._dynamo.decorators.mark_unbacked(rows, 0)
    out = _compiled(fn, along_tokens=False)(rows, *args)
    if isinstance(out, Quantized):
        return Quantized(out.data.reshape(x.shape), out.scale.reshape(*x.shape[:-1], out.scale.shape[-1]))
    return out.reshape(x.shape)


# Graphs each compiled variant may hold before the fused quantize runs as the eager ops (bitwise the
# same, only slower; Dynamo logs it once). A fixed-length graph is one per width, input dtype and
# output dtype: a model has a few widths (hidden size, MLP width, k/v width). The along-tokens one
# is one per class of token count (under 128, a multiple of 128, one group and a tail, ...).
_FIXED_LENGTH_GRAPHS = 32
_ALONG_TOKENS_GRAPHS = 16
# torch.compile's recompile_limit and isolate_recompiles (torch 2.13): each variant counts its own
# graphs. Older versions count both against Dynamo's global recompile limit.
_PER_CALL_LIMITS = "isolate_recompiles" in inspect.signature(torch.compile).parameters


@functools.cache
def _compiled(fn, *, along_tokens: bool):
    """``fn`` compiled for a fixed group length (the last dim static, the rows dynamic), or for
    any shape. A fixed last dim spares Dynamo the symbolic arithmetic of splitting it into groups:
    a graph compiles in about 0.35 s against 1 to 1.7 s with every dim symbolic (this CPU, Inductor
    cache warm)."""
    limit = _ALONG_TOKENS_GRAPHS if along_tokens else _FIXED_LENGTH_GRAPHS
    options = dict(recompile_limit=limit, isolate_recompiles=True) if _PER_CALL_LIMITS else {}
    return torch.compile(fn, dynamic=along_tokens, **options)


def expand_block_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Per-element copy of 128 x 128 block scales for a weight of ``shape`` (N, K)."""
    return _per_block(scale.new_ones(shape), scale, torch.mul)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * s`` in ``dtype`` (exact in BF16 and FP32), for either layout.

    The layout is read off the scale's shape: ``(..., ceil(K/128))`` for 1 x 128 groups,
    ``(ceil(N/128), ceil(K/128))`` for 128 x 128 blocks of a 2-D ``(N, K)`` payload. A 2-D payload
    whose scale has one row per payload row is groupwise.
    """
    if data.dtype != FP8_DTYPE:
        raise TypeError(f"dequantize takes a float8_e4m3fn payload; got {data.dtype}")
    # Multiply in float32: exact for powers of two, then one exact rounding into dtype.
    if tuple(scale.shape) == group_scale_shape(data.shape):
        return _per_group_last(data, scale, _dequantize_op).to(dtype)
    if data.dim() == 2 and scale.dim() == 2 and scale.shape == block_scale_shape(data.shape):
        return _per_block(data, scale, _dequantize_op).to(dtype)
    raise ValueError(
        f"scale of shape {tuple(scale.shape)} fits neither 1x128 groups nor 128x128 blocks of a "
        f"payload of shape {tuple(data.shape)}"
    )
