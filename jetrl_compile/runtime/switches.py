"""Every ``JETRL_*`` environment switch, in one place, read when used (nothing cached: set one
and the next call sees it; under torch.compile a switch is read when a graph is traced, so a
compiled graph keeps the value it was traced with). The switches table of docs/numerics.md lists them.
"""

from __future__ import annotations

import os
from pathlib import Path

BF16_GEMM = "JETRL_BF16_GEMM"
FP8_KERNEL = "JETRL_FP8_KERNEL"
EXACT_KERNELS = "JETRL_EXACT_KERNELS"
FUSED_QUANTIZE = "JETRL_FUSED_QUANTIZE"
CHECK_FINITE = "JETRL_CHECK_FINITE"
DUMP = "JETRL_DUMP"
DUMP_DIR = "JETRL_DUMP_DIR"

BF16_GEMM_CHOICES = ("auto", "native", "fp32")
FP8_KERNEL_CHOICES = ("auto", "emulate", "triton", "scaled_mm")
EXACT_KERNELS_CHOICES = ("auto", "torch", "triton")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default) or default
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; choose one of {', '.join(choices)}")
    return value


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value in ("1", "true", "True"):
        return True
    if value in ("0", "false", "False"):
        return False
    raise ValueError(f"{name}={value!r} is not a switch value; use 1 or 0")


def bf16_gemm() -> str:
    """``auto`` (probe the CPU), ``native`` or ``fp32``: how BF16-operand GEMMs run (kernels)."""
    return _choice(BF16_GEMM, "auto", BF16_GEMM_CHOICES)


def fp8_kernel() -> str:
    """``auto`` (default: Triton's tensor-core GEMM on a CUDA GPU with FP8, the emulation
    elsewhere), ``emulate``, ``triton`` (on CPU tensors under ``TRITON_INTERPRET=1``) or
    ``scaled_mm`` (cuBLAS blockwise on sm90): how FP8 GEMMs run (``kernels.fp8_kernel``)."""
    return _choice(FP8_KERNEL, "auto", FP8_KERNEL_CHOICES)


def exact_kernels() -> str:
    """``auto`` (default: the Triton kernels on a CUDA GPU where Triton is installed, torch's ops
    in float64 fixed point elsewhere), ``torch`` or ``triton`` (on CPU tensors under
    ``TRITON_INTERPRET=1``): which invariant kernels exact mode runs (``invariant.uses_triton``)."""
    return _choice(EXACT_KERNELS, "auto", EXACT_KERNELS_CHOICES)


def fused_quantize() -> bool:
    """Eager quantizes run as one compiled kernel (default on)."""
    return _flag(FUSED_QUANTIZE, True)


def check_finite() -> bool:
    """Eager quantizes raise on NaN/inf input, naming the tensor (default off)."""
    return _flag(CHECK_FINITE, False)


def dump() -> bool:
    """Write every graph the pass saw and produced (default off)."""
    return _flag(DUMP, False)


def dump_dir() -> Path:
    return Path(os.environ.get(DUMP_DIR) or "jetrl_dump")


# Variables, ours and torch's, that cap the CPU's ISA or force our GEMM path: a run names those set.
CPU_SWITCHES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", BF16_GEMM, "JETRL_TEST_CPU")


def cpu_switches_set() -> list[str]:
    """``NAME=value`` for each of ``CPU_SWITCHES`` set in the environment."""
    return [f"{name}={os.environ[name]}" for name in CPU_SWITCHES if os.environ.get(name)]


def launcher_local_rank() -> int:
    """This process's rank on its node as torchrun numbers it (``LOCAL_RANK``; 0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def launcher_world() -> int | None:
    """The number of processes torchrun started (its ``WORLD_SIZE``; ``RANK`` set too), or None
    outside torchrun. Not a switch of ours, but read here with the rest of the environment."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["WORLD_SIZE"])
