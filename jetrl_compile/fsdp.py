"""FP8 all-gather for a unified model that FSDP2 will shard.

    model = jetrl_compile.unify(model, "jetrl", mode="eager")
    plan = jetrl_compile.fp8_all_gather(model)        # before fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

Each rank then quantizes its shard of every eligible linear weight into FP8 128 x 128 blocks and
FSDP2 gathers those (payload and scales) instead of the full-precision weight; the forward and
backward read the gathered blocks, which are bitwise the quantization of the whole weight
(``runtime.fp8_all_gather`` says why). The training result is unchanged bit for bit; only the
bytes on the wire shrink. Which weights qualify, and why the others do not, is the returned plan.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
import torch.nn as nn

from .recipes import Recipe
from .runtime.fp8_all_gather import enable_fp8_all_gather, fp8_gather_plan
from .runtime.sharding import is_sharded
from .state import unified_state

log = logging.getLogger(__name__)


def fp8_all_gather(model: nn.Module, world_size: int | None = None) -> dict[str, str | None]:
    """Make FSDP2 all-gather ``model``'s linear weights as FP8 blocks; call it after ``unify``
    and before ``fully_shard``. ``world_size``: the number of ranks each weight is sharded over
    (default: the default process group's). Returns ``{linear name: None if it gathers in FP8,
    else the reason it gathers in full precision}``.

    Needs a recipe whose GEMMs read the weight only as FP8 blocks (``jetrl``: FP8 fprop and
    dgrad) and ``mode="eager"``."""
    state = unified_state(model)
    why_not = fp8_all_gather_refusal(model)
    if why_not is not None:
        raise ValueError(f"fp8_all_gather: {why_not}")
    if state.fp8_all_gather:
        raise RuntimeError("fp8_all_gather was already applied to this model; it plans for one world size, once")
    if is_sharded(model):
        raise RuntimeError(
            "fp8_all_gather must run before fully_shard: FSDP2 decides how to gather each weight when it shards it"
        )
    if world_size is None:
        if not dist.is_initialized():
            raise RuntimeError("fp8_all_gather: no process group; pass world_size= or init_process_group first")
        world_size = dist.get_world_size()
    if world_size < 1:
        raise ValueError(f"fp8_all_gather: world_size must be >= 1; got {world_size}")
    plan = fp8_gather_plan(model, state.recipe, world_size)
    enable_fp8_all_gather(model, plan)
    state.fp8_all_gather = plan
    log.info("FSDP2 all-gathers %d of %d linear weights as FP8 blocks (%d ranks)",
             sum(why is None for why in plan.values()), len(plan), world_size)
    return plan


def recipe_gathers_fp8(recipe: Recipe) -> bool:
    """Whether FSDP2 can gather ``recipe``'s weights as FP8 blocks: every GEMM that reads the
    weight reads its blocks (FP8 fprop and dgrad; the wgrad does not read it)."""
    return recipe.fprop.is_fp8 and recipe.dgrad.is_fp8


def fp8_all_gather_refusal(model: nn.Module) -> str | None:
    """Why the unified ``model`` cannot gather its weights as FP8 blocks (its recipe or its mode),
    or None if it can."""
    state = unified_state(model)
    recipe = state.recipe
    if not recipe_gathers_fp8(recipe):
        return (
            f"recipe {recipe.name!r} multiplies by the full-precision weight in its BF16 "
            f"{'fprop' if not recipe.fprop.is_fp8 else 'dgrad'} GEMM, so FSDP2 must gather that weight; "
            "FP8 all-gather needs FP8 fprop and dgrad (recipe 'jetrl')"
        )
    if state.mode != "eager":
        return (
            "the gathered FP8 weights are tensor subclasses that the compiled trainer does not trace yet; "
            "unify with mode='eager'"
        )
    return None
