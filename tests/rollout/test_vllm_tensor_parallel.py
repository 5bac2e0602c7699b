"""vLLM's own tensor-parallel loading (TP=2) of our export: every rank holds exactly its slice of
the trainer's FP8 blocks, for column-parallel fused layers (q/k/v with replicated kv heads, gate/up)
and row-parallel ones (o, down: K split, scales split with it).

The two TP ranks are processes started as torchrun starts them, each running its engine in-process
and joining the world as vLLM's ``external_launcher``, forked from the tests' preloaded fork
server. vLLM's own multiprocessing executor instead spawns CPU workers that import vLLM again (this
test took about 20 s that way, 4 s this way). Either way each rank's model loads the export
through the same tensor-parallel weight loaders."""

import json
import os

import torch

from jetrl_compile.rollout.export import export_vllm, rollout_tensors
from jetrl_compile.runtime.quantize import dequantize
from tests.conftest import free_port, requires_vllm, run_ranks, unified_tiny

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


def _shared_memory_name(worker) -> str | None:
    """The group name of vLLM's CPU tensor-parallel communicator, whose shared memory on rank r
    is named ``{group name}_{r}``; None where it uses none. vLLM's AVX2 kernel library (an
    AVX2-only x86 CPU) has no shared-memory ops (``torch.ops._C.init_shm_manager``): there the
    communicator is plain ``torch.distributed`` (gloo) and leaves nothing to remove."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    module = get_tp_group().device_communicator.dist_module
    return None if module is dist else module.group_name


def _rows_dequantized(q: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """A rank's weight: its FP8 payload times the scale of each row's 128-column group."""
    return q.float() * row_scales.repeat_interleave(128, dim=1)[:, : q.shape[1]]


def _tensor_parallel_rank(rank: int, port: int, export: str, folder: str) -> None:
    """One of two TP ranks: load the export, save this rank's slice of layer 0, sample greedily."""
    from vllm import LLM, SamplingParams

    cores = sorted(os.sched_getaffinity(0))
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[-1]}",  # one core per rank
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core in the rank's own process
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    torch.set_num_threads(1)
    llm = LLM(model=export, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
              tensor_parallel_size=2, distributed_executor_backend="external_launcher", seed=0)
    # vLLM's CPU communicator names its shared memory after the init method, the same every run
    # under external_launcher, and frees it in a destructor at process exit, which a multiprocessing
    # child skips (it leaves by os._exit): the next run would find it and fail (errno 17). Each
    # rank removes its own (a rank killed before that leaves it in /dev/shm, to remove by hand).
    shared_memory = None
    try:
        (shared_memory,) = llm.collective_rpc(_shared_memory_name)
        assert llm.collective_rpc(_save_rank_layer, args=(folder,)) == [rank]  # this process's worker only
        out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        with open(os.path.join(folder, f"tokens{rank}.json"), "w") as f:
            json.dump(list(out[0].outputs[0].token_ids), f)
    finally:
        llm.llm_engine.engine_core.shutdown()
        if shared_memory is not None:  # shm_open's name: leading slashes dropped
            os.unlink(f"/dev/shm/{shared_memory.lstrip('/')}_{rank}")


def test_two_way_tensor_parallel_vllm_loads_each_rank_its_exact_blocks(tmp_path):
    model = unified_tiny(**DIMS)
    path = export_vllm(model, tmp_path / "export", tokenizer=False)
    full = dict(rollout_tensors(model))
    whole = {name.removesuffix(".weight"): dequantize(full[name], full[name + "_scale"], torch.float32)
             for name in full if name.startswith("model.layers.0.") and name + "_scale" in full}
    run_ranks(_tensor_parallel_rank, (free_port(), str(path), str(tmp_path)), 2)
    tokens = [json.loads((tmp_path / f"tokens{rank}.json").read_text()) for rank in range(2)]
    assert len(tokens[0]) == 4 and tokens[0] == tokens[1]  # one engine, sharded: both ranks sample alike

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
