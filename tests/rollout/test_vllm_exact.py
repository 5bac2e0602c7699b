"""Exact mode in vLLM: the logprob vLLM reports for each token it samples (paged KV cache, batched
decode, fused qkv/gate_up linears, its own sampler) is bitwise the one the exact-mode trainer
recomputes for it teacher-forced in a packed GRPO group; also after a sync of new weights.
A test that switches one of the patches off shows these inputs do tell the difference."""

import pytest
import torch

import jetrl_compile
from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rl.logprobs import group_logprobs
from jetrl_compile.rl.loop import train
from jetrl_compile.rollout import vllm_exact
from jetrl_compile.rollout.engines import VllmEngine, make_engine
from tests.conftest import VLLM_TINY, ByteTokenizer, requires_vllm, tiny_model
from tests.rl.test_grpo import EarnableTask

pytestmark = requires_vllm

PROMPT_LENGTHS = (5, 17, 11)
NEW_TOKENS = 48


def _exact(recipe="fp8_fwd_bf16_bwd", dtype=torch.float32, layers=4):
    # head size 64 (vLLM's CPU attention has kernels for it), hidden 192: partial FP8 blocks
    model = tiny_model("llama", layers=layers, dtype=dtype, attn_implementation="sdpa", **VLLM_TINY).eval()
    return jetrl_compile.unify(model, recipe, exact=True)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _sample_and_recompute(model, engine, n=4, seed=3, new_tokens=NEW_TOKENS):
    """(engine logprobs, trainer logprobs), flat over every sampled token."""
    groups = engine.generate(_prompts(), n=n, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    with torch.no_grad():
        trainer = group_logprobs(model, _prompts(), [[c.token_ids for c in g] for g in groups])
    rollout = torch.tensor([x for g in groups for c in g for x in c.logprobs])
    return rollout, torch.cat(trainer)


@pytest.mark.parametrize(
    "recipe, dtype", [("fp8_fwd_bf16_bwd", torch.float32), ("jetrl", torch.bfloat16), ("bf16", torch.float32)],
    ids=["fp8_fwd_bf16_bwd-fp32", "jetrl-bf16", "bf16-fp32"],
)
def test_vllm_logprobs_are_the_trainers_bit_for_bit(recipe, dtype, tmp_path):
    model = _exact(recipe, dtype)
    engine = make_engine(model, "vllm", workdir=tmp_path, max_model_len=256)
    try:
        assert isinstance(engine, VllmEngine)
        rollout, trainer = _sample_and_recompute(model, engine)
        assert rollout.numel() >= 200, rollout.numel()  # 12 completions; an early EOS ends a few
        assert torch.equal(rollout, trainer), f"{(rollout != trainer).sum()} of {rollout.numel()} tokens differ"

        # new weights (a step of SGD on every parameter) reach vLLM's fixed-point operands too
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        engine.sync(model)
        after, trainer_after = _sample_and_recompute(model, engine, seed=4)
        assert torch.equal(after, trainer_after)
        assert not torch.equal(after[:50], rollout[:50])  # the engine did sample from the new weights
    finally:
        engine.close()


def test_on_a_gpus_kernels_vllm_is_exact_without_float64_operands(tmp_path, monkeypatch):
    """With a GPU's kernels (here under Triton's interpreter, in vLLM's CPU backend): vLLM's
    quantized linears run the batch-invariant Triton FP8 GEMM in exact mode, and its attention,
    norms, logits head and logprobs ``triton_invariant``'s kernels, as the trainer does: no
    fixed-point operand anywhere, and the trainer's logprobs bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("JETRL_FP8_KERNEL", "triton")
    monkeypatch.setenv("JETRL_EXACT_KERNELS", "triton")
    model = _exact("fp8_fwd_bf16_bwd", layers=2)
    engine = make_engine(model, "vllm", workdir=tmp_path, max_model_len=256)
    try:
        layer = engine.vllm_model.model.layers[0].mlp.down_proj
        assert layer.weight_fixed is True and not hasattr(layer, "weight_dequantized")
        rollout, trainer = _sample_and_recompute(model, engine, n=2, new_tokens=10)
        assert not jetrl_compile.unified_state(model).cache._fixed, "the trainer made a fixed-point operand"
        assert not engine._exact._fixed, "vLLM's logits head made a fixed-point operand"
        assert rollout.numel() >= 40, rollout.numel()
        assert torch.equal(rollout, trainer), f"{(rollout != trainer).sum()} of {rollout.numel()} tokens differ"
    finally:
        engine.close()


def test_without_exact_attention_these_inputs_do_differ(tmp_path, monkeypatch):
    """vLLM's own paged attention kernel in place of the invariant one: tokens differ."""
    monkeypatch.setattr(vllm_exact, "ExactAttention", lambda impl, name: impl)
    model = _exact()
    engine = VllmEngine(model, workdir=tmp_path, max_model_len=256)
    try:
        rollout, trainer = _sample_and_recompute(model, engine)
        assert (rollout != trainer).sum() > 0
    finally:
        engine.close()


def test_exact_engine_refuses_another_dtype(tmp_path):
    with pytest.raises(ValueError, match="exact mode runs the engine in the trainer's dtype"):
        VllmEngine(_exact(layers=1), workdir=tmp_path, max_model_len=256, dtype=torch.bfloat16)


def test_grpo_driver_exact_on_vllm_reports_zero_mismatch_every_step(tmp_path):
    cfg = GrpoConfig(steps=2, batch_size=2, group_size=3, max_new_tokens=8, lr=1e-2, engine="vllm",
                     out=str(tmp_path / "run"), save_every=5, plot_every=5, micro_batch=3, exact=True)
    model = tiny_model("llama", layers=2, **VLLM_TINY)
    rows = train(cfg, model=model, tokenizer=ByteTokenizer(), task=EarnableTask(seed=0), progress=False)
    assert len(rows) == 2
    for row in rows:
        assert row["grad_norm"] > 0  # the first step learns, so the second samples synced weights
        assert row["mismatch_kl"] == 0.0 and row["logprob_abs_diff_max"] == 0.0, row


def test_exact_attention_refuses_a_gpu_backends_kv_cache_by_name():
    """Exact attention reads the CPU backend's KV cache layout; a GPU backend lays its cache out
    otherwise, so it is refused with the way out (the hf engine), not misread."""

    class FlashAttentionImpl:
        num_heads, num_kv_heads, head_size, scale = 4, 2, 64, 0.125

    with pytest.raises(ValueError, match="layers.0.attn runs FlashAttentionImpl. On a GPU, sample exact mode"):
        vllm_exact.ExactAttention(FlashAttentionImpl(), "layers.0.attn")
