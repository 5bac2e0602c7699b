"""The recipe-driven linear op: ``y = x W^T + b`` with explicit forward and backward precisions.

Why a traceable ``torch.autograd.Function`` and not a ``torch.library`` custom op: AOTAutograd
traces straight through the Function's forward and backward, so the compiled graphs hold the
quantize ops themselves (``amax``, ``log2``, the ``convert_element_type`` to ``float8_e4m3fn``)
next to the ops that produce and consume the activations. Inductor then fuses the activation
quantize into the kernel of the RMSNorm/SiLU before it and the dequantize into the loop feeding
the matmul, and a reader of the dumped graphs sees exactly where FP8 happens. A custom op would be
an opaque node (no fusion, no visible casts) unless it also registered a decomposition. The cost
is that AOTAutogradCache does not cache graphs holding a Function; Inductor's FX graph cache does.

Every GEMM runs from BF16 or FP8 copies, whatever the parameters' dtype (FP32 master weights
included), through ``kernels.bf16_gemm`` (the GEMM definition, on this machine's BF16 GEMM path);
results come back in the input's dtype and gradients in each input's dtype.

Backward rules per GEMM precision:

- BF16 dgrad/wgrad: straight-through. Quantization is the identity in the backward; ``dx = dy W``
  and ``dW = dy^T x`` are GEMMs of the BF16 copies of x and W saved in the forward, exactly what
  a BF16 ``F.linear`` computes (on the ``native`` path, bit for bit).
- FP8 dgrad: ``dy`` in 1 x 128 groups along N times the forward's own 128 x 128 weight blocks
  (transposed; the blocks are symmetric). FP8 wgrad: ``dy^T`` and ``x^T`` in groups of 128 along
  the token dim. The gradients handed to other ops stay BF16 (the paper: quantizing them kills
  convergence).
- FP8 hand-off (``handoff="fp8"``, recipe ``fp8_all``, that ablation): ``dx`` is quantized in
  1 x 128 groups along its features and handed on as its dequantized value, so every gradient
  the previous op receives is an FP8 code times its group's scale.
"""

from __future__ import annotations

import torch

from ..recipes import DEFAULT_RECIPE, GEMM_DTYPES, Recipe, get_recipe
from . import invariant
from .kernels import bf16_gemm, fp8_gemm_quantizing, uses_emulation
from .quantize import Quantized, dequantize, fake_quantize_groupwise, fused_quantize_groupwise, quantize_blockwise

BF16 = torch.bfloat16

# What Inductor must be told to compute this op's numbers (docs/design.md, pitfall 12). The op
# rounds its input to BF16 and then quantizes it; fused into one kernel, Inductor keeps the float32
# value and skips that rounding unless it emulates eager's casts, so an FP32 activation would get
# other FP8 codes than the eager op, the vLLM plugin and the exported weights' consumers give it.
# Pass these to torch.compile when compiling fp8_linear yourself.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}

# Inductor CPU pitfall (docs/design.md, pitfall 2): in an FP8-backward graph, the quantize of dy
# (groups along N, for dgrad) and of dy^T (groups along M, for wgrad) read the same buffer in two
# loop orders; fused horizontally, the loop splitter asserts (`try_loop_split`, var_ranges
# mismatch). Keeping horizontal fusion off in those backward graphs compiles them; vertical fusion
# (quantize into the producer and the dequantize into the matmul feed) is unaffected. Pass the same
# options to torch.compile when compiling fp8_linear with an FP8 backward yourself.
FP8_BACKWARD_INDUCTOR_OPTIONS = {**INDUCTOR_OPTIONS, "cpp.max_horizontal_fusion_size": 1}


class _RecipeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_q, weight_s, weight_deq, fprop: str, dgrad: str, wgrad: str, exact,
                handoff: str):
        x2 = x.reshape(-1, x.shape[-1]).to(BF16)
        b = bias.to(BF16) if bias is not None else None
        if exact is not None:
            y = _exact_fprop(x2, weight, weight_q, weight_s, b, fprop, exact)
        elif fprop == "fp8":
            y = fp8_gemm_quantizing(x2, Quantized(weight_q, weight_s), b, b_dequantized=weight_deq)
        else:
            y = bf16_gemm(x2, weight.to(BF16), b)
        ctx.save_for_backward(x2, weight, weight_q, weight_s, weight_deq)
        ctx.dgrad, ctx.wgrad, ctx.handoff = dgrad, wgrad, handoff
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, weight_q, weight_s, weight_deq = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(BF16)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if ctx.dgrad == "fp8":
                # deq(W)^T is exactly deq(W^T): the emulation reuses the cached dequantized weight.
                w_t_deq = weight_deq.t() if weight_deq is not None else None
                dx = fp8_gemm_quantizing(dy2, Quantized(weight_q.t(), weight_s.t()), b_dequantized=w_t_deq)
            else:
                dx = bf16_gemm(dy2, weight.to(BF16).t())
            if ctx.handoff == "fp8":
                dx = fake_quantize_groupwise(dx, BF16)
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if ctx.wgrad == "fp8":
                # both operands in groups of 128 tokens: their last dim is the token count
                x_t = fused_quantize_groupwise(x2.t(), along_tokens=True)
                dw = fp8_gemm_quantizing(dy2.t(), x_t, along_tokens=True)
            else:
                dw = bf16_gemm(dy2.t(), x2.t())
            dw = dw.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


