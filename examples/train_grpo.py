"""GRPO on one FP8 precision flow: vLLM samples with the trainer's own FP8 forward.

    python examples/train_grpo.py                      # SmolLM2-135M, arithmetic: 5-11 min on 2 CPU cores (README)
    python examples/train_grpo.py --recipe jetrl --steps 50 --out runs/jetrl
    python examples/train_grpo.py --resume --steps 50 --out runs/jetrl      # continue it, bit for bit
    python examples/train_grpo.py --eval --limit 200 --out runs/jetrl       # its greedy accuracy
    python examples/train_grpo.py --task gsm8k --data ../shared/data/gsm8k/train.jsonl \\
        --model Qwen/Qwen2.5-1.5B-Instruct --max-new-tokens 256     # a real run, on a GPU

Writes to --out: metrics.jsonl (one line per step), metrics.png, checkpoints/ (resume with
--resume), config.json; eval.json with --eval. --resume and --eval take the run's settings from
its config.json. A folder that holds a run is never written over: --overwrite starts it over.
Every setting is checked before anything loads: a bad one is one 'error:' line and exit code 2.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

from jetrl_compile.console import quiet_console
from jetrl_compile.errors import CommandLineParser, command_line_errors
from jetrl_compile.rl.config import add_arguments, config_from_args
from jetrl_compile.rl.loop import evaluate, train


def make_parser() -> CommandLineParser:
    parser = CommandLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error in the flags, data, "
                        "checkpoint or --out (they print one 'error:' line and exit 2 otherwise)")
    parser.add_argument("--verbose", action="store_true", help="show every library's log records and warnings "
                        "(vLLM's and transformers' INFO records and known-harmless warnings are hidden otherwise)")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    with command_line_errors(args.debug):  # every setting is checked before anything heavy loads
        run(config_from_args(args))


def run(cfg):
    if cfg.eval:
        print(json.dumps(evaluate(cfg), indent=2))
        return

    metrics = train(cfg)
    if metrics:
        first, last = metrics[0], metrics[-1]
        print(f"steps {first['step']}..{last['step']}: reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}, "
              f"accuracy {first['accuracy']:.2f} -> {last['accuracy']:.2f}, mismatch k3 KL {last['mismatch_kl']:.2e}; "
              f"metrics and plot in {cfg.out}")


if __name__ == "__main__":
    # the program's console, set before anything logs (tests call main() and keep their own)
    quiet_console(verbose="--verbose" in sys.argv[1:])
    sys.exit(main())
