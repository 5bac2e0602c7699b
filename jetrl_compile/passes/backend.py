"""The torch.compile backend of ``unify``: the rewrite pass, weight-cache plumbing, Inductor.

1. Dynamo captures the graph; parameters arrive as placeholders, matched to modules by identity.
2. ``rewrite_linears`` swaps every eligible ``nn.Linear`` GEMM for the recipe-driven op and adds
   the inputs the op reads per weight: its FP8 payload, block scales and dequantized copy.
3. Those inputs come from the ``WeightCache``: quantized once per parameter version, so once per
   optimizer step, and the same tensors the vLLM exporter reads.
4. ``compile_fx`` runs AOTAutograd and Inductor; a wrapper around Inductor's inner compile reads
   the precision of every GEMM off the forward and backward graphs (and dumps them under
   ``JETRL_DUMP=1``). Those records are stored, so that a later process may take the graph from
   AOTAutograd's cache and still report them (``compile_cache``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

from ..recipes import Recipe
from ..runtime.fp8_linear import FP8_BACKWARD_INDUCTOR_OPTIONS, INDUCTOR_OPTIONS
from ..runtime.kernels import bf16_gemm_path, gemm_operand_dtype, kernel_name, uses_emulation
from ..state import UnifiedState
from . import compile_cache, dump
from .precision_report import GemmRecord, classify_backward, fp8_saved_tensors, gemms_in_graph, graph_has_fp8
from .rewrite_linears import ParamInfo, RewriteResult, rewrite_linears

log = logging.getLogger("jetrl_compile")

# The Dynamo options every compiled call of a unified model runs under. ``specialize_float``: a
# module's float attribute (RMSNorm's ``variance_epsilon``) is a constant of the graph. Otherwise,
# under ``dynamic=True``, Dynamo first traces it as a symbolic float, AOTAutograd's pass that turns
# such floats into tensors cannot, and Dynamo restarts with it specialized, having thrown away a
# whole AOTAutograd trace (4 s of a 2-layer compile, cold or warm). The graph is the same either way.
DYNAMO_OPTIONS = {"specialize_float": True}


def call_compiled(compiled, options: dict, *args, **kwargs):
    """Call a function ``torch.compile`` made with this backend, under ``DYNAMO_OPTIONS`` and
    ``options`` (Dynamo reads its options when it traces, during a call). Every layer call comes
    through here, so the options are set and put back as attributes: ``config.patch`` cost about
    130 us a call on this CPU, an attribute 4 us."""
    config = torch._dynamo.config
    settings = {**DYNAMO_OPTIONS, **options}
    saved = {name: getattr(config, name) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        return compiled(*args, **kwargs)
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@dataclass
class GraphRecord:
    """What was compiled for one Dynamo graph, and the precisions read off it."""

    graph_id: int
    rewrite: RewriteResult
    compile_id: str = ""
    bf16_gemm: str = ""  # the BF16 GEMM path the graph was traced with ("native" or "fp32")
    fp8_kernel: str = ""
    forward: list[GemmRecord] | None = None
    backward: list[GemmRecord] | None = None
    forward_has_fp8: bool | None = None
    backward_has_fp8: bool | None = None
    # names of the forward's saved tensors that hold FP8 values, read by the backward's report
    fp8_saved: frozenset[str] = frozenset()
    precisions_key: str = ""  # the key its records are stored under (compile_cache)
    from_cache: bool = False  # records loaded from a previous compile of the same graph

    def precision_fields(self) -> dict:
        return {"forward_has_fp8": self.forward_has_fp8, "backward_has_fp8": self.backward_has_fp8}

    def report(self, recipe: Recipe, layer_groups: dict[str, list[str]] | None = None) -> dict:
        """Per linear, the precisions read off the graphs. A graph of a compiled layer (regional
        compilation) runs for every layer of its class: its rows repeat for each of them."""
        weight_shapes = {s.module: s.shape for s in self.rewrite.sites}
        fprop = {r.module: r.precision for r in self.forward or [] if r.module in weight_shapes}
        bwd = classify_backward(self.backward or [], weight_shapes)
        rows = [
            {
                "module": module,
                "shape": list(shape),
                "fprop": fprop.get(module, "?"),
                "dgrad": bwd.get(module, {}).get("dgrad"),
                "wgrad": bwd.get(module, {}).get("wgrad"),
                "handoff": bwd.get(module, {}).get("handoff"),
            }
            for module, shape in weight_shapes.items()
        ]
        skipped = [{"module": s.module, "shape": list(s.shape), "reason": s.reason} for s in self.rewrite.skipped]
        region, traced, members = _region_of([*weight_shapes, *(s["module"] for s in skipped)], layer_groups or {})
        if region is not None:
            rows = [dict(row, module=member + row["module"][len(traced):]) for member in members for row in rows]
            skipped = [dict(s, module=member + s["module"][len(traced):]) for member in members for s in skipped]
        return {
            "graph": self.graph_id,
            "recipe": recipe.name,
            "summary": self.rewrite.summary(),
            "region": region,
            "modules": members,
            "bf16_gemm": self.bf16_gemm,
            "fp8_kernel": self.fp8_kernel,
            "forward_compiled": self.forward is not None,
            "backward_compiled": self.backward is not None,
            "from_cache": self.from_cache,
            "linears": rows,
            "skipped": skipped,
        }


def _region_of(modules: list[str], layer_groups: dict[str, list[str]]) -> tuple[str | None, str, list[str]]:
    """(layer class, the layer the graph was traced from, every layer that runs it) for a graph
    of a compiled layer; (None, "", []) for a graph of the whole model or one without linears."""
    for cls, members in layer_groups.items():
        for member in members:
            if modules and all(m.startswith(member + ".") for m in modules):
                return cls, member, members
    return None, "", []


def _param_table(model: nn.Module) -> dict[int, ParamInfo]:
    """``id(param) -> ParamInfo``; a tied parameter is attributed to the ``nn.Linear`` that uses it."""
    table: dict[int, ParamInfo] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            is_linear_weight = isinstance(module, nn.Linear) and attr == "weight"
            if id(p) in table and not is_linear_weight:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            table[id(p)] = ParamInfo(name, mod_name, is_linear_weight, tuple(p.shape))
    return table


class JetrlBackend:
    """The torch.compile backend of ``unify``: pass, weight-cache plumbing, Inductor."""

    def __init__(self, model: nn.Module, state: UnifiedState, compiler: str = "inductor"):
        self.model, self.state, self.compiler = model, state, compiler
        self.dump_folder = dump.model_folder(state.recipe.name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if not self.state.layer_groups:  # a compiled layer is what checkpointing calls and recomputes
            _refuse_gradient_checkpointing(self.model)
        _refuse_ddp_optimizer()
        state, recipe = self.state, self.state.recipe
        record = self._new_record(str(gm.meta.get("dynamo_compile_id", "")))
        table = _param_table(self.model)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        params = {n.name: table[id(x)] for n, x in zip(placeholders, example_inputs) if id(x) in table}

        if dump.dump_enabled():
            dump.write_graph(self.dump_folder, record.graph_id, "dynamo_before", gm)
        gm = _detached_copy(gm)
        device = next(self.model.parameters()).device
        # The BF16 GEMM path is read once per graph: the dequantized weights fed to it are made in
        # that path's operand dtype, and the op traced below takes the same path.
        record.bf16_gemm, record.fp8_kernel = bf16_gemm_path(device), kernel_name(device)
        operand_dtype = gemm_operand_dtype(device)
        record.rewrite = rewrite_linears(gm, params, recipe, dequantized_weights=uses_emulation(device))
        log.info("graph %d (%s): %s", record.graph_id, recipe.name, record.rewrite.summary())
        if dump.dump_enabled():
            dump.write_graph(self.dump_folder, record.graph_id, "dynamo_after", gm)

        # (weight placeholder index, whether the site also takes the dequantized weight)
        weight_inputs = [
            (s.weight_input, s.dequantized_input is not None) for s in record.rewrite.rewritten if s.quant_inputs
        ]
        cache = state.cache

        def quantized_inputs(args) -> list[torch.Tensor]:
            extra = []
            for i, with_dequantized in weight_inputs:
                extra.extend(cache.get(args[i]))
                if with_dequantized:
                    extra.append(cache.get_dequantized(args[i], operand_dtype))
            return extra

        inputs = [*example_inputs, *_static_fakes(quantized_inputs(example_inputs), example_inputs)]
        if self.compiler == "inductor":
            self._load_precisions(record, gm, inputs)

            def inner_compile(aot_gm, aot_inputs, **kwargs):
                self._read_precisions(record, aot_gm, kwargs)
                fp8_backward = kwargs.get("is_backward") and (recipe.dgrad.is_fp8 or recipe.wgrad.is_fp8)
                # the backward compiles on its first run, outside the patch around compile_fx
                with torch._inductor.config.patch(FP8_BACKWARD_INDUCTOR_OPTIONS if fp8_backward else INDUCTOR_OPTIONS):
                    return compile_fx_inner(aot_gm, aot_inputs, **kwargs)

            marked = compile_cache.marked_cacheable(record.bf16_gemm, record.fp8_kernel)
            options = {**INDUCTOR_OPTIONS, "unsafe_marked_cacheable_functions": marked}
            # JETRL_DUMP=1 writes the AOTAutograd graphs, which a hit of its cache never builds
            with torch._inductor.config.patch(options), _aot_cache(not dump.dump_enabled()):
                compiled = compile_fx(gm, inputs, inner_compile=inner_compile)
            if record.forward is None:  # a hit of AOTAutograd's cache, and the graph's records are gone
                with torch._inductor.config.patch(options), _aot_cache(False):
                    compiled = compile_fx(gm, inputs, inner_compile=inner_compile)
        else:
            compiled = self._aot_eager(record, gm, inputs)
        if not weight_inputs:
            return compiled

        def run(*args):  # Dynamo calls a backend's result with positional args
            return compiled(*args, *quantized_inputs(args))

        return run

    def _new_record(self, compile_id: str) -> GraphRecord:
        """A record for this compile. When Dynamo restarts the analysis of a frame it calls the
        backend again with the same compile id and drops the first result: replace its record."""
        graphs = self.state.graphs
        for i, old in enumerate(graphs):
            if compile_id and old.compile_id == compile_id:
                graphs[i] = GraphRecord(old.graph_id, RewriteResult(), compile_id=compile_id)
                return graphs[i]
        graphs.append(GraphRecord(len(graphs), RewriteResult(), compile_id=compile_id))
        return graphs[-1]

    def _load_precisions(self, record: GraphRecord, gm, inputs) -> None:
        """Key the graph's precision records, and load them if a previous compile stored them: a
        hit of AOTAutograd's cache runs no inner compile to read them off."""
        context = {
            "recipe": repr(self.state.recipe),
            "bf16_gemm": record.bf16_gemm,
            "fp8_kernel": record.fp8_kernel,
            "sites": [s.module for s in record.rewrite.sites],
            # a no-grad graph compiles to an inference graph, a training one to forward + backward
            "grad_enabled": torch.is_grad_enabled(),
            "autocast": [torch.is_autocast_enabled(d) for d in ("cpu", "cuda")],
        }
        record.precisions_key = compile_cache.graph_key(gm, inputs, context)
        if dump.dump_enabled():  # compiled with AOTAutograd's cache off: every graph is read off
            return
        stored = compile_cache.load(record.precisions_key)
        if stored is None or stored["forward"] is None:
            return
        record.forward, record.backward = stored["forward"], stored["backward"]
        record.forward_has_fp8, record.backward_has_fp8 = stored["forward_has_fp8"], stored["backward_has_fp8"]
        record.from_cache = True

    def _aot_eager(self, record: GraphRecord, gm, inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def compiler(is_backward):
            def compile_graph(aot_gm, aot_inputs, **kwargs):
                self._read_precisions(record, aot_gm, {"is_backward": is_backward})
                return make_boxed_func(aot_gm.forward)

            return compile_graph

        return aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True))(gm, inputs)

    def _read_precisions(self, record: GraphRecord, aot_gm, kwargs) -> None:
        backward = bool(kwargs.get("is_backward"))
        inference = bool(kwargs.get("is_inference"))
        # The cached dequantizations of FP8 weights enter the graph as inputs: they count as
        # FP8 operands (their values are exactly the FP8 payload times its power-of-two scale).
        fp8_inputs = {s.dequantized_input for s in record.rewrite.rewritten} - {None}
        # The backward reads them, and views of them, as tensors the forward saved.
        if not backward:
            record.fp8_saved = fp8_saved_tensors(aot_gm, fp8_inputs)
        gemms = gemms_in_graph(aot_gm, "backward" if backward else "forward", fp8_inputs, record.fp8_saved)
        _qualify_module_names(gemms, {site.module for site in record.rewrite.sites})
        if backward:
            record.backward, record.backward_has_fp8 = gemms, graph_has_fp8(aot_gm)
        else:  # a new forward: any backward loaded with stored records is not yet this graph's
            record.forward, record.forward_has_fp8 = gemms, graph_has_fp8(aot_gm)
            record.backward = record.backward_has_fp8 = None
        record.from_cache = False
        # stored once the graph is whole, when AOTAutograd stores its own entry: after the
        # backward of a training graph, after the forward of an inference graph
        if record.precisions_key and (backward or inference):
            compile_cache.save(record.precisions_key, record.forward, record.backward, record.precision_fields())
        if dump.dump_enabled():
            name = "aot_backward" if backward else ("aot_forward_inference" if inference else "aot_forward")
            dump.write_graph(self.dump_folder, record.graph_id, name, aot_gm)
            report = record.report(self.state.recipe, self.state.layer_groups)
            dump.write_report(self.dump_folder, record.graph_id, report)


