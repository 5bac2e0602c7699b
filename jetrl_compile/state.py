"""What ``unify`` attaches to a model: the compiler writes it, the rollout side reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from .recipes import Recipe
from .runtime.weight_cache import WeightCache

STATE_ATTR = "_jetrl_state"


@dataclass
class UnifiedState:
    recipe: Recipe
    mode: str
    cache: WeightCache = field(default_factory=WeightCache)
    graphs: list = field(default_factory=list)  # passes.backend.GraphRecord, one per compile
    patched: list[nn.Module] = field(default_factory=list)  # linears calling the recipe op eagerly
    # modules whose call is compiled: the model (regional=False) or its decoder layers
    compiled: list[nn.Module] = field(default_factory=list)
    # layer group ("LlamaDecoderLayer", or with the linears its layers skip) -> its layers' names
    layer_groups: dict[str, list[str]] = field(default_factory=dict)
    recompile_room: int = 0  # entries this model added to Dynamo's recompile_limit
    exact: bool = False  # exact mode (jetrl_compile.exact): invariant numerics end to end
    exact_undo: list = field(default_factory=list)
    fp8_all_gather: dict = field(default_factory=dict)  # linear -> None (FSDP2 gathers FP8) or why not

    @property
    def compiles(self) -> int:
        """How many graphs were compiled (a graph break or a recompile adds one)."""
        return len(self.graphs)


def is_unified(model: nn.Module) -> bool:
    return hasattr(model, STATE_ATTR)


def unified_state(model: nn.Module) -> UnifiedState:
    """The recipe, weight cache and compiled-graph records of a unified model."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not unified; call jetrl_compile.unify(model, recipe) first")
    return state

