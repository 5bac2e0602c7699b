"""FX pass: rewrite the linear GEMMs of a captured graph to the recipe-driven linear op.

A pure function of the graph and of what the caller knows about its inputs: which placeholder is
the weight (or bias) of which ``nn.Linear``. It matches the forms Dynamo produces for HF models:

- ``torch._C._nn.linear(x, W, b)`` / ``torch.nn.functional.linear(x, W, b)`` (every HF projection,
  fused QKV and gate/up projections included: they are single ``nn.Linear`` modules),
- ``x @ W.t()`` / ``torch.matmul(x, W.T)`` / ``torch.mm(x, W.t())``, with ``addmm(b, x, W.t())``.

Each match whose weight belongs to an eligible ``nn.Linear`` becomes
``fp8_linear(x, W, b, W_q, W_s[, W_deq], fprop=..., dgrad=..., wgrad=...[, handoff="fp8"])``,
where ``W_q``, ``W_s`` (and, for the emulated kernel, the dequantization ``W_deq`` in the GEMM's
operand dtype) are new placeholders appended after the existing ones: the caller feeds them from
the weight cache, so a weight is quantized once per optimizer step, not once per call. A parameter
used by a GEMM the pass cannot prove eligible is left untouched and reported with the reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..recipes import Recipe
from ..runtime.fp8_linear import fp8_linear

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
MATMUL_TARGETS = (operator.matmul, torch.matmul, torch.mm, torch.ops.aten.mm.default)
ADDMM_TARGETS = (torch.addmm, torch.ops.aten.addmm.default)
GEMM_TARGETS = LINEAR_TARGETS + MATMUL_TARGETS + ADDMM_TARGETS


@dataclass(frozen=True)
class ParamInfo:
    """What the caller knows of a placeholder that is a parameter."""

    name: str  # qualified parameter name, e.g. "model.layers.0.self_attn.q_proj.weight"
    module: str  # qualified name of its owning module
    is_linear_weight: bool  # the `weight` of an nn.Linear (or subclass)
    shape: tuple[int, ...] = ()


@dataclass
class LinearSite:
    """One GEMM on a parameter: rewritten, or left alone with the reason."""

    module: str
    shape: tuple[int, ...]
    rewritten: bool
    reason: str | None = None
    weight_input: int | None = None  # placeholder index of the weight
    quant_inputs: tuple[int, ...] | None = None  # placeholder indices of (W_q, W_s[, W_deq]) when added

    @property
    def dequantized_input(self) -> int | None:
        """Placeholder index of ``W_deq`` (the cached dequantization), when the site has one."""
        return self.quant_inputs[2] if self.quant_inputs and len(self.quant_inputs) == 3 else None


@dataclass
class RewriteResult:
    sites: list[LinearSite] = field(default_factory=list)

    @property
    def rewritten(self) -> list[LinearSite]:
        return [s for s in self.sites if s.rewritten]

    @property
    def skipped(self) -> list[LinearSite]:
        return [s for s in self.sites if not s.rewritten]

    def summary(self) -> str:
        skipped = sorted({s.module for s in self.skipped})
        line = f"rewrote {len(self.rewritten)} of {len(self.sites)} linears"
        return line + (f"; skipped {', '.join(skipped)}" if skipped else "")


def _transposed_placeholder(node) -> fx.Node | None:
    """The placeholder ``W`` when ``node`` is ``W.t()``, ``W.T``, ``W.transpose(0, 1)`` or ``permute(1, 0)``."""
    if not isinstance(node, fx.Node):
        return None
    src = None
    if node.op == "call_method" and node.target == "t":
        src = node.args[0]
    elif (node.op == "call_method" and node.target in ("transpose", "permute")
          and tuple(node.args[1:]) in ((0, 1), (1, 0), (-1, -2), (-2, -1))):
        src = node.args[0]
    elif node.op == "call_function" and node.target in (torch.t, torch.ops.aten.t.default):
        src = node.args[0]
    elif node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        src = node.args[0]
    return src if isinstance(src, fx.Node) and src.op == "placeholder" else None


def _match_gemm(node: fx.Node):
    """``(x, weight_placeholder, bias)`` when ``node`` is a linear GEMM on a placeholder weight."""
    if node.op != "call_function":
        return None
    if node.target in LINEAR_TARGETS:
        args = list(node.args) + [None] * 3
        x = args[0] if "input" not in node.kwargs else node.kwargs["input"]
        w = node.kwargs.get("weight", args[1])
        b = node.kwargs.get("bias", args[2])
        return (x, w, b) if isinstance(w, fx.Node) and w.op == "placeholder" else None
    if node.target in MATMUL_TARGETS and len(node.args) == 2:
        w = _transposed_placeholder(node.args[1])
        return (node.args[0], w, None) if w is not None else None
    if node.target in ADDMM_TARGETS and len(node.args) == 3 and not node.kwargs:
        w = _transposed_placeholder(node.args[2])
        return (node.args[1], w, node.args[0]) if w is not None else None
    return None


def _uses_as_gemm_operand(node: fx.Node) -> bool:
    """Whether a placeholder feeds a GEMM, directly or through one transpose."""
    for user in node.users:
        if user.op == "call_function" and user.target in GEMM_TARGETS:
            return True
        if _transposed_placeholder(user) is node and any(
            u.op == "call_function" and u.target in GEMM_TARGETS for u in user.users
        ):
            return True
    return False


def rewrite_linears(
    gm: fx.GraphModule, params: dict[str, ParamInfo], recipe: Recipe, dequantized_weights: bool = False
) -> RewriteResult:
    """Rewrite eligible linear GEMMs of ``gm`` in place; ``params`` maps placeholder names to
    parameters. Returns every GEMM site on a parameter, rewritten or skipped (with the reason).

    ``dequantized_weights``: for an FP8 fprop, also add a ``<weight>_fp8_dequantized`` input, the
    dequantization of the cached payload (BF16 or FP32, the GEMM path's operand dtype), which the
    emulated GEMM multiplies by directly.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index_of = {n: i for i, n in enumerate(placeholders)}
    needs_quantized_weight = recipe.needs_quantized_weight
    result = RewriteResult()
    matched_weights: set[fx.Node] = set()
    last_placeholder = placeholders[-1] if placeholders else None
    n_inputs = len(placeholders)

    for node in list(graph.nodes):
        match = _match_gemm(node)
        if match is None:
            continue
        x, w, b = match
        info = params.get(w.name)
        if info is None:
            continue  # a GEMM on a non-parameter input (an activation): not ours
        matched_weights.add(w)
        shape = tuple(info.shape)
        reason = None
        if not info.is_linear_weight:
            reason = f"weight {info.name} is not the weight of an nn.Linear"
        elif len(shape) != 2:
            reason = f"weight {info.name} has shape {shape}, not 2-D"
        elif b is not None and not (isinstance(b, fx.Node) and b.op == "placeholder" and b.name in params):
            reason = "bias is not a parameter"
        else:
            reason = recipe.skip_reason(info.module)
        if reason is not None:
            result.sites.append(LinearSite(info.module, shape, False, reason, index_of[w]))
            continue

        quant_args, quant_inputs = (None, None), None
        if needs_quantized_weight:
            with graph.inserting_after(last_placeholder):
                q = graph.placeholder(f"{w.name}_fp8")
            with graph.inserting_after(q):
                s = graph.placeholder(f"{w.name}_scale")
            quant_args = (q, s)
            if dequantized_weights and recipe.fprop.is_fp8:
                with graph.inserting_after(s):
                    quant_args += (graph.placeholder(f"{w.name}_fp8_dequantized"),)
            for p in quant_args:  # not Dynamo inputs: AOTAutograd accepts placeholders without a source
                p._dynamo_source = None
            last_placeholder = quant_args[-1]
            quant_inputs = tuple(range(n_inputs, n_inputs + len(quant_args)))
            n_inputs += len(quant_args)
        precisions = {"fprop": recipe.fprop.dtype, "dgrad": recipe.dgrad.dtype, "wgrad": recipe.wgrad.dtype}
        if recipe.grad_handoff != "bf16":  # written only where it changes something: the graphs stay as they were
            precisions["handoff"] = recipe.grad_handoff
        with graph.inserting_before(node):
            new = graph.call_function(fp8_linear, (x, w, b, *quant_args), precisions)
        new.meta = dict(node.meta)
        new.meta["jetrl_module"] = info.module
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        result.sites.append(LinearSite(info.module, shape, True, None, index_of[w], quant_inputs))

    for w in placeholders:
        info = params.get(w.name)
        if info is not None and info.is_linear_weight and w not in matched_weights and _uses_as_gemm_operand(w):
            result.sites.append(
                LinearSite(info.module, tuple(info.shape), False, "GEMM form not recognised by the pass", index_of[w])
            )

    graph.lint()
    gm.recompile()
    return result
