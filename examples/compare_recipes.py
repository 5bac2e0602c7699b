"""Same seed, same task, four precision flows: reward and rollout/trainer mismatch per step.

    python examples/compare_recipes.py --steps 30            # default model and task
    python examples/compare_recipes.py --recipes bf16 fp8_rollout_only --steps 10

Each recipe trains in --out/<recipe> (its own metrics.jsonl and checkpoints); the comparison is
written to --out/compare.png and --out/compare.md. The other flags are train_grpo.py's.
"""

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from jetrl_compile.rl.config import GrpoConfig, add_arguments, config_from_args
from jetrl_compile.rl.loop import train
from jetrl_compile.rl.plot import plot_runs, read_metrics

RECIPES = ["bf16", "fp8_fwd_bf16_bwd", "jetrl", "fp8_rollout_only"]


def summarize(name: str, rows: list[dict], window: int) -> list:
    head, tail = rows[:window], rows[-window:]

    def mean(key, part):
        return statistics.fmean(r[key] for r in part)

    return [
        f"`{name}`", len(rows),
        f"{mean('reward_mean', head):.3f} -> {mean('reward_mean', tail):.3f}",
        f"{mean('accuracy', head):.2f} -> {mean('accuracy', tail):.2f}",
        f"{statistics.median(r['mismatch_kl'] for r in rows):.2e}",
        f"{statistics.median(r['logprob_abs_diff_mean'] for r in rows):.4f}",
        f"{statistics.median(r['step_s'] for r in rows):.1f}",
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, GrpoConfig(out="runs/compare"))
    parser.add_argument("--recipes", nargs="+", default=RECIPES,
                        help=f"flows to compare (default: {' '.join(RECIPES)})")
    args = parser.parse_args(argv)
    base = config_from_args(args)
    out = Path(base.out)
    runs = {}
    for recipe in args.recipes:
        cfg = dataclasses.replace(base, recipe=recipe, out=str(out / recipe))
        print(f"== {recipe} ==", flush=True)
        train(cfg)
        runs[recipe] = read_metrics(Path(cfg.out) / "metrics.jsonl")
    plot_runs(runs, out / "compare.png",
              title=f"GRPO, {base.task}, seed {base.seed}: one precision flow vs FP8 rollout only")
    window = max(1, min(5, base.steps // 4))
    header = ["recipe", "steps", f"reward (first {window} -> last {window} steps)", "accuracy",
              "median k3 KL", "median mean abs dlogp", "median step s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in summarize(name, rows, window)) + " |" for name, rows in runs.items()]
    text = "\n".join(lines) + "\n"
    (out / "compare.md").write_text(f"Command: `python examples/compare_recipes.py {' '.join(sys.argv[1:])}`\n\n{text}")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
