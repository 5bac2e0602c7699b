"""``unify(model, recipe)``: make a causal LM's linear GEMMs follow one precision recipe.

The model object stays the same (parameters, ``state_dict`` keys, ``generate``, ``save_pretrained``).
``mode="compile"`` sends its ``__call__`` through ``torch.compile`` with our backend
(``passes.backend``, imported only then); ``mode="eager"`` patches each eligible linear to call
the recipe op directly. ``restore`` undoes either. ``rollout_forward`` is the block in which an
engine sampling with the model itself (``HfEngine``) gets the recipe's rollout GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn as nn

from .recipes import DEFAULT_RECIPE, Recipe, get_recipe
from .runtime import invariant
from .runtime.fp8_linear import fp8_linear
from .runtime.kernels import gemm_operand_dtype, uses_emulation
from .runtime.weight_cache import WeightCache
from .state import STATE_ATTR, UnifiedState, unified_state

MODES = ("compile", "eager")
COMPILERS = ("inductor", "aot_eager")


def unify(
    model: nn.Module,
    recipe: str | Recipe = DEFAULT_RECIPE,
    *,
    skip: tuple[str, ...] | str = (),
    include_lm_head: bool = False,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    mode: str | None = None,
    compiler: str = "inductor",
    exact: bool = False,
    regional: bool = True,
) -> nn.Module:
    """Make ``model``'s linear GEMMs follow ``recipe``; returns the same model object.

    - ``skip``: module-name patterns (fnmatch, e.g. ``"*.layers.0.*"``) to leave unquantized.
    - ``include_lm_head``: quantize ``lm_head`` too (off by default: logprobs are what RL optimises).
    - ``dynamic``: ``True`` compiles for variable sequence lengths from the first call (no
      recompile per length); ``None`` lets Dynamo decide after the first new shape.
    - ``mode="eager"``: no compile; each eligible ``nn.Linear`` calls the same op eagerly.
      ``restore(model)`` undoes either mode. Default: ``"compile"``, or ``"eager"`` when exact.
    - ``exact=True``: exact mode (``jetrl_compile.exact``): every op from the embedding to the
      logits runs invariant numerics, so the logprob a token gets while the model decodes it is
      bitwise the one the trainer recomputes. Eager only for now (docs/design.md, section 8).
    - ``regional=True`` (compile mode): compile the repeated decoder layer once and reuse it for
      every layer (``passes.regions``); embeddings, final norm and head stay eager (an eligible
      linear among them, ``lm_head`` with ``include_lm_head``, calls the recipe op eagerly).
      ``regional=False`` compiles the whole model as one graph. With a KV cache the cache update
      is a graph break inside each layer, which ``fullgraph=True`` refuses: pass ``use_cache=False``.
    - ``compiler="aot_eager"``: the same pass and AOTAutograd graphs, run without Inductor (fast
      to compile; for debugging numerics and for tests that only inspect graphs).
    """
    r = get_recipe(recipe).with_options(include_lm_head=include_lm_head, skip=skip)
    _check_model(model)
    mode = mode if mode is not None else ("eager" if exact else "compile")
    if exact and mode != "eager":
        raise ValueError(
            "unify(exact=True) runs eagerly (mode='eager'): Inductor's fused kernels do not yet keep the "
            "invariant numerics (docs/design.md, section 8)"
        )
    if mode not in MODES:
        raise ValueError(f"unify mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
    if compiler not in COMPILERS:
        raise ValueError(f"unify compiler {compiler!r} is unknown; choose one of {', '.join(COMPILERS)}")
    state = UnifiedState(recipe=r, mode=mode, exact=bool(exact), cache=WeightCache(model))
    if mode == "compile":
        from .passes import regions
        from .passes.backend import JetrlBackend, call_compiled

        backend = JetrlBackend(model, state, compiler)
        layers = regions.find_layers(model) if regional else {}
        if layers:
            state.layer_groups, state.compiled = regions.compile_layers(
                layers, backend, r, dynamic=dynamic, fullgraph=fullgraph
            )
            in_layers = {id(m) for layer in state.compiled for m in layer.modules()}
            outside = {id(m) for m in model.modules()} - in_layers
            state.patched = _patch_linears_eager(model, state.recipe, state.cache, only=outside)
        else:
            compiled = torch.compile(model._call_impl, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
            # what model.compile sets, called under the backend's Dynamo options
            model._compiled_call_impl = functools.partial(call_compiled, compiled, {})
            state.compiled = [model]
        state.recompile_room = _make_room(max(1, len(state.layer_groups)))
    else:
        state.patched = _patch_linears_eager(model, state.recipe, state.cache, exact=state.exact)
    if state.exact:
        from . import exact as exact_mode

        unquantized = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and r.skip_reason(n) is not None]
        state.exact_undo = exact_mode.patch(model, unquantized, state.cache)
    setattr(model, STATE_ATTR, state)
    return model


# each compiled backend (a model's, or each layer group's) adds this many entries to Dynamo's
# recompile_limit; restore takes them back
_RECOMPILE_ENTRIES_PER_BACKEND = 8


def _make_room(backends: int) -> int:
    """Every unified model (under regional compilation, every layer group) adds Dynamo cache
    entries to the same transformers code objects: each has its own backend, and Dynamo guards
    on the backend. Past ``recompile_limit`` (8 by default) Dynamo silently runs the frame
    eagerly, which would mean BF16 where the recipe says FP8; so each compiled unify raises the
    limit by that many backends' worth of entries (docs/design.md, pitfall 10), and ``restore``
    lowers it again. Returns the entries added."""
    entries = backends * _RECOMPILE_ENTRIES_PER_BACKEND
    torch._dynamo.config.recompile_limit += entries
    return entries


def restore(model: nn.Module) -> nn.Module:
    """Undo ``unify``: the model runs its original eager forward again, and what unify changed
    process-wide (Dynamo's recompile limit) is back as it was."""
    state = unified_state(model)
    if state.mode == "compile":
        for module in state.compiled:
            module._compiled_call_impl = None
        torch._dynamo.config.recompile_limit -= state.recompile_room
    for module in state.patched:
        del module.forward
    if state.exact:
        from . import exact as exact_mode

        exact_mode.unpatch(state.exact_undo)
    state.cache.clear()
    delattr(model, STATE_ATTR)
    return model


def precision_report(model: nn.Module) -> list[dict]:
    """One report per compiled graph (see ``passes.dump`` for the format). A compiled layer's
    graph reports every layer that runs it (``"modules"``), each with its linears."""
    state = unified_state(model)
    return [g.report(state.recipe, state.layer_groups) for g in state.graphs]


def linear_precisions(model: nn.Module) -> dict[str, dict]:
    """Every ``nn.Linear`` of a unified model, one row each: ``fprop``/``dgrad``/``wgrad``, the
    gradient the dgrad hands to the previous op (``handoff``: ``fp8`` for ``fp8_all``), and where
    they come from (``source``):

    - ``"graph <n>"``: read off the compiled graph that runs it (the forward and backward graphs
      handed to Inductor; a layer compiled once for all layers reports each of them);
    - ``"eager op"``: it calls the recipe op eagerly (eager mode, or a linear outside the
      compiled layers, such as ``lm_head`` with ``include_lm_head``); its precisions are the
      recipe's, which the op follows (pinned by the op's own tests), not read off a graph;
    - ``"not compiled yet"``: inside a compiled graph that has not run;
    - ``"not quantized: <reason>"``: a plain ``nn.Linear`` in its own dtype.

    For ``graph`` rows, ``dgrad``/``wgrad``/``handoff`` are None where only no-grad graphs ran."""
    from .passes.precision_report import dtype_tag  # passes load on use, never on import

    state = unified_state(model)
    rows: dict[str, dict] = {}
    for report in precision_report(model):
        for row in report["linears"]:
            seen = rows.get(row["module"])
            if seen is None or (seen["dgrad"] is None and row["dgrad"] is not None):
                rows[row["module"]] = dict(row, source=f"graph {report['graph']}")
    eager = {id(m) for m in state.patched}
    compiled = {id(m) for c in state.compiled for m in c.modules()}
    r = state.recipe
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name in rows:
            continue
        row = {"module": name, "shape": list(module.weight.shape)}
        reason = r.skip_reason(name)
        if id(module) in eager:
            rows[name] = dict(row, fprop=r.fprop.dtype, dgrad=r.dgrad.dtype, wgrad=r.wgrad.dtype,
                              handoff=r.grad_handoff, source="eager op")
        elif reason is None and id(module) in compiled:
            rows[name] = dict(row, fprop="?", dgrad=None, wgrad=None, handoff=None, source="not compiled yet")
        else:
            own = dtype_tag(module.weight.dtype)
            rows[name] = dict(row, fprop=own, dgrad=own, wgrad=own, handoff=own, source=f"not quantized: {reason}")
    return rows


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"unify takes a torch.nn.Module (a HuggingFace causal LM); got {type(model).__name__}")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(
            f"unify got a {type(model).__name__} wrapper; unify the model first, then wrap it: "
            f"{type(model).__name__}(jetrl_compile.unify(model, ...)) (FSDP2's fully_shard may come before or after)"
        )
    if hasattr(model, STATE_ATTR):
        prev = getattr(model, STATE_ATTR).recipe.name
        raise RuntimeError(
            f"this {type(model).__name__} is already unified (recipe {prev!r}); "
            "call jetrl_compile.restore(model) before unifying it again"
        )
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise RuntimeError(
            f"this {type(model).__name__} is already torch.compile'd; unify compiles it itself: "
            "pass the uncompiled model"
        )
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"unify found no nn.Linear in {type(model).__name__}: it rewrites the linear GEMMs of "
            "transformer LMs (Llama, Qwen2/3, Mistral, ...); this model has none to rewrite"
        )
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ValueError(f"parameter {name} is on the meta device; load real weights before unify")
        if not p.is_floating_point() or p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"parameter {name} has dtype {p.dtype}; unify needs a floating-point (FP32/BF16) model, "
                "not an already-quantized one"
            )


