"""Data parallelism for the GRPO driver: ``torchrun --nproc-per-node N ... --parallel ddp``.

Every rank draws the same batch of prompts (the task stream is seeded alike) and keeps its share;
it samples its share with its own engine, scores it and normalises rewards per group (a group
never spans ranks), and trains on it. DDP averages the gradients, so each rank's loss is scaled
to make the average the token-level mean over the whole batch. Rank 0 alone writes metrics,
plots and checkpoints; metrics are computed over the whole batch (every rank's completions and
logprobs are gathered to it), and a checkpoint holds every rank's RNG state so that ``--resume``
with the same world size continues bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UsageValueError

PARALLEL = ("none", "ddp")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks (one rank when not distributed)."""

    kind: str = "none"
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.kind != "none"

    def share(self, items: list) -> list:
        """This rank's contiguous share of a batch (the batch divides evenly: checked at start)."""
        n = len(items) // self.world
        return items[self.rank * n : (self.rank + 1) * n]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (``[obj]`` alone)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def total(self, value: float) -> float:
        """The sum of ``value`` over the ranks."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()


ONE_PROCESS = Ranks()


def start(kind: str, batch_size: int) -> Ranks:
    """Join the ranks torchrun started (its RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or stay
    one process for ``kind="none"``."""
    if kind not in PARALLEL:
        raise UsageValueError(f"--parallel {kind!r} is unknown; choose one of {', '.join(PARALLEL)}")
    if kind == "none":
        return ONE_PROCESS
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageValueError(
            f"--parallel {kind} runs one process per rank: start it with torchrun, e.g. "
            f"torchrun --nproc-per-node 2 examples/train_grpo.py --parallel {kind} ..."
        )
    world = int(os.environ["WORLD_SIZE"])
    if batch_size % world:
        raise UsageValueError(f"--batch-size {batch_size} must divide evenly over {world} ranks")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Ranks(kind, dist.get_rank(), dist.get_world_size())


def stop(ranks: Ranks) -> None:
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """The module the trainer calls: the unified model itself, or DDP around it (unified first,
    so the engines and reports still find the unified state on ``model``)."""
    if ranks.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()