def _qualify_module_names(gemms: list[GemmRecord], modules: set[str]) -> None:
    """Name each GEMM's module as the model does. A graph traced from a submodule's frame (FSDP2's
    hooks break the graph at every sharded module, so each decoder layer is its own graph) names
    modules relative to it (``self_attn.q_proj``); the one site of this graph whose qualified name
    ends with that path is the module (``model.layers.0.self_attn.q_proj``)."""
    for gemm in gemms:
        if gemm.module in modules:
            continue
        matches = [m for m in modules if m.endswith("." + gemm.module)]
        if len(matches) == 1:
            gemm.module = matches[0]


def _refuse_gradient_checkpointing(model: nn.Module) -> None:
    """transformers' gradient checkpointing (on while training) calls each decoder layer through
    ``torch.utils.checkpoint``, where Dynamo breaks the graph: the layers then run eagerly as plain
    modules, forward and recomputed backward, and the recipe would silently not apply (measured:
    gradients bitwise the plain model's). Refuse when Dynamo compiles such a call of the whole
    model; regional compilation compiles the layer call itself, which checkpointing recomputes."""
    if model.training and getattr(model, "is_gradient_checkpointing", False):
        raise ValueError(
            "unify(mode='compile', regional=False) cannot run under gradient checkpointing: transformers calls "
            "each layer through torch.utils.checkpoint, outside the compiled graph, where its linears would run as "
            "plain nn.Linear; unify with regional=True (the default: each compiled layer is what checkpointing "
            "recomputes), call model.gradient_checkpointing_disable(), or unify with mode='eager'"
        )


