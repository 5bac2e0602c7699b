"""Shared pieces of the benchmarks: timing medians, machine facts, markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def median_seconds(fn, reps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict, reps: int, warmup: int = 1) -> dict[str, float]:
    """Median time of each function, runs interleaved (a, b, a, b, ...) so that machine noise
    hits every variant alike; ratios between them are what the tables report."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def machine() -> str:
    from jetrl_compile.runtime.cpu import cpu_kind, cpu_model
    from jetrl_compile.runtime.kernels import bf16_gemm_name
    from jetrl_compile.runtime.switches import cpu_switches_set

    # The CPU kind decides which BF16 GEMM path runs (kernels.bf16_gemm): name both, and any
    # variable that capped the CPU or forced the path for this run.
    forced = cpu_switches_set()
    return (
        f"{cpu_model()} (torch CPU capability {cpu_kind()}), {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}; "
        f"BF16 GEMMs: {bf16_gemm_name('cpu')}" + (f"; set: {' '.join(forced)}" if forced else "")
    )


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """How the benchmark was run, for its result file: ``python bench/<script> <arguments>``
    (``argv``: the arguments ``main`` was given, else the process's own), quoted for a shell."""
    import shlex
    import sys

    return shlex.join(["python", f"bench/{Path(script).name}", *(sys.argv[1:] if argv is None else argv)])


def write_result(name: str, command: str, body: str, folder: Path = RESULTS) -> Path:
    """Print and save a result table with the command and machine that produced it."""
    folder.mkdir(parents=True, exist_ok=True)
    text = f"# {name}\n\nCommand: `{command}`\n\nMachine: {machine()}\n\n{body}\n"
    path = folder / f"{name}.md"
    path.write_text(text)
    print(text)
    return path


def run_in_subprocess(script: str, worker_arg: str, extra: list[str], env: dict | None = None) -> dict:
    """Run ``script --worker worker_arg *extra`` in a fresh process (one in-process vLLM engine per
    process; ``env``: variables to set there) and return the JSON it prints on a ``RESULT`` line."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
    proc = subprocess.run(
        [sys.executable, script, "--worker", worker_arg, *extra], capture_output=True, text=True, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{Path(script).name} {worker_arg} failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix("RESULT "))


def report(result: dict) -> None:
    """The worker side of ``run_in_subprocess``."""
    import json

    print("RESULT " + json.dumps(result), flush=True)
