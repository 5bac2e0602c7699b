"""``JETRL_DUMP=1``: write every graph the pass saw and produced, and the precision report.

Each process that compiles writes into a fresh folder ``$JETRL_DUMP_DIR/<YYYYmmdd-HHMMSS>-<pid>/``
(``JETRL_DUMP_DIR`` defaults to ``./jetrl_dump``), and each model unified in that process its own
folder in it, ``model_<n>-<recipe>/`` (n counts unify calls from 0), so nothing is overwritten:
not between runs, not by a second model (a reference model, two recipes compared in one script).
Inside, one folder per compiled graph, ``graph_000/``, ``graph_001/``, ... holds:

- ``dynamo_before.py``: the graph Dynamo captured, before the pass,
- ``dynamo_after.py``: after the pass (``fp8_linear`` calls, precisions as kwargs),
- ``aot_forward.py`` / ``aot_backward.py`` (or ``aot_forward_inference.py`` under no_grad): the
  graphs handed to Inductor, with dtypes on every value (``f8e4m3fn`` marks FP8),
- ``precision_report.md`` and ``precision_report.json``: per linear, the precision of fprop,
  dgrad and wgrad as read off those graphs, and the skipped modules with the reason.

Under regional compilation (``unify``'s default) a graph is a decoder layer's, traced once and run
by every layer of its class: its report names those layers (``"region"``, ``"modules"``) and lists
the linears of each, so the reports together cover every compiled linear of the model.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.fx as fx

from ..runtime import switches


def dump_enabled() -> bool:
    return switches.dump()


_RUN_DIR: Path | None = None


def run_dir() -> Path:
    """This process's dump folder, created on first use."""
    global _RUN_DIR
    root = switches.dump_dir()
    if _RUN_DIR is None or _RUN_DIR.parent != root:
        _RUN_DIR = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        _RUN_DIR.mkdir(parents=True, exist_ok=True)
    return _RUN_DIR


_models = 0


def model_folder(recipe: str) -> str:
    """A new model's folder name, ``model_<n>-<recipe>``, unique in this process."""
    global _models
    _models += 1
    return f"model_{_models - 1}-{recipe}"


def graph_dir(model: str, graph_id: int) -> Path:
    path = run_dir() / model / f"graph_{graph_id:03d}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def graph_text(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def write_graph(model: str, graph_id: int, name: str, gm: fx.GraphModule) -> Path:
    path = graph_dir(model, graph_id) / f"{name}.py"
    path.write_text(graph_text(gm))
    return path


def write_report(model: str, graph_id: int, report: dict) -> None:
    folder = graph_dir(model, graph_id)
    (folder / "precision_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "precision_report.md").write_text(report_markdown(report))


def report_markdown(report: dict) -> str:
    lines = [
        f"# Precision report, graph {report['graph']}",
        "",
        f"Recipe `{report['recipe']}`: {report['summary']}.",
        f"Read off the compiled graphs: forward {'yes' if report['forward_compiled'] else 'no'}, "
        f"backward {'yes' if report['backward_compiled'] else 'not compiled (yet)'}.",
        f"FP8 GEMM kernel: {report['fp8_kernel']}; BF16 GEMM path: `{report['bf16_gemm']}`.",
    ]
    if report.get("region"):
        members = report["modules"]
        lines.append(
            f"Regional compilation: a compiled `{report['region']}`, run by {len(members)} layers\n"
            f"(`{members[0]}`{' ... `' + members[-1] + '`' if len(members) > 1 else ''}); the table lists each."
        )
    lines += [
        "",
        "| module | shape (N, K) | fprop | dgrad | wgrad | dx handed on |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["linears"]:
        shape = "x".join(str(d) for d in row["shape"])
        lines.append(
            f"| `{row['module']}` | {shape} | {row['fprop']} | {row['dgrad'] or '-'} | {row['wgrad'] or '-'} "
            f"| {row.get('handoff') or '-'} |"
        )
    if report["skipped"]:
        lines += ["", "Skipped:", ""]
        lines += [f"- `{s['module']}`: {s['reason']}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"
