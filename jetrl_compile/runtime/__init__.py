"""Numerics only: the FP8 format and quantizer, GEMM kernels, the recipe-driven linear op and the
weight cache. Imports torch, torchao and ``recipes``, nothing else of ours."""

from .fp8_linear import fp8_linear
from .quantize import FP8_DTYPE, FP8_MAX, Quantized, dequantize, quantize_blockwise, quantize_groupwise

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Quantized",
    "dequantize",
    "fp8_linear",
    "quantize_blockwise",
    "quantize_groupwise",
]
