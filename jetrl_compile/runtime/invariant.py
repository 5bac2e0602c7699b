"""Invariant numerics for exact mode (docs/design.md, section 8): each token's row is computed the
same way whatever the batch, the number of rows, the padding, the packing and whether it runs as
decode against a KV cache or inside a full sequence.

Library kernels do not promise that. A BLAS picks its kernel, its blocking and its reduction order
from the matrix shapes (an FP32 ``x @ W.T`` row differs between M = 1 and M = 8 rows); an attention
kernel's reduction over keys depends on how many queries and keys it sees; and ATen's elementwise
loops compute the tail of a vector loop with the scalar function, so ``torch.exp`` of one value can
differ by an ulp with its position in a tensor. Exact mode therefore uses only operations whose
result per element is fixed by IEEE 754 whatever the kernel (``+ - * /``, ``sqrt``, ``round``,
``max``, comparisons, bit casts, conversions) and builds everything else from them:

- **Sums that cannot be exact** (``tree_sum``: RMSNorm's mean of squares, the vocabulary's
  softmax denominator): zero-padded to blocks of 64, each block summed as a fixed pairwise tree,
  the block sums summed the same way, level by level. The result depends only on the values in
  order: trailing zeros leave it bitwise unchanged.
- **exp / log** (``exp``, ``log``): polynomials of ``+ - *`` with the power of two made from bits
  (exp in float32, log in float64 rounded once). Not torch's, whose vector and scalar paths differ.
- **GEMMs** (``gemm``): exact, so that their reduction order cannot matter. Each operand row is
  cut into blocks of 128 along K and each block written as integers times a power of two (22 bits
  below the block's largest element); a block's dot product is then a sum of at most 128 integers
  below 2**44, exact in float64 in any order, whatever BLAS kernel computes it. The blocks are
  scaled back and added in order. FP8 operands (4-bit significands, power-of-two scales) and BF16
  operands within 2**14 of their block's largest element are represented exactly; smaller BF16
  values and FP32 values are rounded to that fixed-point grid first (22 bits, finer than BF16).
  Unquantized linears (``linear``) use one block per row: one exact BLAS call.
- **Attention** (``attention``): every sum over keys is exact (fixed-point scores, integer
  weights, V in fixed point per class of rows: see the constants below), so neither the keys'
  order nor masked keys can change a query's result: left padding, packing and decode agree.

Backward rules are the usual ones (gradients need not be invariant): each function here is an
autograd Function whose backward recomputes the textbook formula with torch's kernels.

**On a GPU** (``uses_triton``: the default on CUDA where Triton is installed; the switch
``JETRL_EXACT_KERNELS`` forces either), the GEMM of unquantized linears, RMSNorm, attention and
the log-softmax run ``triton_invariant``'s float32 kernels instead, which fix the summation order
rather than make the sums exact (a GPU's float64 rate is a fraction of its float32 one). Quantized
linears run the Triton FP8 GEMM, batch-invariant itself (``fp8_linear``). SiLU and exp stay these
float32 ops, elementwise and so invariant on any device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import switches
from .kernels import triton_installed, uses_emulation

SUM_BLOCK = 64
GEMM_BLOCK = 128
FIXED_POINT_BITS = 22  # |int| <= 2**22, products <= 2**44, 128 of them <= 2**51 < 2**53: exact in float64

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_SQRT2 = 1.4142135623730951
# log(m) = 2 atanh(f), f = (m - 1) / (m + 1), |f| <= 0.172: odd terms to f**17
_ATANH_COEFFS = [1.0 / (2 * k + 1) for k in range(9)]


def uses_triton(device: torch.device | str) -> bool:
    """Whether exact mode's invariant functions run the Triton kernels on ``device`` (module
    docstring): ``JETRL_EXACT_KERNELS=triton|torch`` forces it; ``auto`` takes Triton on CUDA."""
    choice = switches.exact_kernels()
    if choice != "auto":
        return choice == "triton"
    return torch.device(device).type == "cuda" and triton_installed()


def needs_fixed_point(device: torch.device | str, fp8: bool = False) -> bool:
    """Whether exact mode's GEMMs on ``device`` take float64 fixed-point operands
    (``FixedPoint``): not where the invariant Triton kernels run (``uses_triton``), nor for an FP8
    GEMM on a real FP8 kernel, which is batch-invariant itself (``fp8_linear._exact_fprop``)."""
    return not (uses_triton(device) or (fp8 and not uses_emulation(device)))


def _triton():
    from . import triton_invariant  # imports Triton: only where it runs

    return triton_invariant


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` in a fixed order: blocks of 64 (zero-padded) summed as pairwise trees,
    then the block sums the same way until one value is left. Invariant to trailing zeros."""
    x = x.movedim(dim, -1)
    if x.shape[-1] == 0:
        return x.sum(-1)
    while True:
        pad = -x.shape[-1] % SUM_BLOCK
        if pad:
            x = F.pad(x, (0, pad))
        x = x.unflatten(-1, (-1, SUM_BLOCK))
        width = SUM_BLOCK
        while width > 1:
            width //= 2
            x = x[..., :width] + x[..., width:]
        x = x.squeeze(-1)
        if x.shape[-1] == 1:
            return x.squeeze(-1)


