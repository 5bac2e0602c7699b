"""Checkpoints that let ``--resume`` continue a GRPO run bit for bit.

One file holds everything the next step depends on, as plain data (loaded with
``weights_only=True``): FP32 master weights, optimizer state, the step, the task's data position
and RNG state, torch's RNG state (every rank's, in a data-parallel run, with the number of
ranks), and the run-defining settings (a checkpoint of another run is
refused, naming the setting that differs). Files are written to a temporary name and renamed, so a crash
mid-write leaves the previous checkpoint intact; only the latest is kept (an FP32 model plus
AdamW state is 12 bytes per parameter).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from ..errors import UsageValueError
from .config import LEGACY_RUN_DEFINING, GrpoConfig

FORMAT = 1


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def latest_checkpoint(out: str | Path) -> Path | None:
    files = sorted(checkpoint_dir(out).glob("step_*.pt"))
    return files[-1] if files else None


def rng_state() -> tuple:
    """This process's torch and Python RNG states, as a checkpoint stores them."""
    return torch.get_rng_state(), random.getstate()


def save_checkpoint(out, step: int, model, optimizer, task_state: dict, run: dict, counters: dict,
                    rank_rng: list | None = None) -> Path:
    """``model`` and ``optimizer``: the objects, or their state dicts (a sharded run gathers them
    first); ``rank_rng``: every rank's ``rng_state()`` in a data-parallel run (rank 0 writes)."""
    folder = checkpoint_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.pt"
    state = {
        "format": FORMAT,
        "step": step,
        "run": run,
        "model": model if isinstance(model, dict) else model.state_dict(),
        "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
        "task": task_state,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "counters": counters,
        "ranks": len(rank_rng) if rank_rng else 1,
    }
    if rank_rng:
        state["rank_rng"] = [{"torch_rng": t, "python_rng": p} for t, p in rank_rng]
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in folder.glob("step_*.pt"):
        if old != path:
            old.unlink()
    return path


def load_checkpoint(path: Path, run: dict, ranks: int | None = None) -> dict:
    """The checkpoint's state, after checking it belongs to the run ``run`` describes (and, to
    resume it, ``ranks``: that it was trained on that many data-parallel ranks)."""
    try:
        # tensors, numbers, strings, lists, tuples and dicts only: a checkpoint from elsewhere
        # cannot run code on --resume
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise UsageValueError(
            f"checkpoint {path} cannot be read as a jetrl_compile checkpoint ({type(e).__name__}: {e}); "
            "delete it to start over"
        ) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageValueError(f"checkpoint {path} is not a jetrl_compile GRPO checkpoint (format {FORMAT})")
    # a setting added after the checkpoint was written had its default then
    defaults = {**GrpoConfig().run_defining(), **LEGACY_RUN_DEFINING}
    for key, value in run.items():
        saved = state["run"].get(key, defaults.get(key))
        if saved != value:
            raise UsageValueError(
                f"checkpoint {path} belongs to another run: {key}={saved!r} there, {value!r} now; "
                f"pass --{key.replace('_', '-')} {saved} to resume it, or use another --out"
            )
    if ranks is not None and state.get("ranks", 1) != ranks:
        raise UsageValueError(
            f"checkpoint {path} was written by a run on {state.get('ranks', 1)} rank(s), this one has {ranks}: "
            "resume it with the same number of processes (each rank's RNG state and share of the prompts "
            "follow from it)"
        )
    return state


def restore_rng(state: dict, rank: int = 0) -> None:
    """Restore the RNG states ``save_checkpoint`` stored: rank ``rank``'s in a data-parallel run."""
    own = state["rank_rng"][rank] if "rank_rng" in state else state
    torch.set_rng_state(own["torch_rng"])
    version, internal, gauss = own["python_rng"]
    random.setstate((version, tuple(internal), gauss))
