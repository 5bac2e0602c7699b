"""What ``--out`` holds, and the rules that keep a run in it from being lost.

A folder that holds any of a run's files (``RUN_FILES``) holds a run: a new run there is refused
(``--resume`` continues it, ``--overwrite`` deletes the driver's outputs and starts over), and
``--resume`` of a run that never wrote a checkpoint says so. Every JSON file the driver writes is
strict JSON: a value that is not a finite number is written as null, and the row names it
(``finite_row``), since NaN and Infinity are not JSON.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from ..errors import UsageFileExistsError, UsageFileNotFoundError, UsageValueError
from .checkpoint import checkpoint_dir, latest_checkpoint

# any of these in --out means a run lives there
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints")
# everything the driver writes into --out (engine-rank<N>/ too, under --parallel): what --overwrite deletes
DRIVER_OUTPUTS = (*RUN_FILES, "metrics.png", "eval.json", "tensorboard", "engine", "eval-engine")


def run_files(out: str | Path) -> list[str]:
    """The run files ``out`` holds (none where it holds no run)."""
    return [name for name in RUN_FILES if (Path(out) / name).exists()]


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint file holds, from its name (``step_000006.pt``: 6)."""
    return int(path.stem.removeprefix("step_"))


def check_run_folder(out: str | Path, *, resume: bool, overwrite: bool, steps: int) -> Path | None:
    """The checkpoint to continue (``resume``), or None for a new run, after refusing what ``out``
    cannot take: a new run over an existing one (unless ``overwrite``), a resume of a folder that
    holds no checkpoint, or a resume whose ``steps`` are already done. Reads names only: no
    checkpoint is loaded, nothing is written."""
    out = Path(out)
    held = run_files(out)
    found = latest_checkpoint(out)
    if resume:
        if found is None and held:
            raise UsageFileNotFoundError(
                f"--resume: the run in {out} has no checkpoint yet ({', '.join(held)}, but nothing in "
                f"{checkpoint_dir(out)}; one is written every --save-every steps): nothing to resume; start it "
                "over with --overwrite"
            )
        if found is None:
            raise UsageFileNotFoundError(f"--resume: {out} holds no run (no checkpoint in {checkpoint_dir(out)}); "
                                         "run without --resume to start one")
        done = checkpoint_step(found)
        if steps <= done:
            raise UsageValueError(f"--steps {steps}: the run in {out} has done {done} steps already; pass --steps N "
                                  f"with N > {done} (the new total) to train on")
        return found
    if held and not overwrite:
        raise UsageFileExistsError(
            f"{out} already holds a run ({', '.join(held)}); pass --resume to continue it, --overwrite to delete "
            "it and start over, or choose another --out"
        )
    return None


def clear_run(out: str | Path) -> list[str]:
    """Delete the driver's outputs from ``out`` (nothing else in it); returns the names deleted."""
    out = Path(out)
    gone = []
    for path in sorted({*(out / name for name in DRIVER_OUTPUTS), *out.glob("engine-rank*")}):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(path.name)
    return gone


def finite_row(row: dict) -> dict:
    """``row`` with every float that is not finite as None, named under ``non_finite``."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return row
    return {**{k: None if k in bad else v for k, v in row.items()}, "non_finite": bad}


def json_text(value, **kwargs) -> str:
    """Strict JSON (a NaN or Infinity raises ValueError rather than writing what no parser reads)."""
    return json.dumps(value, allow_nan=False, **kwargs)
