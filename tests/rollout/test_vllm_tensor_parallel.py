"""vLLM's own tensor-parallel loading (TP=2, two CPU worker processes) of our export: every rank
holds exactly its slice of the trainer's FP8 blocks, for column-parallel fused layers (q/k/v with
replicated kv heads, gate/up) and row-parallel ones (o, down: K split, scales split with it)."""

import os

import torch

from jetrl_compile.rollout.export import export_vllm, rollout_tensors
from jetrl_compile.runtime.quantize import dequantize
from tests.conftest import requires_vllm, unified_tiny

pytestmark = requires_vllm

# 4 heads of 64 (2 per rank), one kv head (replicated on both ranks), MLP 512 (256 per rank)
DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, intermediate_size=512)


def _save_rank_layer(worker, folder: str) -> int:
    """On each vLLM worker (through ``collective_rpc``): save layer 0's FP8 payloads and per-row
    scales as loaded on this tensor-parallel rank."""
    from vllm.distributed import get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    layer = worker.model_runner.model.model.layers[0]
    saved = {}
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        module = layer.get_submodule(name)
        saved[name] = (module.weight.detach().clone(), module.weight_scale.detach().clone())
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    return rank


def _rows_dequantized(q: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """A rank's weight: its FP8 payload times the scale of each row's 128-column group."""
    return q.float() * row_scales.repeat_interleave(128, dim=1)[:, : q.shape[1]]


def test_two_way_tensor_parallel_vllm_loads_each_rank_its_exact_blocks(tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams

    model = unified_tiny(**DIMS)
    path = export_vllm(model, tmp_path / "export", tokenizer=False)
    full = dict(rollout_tensors(model))
    whole = {name.removesuffix(".weight"): dequantize(full[name], full[name + "_scale"], torch.float32)
             for name in full if name.startswith("model.layers.0.") and name + "_scale" in full}
    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")  # one core per rank
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a test function
    # the engine core in this process: vLLM starts CPU processes by spawning them (each imports vLLM
    # again, about 6 s here), and the two TP workers are the processes this test is about
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert sorted(llm.collective_rpc(_save_rank_layer, args=(str(tmp_path),))) == [0, 1]
        out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.engine_core.shutdown()

    def w(name):
        return whole[f"model.layers.0.{name}"]

    for rank in range(2):
        got = {name: _rows_dequantized(q.view(torch.float8_e4m3fn), s)
               for name, (q, s) in torch.load(tmp_path / f"rank{rank}.pt").items()}
        heads, ffn = slice(128 * rank, 128 * (rank + 1)), slice(256 * rank, 256 * (rank + 1))
        expected = {
            "self_attn.qkv_proj": torch.cat([w("self_attn.q_proj")[heads], w("self_attn.k_proj"),
                                             w("self_attn.v_proj")]),
            "self_attn.o_proj": w("self_attn.o_proj")[:, heads],
            "mlp.gate_up_proj": torch.cat([w("mlp.gate_proj")[ffn], w("mlp.up_proj")[ffn]]),
            "mlp.down_proj": w("mlp.down_proj")[:, ffn],
        }
        for name, value in expected.items():
            assert got[name].shape == value.shape, (rank, name)
            assert torch.equal(got[name], value), f"rank {rank}: {name} is not its slice of the trainer's blocks"
