"""This machine's CPU in words, for every run's start-up line, benchmark tables and test runs:
the kind decides which BF16 GEMM path runs (``kernels.bf16_gemm_path``) and which kernels torch,
Inductor and vLLM pick, so a figure or a failure means little without it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from . import switches


def cpu_model() -> str:
    """The processor's name (``/proc/cpuinfo``'s model name where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_kind() -> str:
    """torch's CPU capability and the BF16 units it found: ``AVX512 with AVX-512 BF16, AMX``,
    ``AVX2``."""
    probes = (("AVX-512 BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
    features = [name for name, probe in probes if getattr(torch.cpu, probe, lambda: False)()]
    capability = torch.backends.cpu.get_cpu_capability()
    return capability + (f" with {', '.join(features)}" if features else "")


def describe(device: torch.device | str = "cpu") -> str:
    """One line: the CPU kind, model and cores, the BF16 GEMM path and any switch set for the run;
    for a GPU device, the GPU and the FP8 GEMM kernel that runs there."""
    from .kernels import bf16_gemm_name, bf16_gemm_path, kernel_name

    device = torch.device(device)
    forced = switches.cpu_switches_set()
    line = (
        f"CPU kind {cpu_kind()} ({cpu_model()}, {os.cpu_count()} cores); "
        f"BF16 GEMM path {bf16_gemm_path('cpu')} ({bf16_gemm_name('cpu')})"
    )
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        line = f"GPU {torch.cuda.get_device_name(index)} (sm{major}{minor}); FP8 GEMM {kernel_name(device)}; " + line
    return line + (f"; set: {' '.join(forced)}" if forced else "")
