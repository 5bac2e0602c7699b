"""Where a GRPO step's time goes, per recipe: rollout / train / sync of the driver's loop, with
the eager trainer unless ``--trainer-mode`` says otherwise (the README's table is eager; the
driver's own default, ``auto``, compiles it).

Runs ``examples/train_grpo.py``'s loop for ``--steps`` steps per recipe (each in its own
process), drops the first ``--warmup`` steps (compilation, first engine calls) and reports the
median of each phase over the rest, with the FP8-over-BF16 ratio per phase. Peak resident
memory of each process is reported too. The default shape is the TRL comparison's: 8 prompts x
8 completions x 32 new tokens.

    python bench/e2e.py
    python bench/e2e.py --recipes bf16 fp8_fwd_bf16_bwd --steps 4 --trainer-mode eager
    python bench/e2e.py --recipes fp8_fwd_bf16_bwd fp8_fwd_bf16_bwd+exact --engine hf --result e2e_exact

A recipe written ``name+exact`` runs in exact mode (``--exact``: eager trainer, hf engine).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, report, run_in_subprocess, table, write_result  # noqa: E402

RECIPES = ["bf16", "fp8_fwd_bf16_bwd", "jetrl"]
PHASES = ["rollout_s", "train_s", "sync_s", "step_s"]


def run_recipe(spec: str, args) -> dict:
    from jetrl_compile.rl.config import GrpoConfig
    from jetrl_compile.rl.loop import train

    recipe, exact = spec.removesuffix("+exact"), spec.endswith("+exact")
    cfg = GrpoConfig(recipe=recipe, exact=exact, steps=args.steps, batch_size=args.batch_size,
                     group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                     trainer_mode=args.trainer_mode, engine=args.engine,
                     out=tempfile.mkdtemp(prefix=f"jetrl-e2e-{recipe}-"), save_every=10**9, plot_every=10**9)
    rows = train(cfg, progress=False)
    timed = rows[args.warmup:]
    result = {k: statistics.median(r[k] for r in timed) for k in PHASES}
    result["first_step_s"] = rows[0]["step_s"]
    result["tokens_per_step"] = statistics.median(
        r["completion_tokens_mean"] * args.batch_size * args.group_size for r in timed
    )
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--trainer-mode", default="eager", choices=["auto", "compile", "eager"])
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    parser.add_argument("--result", default="e2e", help="name of the table under bench/results/")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--steps must exceed --warmup")
    if args.worker:
        report(run_recipe(args.worker, args))
        return
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
             "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
             "--trainer-mode", args.trainer_mode, "--engine", args.engine, "--result", args.result]
    results = {r: run_in_subprocess(__file__, r, extra) for r in args.recipes}
    base_name = "bf16" if "bf16" in results else next(iter(results))
    base = results[base_name]
    rows = []
    for recipe, r in results.items():
        cells = [f"`{recipe}`"]
        for k in PHASES:
            ratio = f" ({r[k] / base[k]:.2f}x)" if recipe != base_name and base[k] > 0 else ""
            cells.append(f"{r[k]:.2f}{ratio}")
        cells += [f"{r['first_step_s']:.0f}", f"{r['tokens_per_step']:.0f}", f"{r['peak_rss_gib']:.1f}"]
        rows.append(cells)
    body = table(["recipe", "rollout s", "train s", "sync s", "step s", "first step s (compile)",
                  "completion tokens/step", "peak RSS GiB"], rows)
    body += (f"\n\n{args.batch_size} prompts x {args.group_size} completions x up to {args.max_new_tokens} "
             f"new tokens per step, SmolLM2-135M (FP32 master weights), trainer {args.trainer_mode}, "
             f"engine {args.engine}; medians over steps "
             f"{args.warmup + 1}..{args.steps}; ratios are recipe over `{base_name}` per phase.")
    write_result(args.result, command_line(__file__), body)


if __name__ == "__main__":
    main()
