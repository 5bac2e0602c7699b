"""The GRPO driver data-parallel (``--parallel ddp``): two gloo ranks on CPU, as torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), on a tiny random model with a reward it earns."""

import datetime
import gc
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import jetrl_compile
from jetrl_compile.errors import UsageValueError
from jetrl_compile.rl import loop, parallel
from jetrl_compile.rl.checkpoint import latest_checkpoint
from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rollout.engines import Completion
from jetrl_compile.runtime.fp8_all_gather import ShardWithFP8Gather
from tests.conftest import (
    FSDP_ALIGNED,
    VLLM_TINY,
    ByteTokenizer,
    free_port,
    one_thread,
    requires_vllm,
    run_ranks,
    tiny_model,
)
from tests.rl.test_grpo import EarnableTask, _cfg, _untimed

WORLD = 2
# the driver's runs, each rank sampling with its own vLLM, the trainer eager: DDP on the default
# recipe; FSDP2 on jetrl with rows that let it gather most weights as FP8 blocks (the checkpoint and
# the engines' exports then go through the gathered-in-FP8 wrappers; its default trainer mode is
# eager). The compiled trainer under DDP is test_distributed's (and one process's driver runs it
# in test_grpo): compiled here, a clean checkout's ranks spent some 25 s compiling one-thread
# kernels that no other test shares (Inductor keys CPU kernels on the thread count).
RUNS = {"ddp": ("fp8_fwd_bf16_bwd", VLLM_TINY, "vllm", "eager"), "fsdp": ("jetrl", FSDP_ALIGNED, "vllm", "auto")}


def _rank(rank, world, port, cfg, die_after_step):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    torch.set_num_threads(1)
    if die_after_step and rank == 0:
        save = loop.save_checkpoint

        def save_then_die(out, step, *args, **kwargs):
            path = save(out, step, *args, **kwargs)
            if step == die_after_step:
                os.kill(os.getpid(), signal.SIGKILL)  # a hard crash of one rank, right after its checkpoint
            return path

        loop.save_checkpoint = save_then_die
    model = tiny_model("llama", layers=2, seed=123 if cfg.resume else 0, **RUNS[cfg.parallel][1])
    callers_group = cfg.engine == "vllm"  # the world is the caller's: the engines must leave it standing
    if callers_group:
        dist.init_process_group("gloo")
    loop.train(cfg, model=model, tokenizer=ByteTokenizer(), task=EarnableTask(seed=0), progress=False)
    if callers_group:
        assert dist.is_initialized(), "closing the engine destroyed the caller's process group"
        dist.barrier()
        dist.destroy_process_group()
    if cfg.parallel == "ddp":  # DDP keeps whole replicas: each rank's weights, to compare
        torch.save({"weights": model.state_dict(), "mode": jetrl_compile.unified_state(model).mode},
                   f"{cfg.out}.rank{rank}.pt")
    elif rank == 0:  # which weights FSDP2 gathered as FP8 blocks, and which shards it holds wrapped
        wrapped = [n for n, p in model.named_parameters() if isinstance(p.to_local(), ShardWithFP8Gather)]
        torch.save((jetrl_compile.unified_state(model).fp8_all_gather, wrapped), f"{cfg.out}.fp8-gather.pt")


def _run_ranks(tmp_path, name, parallel, *, die_after_step=0, **kw) -> tuple[dict, list[dict]]:
    """(the final checkpoint, metrics rows) of a 4-step run on two ranks."""
    recipe, _, engine, trainer_mode = RUNS[parallel]
    # metrics.png once, at the end (drawing it takes about 0.5 s)
    run = dict(steps=4, lr=1e-2, save_every=2, plot_every=4, parallel=parallel, recipe=recipe, engine=engine,
               trainer_mode=trainer_mode)
    cfg = _cfg(tmp_path / name, **{**run, **kw})
    run_ranks(_rank, (WORLD, free_port(), cfg, die_after_step), WORLD)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    final = torch.load(latest_checkpoint(cfg.out), weights_only=True)
    if parallel == "fsdp":  # all but k/v (64 rows) of the 2 layers
        plan, wrapped = torch.load(f"{cfg.out}.fp8-gather.pt")
        fp8 = sorted(f"{name}.weight" for name, why_not in plan.items() if why_not is None)
        assert len(fp8) == 10 and sorted(wrapped) == fp8, (plan, wrapped)
    if parallel == "ddp":
        replicas = [torch.load(f"{cfg.out}.rank{r}.pt") for r in range(WORLD)]
        assert [r["mode"] for r in replicas] == ["eager"] * WORLD
        for key, w in replicas[0]["weights"].items():
            assert torch.equal(w, replicas[1]["weights"][key]) and torch.equal(w, final["model"][key]), key
    return final, rows