def _exact_fprop(x2, weight, weight_q, weight_s, bias, fprop: str, weight_fixed) -> torch.Tensor:
    """The fprop GEMM of exact mode: the same operands (FP8-quantized or BF16), multiplied by
    ``invariant.gemm`` (exact per 128-block, blocks in order), rounded once to BF16. Where FP8
    GEMMs run on a real kernel (a GPU's Triton kernel), that kernel is batch-invariant by
    construction (one tile configuration, K in order, no split-K: ``triton_fp8``), so exact mode
    uses it as it is, with no float64 operand: ``weight_fixed`` is then just ``True``. Where exact
    mode runs the GPU's invariant kernels (``invariant.uses_triton``) but FP8 GEMMs are emulated,
    and for BF16 fprops, the operands go to the invariant Triton GEMM (float32 accumulation in one
    fixed order), again with no fixed-point operand."""
    if fprop == "fp8" and not uses_emulation(x2.device):
        return fp8_gemm_quantizing(x2, Quantized(weight_q, weight_s), bias)
    if invariant.uses_triton(x2.device):  # a GPU's invariant GEMM on the same BF16-valued operands
        if fprop == "fp8":
            a, w = fake_quantize_groupwise(x2, BF16), dequantize(weight_q, weight_s, BF16)
        else:
            a, w = x2, weight.detach().to(BF16)
        return invariant.triton_gemm(a, w, bias).to(BF16)
    if fprop == "fp8":
        a = fake_quantize_groupwise(x2, torch.float32)
        if not isinstance(weight_fixed, invariant.FixedPoint):
            weight_fixed = invariant.FixedPoint(dequantize(weight_q, weight_s, torch.float32))
    else:
        a = x2
        if not isinstance(weight_fixed, invariant.FixedPoint):
            weight_fixed = invariant.FixedPoint(weight.detach().to(BF16))
    return invariant.gemm(a, weight_fixed, bias).to(BF16)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_q: torch.Tensor | None = None,
    weight_s: torch.Tensor | None = None,
    weight_deq: torch.Tensor | None = None,
    *,
    recipe: str | Recipe | None = None,
    fprop: str | None = None,
    dgrad: str | None = None,
    wgrad: str | None = None,
    handoff: str | None = None,
    exact: bool | invariant.FixedPoint = False,
) -> torch.Tensor:
    """``y = x W^T + b`` with a recipe's GEMM precisions and backward rules: the one op, called by
    users, by the graphs the compiler pass rewrites, by the eager mode and by the vLLM plugin.

    Precisions come from ``recipe`` (default: the default recipe), or as the pass writes them into
    graphs, as plain strings ``fprop``, ``dgrad``, ``wgrad`` (all three; graphs print and cache
    them), with ``handoff`` (the gradient handed to the previous op, ``"bf16"`` or ``"fp8"``; the
    pass writes it only where it is ``"fp8"``). ``weight_q``/``weight_s`` are the weight's 128 x 128
    quantization (the weight cache's; quantized here from the weight when a GEMM needs it and none
    is given) and ``weight_deq`` its dequantization in ``kernels.gemm_operand_dtype`` for the
    emulated fprop (None: dequantize here). Gradients flow to ``weight``, the master parameter.
    Works eagerly and under torch.compile.

    ``exact``: run the fprop GEMM with ``invariant.gemm`` (exact mode, eager only), True or the
    weight's ``FixedPoint`` operand made earlier (the weight cache's ``get_fixed``). Backward rules
    are the recipe's either way.
    """
    explicit = (fprop, dgrad, wgrad)
    if any(p is not None for p in explicit) or handoff is not None:
        if recipe is not None or any(p is None for p in explicit):
            raise ValueError("fp8_linear: give either recipe=... or all three of fprop=, dgrad=, wgrad= "
                             "(and optionally handoff=)")
        handoff = handoff or "bf16"
    else:
        r = get_recipe(recipe if recipe is not None else DEFAULT_RECIPE)
        fprop, dgrad, wgrad, handoff = r.fprop.dtype, r.dgrad.dtype, r.wgrad.dtype, r.grad_handoff
    if handoff not in GEMM_DTYPES:
        raise ValueError(f"fp8_linear: handoff {handoff!r} is unknown; choose {' or '.join(GEMM_DTYPES)}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"fp8_linear: x has {x.shape[-1]} features but weight {tuple(weight.shape)} expects {weight.shape[-1]}"
        )
    if weight_q is None and (fprop == "fp8" or dgrad == "fp8"):
        weight_q, weight_s = quantize_blockwise(weight.detach())
    if exact is not False and weight_q is None and fprop == "fp8":
        weight_q, weight_s = quantize_blockwise(weight.detach())
    exact = None if exact is False else exact
    return _RecipeLinear.apply(x, weight, bias, weight_q, weight_s, weight_deq, fprop, dgrad, wgrad, exact, handoff)
