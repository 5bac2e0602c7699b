"""A long-lived vLLM engine, synced after every step, computes what a fresh engine started from the
same weights computes, bit for bit: what a resumed run (a fresh engine from the checkpoint) needs to
continue an uninterrupted one (an engine synced since step 0)."""

import pytest
import torch

from jetrl_compile.rollout import _vllm_compat
from jetrl_compile.rollout.engines import VllmEngine
from tests.conftest import requires_vllm, unified_tiny

pytestmark = requires_vllm

PROMPTS = [[1 + i, 7 + 2 * i, 30 + i, 99 - i] for i in range(6)]


def _train_step(model, lr=1e-2):
    """One AdamW step that moves every weight, the embedding (and so the tied LM head) included."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(input_ids=torch.tensor(PROMPTS)).logits.logsumexp(-1).mean().backward()
    opt.step()


def _samples(engine):
    return engine.generate(PROMPTS, n=2, max_new_tokens=6, seed=3)


@pytest.mark.parametrize("repack", [True, False], ids=["synced", "head-left-stale"])
def test_a_synced_engine_samples_what_a_fresh_engine_on_its_weights_samples(tmp_path, monkeypatch, repack):
    """The model ties its LM head to the embeddings, as SmolLM2 does: vLLM's in-place reload skips
    the tied head, whose CPU GEMM multiplies a packed copy of its weight. With the sync's repack the
    two engines agree bit for bit; without it (the second case, where vLLM packs the head on this
    CPU) the synced engine's logprobs are those of a head left at the starting weights."""
    model = unified_tiny("fp8_fwd_bf16_bwd", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if not repack:
        monkeypatch.setattr(_vllm_compat, "repack_cpu_gemms", lambda llm: 0)
    start = model.model.embed_tokens.weight.detach().clone()
    long = VllmEngine(model, workdir=tmp_path / "long", max_model_len=256)
    try:
        head = long.vllm_model.lm_head
        packed = getattr(head, "cpu_linear", torch.nn.functional.linear) is not torch.nn.functional.linear
        for _ in range(2):
            _train_step(model)
            long.sync(model)
        synced = _samples(long)
        assert torch.equal(head.weight.float(), model.lm_head.weight.to(head.weight.dtype).float())
    finally:
        long.close()
    assert not torch.equal(start, model.model.embed_tokens.weight)  # the steps moved the head

    fresh = VllmEngine(model, workdir=tmp_path / "fresh", max_model_len=256)
    try:
        started = _samples(fresh)
    finally:
        fresh.close()
    logprobs = [[c.logprobs for c in group] for group in started]
    if repack:
        assert synced == started
    elif packed:
        assert [[c.logprobs for c in group] for group in synced] != logprobs
