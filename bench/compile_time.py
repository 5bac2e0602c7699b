"""Compile time of ``unify``: regional (the default) vs the whole model, cold and warm, by depth.

Each measurement runs in a fresh process on a random Llama with SmolLM2-135M's shapes and 2, 8 or
30 decoder layers (30 is the default model's depth), FP32 master weights, batch x seq tokens:

- cold: the first training step (forward + backward + AdamW) with an empty Inductor cache (its
  own ``TORCHINDUCTOR_CACHE_DIR``: FX graph and AOTAutograd caches, compiled C++ kernels);
- warm: the same in a second process that finds that cache filled;
- then the compiled step's median against the same recipe in eager mode (``mode="eager"``),
  steps interleaved.

The first step's own compute is part of "first step"; the step median says how much.

    python bench/compile_time.py                                  # regional 2/8/30, whole 2/8
    python bench/compile_time.py --layers 2,8 --recipes jetrl     # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, run_in_subprocess, table, write_result  # noqa: E402

RECIPES = ("fp8_fwd_bf16_bwd", "jetrl")
# the default model's shapes (SmolLM2-135M-Instruct has 30 such layers)
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)


def worker(spec: dict) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import jetrl_compile

    config = LlamaConfig(num_hidden_layers=spec["layers"], use_cache=False, **SMOLLM2_135M)
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(0))

    def build(mode: str):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        jetrl_compile.unify(model, spec["recipe"], mode=mode, regional=spec["regional"], dynamic=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, step

    compiled, compiled_step = build("compile")
    t0 = time.perf_counter()
    compiled_step()
    first = time.perf_counter() - t0
    _, eager_step = build("eager")
    eager_step()
    times = {"compile": [], "eager": []}
    for _ in range(spec["steps"]):
        for mode, step in (("compile", compiled_step), ("eager", eager_step)):
            t0 = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - t0)
    return {
        "first_step_s": first,
        "graphs": jetrl_compile.unified_state(compiled).compiles,
        "step_s": statistics.median(times["compile"]),
        "eager_step_s": statistics.median(times["eager"]),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,8,30", help="depths to compile regionally")
    parser.add_argument("--whole-layers", default="2,8", help="depths to compile as one graph too ('' for none)")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, interleaved")
    parser.add_argument("--result", default="compile_time", help="name of the table under bench/results/")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    cases = [(r, int(n), True) for r in args.recipes.split(",") for n in args.layers.split(",")]
    cases += [(r, int(n), False) for r in args.recipes.split(",") for n in filter(None, args.whole_layers.split(","))]
    rows = []
    for recipe, layers, regional in cases:
        spec = dict(recipe=recipe, layers=layers, regional=regional, batch=args.batch, seq=args.seq, steps=args.steps)
        with tempfile.TemporaryDirectory(prefix="jetrl-inductor-") as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                   "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
            cold = run_in_subprocess(__file__, json.dumps(spec), [], env=env)
            warm = run_in_subprocess(__file__, json.dumps(spec), [], env=env)
        step = statistics.median([cold["step_s"], warm["step_s"]])
        eager = statistics.median([cold["eager_step_s"], warm["eager_step_s"]])
        rows.append([
            recipe, "regional" if regional else "whole model", layers, cold["graphs"],
            f"{cold['first_step_s']:.1f}", f"{warm['first_step_s']:.1f}", f"{step:.2f}", f"{step / eager:.2f}x",
        ])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    body = table(
        ["recipe", "compiled", "layers", "graphs", "first step s, cold", "first step s, warm", "step s (median)",
         "compiled / eager step"],
        rows,
    )
    body += (
        f"\n\nRandom Llama with SmolLM2-135M's shapes, FP32 master weights, batch {args.batch} x {args.seq} tokens, "
        f"AdamW, dynamic=True, no KV cache (as the trainer runs). Cold: empty Inductor cache; warm: a second "
        f"process with that cache. Step medians over {args.steps} interleaved steps per mode, in each of the two "
        "processes (median of the two)."
    )
    write_result(args.result, command_line(__file__, argv), body)


if __name__ == "__main__":
    main()
