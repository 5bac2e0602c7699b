"""Rollout/trainer mismatch of each precision flow on the default model (SmolLM2-135M).

For every flow: build the trainer (``unify`` with the flow's recipe, parameters in the flow's
dtype), start the flow's engine (vLLM on the trainer's export, or ``HfEngine``: the trainer's own
model decoding with its KV cache), sample ``n`` completions for each prompt, recompute the
sampled tokens' logprobs with the trainer and report ``mismatch_metrics`` and the seconds that
sampling and recomputing took. Every flow sees the same prompts and sampling seeds. One
subprocess per flow (one in-process vLLM per process).

A flow is ``recipe:trainer_dtype:engine_dtype:trainer_mode[:engine]``, engine ``vllm`` (default),
``vllm-compiled`` (vLLM's compiled model, ``enforce_eager=False``), ``hf``, ``vllm-exact`` or
``hf-exact`` (exact mode: ``unify(..., exact=True)``, the engine in the trainer's dtype).

    python bench/mismatch.py                # the standard flows, >= 2000 sampled tokens each
    python bench/mismatch.py --flows fp8_fwd_bf16_bwd:float32:float32:eager
    python bench/mismatch.py --flows $(python bench/mismatch.py --list-exact) --result mismatch_exact
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, report, run_in_subprocess, table, write_result  # noqa: E402

# recipe : trainer parameter dtype : vLLM dtype : trainer mode
FLOWS = [
    "bf16:float32:float32:eager",
    "fp8_fwd_bf16_bwd:float32:float32:eager",
    "fp8_rollout_only:float32:float32:eager",
    "fp8_fwd_bf16_bwd:float32:bfloat16:eager",
    "fp8_fwd_bf16_bwd:bfloat16:bfloat16:eager",
    "bf16:bfloat16:bfloat16:eager",
    "fp8_fwd_bf16_bwd:float32:float32:compile",
]
# per engine: today's unified flow, then exact mode for each on-policy recipe
EXACT_FLOWS = [
    flow
    for engine in ("vllm", "hf")
    for flow in (
        f"fp8_fwd_bf16_bwd:float32:float32:eager:{engine}",
        f"fp8_fwd_bf16_bwd:float32:float32:eager:{engine}-exact",
        f"bf16:float32:float32:eager:{engine}-exact",
        f"jetrl:float32:float32:eager:{engine}-exact",
        f"fp8_fwd_bf16_bwd:bfloat16:bfloat16:eager:{engine}-exact",
    )
]


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    from jetrl_compile.rl.tasks import ArithmeticTask

    task = ArithmeticTask(seed=1234)
    return [task.prompt_ids(tokenizer, task.sample()) for _ in range(count)]


def run_flow(spec: str, args) -> dict:
    import torch

    import jetrl_compile
    from jetrl_compile.models import load_model
    from jetrl_compile.rl.mismatch import rollout_mismatch
    from jetrl_compile.rollout.engines import HfEngine, VllmEngine

    recipe, trainer_dtype, engine_dtype, mode, engine_name = _parse(spec)
    model, tok = load_model(dtype=getattr(torch, trainer_dtype))
    jetrl_compile.unify(model, recipe, mode=mode, dynamic=True if mode == "compile" else None,
                        exact=engine_name.endswith("-exact"))
    if engine_name.startswith("vllm"):
        engine = VllmEngine(model, tokenizer=tok, workdir=tempfile.mkdtemp(prefix="jetrl-mismatch-"),
                            dtype=getattr(torch, engine_dtype), max_model_len=1024,
                            enforce_eager=engine_name != "vllm-compiled")
    else:
        engine = HfEngine(model, tokenizer=tok)
    start = time.perf_counter()
    metrics = rollout_mismatch(model, engine, prompts_for(tok, args.prompts), n=args.n,
                               max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id or 0, seed=7)
    metrics["seconds"] = time.perf_counter() - start
    return metrics


ENGINES = ("vllm", "vllm-compiled", "hf", "vllm-exact", "hf-exact")


def _parse(spec: str) -> tuple[str, str, str, str, str]:
    parts = spec.split(":")
    if len(parts) == 4:
        parts.append("vllm")
    if len(parts) != 5 or parts[4] not in ENGINES:
        raise SystemExit(f"flow {spec!r}: expected recipe:trainer_dtype:engine_dtype:mode[:{'|'.join(ENGINES)}]")
    return tuple(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flows", nargs="*", default=FLOWS, help="recipe:trainer_dtype:engine_dtype:mode")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--result", default="mismatch", help="name of the table under bench/results/")
    parser.add_argument("--list-exact", action="store_true", help="print the exact-mode flows and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list_exact:
        print(" ".join(EXACT_FLOWS))
        return
    if args.worker:
        report(run_flow(args.worker, args))
        return

    rows, results = [], {}
    sizes = ["--prompts", str(args.prompts), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
             "--result", args.result]
    for spec in args.flows:
        m = results[spec] = run_in_subprocess(__file__, spec, sizes)
        recipe, tdt, edt, mode, engine = _parse(spec)
        rows.append([f"`{recipe}`", tdt, engine, edt, mode, m["tokens"], f"{m['mismatch_kl']:.5f}",
                     f"{m['logprob_abs_diff_mean']:.4f}", f"{m['logprob_abs_diff_max']:.3g}",
                     f"{m['ratio_outside_frac']:.4f}", f"{m['seconds']:.0f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    body = table(["recipe", "trainer params", "engine", "engine dtype", "trainer mode", "tokens", "k3 KL",
                  "mean abs dlogp", "max abs dlogp", "ratio outside [0.5, 2]", "sample + recompute s"], rows)
    unified, off = results.get(FLOWS[1]), results.get(FLOWS[2])
    if unified and off:
        body += (f"\n\nUnified FP8 flow vs `fp8_rollout_only` (both FP32 trainer, FP32 vLLM): k3 KL "
                 f"{off['mismatch_kl'] / max(unified['mismatch_kl'], 1e-12):.1f}x lower, mean abs dlogp "
                 f"{off['logprob_abs_diff_mean'] / max(unified['logprob_abs_diff_mean'], 1e-12):.1f}x lower.")
    write_result(args.result, command_line(__file__), body)


if __name__ == "__main__":
    main()
