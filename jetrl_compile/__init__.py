"""jetrl-compile: one FP8 precision flow for RL training and rollout of language models.

    import jetrl_compile
    model = jetrl_compile.unify(model, recipe="fp8_fwd_bf16_bwd")
    engine = jetrl_compile.make_engine(model)          # vLLM running the trainer's FP8 op
"""

import logging

__version__ = "0.1.0"

from .export import export_vllm, validate_export
from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe
from .rl.mismatch import mismatch_metrics
from .runtime.rollout import Completion, HfEngine, VllmEngine, make_engine
from .unify import precision_report, restore, unified_state, unify

__all__ = [
    "DEFAULT_RECIPE",
    "RECIPES",
    "Completion",
    "HfEngine",
    "Recipe",
    "VllmEngine",
    "export_vllm",
    "get_recipe",
    "make_engine",
    "mismatch_metrics",
    "precision_report",
    "restore",
    "unified_state",
    "unify",
    "validate_export",
]

# the library logs (one line per compiled graph, the GRPO loop's warnings); applications choose
# the handlers, as examples/train_grpo.py does
logging.getLogger(__name__).addHandler(logging.NullHandler())
