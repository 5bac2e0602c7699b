"""Read the precision of every linear GEMM off the graphs that were actually compiled.

The report is not copied from the recipe table: for each matrix multiply in the AOTAutograd
forward and backward graphs handed to Inductor, it checks whether each operand is computed from a
``float8_e4m3fn`` tensor, and attributes the GEMM to its ``nn.Linear`` through the node metadata
Dynamo and AOTAutograd keep (``nn_module_stack`` in the forward, ``fwd_nn_module_stack`` in the
backward). A pass that silently did nothing shows up as ``bf16`` rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..runtime import kernels  # noqa: F401 - registers torch.ops.jetrl.gemm_fp32

# GEMM ops and the positions of their two operands. ``jetrl.gemm_fp32`` is the ``fp32`` path of
# ``kernels.bf16_gemm``: it takes the BF16-valued operands and upcasts them inside.
_GEMM_OPS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.jetrl.gemm_fp32.default: (0, 1),
}
# Ops a GEMM operand may pass through between the FP8 payload and the matmul (dequantize,
# layout changes). Anything else ends the search, so an FP8 GEMM upstream cannot leak into the
# classification of the next layer's BF16 GEMM.
_OPERAND_OPS = {
    "convert_element_type", "mul", "div", "expand", "view", "reshape", "_unsafe_view", "permute",
    "t", "transpose", "clone", "unsqueeze", "squeeze", "cat", "slice", "repeat", "alias",
    "contiguous", "_to_copy", "copy", "flatten", "unflatten", "select",
}


@dataclass
class GemmRecord:
    module: str
    graph: str  # "forward" | "backward"
    node: str
    operand_dtypes: tuple[str, str]  # "fp8" | "bf16" | other dtype name, per operand
    out_shape: tuple
    out_dtype: str = ""  # the dtype the GEMM writes (a dgrad's is the gradient handed to the previous op)

    @property
    def precision(self) -> str:
        kinds = set(self.operand_dtypes)
        if kinds == {"fp8"}:
            return "fp8"
        if "fp8" in kinds:
            return "mixed(" + "x".join(self.operand_dtypes) + ")"
        return self.operand_dtypes[0] if len(kinds) == 1 else "x".join(self.operand_dtypes)


_MODULE_PREFIX = re.compile(r"^L\['[^']*'\]\.?")


def module_name_from_meta(node: fx.Node, backward: bool) -> str | None:
    """Qualified name of the innermost module a node was traced in (``L['self'].`` stripped)."""
    stack = node.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = _MODULE_PREFIX.sub("", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")


def dtype_tag(dtype: torch.dtype) -> str:
    """A dtype as the precision report names it: ``fp8``, ``bf16``, ``fp32``, ``fp16``."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def _val_dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(val, "dtype", None)


def _input_index(node: fx.Node) -> int | None:
    """Position of an AOT graph placeholder in the flat inputs (None for saved tensors etc.)."""
    desc = node.meta.get("desc")
    return getattr(desc, "idx", None) if type(desc).__name__ == "PlainAOTInput" else None


def _operand_precision(node: fx.Node, fp8_inputs: frozenset[int] = frozenset(), max_depth: int = 16) -> str:
    """"fp8" if the operand is computed from a float8 tensor through dequantize/layout ops, or is
    one of ``fp8_inputs`` (graph inputs that hold a dequantized FP8 payload)."""
    seen, frontier = set(), [(node, 0)]
    while frontier:
        n, depth = frontier.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if _val_dtype(n) in (torch.float8_e4m3fn, torch.float8_e5m2):
            return "fp8"
        if n.op == "placeholder" and _input_index(n) in fp8_inputs:
            return "fp8"
        if depth >= max_depth or n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if name not in _OPERAND_OPS:
            continue
        frontier.extend((a, depth + 1) for a in n.all_input_nodes)
    dtype = _val_dtype(node)
    return dtype_tag(dtype) if dtype is not None else "?"


def gemms_in_graph(gm: fx.GraphModule, graph: str, fp8_inputs=frozenset()) -> list[GemmRecord]:
    """Every matrix multiply of an AOT graph, with its module and operand precisions.

    ``fp8_inputs``: flat-input positions that carry a dequantization (BF16 or FP32) of an FP8 payload
    (the weight cache's ``W_deq``); GEMM operands read from them count as FP8.
    """
    fp8_inputs = frozenset(fp8_inputs)
    records = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _GEMM_OPS:
            continue
        a, b = (node.args[i] for i in _GEMM_OPS[node.target])
        val = node.meta.get("val")
        records.append(
            GemmRecord(
                module=module_name_from_meta(node, graph == "backward") or "?",
                graph=graph,
                node=node.name,
                operand_dtypes=(_operand_precision(a, fp8_inputs), _operand_precision(b, fp8_inputs)),
                out_shape=tuple(val.shape) if val is not None else (),
                out_dtype=str(val.dtype).removeprefix("torch.") if val is not None else "",
            )
        )
    return records


def graph_has_fp8(gm: fx.GraphModule) -> bool:
    """Whether any value in the graph is a float8 tensor."""
    return any(_val_dtype(n) in (torch.float8_e4m3fn, torch.float8_e5m2) for n in gm.graph.nodes)


def classify_backward(records: list[GemmRecord],
                      weight_shapes: dict[str, tuple[int, int]]) -> dict[str, dict[str, str]]:
    """``{module: {"dgrad": precision, "wgrad": precision}}`` from a backward graph's GEMMs.

    ``dW`` has the weight's shape ``(N, K)``; ``dx`` has ``(M, K)``. When ``M == N`` the shapes
    cannot tell them apart and graph order decides: the op computes ``dx`` before ``dW``.
    """
    out: dict[str, dict[str, str]] = {}
    for module, shape in weight_shapes.items():
        recs = [r for r in records if r.module == module]
        wgrad = [r for r in recs if tuple(r.out_shape) == tuple(shape)]
        dgrad = [r for r in recs if tuple(r.out_shape) != tuple(shape)]
        if not dgrad and len(wgrad) == 2:
            dgrad, wgrad = wgrad[:1], wgrad[1:]
        slots = {}
        if dgrad:
            slots["dgrad"] = dgrad[0].precision
        if wgrad:
            slots["wgrad"] = wgrad[0].precision
        if slots:
            out[module] = slots
    return out
