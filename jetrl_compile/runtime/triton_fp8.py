"""The FP8 GEMM on tensor cores: one Triton kernel of the GEMM definition, for CUDA GPUs with FP8
(sm89 and later), and the same kernel under Triton's interpreter on CPU tensors (the tests).

``fp8_gemm(a, b, bias)`` takes ``a``, an ``(M, K)`` payload in 1 x 128 groups along K, and ``b``,
an ``(N, K)`` payload in 128 x 128 blocks (fprop, dgrad) or in 1 x 128 groups along K (wgrad; the
vLLM plugin's weight, whose block scales it keeps one row per weight row), and returns ``bf16(deq(a)
@ deq(b)^T + bias)``:

- per 128-wide block of K, the dot product of the FP8 codes on the tensor cores, in float32 (the
  products of two e4m3 codes are exact; on Hopper, whose FP8 MMA adds in reduced precision, the
  partial sum is promoted to the float32 accumulator after every MMA instruction);
- times both power-of-two scales (exact), added to one float32 accumulator, blocks in order of K;
- the bias added to that accumulator, then one round-to-nearest-even to BF16, on the bits, so the
  rounding is the same on a GPU and in the interpreter (whose float-to-BF16 cast truncates).

That is the GEMM definition (``kernels``), with one fixed summation order. A partial last group
(K not a multiple of 128: SmolLM2's 576) reads zeros past K; partial tiles of M and N are masked.

**Batch invariance.** The tile configuration is fixed (no autotuning), there is no split-K, and the
K loop is the same for every program, so an output row is computed the same way whatever M is and
whichever tile it falls in: a decode step's row equals the trainer's row for the same input. Tests
check it under the interpreter; on a GPU ``bench/gpu.sh`` checks it too.

**Why our own kernel** (docs/design.md, section 9). torchao's blockwise Triton GEMMs read a K that
is not a multiple of 128 out of bounds (their masks do not advance with K), add no bias before the
rounding, and autotune their tiles (the wgrad variant with M in the key); cuBLAS's blockwise
``scaled_mm`` is sm90-only and needs K and N in multiples of 128 (``JETRL_FP8_KERNEL=scaled_mm``
still selects it where it fits). Neither is batch-invariant by construction.

This module imports Triton. ``kernels`` registers the op ``jetrl::fp8_gemm_triton`` that calls
``launch`` (importing this module on its first call), so that eager calls, compiled graphs (an
opaque node there, which the precision report reads) and vLLM run the same launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .format import FP8_DTYPE, GROUP, block_scale_shape
from .quantize import Quantized

# The one tile configuration (see "Batch invariance"): per program, a BLOCK_M x BLOCK_N tile of the
# output, K in steps of one scale group. Pipeline stages change no number, only speed.
BLOCK_M, BLOCK_N, NUM_WARPS = 128, 128, 8
# Hopper's FP8 MMA accumulates in reduced precision within an instruction (k = 32): promote every 32.
PROMOTE_EVERY = 32


def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_a, stride_a_scale_m, stride_a_scale_k,
    stride_b, stride_b_scale_n, stride_b_scale_k,
    stride_out,
    B_BLOCKS: tl.constexpr,  # b's scales per 128 x 128 block (else one per row and K group)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    PROMOTE_EVERY: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of ``bf16(deq(a) @ deq(b)^T + bias)``; wrapped by ``_jit``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    if B_BLOCKS:
        b_scale_rows = cols // GROUP
    else:
        b_scale_rows = cols
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # builtins only: tl.zeros and tl.cdiv are
    # jit functions of Triton's library, which the interpreter runs only if TRITON_INTERPRET was set at import
    for kb in range(0, (K + GROUP - 1) // GROUP):
        ks = kb * GROUP + tl.arange(0, GROUP)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_b + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(a_scale_ptr + rows * stride_a_scale_m + kb * stride_a_scale_k, mask=row_ok, other=1.0)
        b_s = tl.load(b_scale_ptr + b_scale_rows * stride_b_scale_n + kb * stride_b_scale_k, mask=col_ok, other=1.0)
        partial = tl.dot(a, b, max_num_imprecise_acc=PROMOTE_EVERY)
        acc += partial * a_s[:, None] * b_s[None, :]  # power-of-two scales: exact
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # round to nearest even on the float32 bits; a NaN stays a (quiet) NaN of the same sign
    bits = acc.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(acc != acc, (bits >> 16) | 0x40, rounded)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], rounded.to(tl.int16),
             mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _jit(interpret: bool):
    """The kernel, compiled for the GPU or run by Triton's interpreter: ``triton.jit`` reads
    ``TRITON_INTERPRET`` when it wraps a function, so each mode gets its own wrapper."""
    del interpret  # the cache key; triton.jit reads the same variable
    return triton.jit(_fp8_gemm_kernel)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, read at each call)."""
    return bool(triton.knobs.runtime.interpret)


