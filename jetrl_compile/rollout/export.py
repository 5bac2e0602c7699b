"""What the rollout engine gets from the trainer: the recipe's rollout weights, by name.

One function, ``rollout_tensors``, lists them; ``export_vllm`` writes them to a directory vLLM
loads, and ``VllmEngine.sync`` pushes the same list into a running engine. For every linear the
recipe quantizes, the tensors are the trainer's own cached FP8 payload and power-of-two block
scales (``WeightCache.get``), not a re-quantization of something else, so rollout multiplies by
the bytes the training forward used at this step.

Two formats:

- ``"jetrl"`` (default): our vLLM quantization method (``rollout/vllm_plugin.py``). Quantized
  linears hold ``weight`` (float8_e4m3fn) and ``weight_scale`` (float32, one per 128 x 128 block);
  vLLM then runs the trainer's GEMM definition: activations quantized in 1 x 128 groups, the
  same BF16 GEMM. Everything else (embeddings, norms, linears the recipe skips) keeps the
  trainer's parameter dtype, so vLLM's non-GEMM ops run in the precision the trainer's do.
- ``"fp8"``: vLLM's native block-FP8 checkpoint (``quant_method: fp8``, ``weight_block_size:
  [128, 128]``, ``weight_scale_inv``) for serving without our plugin. Same weight bytes, but
  on CPU vLLM runs it W8A16 (activations stay BF16), so it is not the trainer's function.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

from .. import __version__
from ..recipes import DEFAULT_RECIPE, Recipe, get_recipe
from ..runtime.format import SCALE_NAMES, block_scale_shape
from ..runtime.sharding import gathered
from ..runtime.weight_cache import WeightCache
from ..state import STATE_ATTR

METHOD = "jetrl"
FORMATS = ("jetrl", "fp8")
WEIGHTS_FILE = "model.safetensors"


def rollout_recipe_and_cache(model: nn.Module, recipe: str | Recipe | None = None) -> tuple[Recipe, WeightCache]:
    """The unified model's recipe and weight cache; for a plain model, ``recipe`` and a fresh cache."""
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        if recipe is not None and get_recipe(recipe).name != state.recipe.name:
            raise ValueError(
                f"the model is unified with recipe {state.recipe.name!r} but recipe {get_recipe(recipe).name!r} "
                "was asked for; export the recipe the trainer runs (leave recipe unset)"
            )
        return state.recipe, state.cache
    return get_recipe(recipe if recipe is not None else DEFAULT_RECIPE), WeightCache()


def rollout_linears(model: nn.Module, recipe: Recipe) -> list[str]:
    """Names of the ``nn.Linear`` modules whose rollout GEMM follows ``recipe.rollout``."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and recipe.skip_reason(name) is None
    ]


def engine_dtype(model: nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype vLLM runs non-GEMM ops in: by default the trainer's parameter dtype (FP32 master
    weights make the trainer's norms, attention and RoPE FP32, and the engine follows)."""
    dtype = dtype if dtype is not None else next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the vLLM flow runs models in float32 or bfloat16, not {dtype}")
    return dtype


