"""The peer: TRL's GRPOTrainer on the same model, task and step shape, timed per step.

TRL comes with the project's ``trl`` extra (``make venv`` installs it):

    python bench/trl_peer.py                 # 8 prompts x 8 completions x 32 tokens, 4 steps
    python bench/e2e.py --recipes bf16 fp8_fwd_bf16_bwd   # ours, same shape

SmolLM2-135M in BF16 weights (TRL's usual CPU setup), our arithmetic prompts and reward, no KL
term, one update per batch; the median step time over steps 2..N is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, table, write_result  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-6)
    args = parser.parse_args()
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"bench/trl_peer.py needs TRL ({e}): make venv, or pip install -e '.[trl]'") from e
    import torch

    from jetrl_compile.models import load_model
    from jetrl_compile.rl.tasks import ArithmeticTask, answer_reward, conversational_rows

    model, tok = load_model(dtype=torch.bfloat16)
    data = Dataset.from_list(conversational_rows(ArithmeticTask(seed=0), args.batch_size * args.steps))

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.rewards = [], []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    timer = StepTimer()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-peer-"), max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size * args.group_size, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, beta=0.0, logging_steps=1, report_to=[],
        use_cpu=True, bf16=False, save_strategy="no", seed=0,
    )
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[answer_reward], args=config,
                          train_dataset=data, callbacks=[timer])
    trainer.train()
    timed = timer.times[1:] or timer.times
    body = table(["peer", "step s (median, steps 2..N)", "first step s", "reward per step"], [[
        "TRL 1.16 GRPOTrainer (BF16 weights, HF generate)", f"{statistics.median(timed):.1f}", f"{timer.times[0]:.1f}",
        " ".join(f"{r:.3f}" for r in timer.rewards)]])
    body += (f"\n\n{args.batch_size} prompts x {args.group_size} completions x up to {args.max_new_tokens} "
             f"tokens per step, SmolLM2-135M, lr {args.lr}, {args.steps} steps.")
    write_result("trl_peer", command_line(__file__), body)


if __name__ == "__main__":
    main()
