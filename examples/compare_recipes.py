"""Precision flows side by side on one task: reward and rollout/trainer mismatch per step, over
several seeds.

    python examples/compare_recipes.py --steps 30                      # four flows, seed 0
    python examples/compare_recipes.py --recipes fp8_fwd_bf16_bwd+exact fp8_fwd_bf16_bwd \\
        fp8_rollout_only --seeds 0 1 2 --out runs/compare-exact       # exact vs today vs off-policy

A flow is a recipe, with optional ``+exact`` (exact mode, ``--exact``) and ``+tis`` or ``+mis``
(that rollout correction, ``--rollout-correction``; its bounds from ``--is-clip``, ``--is-low``),
e.g. ``fp8_rollout_only+tis``. Each flow and seed trains in
``--out/<flow>/seed<k>`` (its own metrics.jsonl and checkpoints); a run found complete there is
read back, not retrained, and an interrupted one resumes from its last checkpoint (one killed
before its first checkpoint starts over), so the whole comparison can be restarted after a crash.
Each flow runs the driver's own trainer (``--trainer-mode auto``: compiled, eager in exact mode),
which the table names. The result is ``--out/compare.png`` (mean over seeds with the min..max
band) and ``--out/compare.md``. The other flags are train_grpo.py's.
"""

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from jetrl_compile.console import quiet_console
from jetrl_compile.errors import CommandLineParser, UsageValueError, command_line_errors
from jetrl_compile.recipes import RECIPES
from jetrl_compile.rl.checkpoint import latest_checkpoint
from jetrl_compile.rl.config import GrpoConfig, add_arguments, config_from_args
from jetrl_compile.rl.loop import train
from jetrl_compile.rl.plot import plot_seed_bands, read_metrics

FLOWS = ["bf16", "fp8_fwd_bf16_bwd", "jetrl", "fp8_rollout_only"]


def flow_config(base: GrpoConfig, flow: str) -> GrpoConfig:
    """``base`` with the recipe and modifiers ``flow`` names (``recipe[+exact][+tis|+mis]``)."""
    recipe, *modifiers = flow.split("+")
    if recipe not in RECIPES or not set(modifiers) <= {"exact", "tis", "mis"} or {"tis", "mis"} <= set(modifiers):
        raise UsageValueError(
            f"flow {flow!r}: write a recipe ({', '.join(RECIPES)}) with optional +exact and one of +tis, +mis"
        )
    correction = next((m for m in modifiers if m in ("tis", "mis")), base.rollout_correction)
    # the trainer mode stays the driver's (auto: compiled, eager for exact flows); the table says which ran
    return dataclasses.replace(base, recipe=recipe, exact=base.exact or "exact" in modifiers,
                               rollout_correction=correction)


def run(base: GrpoConfig, flow: str, seed: int, out: Path) -> list[dict]:
    """The metrics rows of ``flow`` at ``seed``: read back if that run is complete, else trained
    (resumed from its last checkpoint if it was interrupted)."""
    cfg = dataclasses.replace(flow_config(base, flow), seed=seed, out=str(out))
    metrics = out / "metrics.jsonl"
    if metrics.exists() and len(read_metrics(metrics)) >= cfg.steps:
        print(f"== {flow}, seed {seed}: complete in {out}, read back ==", flush=True)
        return read_metrics(metrics)[: cfg.steps]
    resume = latest_checkpoint(out) is not None  # else a run killed before its first checkpoint, or none
    print(f"== {flow}, seed {seed}{' (resuming)' if resume else ''} ==", flush=True)
    train(dataclasses.replace(cfg, resume=resume, overwrite=not resume))
    return read_metrics(metrics)


def _spread(values: list[float], fmt: str) -> str:
    """``mean`` for one seed, ``mean (min..max)`` for several."""
    mean = format(statistics.fmean(values), fmt)
    return mean if len(values) == 1 else f"{mean} ({format(min(values), fmt)}..{format(max(values), fmt)})"


def summarize(flow: str, trainer: str, seeds: list[list[dict]], window: int) -> list:
    def window_mean(key, rows, part):
        part_rows = rows[:window] if part == "head" else rows[-window:]
        return statistics.fmean(r[key] for r in part_rows)

    def finite(key):  # a refused step's non-finite values are null in metrics.jsonl
        return [row[key] for rows in seeds for row in rows if row.get(key) is not None]

    reward = [(window_mean("reward_mean", r, "head"), window_mean("reward_mean", r, "tail")) for r in seeds]
    accuracy = [(window_mean("accuracy", r, "head"), window_mean("accuracy", r, "tail")) for r in seeds]
    return [
        f"`{flow}`", trainer, len(seeds), len(seeds[0]),
        f"{_spread([a for a, _ in reward], '.3f')} -> {_spread([b for _, b in reward], '.3f')}",
        f"{_spread([a for a, _ in accuracy], '.2f')} -> {_spread([b for _, b in accuracy], '.2f')}",
        f"{statistics.median(finite('mismatch_kl')):.2e}",
        f"{max(finite('logprob_abs_diff_max')):.3g}",
        f"{statistics.median(finite('step_s')):.1f}",
    ]


def main(argv=None):
    parser = CommandLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, GrpoConfig(out="runs/compare"))
    parser.add_argument("--recipes", nargs="+", default=FLOWS,
                        help=f"flows to compare, recipe[+exact][+tis|+mis] (default: {' '.join(FLOWS)})")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds per flow (default: --seed)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error in the flags, data, "
                        "checkpoint or --out")
    parser.add_argument("--verbose", action="store_true", help="show every library's log records and warnings")
    args = parser.parse_args(argv)
    with command_line_errors(args.debug):
        compare(args)


def compare(args):
    base = config_from_args(args)
    seeds = args.seeds or [base.seed]
    out = Path(base.out)
    for flow in args.recipes:  # a misspelt flow stops here, not after hours of the others
        flow_config(base, flow)
    runs = {flow: [run(base, flow, seed, out / flow.replace("+", "-") / f"seed{seed}") for seed in seeds]
            for flow in args.recipes}
    plot_seed_bands(runs, out / "compare.png",
                    title=f"GRPO, {base.task}, seeds {', '.join(map(str, seeds))}: mean and min..max over seeds")
    window = max(1, min(5, base.steps // 4))
    header = ["flow", "trainer", "seeds", "steps", f"reward (first {window} -> last {window} steps)", "accuracy",
              "median k3 KL", "max abs dlogp (any step)", "median step s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    trainers = {flow: flow_config(base, flow).resolved_trainer_mode() for flow in runs}
    lines += ["| " + " | ".join(str(c) for c in summarize(flow, trainers[flow], rows, window)) + " |"
              for flow, rows in runs.items()]
    text = "\n".join(lines) + "\n"
    note = "Reward and accuracy: mean over seeds of the window means, (min..max) across seeds."
    (out / "compare.md").write_text(
        f"Command: `python examples/compare_recipes.py {' '.join(sys.argv[1:])}`\n\n{text}\n{note}\n"
    )
    print(text)


if __name__ == "__main__":
    # the program's console, set before anything logs (tests call main() and keep their own)
    quiet_console(verbose="--verbose" in sys.argv[1:])
    sys.exit(main())
