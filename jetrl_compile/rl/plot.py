"""Plots of GRPO metrics: reward and accuracy, and rollout/trainer mismatch, per step."""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _series(rows: list[dict], key: str) -> list[float]:
    """``key`` of every row; NaN (a gap in the line) where the row holds null (a non-finite value)."""
    return [math.nan if r[key] is None else r[key] for r in rows]


def plot_runs(runs: dict[str, list[dict]], png: str | Path, title: str = "") -> Path:
    """One figure: reward (solid) and accuracy (dashed) on the left, mismatch k3 KL on the right
    (log scale), one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, rows) in enumerate(runs.items()):
        if not rows:
            continue
        color = f"C{i}"
        steps = [r["step"] for r in rows]
        ax_r.plot(steps, _series(rows, "reward_mean"), color=color, label=f"{name} reward")
        ax_r.plot(steps, _series(rows, "accuracy"), color=color, linestyle="--", label=f"{name} accuracy")
        kl = [max(v, 1e-12) if math.isfinite(v) else v for v in _series(rows, "mismatch_kl")]
        ax_k.plot(steps, kl, color=color, label=name)
    ax_r.set(xlabel="step", ylabel="reward / accuracy", title="reward (solid), accuracy (dashed)")
    ax_k.set(xlabel="step", ylabel="k3 KL(rollout || trainer)", title="rollout/trainer mismatch", yscale="log")
    return _save(fig, (ax_r, ax_k), png, title)


def _save(fig, axes, png: str | Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


_KL_FLOOR = 1e-9  # where a log-scale axis shows a mismatch of exactly 0


def plot_seed_bands(runs: dict[str, list[list[dict]]], png: str | Path, title: str = "") -> Path:
    """Several seeds per flow: reward on the left, mismatch k3 KL on the right (log scale), each
    the mean over seeds per step with a min..max band, one colour per flow. A flow whose mismatch
    is exactly 0 on every step is drawn on the axis floor and labelled so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, seeds) in enumerate(runs.items()):
        seeds = [rows for rows in seeds if rows]
        if not seeds:
            continue
        length = min(len(rows) for rows in seeds)
        steps = [r["step"] for r in seeds[0][:length]]
        color = f"C{i}"
        for ax, key in ((ax_r, "reward_mean"), (ax_k, "mismatch_kl")):
            values = np.array([[r[key] for r in rows[:length]] for rows in seeds], dtype=float)
            if key == "mismatch_kl":
                exact = bool((values == 0).all())
                values = np.maximum(values, _KL_FLOOR)
            label = name if key == "reward_mean" else (f"{name}: 0.0 every step" if exact else name)
            ax.plot(steps, values.mean(0), color=color, label=f"{label} ({len(seeds)} seeds)")
            if len(seeds) > 1:
                ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2, linewidth=0)
    ax_r.set(xlabel="step", ylabel="mean reward", title="reward (mean over seeds, min..max band)")
    ax_k.set(xlabel="step", ylabel="k3 KL(rollout || trainer)", yscale="log", ylim=(_KL_FLOOR / 3, None),
             title=f"rollout/trainer mismatch (0 drawn at {_KL_FLOOR:g})")
    return _save(fig, (ax_r, ax_k), png, title)


def plot_metrics(metrics_jsonl: str | Path, png: str | Path, title: str = "") -> Path:
    return plot_runs({"run": read_metrics(metrics_jsonl)}, png, title)
