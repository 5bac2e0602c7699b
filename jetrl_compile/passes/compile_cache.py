"""Warm starts: a process that compiles a graph an earlier process compiled skips AOTAutograd.

Inductor's FX graph cache stores the compiled kernels of a forward and a backward graph.
AOTAutograd's cache stores the step above it (tracing the Dynamo graph into those two graphs,
the partitioner, the lookup of the kernels), keyed on the Dynamo graph; without it a warm start
still traces every graph anew (at 2 layers: 11.0 s warm without it, 7.2 s with it, 3.5 s once
Dynamo no longer restarts the trace, see ``DYNAMO_OPTIONS`` in ``backend``).

AOTAutograd refuses a graph calling a Python function it cannot vouch for, and every graph the
pass rewrites calls ``fp8_linear``. What that call computes is fixed by the code of
``jetrl_compile.runtime`` and ``recipes`` and by its arguments, which the graph holds (the
precision strings among them). ``op_cache_key`` hashes that code: marking the op cacheable under
it (``unsafe_marked_cacheable_functions``, part of AOTAutograd's key) is safe, and any change
to the op's code is a new key.

The precision report is read off the AOTAutograd graphs, and a cache hit never builds them. So
each graph's records are stored beside Inductor's cache, under a key of the rewritten graph and
what shaped its compile, and a graph is allowed AOTAutograd's cache only when its records are
there to load; ``JETRL_DUMP=1``, which writes those graphs, never uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import torch

from .. import __version__
from ..runtime.fp8_linear import fp8_linear
from .precision_report import GemmRecord

log = logging.getLogger("jetrl_compile")

_PACKAGE = Path(__file__).resolve().parent.parent


@functools.cache
def _sources_hash(*entries: str) -> str:
    """A hash of the package version and of the source files under ``entries`` (package paths)."""
    digest = hashlib.sha256(__version__.encode())
    for entry in entries:
        path = _PACKAGE / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(_PACKAGE).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def op_cache_key() -> str:
    """A hash of the code that decides what ``fp8_linear`` computes (ours and torchao's, whose
    float8 helpers the quantizer traces)."""
    import torchao

    return f"{_sources_hash('runtime', 'recipes.py')}-torchao{torchao.__version__}"


def marked_cacheable(bf16_gemm: str, fp8_kernel: str) -> dict[str, str]:
    """The value of Inductor's ``unsafe_marked_cacheable_functions`` that lets AOTAutograd cache
    graphs calling ``fp8_linear``: the op's code, and the GEMM paths the op took when the graph
    was traced (switches read at trace time; a graph with no dequantized-weight input would
    otherwise look the same on both BF16 GEMM paths)."""
    return {f"{fp8_linear.__module__}.{fp8_linear.__qualname__}": f"{op_cache_key()}-{bf16_gemm}-{fp8_kernel}"}


def graph_key(gm: torch.fx.GraphModule, inputs, context: dict) -> str:
    """The key of a rewritten graph's precision records: its code, its inputs' shapes, strides and
    dtypes (symbolic sizes by name), what else shaped the compile (``context``: recipe, GEMM path,
    the modules its sites stand for), torch's version and the package's code (the pass and the
    reading of precisions included)."""

    def describe(x):
        if isinstance(x, torch.Tensor):
            return [str(tuple(x.shape)), str(x.stride()), str(x.dtype), x.requires_grad]
        return type(x).__name__

    payload = {
        "code": gm.code,
        "inputs": [describe(x) for x in inputs],
        "context": context,
        "torch": torch.__version__,
        "package": _sources_hash("."),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _folder() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "jetrl_precisions"


def save(key: str, forward: list[GemmRecord] | None, backward: list[GemmRecord] | None, fields: dict) -> None:
    """Store a graph's records (``fields``: the other values read off its graphs)."""

    def rows(records):
        if records is None:
            return None
        return [
            {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
            | {"out_shape": [d if isinstance(d, int) else str(d) for d in r.out_shape]}  # SymInts by name
            for r in records
        ]

    folder = _folder()
    # a temporary file of this process and thread, renamed: ranks compiling the same graph into one
    # cache folder each write their own, and a reader never sees half a file
    tmp = folder / f"{key}.json.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"forward": rows(forward), "backward": rows(backward), **fields}))
        tmp.replace(folder / f"{key}.json")
    except OSError as e:  # the compile stands; a later process reads the graphs again
        log.warning("could not store the precision records %s (%s)", folder / f"{key}.json", e)


def load(key: str) -> dict | None:
    """A graph's stored records (``forward``/``backward`` as ``GemmRecord`` lists), or None."""
    path = _folder() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # unreadable: compile without AOTAutograd's cache
        log.warning("ignoring the unreadable precision records %s (%s)", path, e)
        return None

    def records(rows):
        if rows is None:
            return None
        return [GemmRecord(**dict(r, operand_dtypes=tuple(r["operand_dtypes"]), out_shape=tuple(r["out_shape"])))
                for r in rows]

    return dict(data, forward=records(data["forward"]), backward=records(data["backward"]))
