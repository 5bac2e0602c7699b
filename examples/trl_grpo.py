"""GRPO with TRL's GRPOTrainer on the unified flow: a plain TRL script with two changes.

    python examples/trl_grpo.py                                # SmolLM2-135M, arithmetic, colocated vLLM
    python examples/trl_grpo.py --generation transformers      # TRL's generate on the unified model
    python examples/trl_grpo.py --recipe fp8_rollout_only      # the off-policy baseline, for its mismatch
    python examples/trl_grpo.py --exact                        # exact mode: the engine is the trainer's function

The two changes to a TRL script are marked "jetrl" below: ``jetrl_compile.unify(model)``, and
``UnifiedGRPOTrainer`` where the script had ``GRPOTrainer``. TRL logs its usual metrics each step;
with vLLM generation, ``sampling/sampling_logp_difference/mean`` is the rollout/trainer mismatch
(per-token |logprob difference|). Writes TRL's output to --out (trainer_state.json holds every
logged step; TensorBoard events with --report-to tensorboard).
"""

import argparse
import os
import statistics
import sys
import warnings

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine lives in this process
# TRL 1.16 names vLLM 0.31 as the newest it knows; it uses none of vLLM here (our engine samples)
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")

import torch  # noqa: E402

import jetrl_compile  # noqa: E402
from jetrl_compile.console import quiet_console  # noqa: E402
from jetrl_compile.errors import command_line_errors  # noqa: E402
from jetrl_compile.recipes import RECIPES  # noqa: E402

MISMATCH = "sampling/sampling_logp_difference/mean"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="HF causal LM folder or hub name (default: embedded SmolLM2-135M)")
    parser.add_argument("--recipe", default="fp8_fwd_bf16_bwd", choices=sorted(RECIPES))
    parser.add_argument("--mode", default="eager", choices=["eager", "compile"],
                        help="eager: each linear calls the FP8 op (no compile wait); compile: torch.compile, our pass")
    parser.add_argument("--exact", action="store_true",
                        help="exact mode: vLLM computes the trainer's function bit for bit (eager only)")
    parser.add_argument("--generation", default="vllm", choices=["vllm", "transformers"],
                        help="vllm: TRL's colocated path on our FP8 engine; transformers: TRL's generate on the model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/trl-grpo")
    parser.add_argument("--report-to", default="none", choices=["none", "tensorboard"])
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--verbose", action="store_true", help="show every library's log records and warnings")
    args = parser.parse_args(argv)
    with command_line_errors(args.debug):
        run(args)


def run(args):
    from datasets import Dataset
    from trl import GRPOConfig

    from jetrl_compile.integrations.trl import UnifiedGRPOTrainer  # jetrl: the trainer
    from jetrl_compile.models import DEFAULT_MODEL, load_model
    from jetrl_compile.rl.tasks import ArithmeticTask, answer_reward, conversational_rows

    model, tokenizer = load_model(args.model or DEFAULT_MODEL, dtype=torch.float32)  # FP32 master weights
    model = jetrl_compile.unify(model, recipe=args.recipe, mode=args.mode, dynamic=True,  # jetrl: one precision flow
                                exact=args.exact)

    dataset = Dataset.from_list(conversational_rows(ArithmeticTask(seed=args.seed), args.batch_size * args.steps))

    config = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, learning_rate=args.lr, seed=args.seed,
        per_device_train_batch_size=args.batch_size * args.group_size, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, beta=0.0,
        bf16=False,  # the recipe sets the precision (TRL's default would autocast to BF16)
        use_vllm=args.generation == "vllm", vllm_mode="colocate",
        logging_steps=1, report_to=[] if args.report_to == "none" else [args.report_to], save_strategy="no",
    )
    trainer = UnifiedGRPOTrainer(model=model, reward_funcs=[answer_reward], args=config,
                                 train_dataset=dataset, processing_class=tokenizer)
    try:
        trainer.train()
    finally:
        trainer.close()
    trainer.save_state()

    steps = [h for h in trainer.state.log_history if "reward" in h]
    line = f"{len(steps)} steps: reward {steps[0]['reward']:.3f} -> {steps[-1]['reward']:.3f}"
    if MISMATCH in steps[0]:
        line += f", median rollout/trainer |logprob difference| {statistics.median(s[MISMATCH] for s in steps):.2e}"
    print(f"{line}; TRL's log in {args.out}/trainer_state.json")


if __name__ == "__main__":
    # the program's console, set before anything logs (tests call main() and keep their own)
    quiet_console(verbose="--verbose" in sys.argv[1:])
    sys.exit(main())