def _power_of_two(n: torch.Tensor) -> torch.Tensor:
    """``2.0 ** n`` in float64 for integer-valued ``n`` in [-1022, 1023], built from bits."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def _power_of_two_f32(n: torch.Tensor) -> torch.Tensor:
    """``2.0 ** n`` in float32 for integer-valued ``n`` in [-126, 127], built from bits."""
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


_EXP_LOW, _EXP_HIGH = -87.33654, 88.72284  # exp(low) is float32's smallest normal; exp(high) its max
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split: n * _LN2_HI is exact for |n| < 2**15
# exp(r) on |r| <= ln(2) / 2: Taylor terms to r**7 (truncation 2e-8 relative, below float32's ulp)
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(8)]


def _exp32(x: torch.Tensor) -> torch.Tensor:
    """exp of float32 ``x`` from float32 ``+ - *`` and bits; results below float32's smallest
    normal flush to 0."""
    xc = x.clamp(_EXP_LOW, _EXP_HIGH)
    n = torch.round(xc * _LOG2E)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[-1])
    for c in reversed(_EXP_COEFFS[:-1]):
        p = p * r + c
    n = torch.nan_to_num(n)
    half = torch.floor(n * 0.5)
    y = p * _power_of_two_f32(half) * _power_of_two_f32(n - half)  # two exact scalings: no overflow in 2**n
    return torch.where(x < _EXP_LOW, 0.0, y)


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            y = _exp32(x.float())
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy * y


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in float32, the same bits for a value wherever it sits in whatever tensor
    (-inf gives 0, NaN stays NaN, results below 2**-126 flush to 0). Within 2 ulps of torch.exp."""
    return _Exp.apply(x)


