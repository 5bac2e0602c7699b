"""Rollout throughput on the default model (SmolLM2-135M): 32 prompts x 128 new tokens.

Engines, each in its own process (one in-process vLLM per process), same prompts and seeds:

- ``vllm-bf16``: plain vLLM on a BF16 checkpoint (vLLM's own unquantized linears);
- ``vllm-jetrl-fp8``: vLLM with our plugin on a BF16 trainer's export (the trainer's W8A8 op);
- ``vllm-jetrl-fp8-fp32``: the same for an FP32-master trainer (non-GEMM ops in FP32, the flow
  the GRPO driver runs), plus the time of one ``sync``;
- ``vllm-native-fp8``: vLLM's own block-FP8 method on the native export (W8A16 on CPU);
- ``hf-bf16`` / ``hf-jetrl-fp8``: transformers ``generate`` on the plain and the unified model;
- a ``jetrl`` engine name ending in ``-exact`` runs exact mode (``unify(..., exact=True)``),
  ``-fp32`` in it an FP32-master trainer (exact mode runs the engine in the trainer's dtype),
  ``-mp`` in it vLLM's engine core in a process of its own (``in_process=False``: sync
  through the export folder and ``collective_rpc``), ``-compiled`` in it vLLM's compiled model
  (``enforce_eager=False``; start-up then includes the compile).

Tokens/s counts the tokens actually generated (EOS ends a completion early), median of
``--reps`` runs after one warm-up.

    python bench/rollout.py
    python bench/rollout.py --engines $(python bench/rollout.py --list-exact) --result rollout_exact
    python bench/rollout.py --engines vllm-jetrl-fp8-fp32 vllm-jetrl-fp8-fp32-mp --result rollout_sync
    python bench/rollout.py --engines vllm-jetrl-fp8-fp32 vllm-jetrl-fp8-fp32-compiled --result rollout_compiled
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, report, run_in_subprocess, table, write_result  # noqa: E402

ENGINES = ["vllm-bf16", "vllm-jetrl-fp8", "vllm-jetrl-fp8-fp32", "vllm-native-fp8", "hf-bf16", "hf-jetrl-fp8"]
EXACT_ENGINES = ["vllm-jetrl-fp8-fp32", "vllm-jetrl-fp8-fp32-exact", "hf-jetrl-fp8-fp32", "hf-jetrl-fp8-fp32-exact"]


def build(name: str, workdir: Path):
    """(engine with .generate, model or None)."""
    import torch

    import jetrl_compile
    from jetrl_compile.models import load_model
    from jetrl_compile.rollout.engines import HfEngine, VllmEngine
    from jetrl_compile.rollout.export import export_vllm

    parts = name.split("-")
    dtype = torch.float32 if "fp32" in parts else torch.bfloat16
    exact = "exact" in parts
    model, tok = load_model(dtype=dtype)
    if name == "hf-bf16":
        return HfEngine(jetrl_compile.unify(model, "bf16", mode="eager")), None, tok
    if name.startswith("hf-jetrl-fp8"):
        return HfEngine(jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", mode="eager", exact=exact)), None, tok
    if name.startswith("vllm-jetrl"):
        jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", mode="eager", exact=exact)
        engine = VllmEngine(model, tokenizer=tok, workdir=workdir, max_model_len=512, in_process="mp" not in parts,
                            enforce_eager="compiled" not in parts)
        return engine, model, tok
    # plain vLLM on a BF16 or native-FP8 checkpoint, behind the same generate()
    if name == "vllm-bf16":
        model.save_pretrained(workdir / "ckpt")
        tok.save_pretrained(workdir / "ckpt")
    else:
        export_vllm(model, workdir / "ckpt", tokenizer=tok, recipe="fp8_rollout_only", format="fp8")
    return _PlainVllm(workdir / "ckpt", model.config.eos_token_id), None, tok


class _PlainVllm:
    def __init__(self, path, eos):
        from vllm import LLM

        self.eos = eos
        self.llm = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0,
                       max_num_batched_tokens=16384)

    def generate(self, prompts, *, n, max_new_tokens, seed):
        from vllm import SamplingParams

        params = [SamplingParams(n=n, max_tokens=max_new_tokens, logprobs=0, seed=seed + i, detokenize=False)
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[o for o in out.outputs] for out in outs]


def measure(name: str, args) -> dict:
    from jetrl_compile.rl.tasks import ArithmeticTask

    workdir = Path(tempfile.mkdtemp(prefix="jetrl-bench-rollout-"))
    start = time.perf_counter()
    try:
        engine, model, tok = build(name, workdir)
    except Exception as e:  # noqa: BLE001 - report why a path cannot run here instead of dying
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    start_s = time.perf_counter() - start
    task = ArithmeticTask(seed=99)
    prompts = [task.prompt_ids(tok, task.sample()) for _ in range(args.prompts)]
    times, tokens = [], []
    for rep in range(args.reps + 1):
        start = time.perf_counter()
        groups = engine.generate(prompts, n=1, max_new_tokens=args.max_new_tokens, seed=rep)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(c.token_ids) for g in groups for c in g))
    # the first run warms up (the fused quantize's first-use compiles included): timed apart
    result = {"tokens_per_s": statistics.median(t / s for t, s in zip(tokens[1:], times[1:])),
              "tokens": statistics.median(tokens[1:]), "start_s": start_s, "first_s": times[0]}
    if model is not None:
        syncs = []
        for _ in range(args.reps):
            syncs.append(engine.sync(model))
        result["sync_s"] = statistics.median(syncs)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="*", default=ENGINES)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--result", default="rollout", help="name of the table under bench/results/")
    parser.add_argument("--list-exact", action="store_true", help="print exact mode's engines beside today's and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list_exact:
        print(" ".join(EXACT_ENGINES))
        return
    sizes = ["--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--reps", str(args.reps)]
    if args.worker:
        report(measure(args.worker, args))
        return
    results = {name: run_in_subprocess(__file__, name, sizes) for name in args.engines}
    first = args.engines[0]
    base = results[first].get("tokens_per_s")
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "n/a", "", "", "", "", r["error"]])
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        sync = f"{r['sync_s']:.2f}" if "sync_s" in r else ""
        rows.append([name, f"{r['tokens_per_s']:.0f}", ratio, sync, f"{r['start_s']:.0f}", f"{r['first_s']:.1f}",
                     f"{r['tokens']:.0f} tokens/run"])
    body = table(["engine", "tokens/s (median)", f"vs {first}", "sync s (median)", "start s", "first run s", "notes"],
                 rows)
    body += (f"\n\n{args.prompts} prompts x up to {args.max_new_tokens} new tokens, n=1, median of {args.reps} runs "
             f"after a warm-up; vLLM eager (enforce_eager) unless the name says -compiled. Start: loading the "
             f"model, unify, export and the engine's start-up (a compiled engine's compile included). First run: the "
             f"warm-up generate, which compiles the plugin's fused quantize on first use.")
    write_result(args.result, command_line(__file__), body)


if __name__ == "__main__":
    main()
