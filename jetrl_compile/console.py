"""A quiet console for applications: the examples call ``quiet_console`` once from their
``main``; library code never changes logging or warning filters.

By default it shows the run (our own INFO records, the progress bar, WARNING and above from every
library) and hides what the libraries print on every start or step that says nothing about the run:
vLLM's and transformers' INFO records, their loading progress bars, and a fixed list of warnings
known to be harmless here (``KNOWN_HARMLESS``: a CUDA extension that torchao cannot load on a CPU
machine, vLLM's notes on a CPU backend without Triton or tcmalloc, torch's deprecation notes about
calls inside torchao and vLLM). Each is matched by its text, so a new warning, or an error, still
shows. ``verbose=True`` shows everything.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

# Log records and warnings hidden by default, as regular expressions searched in the message.
KNOWN_HARMLESS = (
    # torchao on a machine without CUDA / Triton
    r"Failed to load .*torchao/_C",
    r"Detected no triton, on systems without Triton certain kernels will not work",
    # torch, about calls in torchao and vLLM
    r"is an Enum subclass and is now natively supported by torch\.compile",
    r"Triton not available, find_triton_kernels",
    r"`torch\.distributed\.reduce_op` is deprecated",
    # vLLM's CPU backend, at every start
    r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False",
    r"Enforce eager set, disabling torch\.compile",
    r"Inductor compilation was disabled by user settings",
    r"Triton is not installed\. triton-cpu is expected",
    # the CPU install keeps Triton (the GPU kernel's interpreter tests); vLLM's CPU backend skips it
    r"Triton is installed, but doesn't include CPU backend\. Disabling Triton",
    r"Reset SSM cache type to float32",
    r"Model Runner V2 requires Triton",
    r"(libtcmalloc|libiomp) is not found in LD_PRELOAD",
    # vLLM's CPU worker sets VLLM_DIST_IDENT itself, and its own check of the environment does not
    # know it: every later engine start in the process (or in a child that inherits it) warns
    r"Unknown vLLM environment variable detected: VLLM_DIST_IDENT$",
    # vLLM's CPU backend, at every generate and weight reload
    r"CPU backend doesn't allow to use `torch\.set_num_threads`",
    r"RotaryEmbedding: Failed to load weights",  # rotary tables are computed, not loaded
    # a model whose head is tied to its embeddings (SmolLM2): the sync loads the embedding, the head
    # shares it, and vLLM's layerwise reload reports the head as not loaded on every sync (the sync
    # then repacks the head's CPU GEMM itself: _vllm_compat.repack_cpu_gemms)
    r"ParallelLMHead: Failed to load weights",
)
_PATTERN = re.compile("|".join(f"(?:{p})" for p in KNOWN_HARMLESS))
# Loggers whose INFO records are start-up and per-step detail of the library's own workings
CHATTY = ("vllm", "transformers", "torchao")


class KnownHarmless(logging.Filter):
    """Drops the records ``KNOWN_HARMLESS`` matches; passes everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to hide
            return True
        return _PATTERN.search(message) is None


def quiet_console(verbose: bool = False, fmt: str = "[%(name)s] %(message)s") -> None:
    """Configure logging for a command-line run: every record through one root handler in
    ``fmt``, INFO and up; by default the libraries' INFO records, loading bars and known-harmless
    warnings hidden (module docstring). Call it once from an application's ``main``, before an
    engine starts (vLLM reads ``VLLM_CONFIGURE_LOGGING`` when it first logs)."""
    import os

    logging.basicConfig(level=logging.INFO, format=fmt)
    # basicConfig leaves the root logger alone where an import gave it a handler already; the
    # libraries' records (vLLM's too, when VLLM_CONFIGURE_LOGGING=0) reach the root at INFO either way
    logging.getLogger().setLevel(logging.INFO)
    if verbose:
        return
    # vLLM's records then go through the root handler (and its filter) instead of a handler of its own
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=f".*{message}")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    else:  # read when transformers is imported; importing it now would cost a refused flag seconds
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torch prints through a handler of its own on the "torch" logger
    for name in ("", "torch"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(KnownHarmless())
