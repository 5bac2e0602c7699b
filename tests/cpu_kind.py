"""The CPU kind a test run is on, and ``JETRL_TEST_CPU=avx2``: the suite run on this machine as
on an AVX2-only x86 CPU (no AVX-512, no AVX-512 BF16, no AMX), for a developer without one.

Which kernels a process runs is chosen in three places, and capping the ISA through the
environment alone (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``) reaches only two:

- ATen's vectorized kernels and Inductor's generated C++ follow ``ATEN_CPU_CAPABILITY``;
- oneDNN follows ``ONEDNN_MAX_CPU_ISA``, and so does torch's test of whether BF16 matmuls go to
  oneDNN (``torch.ops.mkldnn._is_mkldnn_bf16_supported``), hence our BF16 GEMM path probe;
- vLLM reads the CPU itself, through ``torch.cpu._is_avx512_supported`` and its kin (cpuinfo,
  no environment): it loads its AVX2 kernel library (``vllm._C_AVX2``) and its AVX2 attention
  only where those say no. Under the environment cap alone vLLM ran its AVX-512 BF16 / AMX
  kernels, as it does on this machine.

So the simulation sets both variables and also makes those ``torch.cpu`` probes answer as an
AVX2-only CPU would, in this process and in every process it starts that imports this module
(the test ranks' fork server does; so does a script started through ``script_command``). It
must run before ``jetrl_compile`` is imported (the GEMM path is probed at import) and before
torch is, for ``ATEN_CPU_CAPABILITY``: ``tests/conftest.py`` calls it first. Inductor's compiled
kernels go to their own cache folder: a kernel compiled under another ``ATEN_CPU_CAPABILITY``
would be reused, with wrong results (docs/design.md).
What it cannot change: the instructions the CPU has (a kernel that would fault on AVX2 runs) and
BLAS (MKL or OpenBLAS pick their own code path; they compute FP32 GEMMs either way).
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile

SIMULATE = "JETRL_TEST_CPU"
# torch.cpu's probes of ISA features an AVX2-only x86 CPU lacks
_AVX2_LACKS = (
    "_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
    "_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_fp16_supported",
)


def simulate_from_environment() -> str | None:
    """Apply ``JETRL_TEST_CPU`` (``avx2``, or unset for this CPU as it is); returns it."""
    kind = os.environ.get(SIMULATE) or None
    if kind is None:
        return None
    if kind != "avx2":
        raise ValueError(f"{SIMULATE}={kind!r} is unknown; the one simulated CPU kind is avx2")
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jetrl-inductor-avx2"))
    import torch

    for probe in _AVX2_LACKS:
        if hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, _no)
    return kind


def _no() -> bool:
    return False


def script_command(script: str, *args: str) -> list[str]:
    """The command that runs the Python ``script`` in a child process as the CPU kind of this run:
    under ``JETRL_TEST_CPU`` through this module (``python -m tests.cpu_kind SCRIPT ARGS``), so
    that vLLM's probes in the child answer as the simulated CPU's too; otherwise the script
    itself. The child must run from the repository root."""
    if os.environ.get(SIMULATE):
        return [sys.executable, "-m", "tests.cpu_kind", script, *args]
    return [sys.executable, script, *args]


if __name__ == "__main__":  # python -m tests.cpu_kind SCRIPT ARGS: SCRIPT run as the simulated CPU kind
    simulate_from_environment()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
