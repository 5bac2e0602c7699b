"""Data parallelism for the GRPO driver: ``torchrun --nproc-per-node N ... --parallel ddp|fsdp``.

Every rank draws the same batch of prompts (the task stream is seeded alike) and keeps its share;
it samples its share with its own engine, scores it and normalises rewards per group (a group
never spans ranks), and trains on it. On GPUs (``--device cuda``) each rank trains on the GPU of
its local rank, with its own vLLM engine there, and the ranks talk over NCCL; on the CPU, gloo.
DDP (or FSDP2's reduce-scatter) averages the gradients, so each rank's loss is scaled to make the
average the token-level mean over the whole batch. Under
FSDP2 every forward is a collective, so whatever runs the model runs on every rank, in step
(generation included). Rank 0 alone writes metrics, plots and checkpoints; metrics are computed
over the whole batch (every rank's completions and logprobs are gathered to it), and a
checkpoint holds every rank's RNG state so that ``--resume`` with the same world size continues
bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UsageValueError
from ..fsdp import fp8_all_gather, fp8_all_gather_refusal
from ..runtime.fp8_all_gather import unwrap_fp8_gather
from ..runtime.switches import launcher_local_rank, launcher_world

PARALLEL = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks (one rank when not distributed)."""

    kind: str = "none"
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # ``start`` created the process group (``stop`` then destroys it)
    device: str = "cpu"  # where this rank trains: ``cpu`` or its GPU, ``cuda:<local rank>``

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
        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL reduces GPU tensors only
        dist.all_reduce(t)
        return t.item()


ONE_PROCESS = Ranks()


def start(kind: str, batch_size: int, device: str = "cpu") -> Ranks:
    """Join the ranks torchrun started (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), or stay one process for ``kind="none"``. ``device`` is ``cpu`` or ``cuda``:
    on ``cuda`` each rank takes the GPU of its local rank and the ranks talk over NCCL, on the CPU
    over gloo."""
    if kind not in PARALLEL:
        raise UsageValueError(f"--parallel {kind!r} is unknown; choose one of {', '.join(PARALLEL)}")
    if kind == "none":
        return Ranks(device=_own_device(device, local_rank=0))
    world = launcher_world()
    if world is None:
        raise UsageValueError(
            f"--parallel {kind} runs one process per rank: start it with torchrun, e.g. "
            f"torchrun --nproc-per-node 2 examples/train_grpo.py --parallel {kind} ..."
        )
    if batch_size % world:
        raise UsageValueError(f"--batch-size {batch_size} must divide evenly over {world} ranks")
    own = _own_device(device, local_rank=launcher_local_rank())
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend_for(own))
    return Ranks(kind, dist.get_rank(), dist.get_world_size(), owns, own)


def backend_for(device: str) -> str:
    """The collective backend for a trainer on ``device``: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _own_device(device: str, local_rank: int) -> str:
    """This rank's device: ``cuda:<local rank>`` (made current, for NCCL and vLLM) or ``cpu``."""
    if torch.device(device).type != "cuda":
        return "cpu"
    if local_rank >= torch.cuda.device_count():
        raise UsageValueError(
            f"local rank {local_rank} has no GPU of its own: this machine has {torch.cuda.device_count()}; "
            "start at most that many processes per node"
        )
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


def stop(ranks: Ranks) -> None:
    if ranks.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """The module the trainer calls: the unified model itself, DDP around it (unified first, so
    the engines and reports still find the unified state on ``model``), or, for FSDP2, the model
    sharded in place: each decoder layer (the classes transformers names in ``_no_split_modules``),
    then the rest."""
    if ranks.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # a compiled trainer under DDP needs Dynamo's DDP optimizer off (it hides the weights
        # from the pass: docs/design.md, section 5.3); DDP then reduces after the whole backward
        torch._dynamo.config.optimize_ddp = False
        return DistributedDataParallel(model)
    if ranks.kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
        if not layers:
            raise UsageValueError(
                f"--parallel fsdp shards each decoder layer, but {type(model).__name__} names none "
                "(transformers' _no_split_modules); use --parallel ddp"
            )
        if fp8_all_gather_refusal(model) is None:
            fp8_all_gather(model, ranks.world)  # bitwise the same training, fewer bytes gathered
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def state_dicts(model: torch.nn.Module, optimizer, ranks: Ranks) -> tuple[dict, dict]:
    """(model, optimizer) state dicts of the whole model, as one process would write them; under
    FSDP2 gathered from the shards (a collective; rank 0 receives them, in FQN-keyed form)."""
    if ranks.kind != "fsdp":
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    # a weight gathered as FP8 blocks is kept as its full-precision shard in a wrapper: save the values
    return unwrap_fp8_gather(model_state), optimizer_state


def load_state_dicts(model: torch.nn.Module, optimizer, model_state: dict, optimizer_state: dict,
                     ranks: Ranks) -> None:
    """Load what ``state_dicts`` made (every rank reads the same checkpoint; FSDP2 keeps its shard)."""
    if ranks.kind != "fsdp":
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))
