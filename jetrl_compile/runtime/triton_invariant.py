"""Exact mode's invariant kernels for a GPU, in Triton and float32: the dense GEMM (linears left
unquantized, BF16 fprops), RMSNorm, attention and the log-softmax (docs/design.md, section 9).

On CPU, exact mode makes its sums exact in float64 fixed point (``invariant``), which frees it from
whatever order a library kernel sums in. A GPU runs float64 at a fraction of its float32 rate, so
there exact mode fixes the order instead: each kernel here computes a row of its output in one
program, over the same blocks in the same order, whatever the number of rows, the padding, the
packing, or whether the row is a decode step against a KV cache or a position inside a full
sequence. No split reductions, no autotuning, one tile configuration per kernel:

- ``gemm``: ``a @ b^T + bias`` in 64 x 64 output tiles, K in steps of 64 into one float32
  accumulator (``tl.dot``, IEEE float32 products for float32 operands), the bias added last.
- ``rms_norm``: one program per row, the whole row in one block: ``x / sqrt(mean(x * x) + eps)``.
- ``attention``: one program per query and head, over the keys the query sees and only those,
  in order, in blocks of 64 with an online softmax. A decode step (keys 0..t of its cache) and
  the trainer's row t (the same keys among padding, other sequences packed beside it and later
  positions, all masked) run the same blocks of the same keys.
- ``log_softmax``: one program per row, the maximum and then the sum of ``exp(x - max)`` over the
  vocabulary in blocks of 1024, in order; a sampled token's logprob and the full row's agree.

Each result is float32; callers round it to the model's dtype with torch (round to nearest even,
the same on a GPU and under Triton's interpreter, whose float-to-BF16 cast truncates). The
kernels are not the CPU's float64 function: exact mode on a GPU is invariant, and bitwise equal
between the trainer and the engine that run these same kernels, not bitwise the CPU's numbers.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors: the tests check there that a
row does not depend on the batch it is in (the property that does not depend on the hardware).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Reductions call tl.reduce with Triton's own combine functions, not tl.sum / tl.max: those are
# jit functions of Triton's library, which its interpreter runs only if TRITON_INTERPRET was set
# before Triton was imported (the tests set it per test); tl.reduce is a builtin, and the
# interpreter maps these two combine functions to numpy's sum and max.
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max

GEMM_BLOCK_M = GEMM_BLOCK_N = GEMM_BLOCK_K = 64
ATTENTION_BLOCK_N = 64
SOFTMAX_BLOCK = 1024


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _check_device(name: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"invariant {name}: operands on several devices {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and not interpreting():
        raise RuntimeError(
            f"exact mode's Triton {name} got CPU tensors: it runs on a CUDA GPU, or on CPU under Triton's "
            "interpreter with TRITON_INTERPRET=1 (slow: for tests). On CPU, exact mode's default kernels "
            "(JETRL_EXACT_KERNELS=torch) need no Triton"
        )


@functools.cache
def _jit(kernel, interpret: bool):
    """``kernel`` compiled for the GPU or run by the interpreter (``triton.jit`` reads
    ``TRITON_INTERPRET`` when it wraps a function, so each mode gets its own wrapper)."""
    del interpret  # the cache key
    return triton.jit(kernel)


# --- GEMM ----------------------------------------------------------------------------------------


def _gemm_kernel(
    a_ptr, b_ptr, bias_ptr, out_ptr, M, N, K, stride_a, stride_b,
    HAS_BIAS: tl.constexpr, FLOAT32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_b + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if FLOAT32_DOT:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)  # BF16 tensor cores, float32 accumulation
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b^T + bias`` in float32 for ``a`` (M, K), ``b`` (N, K), both BF16 or both float32
    (float32: IEEE products, no TF32), every output row the same whatever M (module docstring).

    Triton's interpreter multiplies BF16 tiles as their raw 16-bit patterns (its ``tl.dot`` hands
    numpy the bits, which numpy stores as uint16), so there BF16 tiles are upcast first: float32
    products of BF16 values are exact, the same products a BF16 tensor core forms."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"invariant gemm: a {tuple(a.shape)} and b {tuple(b.shape)} are not (M, K) and (N, K)")
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"invariant gemm takes two BF16 or two float32 operands; got {a.dtype} and {b.dtype}")
    _check_device("gemm", a, b, *(() if bias is None else (bias,)))
    (m, k), n = a.shape, b.shape[0]
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return out
    bias_arg = bias.float().contiguous() if bias is not None else out  # unread without a bias
    grid = (triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, GEMM_BLOCK_N))
    _jit(_gemm_kernel, interpreting())[grid](
        a, b, bias_arg, out, m, n, k, a.stride(0), b.stride(0),
        HAS_BIAS=bias is not None, FLOAT32_DOT=a.dtype == torch.float32 or interpreting(),
        BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K,
    )
    return out


# --- RMSNorm -------------------------------------------------------------------------------------


def _rms_norm_kernel(x_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + tl.program_id(0) * H + cols, mask=ok, other=0.0).to(tl.float32)
    variance = tl.div_rn(tl.reduce(x * x, 0, _SUM), H * 1.0)
    inverse = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    tl.store(out_ptr + tl.program_id(0) * H + cols, x * inverse, mask=ok)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x * x) + eps)`` over the last dim, in float32, one program per row."""
    _check_device("RMSNorm", x)
    h = x.shape[-1]
    rows = x.reshape(-1, h).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(h)
        _jit(_rms_norm_kernel, interpreting())[(rows.shape[0],)](rows, out, h, float(eps), BLOCK=block)
    return out.reshape(x.shape)


