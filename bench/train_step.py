"""One training step (forward + backward + AdamW) of the default model, per recipe, compiled.

SmolLM2-135M-Instruct with FP32 master weights, batch 8 x 256 tokens by default. Every recipe
runs through ``unify`` (the ``bf16`` row is the same flow with BF16 GEMMs), steps are interleaved
across recipes so that machine noise hits all alike, and the table reports medians and the ratio
to BF16. Memory: bytes saved for backward per step (activations, read through
``saved_tensors_hooks``) and the bytes of the GEMM weight copies (BF16 copies; FP8 payload +
scales, plus on CPU the BF16 dequantization the emulated GEMM reads).

    python bench/train_step.py                     # 8 x 256, 3 timed steps per recipe
    python bench/train_step.py --batch 2 --seq 64  # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, table, write_result  # noqa: E402

import jetrl_compile  # noqa: E402
from jetrl_compile.models import load_model  # noqa: E402

RECIPES = ("bf16", "fp8_fwd_bf16_bwd", "jetrl")


class SavedBytes:
    """Counts the bytes autograd saves for backward inside the context."""

    def __init__(self):
        self.total = 0

    def pack(self, t):
        self.total += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self.total = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def gemm_weight_bytes(model) -> int:
    cache = jetrl_compile.unified_state(model).cache
    if len(cache):
        return cache.nbytes()
    return sum(
        m.weight.numel() * 2 for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per recipe (after one warm-up step)")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--result", default="train_step", help="name of the table under bench/results/")
    args = parser.parse_args(argv)
    recipes = args.recipes.split(",")

    base, _ = load_model(dtype=torch.float32)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    runs = {}
    for recipe in recipes:
        model, _ = load_model(dtype=torch.float32) if recipe != recipes[0] else (base, None)
        model.load_state_dict(state)
        jetrl_compile.unify(model, recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        t0 = time.perf_counter()
        saved = SavedBytes()
        with saved:
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        runs[recipe] = {"model": model, "opt": opt, "times": [], "compile_s": time.perf_counter() - t0,
                        "saved": saved.total, "weights": gemm_weight_bytes(model)}
        print(f"{recipe}: first step (compile) {runs[recipe]['compile_s']:.1f} s", flush=True)

    for step in range(args.steps):
        for recipe in recipes:
            r = runs[recipe]
            t0 = time.perf_counter()
            r["model"](ids, labels=ids).loss.backward()
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            r["times"].append(time.perf_counter() - t0)
        print(f"step {step}: " + ", ".join(f"{k} {runs[k]['times'][-1]:.2f}s" for k in recipes), flush=True)

    base_t = statistics.median(runs["bf16"]["times"]) if "bf16" in runs else None
    rows = []
    for recipe in recipes:
        r = runs[recipe]
        med = statistics.median(r["times"])
        rows.append([
            recipe, f"{med:.2f}", f"{med / base_t:.2f}x" if base_t else "-",
            f"{r['saved'] / 2**20:.0f}", f"{r['weights'] / 2**20:.1f}", f"{r['compile_s']:.0f}",
        ])
    body = table(
        ["recipe", "step s (median)", "vs bf16", "saved for backward MiB", "GEMM weights MiB",
         "first step s (compile)"],
        rows,
    )
    body += (
        f"\n\nSmolLM2-135M-Instruct, FP32 master weights, batch {args.batch} x {args.seq} tokens, AdamW, "
        f"{args.steps} timed steps per recipe, interleaved. Target: fp8_fwd_bf16_bwd within 1.3x of bf16."
    )
    write_result(args.result, command_line(__file__, argv), body)


if __name__ == "__main__":
    main()
