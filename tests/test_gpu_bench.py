"""bench/gpu.sh must fail fast and clearly without CUDA; its Python part runs end to end on CPU
in smoke mode (tiny shapes), so that the one H200 run is not spent finding a typo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_sh_refuses_without_cuda(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "gpu.md").exists()


def test_gpu_py_smoke_runs_every_section_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert set(data) == {"kernels", "linear", "train_step", "decode"}
    assert all(s["quantizer_bitwise"] and s["emulation_excess"] <= 1 for s in data["kernels"]["shapes"])
    assert data["kernels"]["fp8_kernel_ok"] is False  # no CUDA: the later sections time the emulation
    assert {r["tokens"] for r in data["linear"]} == {128}
    assert set(data["train_step"]) == {"bf16", "fp8_fwd_bf16_bwd", "jetrl"}
    assert all(v["tokens_per_s"] > 0 for v in data["decode"].values())
    assert "## decode" in (tmp_path / "gpu.md").read_text()