def _patch_linears_eager(
    model: nn.Module, recipe: Recipe, cache: WeightCache, *, exact: bool = False, only: set[int] | None = None
) -> list[nn.Module]:
    """Each eligible nn.Linear calls the recipe op directly, no compile; returns the patched
    modules. ``only``: ids of the modules that may be patched (default: all)."""
    needs_q = recipe.needs_quantized_weight
    fixed_kind = "fp8" if recipe.fprop.is_fp8 else "bf16"
    patched = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or recipe.skip_reason(name) is not None:
            continue
        if only is not None and id(module) not in only:
            continue

        def forward(x, module=module):
            q, s = cache.get(module.weight) if needs_q else (None, None)
            deq = None
            if exact:  # a GPU's kernels are batch-invariant themselves: no fixed-point operand (fp8_linear)
                fixed = invariant.needs_fixed_point(module.weight.device, recipe.fprop.is_fp8)
                return fp8_linear(
                    x, module.weight, module.bias, q, s, None, fprop=recipe.fprop.dtype, dgrad=recipe.dgrad.dtype,
                    wgrad=recipe.wgrad.dtype, handoff=recipe.grad_handoff,
                    exact=cache.get_fixed(module.weight, fixed_kind) if fixed else True,
                )
            if recipe.fprop.is_fp8 and uses_emulation(module.weight.device):
                deq = cache.get_dequantized(module.weight, gemm_operand_dtype(module.weight.device))
            return fp8_linear(
                x, module.weight, module.bias, q, s, deq,
                fprop=recipe.fprop.dtype, dgrad=recipe.dgrad.dtype, wgrad=recipe.wgrad.dtype,
                handoff=recipe.grad_handoff,
            )

        module.forward = forward
        patched.append(module)
    return patched


@contextlib.contextmanager
def rollout_forward(model: nn.Module):
    """Within this block the unified ``model`` computes the recipe's rollout forward, for an
    engine that samples with the trainer's own model (``HfEngine``). Nothing changes for an
    on-policy recipe (its rollout GEMM is its training forward); for ``fp8_rollout_only`` every
    eligible linear runs the FP8 op eagerly on the trainer's cached weight quantization, the
    function vLLM samples with, and the training forward (compiled or eager) is back on exit."""
    state = unified_state(model)
    if state.recipe.on_policy:
        yield model
        return
    compiled = [(module, module._compiled_call_impl) for module in state.compiled]
    for module in state.compiled:
        module._compiled_call_impl = None
    training = {id(module) for module in state.patched}  # the training forward's eager linears
    for module in state.patched:
        del module.forward
    rollout_recipe = dataclasses.replace(state.recipe, fprop=state.recipe.rollout)
    sampling = _patch_linears_eager(model, rollout_recipe, state.cache, exact=state.exact)
    try:
        yield model
    finally:
        for module in sampling:
            del module.forward
        state.patched = _patch_linears_eager(model, state.recipe, state.cache, exact=state.exact, only=training)
        for module, call in compiled:
            module._compiled_call_impl = call
