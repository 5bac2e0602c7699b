"""Runtime pieces: the FP8 quantizer, the recipe-driven linear op and its kernels."""

from .fp8_linear import fp8_linear, linear_with_quantized_weight
from .quantize import FP8_DTYPE, FP8_MAX, Quantized, dequantize, quantize_blockwise, quantize_groupwise

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Quantized",
    "dequantize",
    "fp8_linear",
    "linear_with_quantized_weight",
    "quantize_blockwise",
    "quantize_groupwise",
]
