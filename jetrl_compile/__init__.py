"""jetrl-compile: one FP8 precision flow for RL training and rollout of language models.

    import jetrl_compile
    model = jetrl_compile.unify(model, recipe="fp8_fwd_bf16_bwd")
    engine = jetrl_compile.make_engine(model)          # vLLM running the trainer's FP8 op

Importing the package loads torch and the numerics (``recipes``, ``runtime``, ``unify``); the
rest of the public names load on first use, so importing it (as vLLM's plugin entry point does in
every vLLM process) loads no compiler pass, no Inductor, no RL loop and no engine.
"""

import importlib
import logging

from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe

# the module shares the function's name: bind it here
from .unify import linear_precisions, precision_report, restore, unify

__version__ = "0.1.0"

# the library logs (one line per compiled graph, the GRPO loop's warnings); applications choose
# the handlers, as examples/train_grpo.py does
logging.getLogger(__name__).addHandler(logging.NullHandler())

_PUBLIC = {
    "unified_state": "state",
    "fp8_all_gather": "fsdp",
    "export_vllm": "rollout.export",
    "validate_export": "rollout.export",
    "Completion": "rollout.engines",
    "HfEngine": "rollout.engines",
    "VllmEngine": "rollout.engines",
    "make_engine": "rollout.engines",
    "mismatch_metrics": "rl.mismatch",
}
__all__ = [  # the lazy names (_PUBLIC) resolve through __getattr__
    "DEFAULT_RECIPE",
    "RECIPES",
    "Recipe",
    "get_recipe",
    "linear_precisions",
    "precision_report",
    "restore",
    "unify",
    *_PUBLIC,
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jetrl_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC})