@requires_vllm
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_and_a_killed_rank_resumes_bit_for_bit(tmp_path, parallel):
    """Each rank's vLLM joins the torchrun world (external_launcher), samples its share from its
    rank's weights (under FSDP2 the whole weights, gathered for the export, most of them as FP8
    blocks) and is synced after every step; the world, made by the ranks before ``train``,
    outlives the engines (a barrier runs after it)."""
    straight, rows = _run_ranks(tmp_path, "a", parallel)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # rank 0 alone writes, one line per step
    assert all(r["completions"] == 4 for r in rows)  # both ranks' completions: 2 prompts x 2 samples
    assert sum(r["grad_norm"] > 0 for r in rows) >= 2  # (a step whose groups all tie has no gradient)
    for rank in range(WORLD):  # the engines were vLLM's (an HfEngine exports nothing)
        assert (tmp_path / "a" / "run" / f"engine-rank{rank}" / "rollout-weights" / "config.json").is_file()
    # each rank's engine, synced after every step, computes its trainer's function (rare
    # attention ulps aside, see test_vllm_flow); with the sync removed this fails
    assert all(r["logprob_abs_diff_mean"] < 1e-3 for r in rows), [r["logprob_abs_diff_mean"] for r in rows]
    start = tiny_model("llama", layers=2, seed=0, **RUNS[parallel][1]).state_dict()
    assert straight["ranks"] == WORLD and straight["model"].keys() == start.keys()
    unmoved = [n for n, w in straight["model"].items() if torch.equal(w, start[n])]
    assert not unmoved, unmoved  # every weight moved

    with pytest.raises(mp.ProcessExitedException, match="signal SIGKILL"):
        _run_ranks(tmp_path, "b", parallel, die_after_step=2)
    assert latest_checkpoint(tmp_path / "b" / "run").name == "step_000002.pt"
    resumed, resumed_rows = _run_ranks(tmp_path, "b", parallel, resume=True)  # weights come from the checkpoint
    for name, w in straight["model"].items():
        assert torch.equal(w, resumed["model"][name]), name
    assert _untimed(resumed_rows) == _untimed(rows)


def test_fsdp_ranks_can_sample_with_their_own_model_in_step(tmp_path):
    """``--engine hf`` under FSDP2: each rank generates with its sharded model, every forward a
    collective, so the ranks step together (``synced_gpus``) until all are done. It samples the
    trainer's own function."""
    _, rows = _run_ranks(tmp_path, "hf", "fsdp", engine="hf", steps=2)
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions"] == 4 for r in rows)
    assert not (tmp_path / "hf" / "run" / "engine-rank0" / "rollout-weights").exists()  # no vLLM export
    assert all(r["logprob_abs_diff_mean"] < 1e-3 for r in rows), rows


def _batch(rank1_empty: bool):
    """Two prompts of two completions each, with rollout logprobs and advantages; with
    ``rank1_empty`` the second prompt's completions are empty (nothing to train on there)."""
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    tokens = [[[9, 10, 11], [12, 13]], [[], []] if rank1_empty else [[14], [15, 16, 17, 18]]]
    groups = [[Completion(t, [-1.5] * len(t), "length") for t in g] for g in tokens]
    return prompts, groups, torch.tensor([[1.0, -1.0], [0.5, -0.5]], dtype=torch.float64)


def _update(model, ranks, rank1_empty, trainer=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prompts, groups, advantages = (ranks.share(x) for x in _batch(rank1_empty))
    cfg = GrpoConfig(group_size=2, micro_batch=2)  # one prompt per micro-batch
    stats = loop.policy_update(model, optimizer, prompts, groups, advantages, cfg, 0, None, ranks, trainer)
    return parallel.state_dicts(model, optimizer, ranks)[0], stats


def _update_rank(rank, world, port, kind, rank1_empty, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=120))  # a rank left waiting fails
    ranks = parallel.start(kind, 2)
    model = jetrl_compile.unify(tiny_model("llama", layers=2, **VLLM_TINY), "fp8_fwd_bf16_bwd", mode="eager")
    weights, stats = _update(model, ranks, rank1_empty, parallel.wrap(model, ranks))
    if rank == 0:
        torch.save((weights, stats.loss, stats.grad_norm), out)
    gc.collect()  # the DDP wrapper (and its reducer) goes before its process group
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(("kind", "rank1_empty"), [("ddp", True), ("fsdp", False)])
def test_a_data_parallel_update_is_bitwise_one_process_on_the_whole_batch(tmp_path, kind, rank1_empty):
    """Each rank scales its loss by world / global tokens and DDP (FSDP2) averages: the step is the
    one process's on both prompts (one micro-batch each), bit for bit. A rank whose completions are
    all empty still runs a backward (zero-valued), or the other rank would wait forever."""
    with one_thread():
        model = jetrl_compile.unify(tiny_model("llama", layers=2, **VLLM_TINY), "fp8_fwd_bf16_bwd", mode="eager")
        ref_weights, ref_stats = _update(model, parallel.ONE_PROCESS, rank1_empty)
    out = tmp_path / "rank0.pt"
    run_ranks(_update_rank, (WORLD, free_port(), kind, rank1_empty, str(out)), WORLD)
    weights, loss, grad_norm = torch.load(out, weights_only=True)
    assert ref_stats.grad_norm > 0 and (loss, grad_norm) == (ref_stats.loss, ref_stats.grad_norm)
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name


def test_parallel_needs_torchrun_and_a_batch_that_divides(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UsageValueError, match="start it with torchrun"):
        loop.train(GrpoConfig(out=str(tmp_path / "r"), parallel="ddp"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageValueError, match="--batch-size 4 must divide evenly over 3 ranks"):
        loop.train(GrpoConfig(out=str(tmp_path / "r"), parallel="ddp"))