def _refuse_ddp_optimizer() -> None:
    """Under DDP, Dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default)
    splits the graph at DDP's gradient buckets and hands this backend each piece with fake copies
    of the parameters, so the pass cannot tell which inputs are weights: it would rewrite no
    linear, and the model would train in its own precision. Refuse; with the option off, DDP's
    reducer all-reduces the gradients of the whole compiled graph (no overlap with its backward)."""
    from torch.nn.parallel import DistributedDataParallel

    if DistributedDataParallel._get_active_ddp_module() is None:
        return
    if torch._dynamo.utils.get_optimize_ddp_mode() != "no_optimization":
        raise RuntimeError(
            "unify(mode='compile') under DistributedDataParallel needs torch._dynamo.config.optimize_ddp = False: "
            "Dynamo's DDPOptimizer hands the backend fake copies of the parameters, and no linear would get the "
            "recipe; set it before the first step, or unify with mode='eager'"
        )


def _aot_cache(enabled: bool):
    """AOTAutograd's cache on (as configured) or off, for one compile."""
    config = torch._functorch.config
    return config.patch(enable_autograd_cache=enabled and config.enable_autograd_cache)


def _static_fakes(tensors: list[torch.Tensor], example_inputs) -> list[torch.Tensor]:
    """Example values for the added inputs, with static shapes: a weight's payload and scales
    never change shape, and under ``dynamic=True`` AOTAutograd would otherwise give every dim of
    them a symbol, and the quantizer's shape branches would become guards."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        return tensors
    return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


def _detached_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph module that the pass may change: Dynamo keeps reading the
    original's placeholders after the backend returns. Carries the Dynamo metadata AOTAutograd
    reads (``meta``, ``_param_name_to_source``, each placeholder's ``_dynamo_source``)."""
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta = dict(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for old, node in zip(gm.graph.find_nodes(op="placeholder"), new.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            node._dynamo_source = old._dynamo_source
    return new
