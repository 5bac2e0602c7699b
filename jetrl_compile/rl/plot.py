"""Plots of GRPO metrics: reward and accuracy, and rollout/trainer mismatch, per step."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


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
        ax_r.plot(steps, [r["reward_mean"] for r in rows], color=color, label=f"{name} reward")
        ax_r.plot(steps, [r["accuracy"] for r in rows], color=color, linestyle="--", label=f"{name} accuracy")
        kl = [max(r["mismatch_kl"], 1e-12) for r in rows]
        ax_k.plot(steps, kl, color=color, label=name)
    ax_r.set(xlabel="step", ylabel="reward / accuracy", title="reward (solid), accuracy (dashed)")
    ax_k.set(xlabel="step", ylabel="k3 KL(rollout || trainer)", title="rollout/trainer mismatch", yscale="log")
    ax_r.legend(fontsize=7)
    ax_k.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot_metrics(metrics_jsonl: str | Path, png: str | Path, title: str = "") -> Path:
    return plot_runs({"run": read_metrics(metrics_jsonl)}, png, title)