def fp8_gemm(a: Quantized, b: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``bf16(deq(a) @ deq(b)^T + bias)`` by the Triton kernel (module docstring). Graphs and
    ``kernels.fp8_gemm`` reach it through the op ``torch.ops.jetrl.fp8_gemm_triton``."""
    return launch(a.data, a.scale, b.data, b.scale, bias)


def _check(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias) -> bool:
    """Validate the operands; returns whether ``b``'s scales are per 128 x 128 block."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise TypeError(f"fp8_gemm_triton takes float8_e4m3fn payloads; got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm_triton: a {tuple(a.shape)} and b {tuple(b.shape)} are not (M, K) and (N, K)")
    (m, k), n = a.shape, b.shape[0]
    groups = -(-k // GROUP)
    if tuple(a_scale.shape) != (m, groups):
        raise ValueError(
            f"fp8_gemm_triton: a's scales {tuple(a_scale.shape)} are not 1 x {GROUP} groups ({m}, {groups})"
        )
    blocks = tuple(b_scale.shape) == block_scale_shape((n, k))
    if not blocks and tuple(b_scale.shape) != (n, groups):
        raise ValueError(
            f"fp8_gemm_triton: b's scales {tuple(b_scale.shape)} fit neither {GROUP} x {GROUP} blocks "
            f"{block_scale_shape((n, k))} nor 1 x {GROUP} groups ({n}, {groups})"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"fp8_gemm_triton: bias of shape {tuple(bias.shape)}, expected ({n},)")
    devices = {t.device for t in (a, a_scale, b, b_scale) + (() if bias is None else (bias,))}
    if len(devices) != 1:
        raise ValueError(f"fp8_gemm_triton: operands on several devices {sorted(map(str, devices))}")
    if a.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "the Triton FP8 GEMM got CPU tensors: it runs on a CUDA GPU, or on CPU under Triton's "
            "interpreter with TRITON_INTERPRET=1 (slow: for tests)"
        )
    return blocks


def launch(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Check the operands and run the kernel over a grid of output tiles."""
    blocks = _check(a, a_scale, b, b_scale, bias)
    (m, k), n = a.shape, b.shape[0]
    a, b = a.contiguous(), b.contiguous()  # K-major rows, as FP8 MMAs read them (dgrad's W^T is copied)
    a_scale, b_scale = a_scale.float(), b_scale.float()
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return out
    bias_arg = bias.to(torch.bfloat16).contiguous() if bias is not None else out  # unread without bias
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    options = {} if a.device.type == "cpu" else dict(num_warps=NUM_WARPS, num_stages=_stages(a.device))
    _jit(interpreting())[grid](
        a, a_scale, b, b_scale, bias_arg, out.view(torch.int16),
        m, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b_scale.stride(0), b_scale.stride(1),
        n,
        B_BLOCKS=blocks, HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP=GROUP, PROMOTE_EVERY=PROMOTE_EVERY,
        **options,
    )
    return out


def _stages(device: torch.device) -> int:
    """Software-pipeline depth: 3 where shared memory allows (Hopper: 228 KiB a multiprocessor),
    2 on Ada (about 100 KiB; a stage holds two 16 KiB FP8 tiles). Numerics do not depend on it."""
    return 3 if torch.cuda.get_device_capability(device)[0] >= 9 else 2
