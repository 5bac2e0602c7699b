"""The FP8 format every part of the flow agrees on: payload dtype, group sizes, scale layouts and
the checkpoint names of the scales (docs/design.md, section 2)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
GROUP = 128  # weights: GROUP x GROUP blocks; activations: 1 x GROUP groups along the contraction dim

# checkpoint name of a quantized weight's scales, per export format: ours holds the scale s
# (value = q * s); vLLM's native block-FP8 format names the same tensor "weight_scale_inv"
SCALE_NAMES = {"jetrl": "weight_scale", "fp8": "weight_scale_inv"}


def block_scale_shape(shape: torch.Size | tuple[int, int]) -> tuple[int, int]:
    """Shape of the GROUP x GROUP block scales of an (N, K) weight."""
    n, k = shape
    return (-(-n // GROUP), -(-k // GROUP))


def group_scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the 1 x GROUP group scales of an activation: one per GROUP along the last dim."""
    return (*shape[:-1], -(-shape[-1] // GROUP))