def rollout_tensors(
    model: nn.Module, recipe: str | Recipe | None = None, *, fmt: str = "jetrl", dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for every weight the engine needs, in HF naming.

    Tensors that are not quantized come in ``engine_dtype(model, dtype)`` (BF16 for ``fmt="fp8"``).
    Shared parameters (tied embeddings) appear once, under their first name.
    """
    if fmt not in FORMATS:
        raise ValueError(f"export format {fmt!r} is unknown; choose one of {', '.join(FORMATS)}")
    recipe, cache = rollout_recipe_and_cache(model, recipe)
    if recipe.include_lm_head:
        raise NotImplementedError(
            "exporting a quantized lm_head to vLLM is not supported; unify with include_lm_head=False"
        )
    dtype = engine_dtype(model, dtype) if fmt == "jetrl" else torch.bfloat16
    linears = {f"{name}.weight" for name in rollout_linears(model, recipe)}
    scale_name = SCALE_NAMES[fmt]
    # FSDP2: the whole weights, as its forward sees them, freed when the block ends: copy them
    with torch.no_grad(), gathered(model) as sharded:
        for name, p in model.named_parameters():
            if name not in linears:
                yield name, p.detach().to(dtype, copy=sharded)
            elif recipe.rollout.is_fp8:
                q, s = cache.get(p)
                yield name, q
                yield name.removesuffix("weight") + scale_name, s
            else:
                yield name, p.detach().to(torch.bfloat16, copy=sharded)


def _architecture(model: nn.Module) -> str:
    """The model's class name as transformers and vLLM know it: FSDP2's ``fully_shard`` swaps in
    a subclass ``FSDP<Name>`` (bases: ``FSDPModule``, the model's class)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def quantization_config(model: nn.Module, recipe: str | Recipe | None = None, *, fmt: str = "jetrl") -> dict | None:
    """The ``quantization_config`` entry of the exported ``config.json`` (None: plain BF16)."""
    recipe, _ = rollout_recipe_and_cache(model, recipe)
    if fmt == "fp8":
        if not recipe.rollout.is_fp8:
            raise ValueError(
                f"recipe {recipe.name!r} rolls out in BF16; the native fp8 format needs an FP8 rollout recipe"
            )
        skipped = [
            n for n, m in model.named_modules() if isinstance(m, nn.Linear) and recipe.skip_reason(n) is not None
        ]
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "ignored_layers": skipped,
        }
    return {
        "quant_method": METHOD,
        "recipe": recipe.name,
        "rollout": recipe.rollout.dtype,
        "modules": rollout_linears(model, recipe),
        "weight_block_size": [128, 128],
        "activation_group_size": 128,
        "jetrl_compile_version": __version__,
    }


def export_vllm(
    model: nn.Module,
    path: str | Path,
    *,
    tokenizer=None,
    recipe: str | Recipe | None = None,
    format: str = "jetrl",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model``'s rollout weights to ``path`` as a checkpoint directory vLLM loads.

    ``model`` is a HuggingFace causal LM, normally unified (its recipe and cached quantization are
    used); for a plain model pass ``recipe``. ``dtype`` (float32 or bfloat16) is what vLLM runs
    the non-GEMM ops in; default the model's parameter dtype. ``tokenizer`` is saved alongside: by default
    the tokenizer of the checkpoint the model was loaded from (``config._name_or_path``; a
    ValueError says how to pass one where there is none), ``False`` for none (vLLM then needs
    ``skip_tokenizer_init=True``). Returns the directory.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"export_vllm takes a HuggingFace causal LM (with .config); got {type(model).__name__}")
    tensors = list(rollout_tensors(model, recipe, fmt=format, dtype=dtype))
    if tokenizer is None:  # before anything is written: a missing tokenizer leaves no half-made folder
        from ..models import source_tokenizer

        try:
            tokenizer = source_tokenizer(model)
        except ValueError as e:
            raise ValueError(f"export_vllm: vLLM needs a tokenizer beside the weights, and {e}; "
                             "or tokenizer=False to write none (vLLM with skip_tokenizer_init=True)") from e
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_weights(path, tensors)

    cfg = config.to_dict()
    cfg["architectures"] = [_architecture(model)]  # a config built in code may not name it
    qcfg = quantization_config(model, recipe, fmt=format)
    cfg["torch_dtype"] = cfg["dtype"] = str(
        engine_dtype(model, dtype) if format == "jetrl" else torch.bfloat16
    ).removeprefix("torch.")
    cfg.pop("quantization_config", None)
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    if tokenizer is not False:
        tokenizer.save_pretrained(path)
    return path


def write_weights(path: str | Path, tensors) -> Path:
    """(Re)write an export's weights file with ``(checkpoint name, tensor)`` pairs; returns its path."""
    from safetensors.torch import save_file

    file = Path(path) / WEIGHTS_FILE
    metadata = {"format": "pt", "producer": f"jetrl_compile {__version__}"}
    save_file({name: t.contiguous() for name, t in tensors}, str(file), metadata=metadata)
    return file


def validate_export(path: str | Path) -> dict:
    """Check an export before an engine loads it; returns its ``quantization_config``.

    Every module the config lists must have an FP8 ``weight`` and a float32 ``weight_scale`` of
    the 128 x 128 block shape holding positive powers of two. Errors name the tensor and the fix.
    """
    from safetensors import safe_open

    path = Path(path)
    config_file, weights_file = path / "config.json", path / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(
                f"{f} is missing: {path} is not a jetrl_compile export; "
                "write one with jetrl_compile.export_vllm(model, path)"
            )
    qcfg = json.loads(config_file.read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") != METHOD:
        return qcfg
    fix = "re-export with jetrl_compile.export_vllm"
    with safe_open(str(weights_file), framework="pt") as f:
        names = set(f.keys())
        for module in qcfg["modules"]:
            w_name = f"{module}.weight"
            if w_name not in names:
                raise ValueError(f"{path}: tensor {w_name} is missing; {fix}")
            w = f.get_slice(w_name)
            if qcfg["rollout"] == "bf16":
                if w.get_dtype() != "BF16":
                    raise ValueError(
                        f"{path}: {w_name} has dtype {w.get_dtype()}, expected BF16 (recipe {qcfg['recipe']}); {fix}"
                    )
                continue
            if w.get_dtype() != "F8_E4M3":
                raise ValueError(f"{path}: {w_name} has dtype {w.get_dtype()}, expected F8_E4M3; {fix}")
            s_name = f"{module}.weight_scale"
            if s_name not in names:
                raise ValueError(f"{path}: scale {s_name} is missing for FP8 weight {w_name}; {fix}")
            s = f.get_tensor(s_name)
            expected = block_scale_shape(tuple(w.get_shape()))
            if s.dtype != torch.float32 or tuple(s.shape) != expected:
                raise ValueError(
                    f"{path}: {s_name} is {s.dtype} {tuple(s.shape)}; expected float32 {expected} "
                    f"(one scale per 128 x 128 block of {w_name} {tuple(w.get_shape())}); {fix}"
                )
            if not is_power_of_two(s).all():
                raise ValueError(f"{path}: {s_name} holds values that are not positive powers of two; {fix}")
    return qcfg


def is_power_of_two(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: finite, positive, and an exact power of two."""
    mantissa, _ = torch.frexp(t.float())
    return torch.isfinite(t) & (t > 0) & (mantissa == 0.5)


__all__ = ["FORMATS", "METHOD", "export_vllm", "quantization_config", "rollout_tensors", "validate_export"]
