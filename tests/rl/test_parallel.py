"""The GRPO driver data-parallel (``--parallel ddp``): two gloo ranks on CPU, as torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), on a tiny random model with a reward it earns."""

import json
import os
import signal
import socket

import pytest
import torch
import torch.multiprocessing as mp

from jetrl_compile.errors import UsageValueError
from jetrl_compile.rl import loop
from jetrl_compile.rl.checkpoint import latest_checkpoint
from jetrl_compile.rl.config import GrpoConfig
from tests.conftest import VLLM_TINY, ByteTokenizer, tiny_model
from tests.rl.test_grpo import EarnableTask, _cfg, _untimed

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, cfg, out_weights, die_after_step):
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
    model = tiny_model("llama", layers=1, seed=123 if cfg.resume else 0, **VLLM_TINY)
    loop.train(cfg, model=model, tokenizer=ByteTokenizer(), task=EarnableTask(seed=0), progress=False)
    torch.save(model.state_dict(), f"{out_weights}.rank{rank}")


def _ddp_run(tmp_path, name, *, die_after_step=0, **kw) -> tuple[dict, list[dict]]:
    cfg = _cfg(tmp_path / name, steps=4, lr=1e-2, save_every=2, parallel="ddp", **kw)
    weights = tmp_path / f"{name}.pt"
    mp.spawn(_rank, args=(WORLD, _free_port(), cfg, str(weights), die_after_step), nprocs=WORLD)
    rows = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
    per_rank = [torch.load(f"{weights}.rank{r}") for r in range(WORLD)]
    for name_, w in per_rank[0].items():  # DDP keeps the replicas identical
        assert torch.equal(w, per_rank[1][name_]), name_
    return per_rank[0], rows


def test_two_ranks_train_on_the_whole_batch_and_write_metrics_once(tmp_path):
    weights, rows = _ddp_run(tmp_path, "a")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # rank 0 alone writes, one line per step
    start = tiny_model("llama", layers=1, seed=0, **VLLM_TINY).state_dict()
    assert all(r["grad_norm"] > 0 for r in rows)
    assert sum(not torch.equal(w, start[n]) for n, w in weights.items()) == len(start)
    # the metrics cover both ranks' completions: 2 prompts x 2 samples per step, one prompt per rank
    assert all(r["completions"] == 4 for r in rows)
    assert sorted(os.listdir(tmp_path / "a" / "run" / "checkpoints")) == ["step_000004.pt"]


def test_a_rank_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path):
    straight, rows = _ddp_run(tmp_path, "a")
    with pytest.raises(mp.ProcessExitedException, match="signal SIGKILL"):
        _ddp_run(tmp_path, "b", die_after_step=2)
    assert latest_checkpoint(tmp_path / "b" / "run").name == "step_000002.pt"
    resumed, resumed_rows = _ddp_run(tmp_path, "b", resume=True)  # seed 123: weights come from the checkpoint
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name
    assert _untimed(resumed_rows) == _untimed(rows)


def test_parallel_needs_torchrun_and_a_batch_that_divides(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UsageValueError, match="start it with torchrun"):
        loop.train(GrpoConfig(out=str(tmp_path / "r"), parallel="ddp"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageValueError, match="--batch-size 4 must divide evenly over 3 ranks"):
        loop.train(GrpoConfig(out=str(tmp_path / "r"), parallel="ddp"))
