"""Read the precision of every linear GEMM off the graphs that were actually compiled.

The report is not copied from the recipe table: for each matrix multiply in the AOTAutograd
forward and backward graphs handed to Inductor, it checks whether each operand is computed from a
``float8_e4m3fn`` tensor, and attributes the GEMM to its ``nn.Linear`` through the node metadata
Dynamo and AOTAutograd keep (``nn_module_stack`` in the forward, ``fwd_nn_module_stack`` in the
backward). A pass that silently did nothing shows up as ``bf16`` rows.

An operand counts as FP8 when its values are exactly an FP8 payload times its scales, in any
dtype: on the ``fp32`` BF16 GEMM path the dequantized operands are FP32 tensors, and still FP8.
Three ways in: computed in the graph from a ``float8_e4m3fn`` value; a graph input that holds a
dequantization (the weight cache's ``W_deq``); or, in a backward graph, a tensor the forward
saved that is one of those (the FP8 dgrad's ``deq(W)^T``, a view the forward made of ``W_deq``).
AOTAutograd's partitioner cuts both graphs out of one joint graph, so a saved tensor has the same
node name in the forward's outputs and among the backward's inputs. Likewise an operand that is
an exact upcast of a BF16 value (a BF16 gradient converted to FP32) counts as BF16.

The gradient a dgrad GEMM hands on (``handoff``) is read the same way, forwards: it is ``fp8``
when the GEMM's output leaves the computation made from it alone only as a dequantized FP8 value
of its own shape (``_handoff_precision``), else the dtype the GEMM writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..runtime import kernels  # noqa: F401 - registers torch.ops.jetrl.gemm_fp32 and fp8_gemm_triton

_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# GEMM ops and the positions of their two operands. ``jetrl.gemm_fp32`` is the ``fp32`` path of
# ``kernels.bf16_gemm``: it takes the BF16-valued operands and upcasts them inside.
# ``jetrl.fp8_gemm_triton`` is the Triton FP8 kernel: (a payload, its scales, b payload, ...).
_GEMM_OPS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.jetrl.gemm_fp32.default: (0, 1),
    torch.ops.jetrl.fp8_gemm_triton.default: (0, 2),
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
    handoff: str = ""  # what the rest of the graph receives of the output: "fp8" (a fake quantization) or its dtype

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
    if dtype in _FLOAT8_DTYPES:
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def _val_dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(val, "dtype", None)


def _is_float8(node) -> bool:
    return _val_dtype(node) in _FLOAT8_DTYPES


def _input_index(node: fx.Node) -> int | None:
    """Position of an AOT graph placeholder in the flat inputs (None for saved tensors etc.)."""
    desc = node.meta.get("desc")
    return getattr(desc, "idx", None) if type(desc).__name__ == "PlainAOTInput" else None


# Ops that move values without changing any (the upcast chain of ``_upcast_source``).
_LAYOUT_OPS = {
    "expand", "view", "reshape", "_unsafe_view", "permute", "t", "transpose", "clone", "unsqueeze",
    "squeeze", "alias", "contiguous", "flatten", "unflatten",
}
# dtype -> the dtypes it holds exactly (an upcast from one of them changes no value)
_EXACT_UPCASTS = {
    torch.float32: (torch.bfloat16, torch.float16),
    torch.float64: (torch.float32, torch.bfloat16, torch.float16),
}


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _operand_precision(
    node: fx.Node,
    fp8_inputs: frozenset[int] = frozenset(),
    fp8_saved: frozenset[str] = frozenset(),
    max_depth: int = 16,
) -> str:
    """"fp8" if the operand is computed from a float8 tensor through dequantize/layout ops, is one
    of ``fp8_inputs`` (graph inputs that hold a dequantized FP8 payload) or a placeholder named in
    ``fp8_saved`` (saved tensors of the forward that do); else the dtype of the value it upcasts."""
    if _is_fp8_valued(node, fp8_inputs, fp8_saved, max_depth):
        return "fp8"
    dtype = _val_dtype(_upcast_source(node))
    return dtype_tag(dtype) if dtype is not None else "?"


def _is_fp8_valued(node: fx.Node, fp8_inputs: frozenset[int], fp8_saved: frozenset[str], max_depth: int) -> bool:
    seen, frontier = set(), [(node, 0)]
    while frontier:
        n, depth = frontier.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if _is_float8(n):
            return True
        if n.op == "placeholder" and (_input_index(n) in fp8_inputs or n.name in fp8_saved):
            return True
        if depth >= max_depth or n.op != "call_function" or _op_name(n) not in _OPERAND_OPS:
            continue
        frontier.extend((a, depth + 1) for a in n.all_input_nodes)
    return False


def _upcast_source(node: fx.Node) -> fx.Node:
    """The value an operand holds exactly: followed back through layout ops and exact upcasts
    (``convert_element_type`` to a dtype that holds every value of its input's)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        source = node.args[0]
        name = _op_name(node)
        upcast = name in ("convert_element_type", "_to_copy") and _val_dtype(source) in _EXACT_UPCASTS.get(
            _val_dtype(node), ()
        )
        if not (upcast or (name in _LAYOUT_OPS and _val_dtype(source) == _val_dtype(node))):
            break
        node = source
    return node


def _handoff_precision(gemm: fx.Node) -> str:
    """What the rest of the graph receives of ``gemm``'s output: ``"fp8"`` where it is handed on
    only as a dequantized FP8 value, else the dtype the GEMM writes.

    The nodes computed from the output alone (with constants) hold the quantizer, if there is one:
    its amax and scale, the cast to float8 and the dequantize. The output is handed on in FP8 when
    one dequantized value of the output's size and row length (computed from a float8 node, not
    float8 itself) is where everything that leaves that set comes from. A BF16 hand-off leaves as
    the output itself (or its view) and fails this. So does ``jetrl``'s linear feeding a linear
    directly: the next dgrad's FP8 operand is of the output's shape, but the next wgrad's is its
    transpose, quantized along the tokens, and neither comes from the other."""
    val = gemm.meta.get("val")
    if val is None:
        return "?"
    own = dtype_tag(val.dtype)

    def constant(n: fx.Node) -> bool:
        return n.op in ("call_function", "get_attr") and not n.all_input_nodes

    alone, dequantized, order = {gemm}, set(), [gemm]
    node = gemm.next
    while node.op != "output":
        inputs = node.all_input_nodes
        if node.op == "call_function" and inputs and all(n in alone or constant(n) for n in inputs):
            alone.add(node)
            order.append(node)
            if _is_float8(node) or any(n in dequantized for n in inputs):
                dequantized.add(node)
        node = node.next
    leaving = {n for n in alone for user in n.users if user not in alone}

    def handed_on_in_fp8(n: fx.Node) -> bool:
        v = n.meta.get("val")
        return (n in dequantized and not _is_float8(n) and v is not None
                and v.shape[-1:] == val.shape[-1:] and v.numel() == val.numel())

    for i, source in enumerate(order):
        if not handed_on_in_fp8(source):
            continue
        reached = {source}
        for n in order[i + 1:]:
            if any(a in reached for a in n.all_input_nodes):
                reached.add(n)
        if leaving and leaving <= reached:
            return "fp8"
    return own

def gemms_in_graph(
    gm: fx.GraphModule, graph: str, fp8_inputs=frozenset(), fp8_saved=frozenset()
) -> list[GemmRecord]:
    """Every matrix multiply of an AOT graph, with its module and operand precisions.

    ``fp8_inputs``: flat-input positions that carry a dequantization (BF16 or FP32) of an FP8 payload
    (the weight cache's ``W_deq``); GEMM operands read from them count as FP8. ``fp8_saved``, for
    a backward graph: the names of the forward's saved tensors that do (``fp8_saved_tensors``).
    """
    fp8_inputs, fp8_saved = frozenset(fp8_inputs), frozenset(fp8_saved)
    records = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _GEMM_OPS:
            continue
        operands = [node.args[i] for i in _GEMM_OPS[node.target]]
        val = node.meta.get("val")
        records.append(
            GemmRecord(
                module=module_name_from_meta(node, graph == "backward") or "?",
                graph=graph,
                node=node.name,
                operand_dtypes=tuple(_operand_precision(x, fp8_inputs, fp8_saved) for x in operands),
                out_shape=tuple(val.shape) if val is not None else (),
                out_dtype=str(val.dtype).removeprefix("torch.") if val is not None else "",
                handoff=_handoff_precision(node) if graph == "backward" else "",
            )
        )
    return records


def fp8_saved_tensors(gm: fx.GraphModule, fp8_inputs=frozenset()) -> frozenset[str]:
    """Names of a forward graph's outputs that hold FP8 values (a payload, or a dequantization of
    one, read from ``fp8_inputs`` or computed in the graph): the saved tensors the backward reads
    under the same names. The user outputs among them are never backward placeholders."""
    fp8_inputs = frozenset(fp8_inputs)
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    return frozenset(v.name for v in output.all_input_nodes if _is_fp8_valued(v, fp8_inputs, frozenset(), 16))


def graph_has_fp8(gm: fx.GraphModule) -> bool:
    """Whether any value in the graph is a float8 tensor."""
    return any(_is_float8(n) for n in gm.graph.nodes)


def classify_backward(records: list[GemmRecord],
                      weight_shapes: dict[str, tuple[int, int]]) -> dict[str, dict[str, str]]:
    """``{module: {"dgrad": precision, "wgrad": precision, "handoff": precision}}`` from a
    backward graph's GEMMs (``handoff``: what the dgrad hands to the previous op).

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
            slots["handoff"] = dgrad[0].handoff
        if wgrad:
            slots["wgrad"] = wgrad[0].precision
        if slots:
            out[module] = slots
    return out
