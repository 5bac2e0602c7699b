"""Regional compilation: compile a model's repeated decoder layer once, reuse it for every layer.

A causal LM is an embedding, N identical decoder layers and a head. Compiling the whole model
makes Dynamo trace and Inductor compile every layer again (compile time grows with depth:
minutes for 30 layers on 2 cores). Here each layer's ``__call__`` goes through one compiled
function shared by all layers of its class. The layer arrives as an argument, so its parameters
are graph inputs (Dynamo's default for ``nn.Module`` parameters), and every layer passes the guards
the first one installed: one Dynamo trace, one AOTAutograd graph, one Inductor compile per
layer class, whatever the depth. The embedding, final norm and head stay eager.

The one thing in a decoder layer that differs per layer is its KV cache slot: HF attention calls
``past_key_values.update(k, v, self.layer_idx)``, and tracing into it guards on that layer's
cache state (``past_key_values.layers[i].is_initialized``), so every layer would recompile. The
cache update therefore runs outside the compiled code: while a layer runs, the cache object's
``update`` is a Dynamo-disabled call, where Dynamo breaks the graph (before it the projections,
RoPE; after it attention, o_proj, MLP), and the layer index it is passed is traced as a symbolic
int rather than a per-layer constant (with ``dynamic=None`` after the second layer: one
recompile, not one per layer; ``dynamic=False`` is refused with a cache). A forward without a
cache (the trainer's, ``use_cache=False``) is one graph per layer class.
"""

from __future__ import annotations

import copy
import functools
import types

import torch
import torch.nn as nn

from .backend import call_compiled


def find_layers(model: nn.Module) -> dict[str, list[tuple[str, nn.Module]]]:
    """The model's repeated layers, by class name: the classes HF names in ``_no_split_modules``
    (its decoder layers), or else the children of a ``ModuleList`` of two or more modules of one
    class that hold linears. Only outermost matches count (a layer inside a layer is part of it)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) >= 2:
                classes = {type(child) for child in module}
                if len(classes) == 1 and any(isinstance(m, nn.Linear) for m in module[0].modules()):
                    names.add(type(module[0]).__name__)
    layers: dict[str, list[tuple[str, nn.Module]]] = {}
    taken: list[str] = []
    for name, module in model.named_modules():
        # by the class's own name or a base's: FSDP2's fully_shard swaps in a subclass FSDP<Name>
        cls = next((c.__name__ for c in type(module).__mro__ if c.__name__ in names), None)
        if cls is None or not name or any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        layers.setdefault(cls, []).append((name, module))
    return layers


def _call_layer(layer: nn.Module, *args, **kwargs):
    """The function a group of layers' calls go through, compiled once (the layer is an input)."""
    return layer._call_impl(*args, **kwargs)


def compile_layers(
    layers: dict[str, list[tuple[str, nn.Module]]], backend, recipe, *, dynamic: bool | None, fullgraph: bool
) -> tuple[dict[str, list[str]], list[nn.Module]]:
    """Send every layer's ``__call__`` through a compiled ``_call_layer``, one per group of layers
    that must compile alike: same class, and the same linears left out by the recipe's skip
    patterns (``skip="*.layers.0.*"`` makes layer 0 a group of its own). Returns the groups,
    ``{name: [layer names]}``, and the layers (``restore`` sets their ``_compiled_call_impl`` back
    to None).

    Each group gets its own copy of ``_call_layer``'s code (Dynamo keeps compiled graphs per code
    object, so each group, and each unified model, has its own cache and recompile budget) and its
    own copy of the backend: Dynamo guards every graph on the backend that compiled it, so the
    frames past a graph break (transformers' code, shared by all groups) never run a graph traced
    for another group."""
    groups: dict[str, list[tuple[str, nn.Module]]] = {}
    for cls, members in layers.items():
        by_skips: dict[tuple[str, ...], list[tuple[str, nn.Module]]] = {}
        for name, module in members:
            skips = tuple(
                rel for rel, m in module.named_modules()
                if isinstance(m, nn.Linear) and recipe.skip_reason(f"{name}.{rel}") is not None
            )
            by_skips.setdefault(skips, []).append((name, module))
        for skips, group in by_skips.items():
            key = cls if not skips else f"{cls} (not quantized: {', '.join(skips)})"
            groups[key] = group
    modules = []
    for group in groups.values():
        # a copy, not the same object: torch.compile's wrappers compare equal when their backends
        # do, and Dynamo would then let one group's graphs serve another's frames
        compiled = torch.compile(_fresh_call_layer(), backend=copy.copy(backend), dynamic=dynamic, fullgraph=fullgraph)
        for _, module in group:
            module._compiled_call_impl = functools.partial(_run_layer, compiled, dynamic, module)
            modules.append(module)
    return {key: [name for name, _ in group] for key, group in groups.items()}, modules


def _fresh_call_layer():
    """``_call_layer`` with its own code object: Dynamo keeps compiled graphs per code object."""
    return types.FunctionType(_call_layer.__code__.replace(), _call_layer.__globals__, "_call_layer")


def _run_layer(compiled, dynamic: bool | None, layer: nn.Module, *args, **kwargs):
    """A layer's call: the compiled function, with the KV cache's update kept out of the graph."""
    cache = kwargs.get("past_key_values")
    if cache is None or getattr(cache, "update", None) is None:
        return call_compiled(compiled, {}, layer, *args, **kwargs)
    if dynamic is False:
        raise ValueError(
            "unify(regional=True, dynamic=False) cannot run a layer with a KV cache: the layer index the cache "
            "update is passed would be a constant, and every layer would compile its own graph (past Dynamo's "
            "recompile limit, the rest would run uncompiled). Pass use_cache=False, or unify with dynamic=None "
            "(default) or True, or regional=False"
        )
    # For this call only, ``cache.update`` is a call Dynamo does not trace: it runs eagerly between
    # two compiled graphs, and no guard reads which layer's slot it filled. The layer index passed
    # to it is traced as a symbolic int (a constant would be guarded per layer).
    own = "update" in vars(cache)
    if not own:
        cache.update = torch._dynamo.disable(cache.update, reason="the KV cache update differs per layer")
    try:
        return call_compiled(compiled, {"allow_unspec_int_on_nn_module": True}, layer, *args, **kwargs)
    finally:
        if not own:
            del cache.update