def log(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` in float32 for positive float ``x`` (0 gives -inf, negative or NaN give NaN),
    invariant like ``exp``. Not differentiable (exact mode takes it of softmax denominators)."""
    with torch.no_grad():
        x64 = x.double()
        bits = x64.abs().view(torch.int64)
        e = ((bits >> 52) - 1023).double()
        m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # [1, 2)
        big = m > _SQRT2
        m = torch.where(big, m * 0.5, m)
        e = torch.where(big, e + 1, e)
        f = (m - 1.0) / (m + 1.0)
        f2 = f * f
        p = torch.full_like(f, _ATANH_COEFFS[-1])
        for c in reversed(_ATANH_COEFFS[:-1]):
            p = p * f2 + c
        y = (e * _LN2 + 2.0 * f * p).float()
        normal = (x64 >= 2.0**-1022) & torch.isfinite(x64)
        special = torch.where(x64 == 0, -math.inf, torch.where(x64 == math.inf, math.inf, math.nan))
        return torch.where(normal, y, special.float())


# --- GEMM ----------------------------------------------------------------------------------------


class FixedPoint:
    """An operand ``(R, K)`` rounded to block fixed point and kept in float64, ready for ``gemm``:
    ``values`` is ``(nb, R, block)`` (zero-padded along K); in each block of a row every value is
    an integer times the same power of two. ``block=128`` (FP8's blocks; integers below 2**22) or
    ``block=None``: one block over the whole row (integers below 2**((52 - ceil(log2 K)) // 2),
    21 bits for K <= 1024), which makes ``gemm`` one BLAS call."""

    __slots__ = ("values", "k", "block")

    def __init__(self, t: torch.Tensor, block: int | None = GEMM_BLOCK):
        t = t.detach().to(torch.float64)
        self.k = t.shape[-1]
        self.block = block
        size = block if block is not None else max(1, self.k)
        bits = FIXED_POINT_BITS if block is not None else (52 - math.ceil(math.log2(size))) // 2
        nb = -(-self.k // size)
        t = F.pad(t, (0, nb * size - self.k)).unflatten(-1, (nb, size))
        exponent = torch.frexp(t.abs().amax(-1, keepdim=True)).exponent.double()  # amax < 2**exponent
        scale = _power_of_two(exponent - bits)  # a zero block gets 2**-bits: any scale works
        self.values = (torch.round(t / scale) * scale).permute(1, 0, 2).contiguous()

    @property
    def rows(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        return self.values.nbytes


_GEMM_CHUNK = 2**22  # float64 elements of block products held at once (32 MiB)


def gemm(a: torch.Tensor | FixedPoint, b: torch.Tensor | FixedPoint, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b^T (+ bias)`` for ``a`` (M, K) and ``b`` (N, K), in float64 and invariant: every
    output element depends only on its row of ``a`` and its row of ``b`` (module docstring).

    Within a 128-block, all products of an output element share one power of two (the two rows'
    block scales), so the block's dot product is a sum of integers below 2**51: exact in float64,
    whatever order the BLAS kernel sums in. The block results are added in order of K, then the
    bias. The caller rounds the float64 result once to its output dtype.
    """
    b = b if isinstance(b, FixedPoint) else FixedPoint(b)
    a = a if isinstance(a, FixedPoint) else FixedPoint(a, b.block)
    if a.k != b.k or a.block != b.block:
        raise ValueError(f"invariant gemm: a has K={a.k} (block {a.block}) but b has K={b.k} (block {b.block})")
    blocks = a.values.shape[0]
    out = a.values.new_empty(a.rows, b.rows)
    columns = max(GEMM_BLOCK, _GEMM_CHUNK // max(1, blocks * a.rows))
    for n0 in range(0, b.rows, columns):
        per_block = torch.bmm(a.values, b.values[:, n0 : n0 + columns].transpose(1, 2))  # each exact
        acc = per_block[0]
        for blk in range(1, blocks):
            acc = acc + per_block[blk]
        out[:, n0 : n0 + columns] = acc
    if bias is not None:
        out = out + bias.double()
    return out


def triton_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b^T + bias`` in float32 by the GPU's invariant Triton GEMM (``uses_triton``)."""
    return _triton().gemm(a, b, bias)


class _Linear(torch.autograd.Function):
    """Invariant forward in the input's dtype; F.linear's backward in the same dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_fixed):
        x2 = x.reshape(-1, x.shape[-1])
        if uses_triton(x.device):
            dtype = x.dtype if weight.dtype == x.dtype else torch.float32
            y = triton_gemm(x2.to(dtype), weight.detach().to(dtype), bias)
        else:
            w = FixedPoint(weight, block=None) if weight_fixed is None else weight_fixed
            y = gemm(x2, w, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = (dy.to(weight.dtype) @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (dy2.t().to(x.dtype) @ x2).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_fixed: FixedPoint | None = None
) -> torch.Tensor:
    """``x W^T + b`` with the invariant ``gemm``, in ``x``'s dtype (for linears exact mode keeps
    unquantized, such as ``lm_head``): one fixed-point block per row, so one exact float64 GEMM;
    on a GPU (``uses_triton``) the Triton GEMM in ``x``'s dtype (float32 where the weight's
    differs). ``weight_fixed``: ``FixedPoint(weight, block=None)`` made earlier (unused on a GPU)."""
    return _Linear.apply(x, weight, bias, weight_fixed)


# --- norms, activations, attention, logprobs -----------------------------------------------------


class _TritonRMSNorm(torch.autograd.Function):
    """The normalized float32 rows by the Triton kernel; the backward of the same formula in torch."""

    @staticmethod
    def forward(ctx, x, eps):
        ctx.save_for_backward(x)
        ctx.eps = eps
        return _triton().rms_norm(x, eps)

    @staticmethod
    def backward(ctx, dh):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            h = x.detach().float().requires_grad_()
            ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
            (dx,) = torch.autograd.grad(ref, h, dh)
        return dx.to(x.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's function (float32 statistics, weight times the input-dtype result) with a
    ``tree_sum`` for the mean of squares, differentiable through plain ops; on a GPU
    (``uses_triton``) the Triton kernel's one program per row."""
    if uses_triton(x.device):
        return weight * _TritonRMSNorm.apply(x, eps).to(x.dtype)
    h = x.float()
    variance = tree_sum(h * h) / h.shape[-1]
    h = h * (1.0 / torch.sqrt(variance + eps)).unsqueeze(-1)
    return weight * h.to(x.dtype)


class _SiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        xf = x.float()
        with torch.no_grad():
            y = (xf / (1.0 + exp(-xf))).to(x.dtype)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x.float())
        return (dy.float() * s * (1 + x.float() * (1 - s))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))`` with the invariant ``exp``."""
    return _SiLU.apply(x)


# Attention: every sum over keys is exact, so neither the keys' order nor masked keys (weight 0)
# can change a query's result.
# - Scores: q and k rows on a fixed-point grid of _QK_BITS below each row's largest element, so
#   every q.k is exact in float64 (2 * 23 bits + log2(head_dim <= 128) <= 53).
# - Weights: p = exp(s - max) <= 1 rounded to multiples of 2**-_P_BITS: integers <= 2**22.
# - Values: each key row of V belongs to the class of _V_CLASS_BINADES binades holding its largest
#   element, and is rounded to multiples of 2**(class top - _V_BITS): integers below 2**16. Per
#   class, sum_j p_j v_j over up to _MAX_KEYS keys stays below 2**(22 + 16 + 15) = 2**53: exact.
#   A row's largest element keeps at least _V_BITS - _V_CLASS_BINADES = 12 bits.
_QK_BITS = 23
_P_BITS = 22
_V_BITS = 16
_V_CLASS_BINADES = 4
_MAX_KEYS = 2**15
_MAX_HEAD_DIM = 128


def _row_exponent(t: torch.Tensor) -> torch.Tensor:
    """Per row (last dim): the e with row max < 2**e (0 for a zero row), as float32."""
    return torch.frexp(t.abs().amax(-1, keepdim=True)).exponent.float()


def _on_grid(t: torch.Tensor, grid_exponent: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to multiples of 2**grid_exponent, in float64. Exact scalings by
    powers of two around one rounding; the integers stay below 2**24, so float32 holds them."""
    g = grid_exponent.clamp(-126, 126)  # a row below 2**-100 gets a coarser grid: still exact integers
    return (torch.round(t * _power_of_two_f32(-g)) * _power_of_two_f32(g)).double()


def _attention_forward(q, k, v, visible, scaling: float) -> torch.Tensor:
    """q (B, H, Tq, D), k and v (B, Hkv, Tk, D) with H a multiple of Hkv (grouped queries share
    their key head), visible (B, Tq, Tk) bool: float64 (B, H, Tq, D)."""
    b, h, tq, d = q.shape
    hkv, groups = k.shape[1], h // k.shape[1]
    q, k, v = q.float().reshape(b, hkv, groups * tq, d), k.float(), v.float()  # query heads stacked by key head
    scores = _on_grid(q, _row_exponent(q) - _QK_BITS) @ _on_grid(k, _row_exponent(k) - _QK_BITS).transpose(-1, -2)
    scores = (scores * scaling).float().view(b, hkv, groups, tq, -1).masked_fill(~visible[:, None, None], -math.inf)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a query that sees no key: all weights 0
    weights = torch.round(exp(scores - top).double() * 2.0**_P_BITS).view(b, hkv, groups * tq, -1)  # integers
    den = weights.sum(-1, keepdim=True)  # exact

    bad = ~torch.isfinite(v)
    poisoned = None
    if bool(bad.any()):  # NaN/inf must reach the queries that see them, and only those
        poisoned = (weights > 0).double() @ bad.double() > 0
        v = v.masked_fill(bad, 0.0)
    cls = torch.div(_row_exponent(v) - 1, _V_CLASS_BINADES, rounding_mode="floor")  # (b, hkv, Tk, 1)
    values = _on_grid(v, (cls + 1) * _V_CLASS_BINADES - _V_BITS)
    key_cls = cls.squeeze(-1).unsqueeze(-2)  # (b, hkv, 1, Tk)
    num = None
    for c in torch.unique(cls).tolist()[::-1]:  # descending classes; each sum exact
        term = weights.masked_fill(key_cls != c, 0.0) @ values
        num = term if num is None else num + term
    if poisoned is not None:
        num = num.masked_fill(poisoned, math.nan)
    # a query that sees no key (a padding row) gets zeros, as transformers' SDPA path gives
    return (num / torch.where(den > 0, den, 1.0)).view(b, h, tq, d)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scaling):
        with torch.no_grad():
            if uses_triton(q.device):
                out = _triton().attention(q, k, v, visible, scaling).to(q.dtype)
            else:
                out = _attention_forward(q, k, v, visible, scaling).to(q.dtype)
        ctx.save_for_backward(q, k, v, visible)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, visible = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(
                q_, k_, v_, attn_mask=visible[:, None], scale=ctx.scaling, enable_gqa=k.shape[1] != q.shape[1]
            )
            dq, dk, dv = torch.autograd.grad(ref, (q_, k_, v_), dout)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention, invariant: q (B, H, Tq, D), k and v (B, Hkv, Tk, D) (H a multiple of
    Hkv: grouped queries), ``visible`` (B, Tq, Tk) bool. Every sum over keys is exact
    (module docstring), so neither the keys' order nor the masked keys can change a query's
    result. Returns (B, H, Tq, D) in q's dtype; the backward is SDPA's. On a GPU (``uses_triton``)
    the Triton kernel: each query's visible keys, and only those, in fixed blocks in order."""
    if visible.dim() != 3 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"invariant attention: visible must be (B, Tq, Tk) and query heads a multiple of key heads; got "
            f"visible {tuple(visible.shape)}, {q.shape[1]} query heads, {k.shape[1]} key heads"
        )
    if not uses_triton(q.device) and (k.shape[2] > _MAX_KEYS or q.shape[-1] > _MAX_HEAD_DIM):
        raise ValueError(
            f"invariant attention is exact up to {_MAX_KEYS} keys and head_dim {_MAX_HEAD_DIM}; "
            f"got {k.shape[2]} keys, head_dim {q.shape[-1]}"
        )
    return _Attention.apply(q, k, v, visible, scaling)


_LOGPROB_CHUNK = 2**17  # logits per pass of token_logprobs


def _shifted_and_log_total(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of (R, V) logits, in float32: ``x - max`` and ``log(tree_sum(exp(x - max)))``."""
    shifted = logits.float()
    shifted = shifted - shifted.amax(-1, keepdim=True)
    return shifted, log(tree_sum(_exp32(shifted), -1))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens):
        ctx.save_for_backward(logits, tokens)
        if uses_triton(logits.device):
            with torch.no_grad():
                return _triton().log_softmax(logits, tokens)
        x = logits.reshape(-1, logits.shape[-1])
        t = tokens.reshape(-1, 1)
        rows = max(1, _LOGPROB_CHUNK // x.shape[-1])  # a few rows at a time: exp stays in cache
        parts = []
        with torch.no_grad():
            for r0 in range(0, x.shape[0], rows):
                shifted, log_total = _shifted_and_log_total(x[r0 : r0 + rows])
                parts.append(shifted.gather(-1, t[r0 : r0 + rows]).squeeze(-1) - log_total)
        return torch.cat(parts).reshape(tokens.shape) if parts else x.new_zeros(tokens.shape, dtype=torch.float32)

    @staticmethod
    def backward(ctx, dlp):
        logits, tokens = ctx.saved_tensors
        grad = -torch.softmax(logits.float(), -1) * dlp.unsqueeze(-1)
        grad.scatter_add_(-1, tokens.unsqueeze(-1), dlp.unsqueeze(-1))
        return grad.to(logits.dtype), None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[token]`` in float32 for logits (..., V) and tokens (...), invariant:
    ``(x_t - max) - log(tree_sum(exp(x - max)))`` (on a GPU, ``uses_triton``: the Triton kernel's
    blocks of the vocabulary in order). The backward is the usual softmax one."""
    return _TokenLogprobs.apply(logits, tokens)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of (R, V) logits in float32, invariant, no autograd: for every token the same
    bits ``token_logprobs`` gives it (a rollout engine that reports logprobs over the whole
    vocabulary uses this)."""
    if uses_triton(logits.device):
        with torch.no_grad():
            return _triton().log_softmax(logits)
    x = logits.reshape(-1, logits.shape[-1])
    rows = max(1, _LOGPROB_CHUNK // max(1, x.shape[-1]))
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    with torch.no_grad():
        for r0 in range(0, x.shape[0], rows):
            shifted, log_total = _shifted_and_log_total(x[r0 : r0 + rows])
            out[r0 : r0 + rows] = shifted - log_total.unsqueeze(-1)
    return out.reshape(logits.shape)
