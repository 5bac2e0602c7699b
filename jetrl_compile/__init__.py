"""jetrl-compile: one FP8 precision flow for RL training and rollout of language models.

    import jetrl_compile
    model = jetrl_compile.unify(model, recipe="fp8_fwd_bf16_bwd")
"""

from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe
from .unify import precision_report, restore, unified_state, unify

__all__ = [
    "DEFAULT_RECIPE",
    "RECIPES",
    "Recipe",
    "get_recipe",
    "precision_report",
    "restore",
    "unified_state",
    "unify",
]
__version__ = "0.1.0"
