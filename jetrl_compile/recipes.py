"""Precision recipes: which GEMM of a linear layer runs in FP8, and with which granularity.

A linear layer ``y = x W^T`` has three GEMMs in training and one in rollout:

- **fprop**: ``y = x W^T`` (the training forward),
- **dgrad**: ``dx = dy W`` (gradient handed to the previous op),
- **wgrad**: ``dW = dy^T x`` (gradient of the weight),
- **rollout**: the forward the inference engine runs while sampling.

and one hand-off: the gradient ``dx`` the dgrad gives the previous op (``grad_handoff``). Every
shipped flow hands it on in BF16; ``fp8_all`` also quantizes it, in 1 x 128 groups, which is the
paper's ablation that fails to converge.

A recipe says, for each, whether it is BF16 or FP8 and how each FP8 operand is grouped for its
scales. The contract for on-policy training is ``fprop == rollout``: the sampler and the learner
compute the same function. ``fp8_rollout_only`` breaks it on purpose, to reproduce the failure
the Jet-RL paper is about.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Literal

GEMM_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class GemmPrecision:
    """Precision of one GEMM. For FP8, the scale granularity of each operand, as written in the
    paper: ``"1x128"`` groups of 128 along the contraction dimension, ``"128x128"`` blocks."""

    dtype: Literal["bf16", "fp8"]
    lhs: str | None = None
    rhs: str | None = None

    def __post_init__(self):
        if self.dtype not in GEMM_DTYPES:
            raise ValueError(f"GEMM dtype {self.dtype!r} is unknown; choose one of {', '.join(GEMM_DTYPES)}")
        if (self.dtype == "fp8") != (self.lhs is not None and self.rhs is not None):
            raise ValueError("an FP8 GEMM names the granularity of both operands; a BF16 one names none")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8"

    def __str__(self) -> str:
        return self.dtype if not self.is_fp8 else f"fp8 ({self.lhs} x {self.rhs})"


BF16 = GemmPrecision("bf16")
# y = x W^T: activations in 1x128 groups along K, weights in 128x128 blocks (DeepSeek-V3 style).
FP8_FPROP = GemmPrecision("fp8", lhs="1x128", rhs="128x128")
# dx = dy W: dy in 1x128 groups along N (the contraction dim), W in the same 128x128 blocks.
FP8_DGRAD = GemmPrecision("fp8", lhs="1x128", rhs="128x128")
# dW = dy^T x: both operands grouped by 128 along the token dim M (the contraction dim).
FP8_WGRAD = GemmPrecision("fp8", lhs="1x128", rhs="128x1")

# Module-name patterns (fnmatch, on the qualified name) never rewritten to FP8, with the reason.
# Embeddings, norms, attention and activations are not nn.Linear and are never candidates.
DEFAULT_SKIP: tuple[tuple[str, str], ...] = (
    ("lm_head",
     "lm_head stays in the model dtype: logprobs are what RL optimises (include_lm_head=True to quantize it)"),
    ("*.router", "MoE routers are never quantized"),
    ("*.mlp.gate", "MoE routers are never quantized"),
    ("*.block_sparse_moe.gate", "MoE routers are never quantized"),
)


@dataclass(frozen=True)
class Recipe:
    """A named precision flow for every eligible linear layer of a model."""

    name: str
    fprop: GemmPrecision
    dgrad: GemmPrecision
    wgrad: GemmPrecision
    rollout: GemmPrecision
    description: str = ""
    include_lm_head: bool = False
    skip: tuple[str, ...] = ()  # extra user patterns, on top of DEFAULT_SKIP
    # The gradient a linear hands to the previous op: "bf16" (straight from the dgrad GEMM) or
    # "fp8" (quantized in 1 x 128 groups along its features, passed on as its dequantized value).
    grad_handoff: Literal["bf16", "fp8"] = "bf16"

    def __post_init__(self):
        if self.grad_handoff not in GEMM_DTYPES:
            raise ValueError(f"grad_handoff {self.grad_handoff!r} is unknown; choose one of {', '.join(GEMM_DTYPES)}")

    @property
    def on_policy(self) -> bool:
        """True when the rollout engine runs exactly the trainer's forward GEMM."""
        return self.fprop == self.rollout

    @property
    def needs_quantized_weight(self) -> bool:
        """The training GEMMs read the weight's FP8 blocks (fprop or dgrad is FP8)."""
        return self.fprop.is_fp8 or self.dgrad.is_fp8

    def with_options(self, *, include_lm_head: bool | None = None, skip=None) -> Recipe:
        """A copy with module-selection options changed; the GEMM precisions stay."""
        changes = {}
        if include_lm_head is not None:
            changes["include_lm_head"] = bool(include_lm_head)
        if skip is not None:
            if isinstance(skip, str):
                skip = (skip,)
            changes["skip"] = tuple(skip)
        return dataclasses.replace(self, **changes)

    def skip_reason(self, module_name: str) -> str | None:
        """Why the linear called ``module_name`` stays unquantized, or None if it is eligible."""
        for pattern in self.skip:
            if fnmatch.fnmatchcase(module_name, pattern):
                return f"matches skip pattern {pattern!r}"
        for pattern, reason in DEFAULT_SKIP:
            if pattern == "lm_head" and self.include_lm_head:
                continue
            if fnmatch.fnmatchcase(module_name, pattern) or fnmatch.fnmatchcase(module_name, "*." + pattern):
                return reason
        return None


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", BF16, BF16, BF16, BF16,
               description="BF16 everywhere: the reference flow"),
        Recipe("fp8_fwd_bf16_bwd", FP8_FPROP, BF16, BF16, FP8_FPROP,
               description="FP8 forward shared by trainer and rollout; BF16 backward (default)"),
        Recipe("jetrl", FP8_FPROP, FP8_DGRAD, FP8_WGRAD, FP8_FPROP,
               description="the paper's flow: FP8 fprop, dgrad and wgrad; BF16 gradients between ops"),
        Recipe("fp8_rollout_only", BF16, BF16, BF16, FP8_FPROP,
               description="off-policy baseline: BF16 training, FP8 rollout (never a default)"),
        Recipe("fp8_all", FP8_FPROP, FP8_DGRAD, FP8_WGRAD, FP8_FPROP, grad_handoff="fp8",
               description="the paper's failing ablation: jetrl with FP8 gradients between ops (never a default)"),
    )
}

DEFAULT_RECIPE = "fp8_fwd_bf16_bwd"


def get_recipe(recipe: str | Recipe = DEFAULT_RECIPE) -> Recipe:
    """The named recipe (a Recipe passes through unchanged). Unknown names raise ValueError."""
    if isinstance(recipe, Recipe):
        return recipe
    try:
        return RECIPES[recipe]
    except (KeyError, TypeError):
        raise ValueError(f"recipe {recipe!r} is unknown; choose one of {', '.join(RECIPES)}") from None
