"""FP8 GEMM kernels, chosen by device. The numerics contract is the same on every path.

``fp8_gemm(a, b)`` returns ``bf16(deq(a) @ deq(b)^T)`` with float32 accumulation, where ``a`` is an
``(M, K)`` payload in 1 x 128 groups along K and ``b`` an ``(N, K)`` payload in 128 x 128 blocks or
1 x 128 groups along K (see ``quantize.dequantize``).

- **Emulation** (CPU, and any device without FP8 tensor cores): dequantize both operands to BF16
  (exact, because scales are powers of two) and run one BF16 matmul with float32 accumulation.
  Under torch.compile, Inductor fuses the dequantize into the loops that feed the matmul. This
  is not ``torch._scaled_mm``: on CPU that is a scalar reference loop, about 10,000x slower.
- **CUDA sm90** with cuBLAS blockwise scaling (``torch.nn.functional.scaled_mm``, or
  ``torch._scaled_mm`` where torch has no ``F.scaled_mm``): a real FP8 tensor-core GEMM for
  ``b`` in 128 x 128 blocks (fprop, dgrad) or in 1 x 128 groups (wgrad), when K and N are
  multiples of 128. Off unless ``JETRL_FP8_KERNEL=scaled_mm`` until it has been
  checked against the emulation on an H200 (``bench/gpu.sh`` does); other shapes and devices use
  the emulation.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from .quantize import GROUP, Quantized, block_scale_shape, dequantize, fake_quantize_groupwise, fused_quantize_groupwise


def fp8_gemm(
    a: Quantized, b: Quantized, bias: torch.Tensor | None = None, b_dequantized: torch.Tensor | None = None
) -> torch.Tensor:
    """``bf16(deq(a) @ deq(b)^T + bias)``, the GEMM definition of DESIGN.md section 4.

    ``bias`` (BF16) is added to the float32 accumulator before the one rounding to BF16 (the
    CUDA kernel adds it to the BF16 result, within the summation-order tolerance its check uses).
    ``b_dequantized``, when given, is ``dequantize(*b)`` made earlier (the weight cache keeps it
    per optimizer step); the emulation then skips dequantizing the weight on every call.
    """
    if _use_cuda_blockwise(a.data, b):
        y = _scaled_mm_blockwise(a, b)
        return y if bias is None else y + bias
    return F.linear(dequantize(*a), dequantize(*b) if b_dequantized is None else b_dequantized, bias)


def fp8_gemm_quantizing(
    x: torch.Tensor, b: Quantized, bias: torch.Tensor | None = None, b_dequantized: torch.Tensor | None = None
) -> torch.Tensor:
    """``fp8_gemm(quantize_groupwise(x), b, bias, b_dequantized)``, taking the activation
    unquantized so that its quantize runs as one fused kernel when called eagerly: fused with the
    dequantize for the emulation (``fake_quantize_groupwise``), alone before a real FP8 GEMM.
    Same result, bit for bit."""
    if b_dequantized is not None and not _use_cuda_blockwise(x, b):
        return F.linear(fake_quantize_groupwise(x), b_dequantized, bias)
    return fp8_gemm(fused_quantize_groupwise(x), b, bias, b_dequantized)


def uses_emulation(device: torch.device | str) -> bool:
    """Whether fprop GEMMs on ``device`` run the emulation (and so can use a dequantized weight)."""
    device = torch.device(device)
    return not (device.type == "cuda" and _cuda_blockwise_enabled(device.index or 0))


def kernel_name(device: torch.device | str) -> str:
    """Which kernel ``fp8_gemm`` uses for fprop-layout operands on ``device`` (for reports)."""
    return "emulated (dequantize + bf16 matmul)" if uses_emulation(device) else "cuda-scaled_mm-blockwise"


@functools.cache
def _cuda_blockwise_enabled(device_index: int) -> bool:
    if os.environ.get("JETRL_FP8_KERNEL") != "scaled_mm" or not torch.cuda.is_available():
        return False
    # cuBLAS's 1x128 / 128x128 scaling exists for sm90 only (and cuBLAS 12.9+).
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _use_cuda_blockwise(a: torch.Tensor, b: Quantized) -> bool:
    """Whether the real kernel takes ``a`` (the (M, K) activation or its payload) times ``b``."""
    if a.device.type != "cuda" or not _cuda_blockwise_enabled(a.device.index or 0):
        return False
    k, n = a.shape[1], b.data.shape[0]
    b_layout_ok = tuple(b.scale.shape) in (block_scale_shape(b.data.shape), (n, k // GROUP))
    return b_layout_ok and k % GROUP == 0 and n % GROUP == 0


def _scaling_type(name: str):
    """``ScalingType.BlockWise1x128`` (torch 2.13) is spelled ``Blockwise_1x128`` in some releases."""
    from torch.nn.functional import ScalingType

    for spelling in (name, name.replace("BlockWise", "Blockwise_")):
        if hasattr(ScalingType, spelling):
            return getattr(ScalingType, spelling)
    raise RuntimeError(f"this torch's ScalingType has no {name}")


def _scaled_mm_blockwise(a: Quantized, b: Quantized) -> torch.Tensor:
    """``a`` (M, K) in 1x128 groups times ``b`` (N, K) in 128x128 blocks or 1x128 groups, as
    cuBLAS wants them: the second operand column-major (the transpose of a row-major ``b``),
    1x128 scales outer-dim-major, and 128x128 scales as (round_up(K/128, 4), N/128) with stride
    (1, round_up(K/128, 4)) (see ATen's ScaledBlas.cpp checks)."""
    mat_b = b.data.contiguous().t()
    scale_a = a.scale.t().contiguous().t()
    blockwise_b = tuple(b.scale.shape) == block_scale_shape(b.data.shape)
    if blockwise_b:
        k_blocks = b.scale.shape[1]
        scale_b = F.pad(b.scale, (0, -k_blocks % 4)).t()
        recipe_b = "BlockWise128x128"
    else:
        scale_b = b.scale.t().contiguous().t()
        recipe_b = "BlockWise1x128"
    if hasattr(F, "scaled_mm"):
        return F.scaled_mm(
            a.data, mat_b, scale_a, _scaling_type("BlockWise1x128"), scale_b, _scaling_type(recipe_b),
            output_dtype=torch.bfloat16,
        )
    # Older torch: _scaled_mm picks the blockwise kernel from the scales' shapes.
    return torch._scaled_mm(a.data, mat_b, scale_a, scale_b, out_dtype=torch.bfloat16)