# --- attention -----------------------------------------------------------------------------------


def _attention_kernel(
    q_ptr, k_ptr, v_ptr, keys_ptr, count_ptr, out_ptr, H, HKV, TQ, TK, D, scaling,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh, i = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv = b * HKV + h // (H // HKV)  # grouped queries share their key head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + (bh * TQ + i) * D + d, mask=d_ok, other=0.0).to(tl.float32)
    row = b * TQ + i
    count = tl.load(count_ptr + row)
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.full((BLOCK_D,), 0.0, tl.float32)
    for start in range(0, count, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        k_ok = slots < count
        keys = tl.load(keys_ptr + row * TK + slots, mask=k_ok, other=0)  # the query's visible keys, in order
        offsets = (kv * TK + keys[:, None]) * D + d[None, :]
        mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        scores = tl.where(k_ok, tl.reduce(k * q[None, :], 1, _SUM) * scaling, float("-inf"))
        new_top = tl.maximum(top, tl.reduce(scores, 0, _MAX))
        rescale = tl.exp(top - new_top)
        p = tl.exp(scores - new_top)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        total = total * rescale + tl.reduce(p, 0, _SUM)
        acc = acc * rescale + tl.reduce(p[:, None] * v, 0, _SUM)
        top = new_top
    # a query that sees no key (a padding row) gets zeros, as the CPU kernel and SDPA give
    out = tl.where(total > 0, tl.div_rn(acc, tl.maximum(total, 1e-30)), 0.0)
    tl.store(out_ptr + (bh * TQ + i) * D + d, out, mask=d_ok)


def visible_keys(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From a (B, Tq, Tk) bool mask: each query's visible key indices in increasing order, packed
    to the front of a (B, Tq, Tk) int32 tensor, and how many there are, (B, Tq) int32."""
    order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
    return order.to(torch.int32), visible.sum(-1, dtype=torch.int32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention in float32 for q (B, H, Tq, D), k and v (B, Hkv, Tk, D), ``visible``
    (B, Tq, Tk) bool: one program per query and head, over the query's visible keys only, in
    blocks of 64 counted from its first one (module docstring)."""
    _check_device("attention", q, k, v, visible)
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    keys, count = visible_keys(visible.expand(b, tq, tk))
    out = torch.empty((b, h, tq, d), dtype=torch.float32, device=q.device)
    if out.numel():
        _jit(_attention_kernel, interpreting())[(b * h, tq)](
            q.contiguous(), k.contiguous(), v.contiguous(), keys.contiguous(), count.contiguous(), out,
            h, hkv, tq, tk, d, float(scaling),
            BLOCK_N=ATTENTION_BLOCK_N, BLOCK_D=triton.next_power_of_2(d),
        )
    return out


# --- log-softmax ---------------------------------------------------------------------------------


def _log_softmax_kernel(x_ptr, tokens_ptr, out_ptr, V, ONE_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row * V
    top = tl.full((), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, tl.reduce(x, 0, _MAX))
    total = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        total += tl.reduce(tl.exp(x - top), 0, _SUM)
    log_total = tl.log(total)
    if ONE_TOKEN:
        token = tl.load(tokens_ptr + row)
        tl.store(out_ptr + row, (tl.load(base + token).to(tl.float32) - top) - log_total)
    else:
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * V + cols, (x - top) - log_total, mask=cols < V)


def log_softmax(logits: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of (..., V) logits, in float32: ``(x - max) - log(sum(exp(x - max)))``, the whole
    row, or only at ``tokens`` (...) when given (the same bits as the whole row's entry)."""
    v = logits.shape[-1]
    x = logits.reshape(-1, v).contiguous()
    if tokens is not None:
        t = tokens.reshape(-1).to(torch.int64).contiguous()
        if t.numel() != x.shape[0]:
            raise ValueError(f"invariant log_softmax: {t.numel()} tokens for {x.shape[0]} rows of logits")
        _check_device("log-softmax", x, t)
        out = torch.empty(t.shape, dtype=torch.float32, device=x.device)
    else:
        _check_device("log-softmax", x)
        t, out = x, torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] and v:
        _jit(_log_softmax_kernel, interpreting())[(x.shape[0],)](
            x, t, out, v, ONE_TOKEN=tokens is not None, BLOCK=SOFTMAX_BLOCK
        )
    return out.reshape(tokens.shape if tokens is not None else logits.shape)
