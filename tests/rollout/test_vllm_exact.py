"""Exact mode in vLLM: the logprob vLLM reports for each token it samples (paged KV cache, batched
decode, fused qkv/gate_up linears, its own sampler) is bitwise the one the exact-mode trainer
recomputes for it teacher-forced in a packed GRPO group; also after a sync of new weights.
A test that switches one of the patches off shows these inputs do tell the difference."""

import itertools
import types

import pytest
import torch

import jetrl_compile
from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rl.logprobs import group_logprobs
from jetrl_compile.rl.loop import train
from jetrl_compile.rollout import vllm_exact
from jetrl_compile.rollout.engines import VllmEngine, make_engine
from jetrl_compile.runtime import invariant
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


def _impl(class_name, num_heads=4, num_kv_heads=2, head_size=8):
    """A stand-in for a vLLM attention backend's impl: what ExactAttention reads of one."""
    attrs = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size, "scale": head_size**-0.5}
    return type(class_name, (), attrs)()


def test_exact_attention_refuses_a_kv_cache_it_does_not_know_by_name():
    """A backend whose cache layout ExactAttention does not know is refused with the way out,
    not misread."""
    with pytest.raises(ValueError, match="layers.0.attn runs FlashInferImpl. Start vLLM with attention_backend="):
        vllm_exact.ExactAttention(_impl("FlashInferImpl"), "layers.0.attn")


def _step(attn, kv_cache, seqs, tables, block_size, spans):
    """One vLLM step through ``attn``: positions ``start:stop`` of each sequence are the queries
    (a prefill, or one decode token each); returns their outputs, (tokens, H, D)."""
    q, k, v, slots, query_lens, seq_lens = [], [], [], [], [], []
    for (sq, sk, sv), table, (start, stop) in zip(seqs, tables, spans):
        positions = torch.arange(start, stop)
        q.append(sq[start:stop]), k.append(sk[start:stop]), v.append(sv[start:stop])
        slots.append(torch.tensor(table)[positions // block_size] * block_size + positions % block_size)
        query_lens.append(stop - start), seq_lens.append(stop)
    q, k, v = torch.cat(q), torch.cat(k), torch.cat(v)
    width = max(len(t) for t in tables)
    meta = types.SimpleNamespace(
        num_actual_tokens=q.shape[0], causal=True,
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    )
    attn.do_kv_cache_update(None, k, v, kv_cache, torch.cat(slots).to(torch.int32))
    return attn.forward(None, q, k, v, kv_cache, meta, torch.empty_like(q))


def test_exact_attention_on_a_gpu_backends_kv_cache_is_the_cpu_ones_and_the_unpaged_function():
    """On a GPU, exact mode's engine asks vLLM for its Triton attention backend, whose cache holds
    each slot's key then its value (logically (blocks, kv heads, block size, 2 x head size), laid
    out slot-major in memory). ExactAttention reads and writes that cache; a prefill then a decode
    step of two sequences on scattered blocks give, bit for bit, what it gives on the CPU
    backend's cache and what ``invariant.attention`` gives each sequence unpaged. The keys land
    where vLLM's own kernels look for them (its ``kv_cache.transpose(1, 2).split(head_size, -1)``)."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, block_size, blocks = 4, 2, 8, 4, 8
    lengths, tables = (6, 10), ([5, 2], [7, 0, 3])
    seqs = [tuple(torch.randn(n, heads, D, generator=g) for heads in (H, Hkv, Hkv)) for n in lengths]  # q, k, v
    gpu_cache = torch.zeros(blocks, block_size, Hkv, 2 * D).transpose(1, 2)  # vLLM's slot-major layout (NHD)
    cpu_cache = torch.zeros(blocks, Hkv, block_size, 2 * D)
    outputs = {}
    for name, cache in (("TritonAttentionImpl", gpu_cache), ("CPUAttentionBackendImpl", cpu_cache)):
        attn = vllm_exact.ExactAttention(_impl(name, H, Hkv, D), "layers.0.attn")
        prefill = _step(attn, cache, seqs, tables, block_size, spans=[(0, n - 1) for n in lengths])
        decode = _step(attn, cache, seqs, tables, block_size, spans=[(n - 1, n) for n in lengths])
        outputs[name] = prefill, decode
    for gpu, cpu in zip(outputs["TritonAttentionImpl"], outputs["CPUAttentionBackendImpl"]):
        assert torch.equal(gpu, cpu)

    prefill, decode = outputs["TritonAttentionImpl"]
    first = 0
    for b, (sq, sk, sv) in enumerate(seqs):
        n = sq.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
        alone = invariant.attention(sq.transpose(0, 1)[None], sk.transpose(0, 1)[None], sv.transpose(0, 1)[None],
                                    causal, D**-0.5)[0].transpose(0, 1)  # (n, H, D)
        assert torch.equal(prefill[first : first + n - 1], alone[: n - 1])
        assert torch.equal(decode[b], alone[n - 1])
        first += n - 1

    key_cache, value_cache = gpu_cache.transpose(1, 2).split(D, dim=-1)  # (blocks, block size, kv heads, D)
    sk, sv = seqs[1][1], seqs[1][2]
    for position in range(lengths[1]):
        block, slot = tables[1][position // block_size], position % block_size
        assert torch.equal(key_cache[block, slot], sk[position]) and torch.equal(value_cache[block, slot], sv[position])


def test_an_exact_engine_on_a_gpu_asks_vllm_for_an_attention_backend_it_reads(tmp_path, monkeypatch):
    """vLLM picks an attention backend by GPU (FlashInfer on some); an exact engine on CUDA names
    one whose KV cache ExactAttention reads, beside its stated memory share."""
    import vllm

    class Started(Exception):
        pass

    def llm(**kwargs):
        raise Started(kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm, "LLM", llm)
    with pytest.raises(Started) as started:
        VllmEngine(_exact(layers=1), workdir=tmp_path, max_model_len=256, gpu_memory=0.25)
    kwargs = started.value.args[0]
    assert kwargs["attention_backend"] == vllm_exact.GPU_ATTENTION_BACKEND and kwargs["gpu_memory_utilization"] == 0.25
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name in (vllm_exact.GPU_ATTENTION_BACKEND, "FLASH_ATTN"):  # vLLM's implementations of those backends
        assert AttentionBackendEnum[name].get_class().get_impl_cls().__name__ in vllm_exact.KV_SPLITS
