"""The GPU run: our FP8 kernel against the CPU emulation, then FP8 vs BF16 speed, rollout, mismatch.

Run through ``bench/gpu.sh`` (which checks for CUDA first and sets the import path). Sections, in
order, each guarded so that one failure is reported and the rest still run:

1. ``kernels``: the quantizer on CUDA is bitwise the CPU quantizer; the emulated GEMM on CUDA
   matches the CPU emulation within summation-order error; our Triton FP8 kernel (the default on
   sm89+) computes the GEMM definition in the fprop, dgrad and wgrad layouts (within BF16 rounding
   plus summation-order error of the float64 product), and gives every row the same bits whatever
   the batch; cuBLAS blockwise ``scaled_mm`` on sm90, for comparison. Only if the Triton kernel
   passes every layout do the later sections use it; otherwise they time the emulation and say so.
2. ``linear``: the default model's (SmolLM2-135M) and an 8B model's linear shapes at 4096 tokens:
   BF16 ``F.linear`` vs the recipe op, forward, and forward+backward per recipe. The activation
   quantize runs as one fused kernel; the weight is quantized once outside the timed region, as
   the weight cache does once per optimizer step.
3. ``train_step``: a 1B-class Llama with random weights (no downloads), FP32 master weights,
   AdamW, one step per recipe through ``unify(mode="eager")``: median step time, ratio to BF16,
   peak memory, and the bytes of the rollout weight copies per recipe.
4. ``decode``: tokens/s of the unified model's own generation path (transformers ``generate``),
   BF16 vs FP8, on an 8B-class config with random BF16 weights.
5. ``rollout``: vLLM tokens/s on a random Llama: plain vLLM BF16, our plugin (the trainer's FP8
   op on the FP8 payloads), vLLM's own online ``fp8_per_block``. Needs vLLM (``pip install vllm``);
   reported as skipped where it cannot import.
6. ``mismatch``: k3 KL between the engine's and the trainer's logprobs of sampled tokens on the
   GPU (``HfEngine``, the trainer's own model; and vLLM in exact mode where it is installed), for
   ``fp8_fwd_bf16_bwd`` as is and in exact mode
   (no float64 on a GPU: the Triton FP8 kernel's batch invariance for the quantized linears and
   ``triton_invariant``'s fixed-order kernels for ``lm_head``, norms, attention and log-softmax).

Every section writes its markdown table to ``OUT/gpu.md`` as soon as it finishes (a run cut short
still leaves what it measured) and the raw numbers to ``OUT/gpu.json``.

    bash bench/gpu.sh /tmp/gpu-results           # on the GPU machine
    python bench/gpu.py --smoke --out /tmp/g     # CPU: tiny shapes, the Triton kernel under its interpreter
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

from jetrl_compile.runtime import (  # noqa: E402
    Quantized,
    dequantize,
    fp8_linear,
    invariant,
    kernels,  # noqa: E402
    quantize_blockwise,
    quantize_groupwise,
)

BF16 = torch.bfloat16
RECIPE_GEMMS = {  # recipe -> (fprop, dgrad, wgrad), as in jetrl_compile.recipes
    "bf16": ("bf16", "bf16", "bf16"),
    "fp8_fwd_bf16_bwd": ("fp8", "bf16", "bf16"),
    "jetrl": ("fp8", "fp8", "fp8"),
}
# (name, K in, N out) per model: fused qkv (GQA, 8 KV heads of 128), o_proj, fused gate_up, down.
SHAPES = {
    "SmolLM2-135M": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)],
    "8B": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
}
SMOKE_SHAPES = {"tiny": [("qkv", 256, 384), ("down", 512, 256)]}
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
LLAMA_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)
# What each section runs on the H200, and in a CPU smoke run of this script.
LLAMA_SMALL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000)
FULL = dict(kernel_mnk=[(200, 576, 1536), (4096, 4096, 14336)], linear_shapes=SHAPES, linear_tokens=[4096],
            reps=10, train_cfg=LLAMA_1B, train_batch_seq=(4, 2048), decode_cfg=LLAMA_8B,
            decode_batch_prompt_new=(32, 128, 64), decode_reps=3, rollout_cfg=LLAMA_1B,
            rollout_prompts_new_runs=(64, 256, 4), mismatch_cfg=LLAMA_SMALL, mismatch_prompts_new=(16, 4, 64))
# The smoke run's FP8 GEMMs run under Triton's interpreter (about 0.1 s a call): sizes are minimal.
SMOKE = dict(kernel_mnk=[(64, 256, 384)], linear_shapes=SMOKE_SHAPES, linear_tokens=[128], reps=1,
             train_cfg=LLAMA_TINY, train_batch_seq=(2, 32), decode_cfg=LLAMA_TINY,
             decode_batch_prompt_new=(2, 8, 2), decode_reps=1, rollout_cfg=LLAMA_TINY,
             rollout_prompts_new_runs=(2, 2, 2), mismatch_cfg=LLAMA_TINY, mismatch_prompts_new=(2, 2, 3))


class Report:
    """Collects each section's table and numbers; rewrites OUT/gpu.md and gpu.json after each."""

    def __init__(self, out: Path, header: str):
        self.out, self.parts, self.data = out, [header], {}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, markdown: str, data) -> None:
        self.parts.append(f"## {name}\n\n{markdown}\n")
        self.data[name] = data
        (self.out / "gpu.md").write_text("\n".join(self.parts))
        (self.out / "gpu.json").write_text(json.dumps(self.data, indent=1, default=str))
        print(f"\n## {name}\n\n{markdown}\n", flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_s(fn, device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def use_fp8_kernel(on: bool) -> None:
    """Our Triton FP8 kernel (on a CPU smoke run: under Triton's interpreter) or the emulation."""
    os.environ["JETRL_FP8_KERNEL"] = "triton" if on else "emulate"  # read at each GEMM


# ---------------------------------------------------------------- 1. kernels


def _same_bits(a, b) -> bool:
    (qa, sa), (qb, sb) = a, b
    return torch.equal(qa.cpu().view(torch.uint8), qb.cpu().view(torch.uint8)) and torch.equal(sa.cpu(), sb.cpu())


def _excess_over_tolerance(y: torch.Tensor, a, b) -> float:
    """max |y - ref| / tol, where ref is the float64 product of the dequantized operands and tol
    is BF16 output rounding plus float32 summation-order error. <= 1 passes."""
    da, db = dequantize(*a).double(), dequantize(*b).double()
    ref = da @ db.t()
    k = da.shape[1]
    tol = ref.abs() * 2.0**-8 + k * 2.0**-24 * (da.abs() @ db.abs().t()) + 1e-30
    return float(((y.double() - ref).abs() / tol).max())


def _rows_invariant(a, b) -> bool:
    """Whether rows of the FP8 GEMM are the same bits alone, in a slice, and in the whole batch."""
    full = kernels.fp8_gemm(a, b)
    m = a.data.shape[0]
    picks = [slice(0, 1), slice(m // 2, m // 2 + 1), slice(m // 3, m // 3 + 64), slice(m - 1, m)]
    return all(torch.equal(kernels.fp8_gemm(Quantized(a.data[r], a.scale[r]), b), full[r]) for r in picks)


def check_kernels(device, shapes, report: Report) -> bool:
    """Returns whether our Triton FP8 kernel passed every layout (and so may be used later)."""
    rows, data, fp8_ok = [], [], True
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    for m, k, n in shapes:
        g = torch.Generator().manual_seed(m + k + n)
        x = torch.randn(m, k, generator=g).to(BF16)
        w = torch.randn(n, k, generator=g) * k**-0.5
        dy = torch.randn(m, n, generator=g).to(BF16)
        a_cpu, b_cpu = quantize_groupwise(x), quantize_blockwise(w)
        a_dev, b_dev = quantize_groupwise(x.to(device)), quantize_blockwise(w.to(device))
        quant_same = _same_bits(a_cpu, a_dev) and _same_bits(b_cpu, b_dev)
        use_fp8_kernel(False)
        y_cpu = kernels.fp8_gemm(a_cpu, b_cpu).double()
        y_emu = kernels.fp8_gemm(a_dev, b_dev).cpu().double()
        emu_vs_cpu = _excess_over_tolerance(y_emu, a_cpu, b_cpu)
        emu_bitwise = bool(torch.equal(y_emu, y_cpu))
        layouts = {  # (a, b) operands of fp8_gemm as fp8_linear builds them
            "fprop": (a_dev, b_dev),
            "dgrad": (quantize_groupwise(dy.to(device)), Quantized(b_dev.data.t(), b_dev.scale.t())),
            "wgrad": (quantize_groupwise(dy.to(device).t()), quantize_groupwise(x.to(device).t())),
        }
        results, invariant, cublas = {}, None, "sm90 only"
        use_fp8_kernel(True)
        try:
            for name, (a, b) in layouts.items():
                try:
                    excess = _excess_over_tolerance(kernels.fp8_gemm(a, b).cpu(), a, b)
                    results[name] = f"{excess:.2f} ({'ok' if excess <= 1 else 'FAIL'})"
                    fp8_ok &= excess <= 1
                except Exception as e:  # the message is the finding
                    results[name] = f"error: {str(e).splitlines()[0][:120]}"
                    fp8_ok = False
            invariant = _rows_invariant(a_dev, b_dev)
            fp8_ok &= invariant
        except Exception as e:  # noqa: BLE001
            invariant, fp8_ok = f"error: {str(e).splitlines()[0][:120]}", False
        if sm90 and kernels._scaled_mm_fits(a_dev.data, b_dev):
            os.environ["JETRL_FP8_KERNEL"] = "scaled_mm"
            try:
                cublas = f"{_excess_over_tolerance(kernels.fp8_gemm(a_dev, b_dev).cpu(), a_dev, b_dev):.2f}"
            except Exception as e:  # noqa: BLE001
                cublas = f"error: {str(e).splitlines()[0][:120]}"
        elif sm90:
            cublas = "shape not multiple of 128"
        use_fp8_kernel(True)
        name = kernels.kernel_name(device)
        use_fp8_kernel(False)
        rows.append([f"{m}x{k}x{n}", "yes" if quant_same else "NO", f"{emu_vs_cpu:.2f}",
                     "yes" if emu_bitwise else "no", results["fprop"], results["dgrad"], results["wgrad"],
                     {True: "yes", False: "NO"}.get(invariant, invariant), cublas])
        data.append({"mnk": [m, k, n], "quantizer_bitwise": quant_same, "emulation_excess": emu_vs_cpu,
                     "emulation_bitwise": emu_bitwise, "triton": results, "rows_invariant": invariant,
                     "scaled_mm": cublas})
    md = table(["M x K x N", "quantizer bitwise = CPU", "emulation error / tol", "emulation bitwise = CPU",
                "triton fprop error / tol", "dgrad", "wgrad", "rows batch-invariant", "cuBLAS scaled_mm fprop"],
               rows)
    md += ("\n\nerror / tol: max |y - ref| over (BF16 rounding + float32 summation-order bound), ref the "
           "float64 product of the dequantized operands; <= 1 passes. Batch-invariant: rows 0, M/2, M/3.., "
           f"M-1 computed alone equal the whole batch's bit for bit. FP8 GEMM below: {name} "
           f"if the kernel passed ({'yes' if fp8_ok else 'no: the emulation is timed'}).")
    report.add("kernels", md, {"shapes": data, "fp8_kernel_ok": fp8_ok})
    return fp8_ok


# ---------------------------------------------------------------- 2. linear


def bench_linear(device, shapes: dict, tokens: list[int], reps: int, report: Report, fp8_kernel: bool) -> None:
    def recipe_fn(fprop, dgrad, wgrad):
        def fn(x, w, q, s, deq):
            return fp8_linear(x, w, None, q, s, deq, fprop=fprop, dgrad=dgrad, wgrad=wgrad)
        return fn

    use_fp8_kernel(fp8_kernel)
    rows, data = [], []
    for model, layer_shapes in shapes.items():
        for name, k, n in layer_shapes:
            w = (torch.randn(n, k, device=device) * k**-0.5).to(BF16).requires_grad_()
            q, s = quantize_blockwise(w.detach())
            deq = dequantize(q, s) if kernels.uses_emulation(device) else None
            for m in tokens:
                x = torch.randn(m, k, device=device).to(BF16).requires_grad_()
                dy = torch.randn(m, n, device=device).to(BF16)

                def fwd_bf16():
                    with torch.no_grad():
                        F.linear(x, w)

                def fwd_fp8():
                    with torch.no_grad():
                        kernels.fp8_gemm_quantizing(x, Quantized(q, s), b_dequantized=deq)

                def fwd_bwd(recipe):
                    f = recipe_fn(*RECIPE_GEMMS[recipe])

                    def run():
                        f(x, w, q, s, deq).backward(dy)
                        x.grad = w.grad = None
                    return run

                warm = min(2, reps)
                t = {"bf16 fwd": median_s(fwd_bf16, device, reps, warm),
                     "fp8 fwd": median_s(fwd_fp8, device, reps, warm)}
                for recipe in RECIPE_GEMMS:
                    t[f"{recipe} fwd+bwd"] = median_s(fwd_bwd(recipe), device, reps, warm)
                flops = 2 * m * k * n
                rows.append([model, f"{name} {k}->{n}", m, f"{t['bf16 fwd'] * 1e3:.3f}",
                             f"{flops / t['bf16 fwd'] / 1e12:.0f}", f"{t['bf16 fwd'] / t['fp8 fwd']:.2f}x",
                             f"{t['bf16 fwd+bwd'] / t['fp8_fwd_bf16_bwd fwd+bwd']:.2f}x",
                             f"{t['bf16 fwd+bwd'] / t['jetrl fwd+bwd']:.2f}x"])
                data.append({"model": model, "layer": name, "k": k, "n": n, "tokens": m, "seconds": t})
                print(rows[-1], flush=True)
            del w, q, s, deq
    md = table(["model", "linear", "tokens", "BF16 fwd ms", "BF16 TFLOP/s", "FP8 fwd speedup",
                "fp8_fwd_bf16_bwd fwd+bwd speedup", "jetrl fwd+bwd speedup"], rows)
    md += (f"\n\nSpeedup = BF16 time / FP8 time (higher is better), medians of {reps} runs. FP8 GEMM: "
           f"{kernels.kernel_name(device)}; activation quantize fused, weight quantized once outside the "
           "timed region. Target: FP8 forward >= 1.6x BF16 on the 8B shapes at 4096+ tokens.")
    report.add("linear", md, data)


# ---------------------------------------------------------------- 3. train step


def _llama(cfg: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**cfg, max_position_embeddings=8192, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


def bench_train_step(device, cfg: dict, batch: int, seq: int, steps: int, report: Report, fp8_kernel: bool) -> None:
    import jetrl_compile

    use_fp8_kernel(fp8_kernel)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)
    rows, data, base = [], {}, None
    for recipe in RECIPE_GEMMS:
        model = _llama(cfg, device, torch.float32)
        jetrl_compile.unify(model, recipe, mode="eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def step():
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = median_s(step, device, steps, warmup=1)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        cache = jetrl_compile.unified_state(model).cache
        weights = cache.nbytes() if len(cache) else sum(
            m.weight.numel() * 2 for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and "lm_head" not in n)
        base = base or t
        rows.append([recipe, f"{t:.3f}", f"{base / t:.2f}x", f"{batch * seq / t:.0f}", f"{peak:.1f}",
                     f"{weights / 2**20:.0f}"])
        data[recipe] = {"step_s": t, "peak_gib": peak, "gemm_weight_bytes": weights}
        print(rows[-1], flush=True)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    md = table(["recipe", "step s", "speedup vs bf16", "tokens/s", "peak GiB", "GEMM weight copies MiB"], rows)
    md += (f"\n\nLlama config {cfg}, random weights, FP32 master weights, AdamW, batch "
           f"{batch} x {seq} tokens, unify(mode='eager'); medians of {steps} steps after one warm-up. FP8 GEMM: "
           f"{kernels.kernel_name(device)}. Target: jetrl step >= 1.3x BF16.")
    report.add("train_step", md, data)


# ---------------------------------------------------------------- 4. decode


def bench_decode(device, cfg: dict, batch: int, prompt: int, new_tokens: int, reps: int, report: Report,
                 fp8_kernel: bool) -> None:
    import jetrl_compile

    use_fp8_kernel(fp8_kernel)
    model = _llama(cfg, device, BF16)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, cfg["vocab_size"], (batch, prompt), device=device)
    rows, data, base = [], {}, None
    for recipe in ("bf16", "fp8_fwd_bf16_bwd"):
        jetrl_compile.unify(model, recipe, mode="eager")

        def gen():
            with torch.no_grad():
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

        t = median_s(gen, device, reps, warmup=1)
        tps = batch * new_tokens / t
        base = base or tps
        rows.append([recipe, f"{tps:.0f}", f"{tps / base:.2f}x"])
        data[recipe] = {"seconds": t, "tokens_per_s": tps}
        print(rows[-1], flush=True)
        jetrl_compile.restore(model)
    md = table(["recipe", "decode tokens/s", "speedup vs bf16"], rows)
    md += (f"\n\nLlama config {cfg}, random BF16 weights, transformers generate (greedy), batch {batch}, prompt "
           f"{prompt}, {new_tokens} new tokens, medians of {reps}. FP8 GEMM: {kernels.kernel_name(device)}. "
           "Eager generate: per-token Python and launch overhead bound what any GEMM can win here. "
           "Target: FP8 decode >= 1.3x BF16.")
    report.add("decode", md, data)


# ---------------------------------------------------------------- 5. rollout


def bench_rollout(device, cfg: dict, prompts: int, new_tokens: int, runs: int, report: Report,
                  fp8_kernel: bool) -> None:
    if importlib.util.find_spec("vllm") is None:
        report.add("rollout", "skipped: vLLM is not installed here (`pip install vllm`); nothing else measures "
                   "rollout through the plugin", None)
        return
    import tempfile

    import jetrl_compile
    from jetrl_compile.rollout.engines import VllmEngine, memory_share

    use_fp8_kernel(fp8_kernel)
    workdir = Path(tempfile.mkdtemp(prefix="jetrl-gpu-rollout-"))
    model = _llama(cfg, "cpu", BF16)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(workdir / "bf16")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, cfg["vocab_size"], (64,), generator=g).tolist() for _ in range(prompts)]

    def plain(quantization):
        from vllm import LLM

        from jetrl_compile.rollout import _vllm_compat

        # in this process, as our engine runs (on a CPU the KV cache is sized by VLLM_CPU_KVCACHE_SPACE)
        settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
        with _vllm_compat.environment(settings):
            return _VllmGenerate(LLM(model=str(workdir / "bf16"), dtype="bfloat16", enforce_eager=True, seed=0,
                                     max_model_len=512, quantization=quantization, skip_tokenizer_init=True,
                                     **memory_share(0.4)))

    def plugin():
        jetrl_compile.unify(model.to(device), "fp8_fwd_bf16_bwd", mode="eager")
        return VllmEngine(model, workdir=workdir / "plugin", max_model_len=512, gpu_memory=0.4)

    rows, data, base = [], {}, None
    for name, build in [("vLLM BF16", lambda: plain(None)), ("plugin (jetrl FP8)", plugin),
                        ("vLLM fp8_per_block", lambda: plain("fp8_per_block"))]:
        engine = None
        try:
            engine = build()
            times = []
            for rep in range(runs):
                sync(device)
                t0 = time.perf_counter()
                groups = engine.generate(ids, n=1, max_new_tokens=new_tokens, seed=rep)
                sync(device)
                times.append(time.perf_counter() - t0)
            tokens = sum(len(c.token_ids) for grp in groups for c in grp)
            tps = tokens / statistics.median(times[1:])  # the first run warms up
            base = base or tps
            rows.append([name, f"{tps:.0f}", f"{tps / base:.2f}x"])
            data[name] = {"tokens_per_s": tps}
        except Exception as e:  # noqa: BLE001 - one engine failing is a finding, not the end of the section
            rows.append([name, f"error: {str(e).splitlines()[0][:100]}", ""])
            data[name] = {"error": str(e)}
        finally:
            if engine is not None:
                engine.close()
        print(rows[-1], flush=True)
    md = table(["engine", "tokens/s", "vs vLLM BF16"], rows)
    md += (f"\n\nLlama config {cfg}, random weights, {prompts} prompts of 64 tokens x {new_tokens} new tokens, "
           f"eager engines, medians of {runs - 1} runs after a warm-up. FP8 GEMM of the plugin: "
           f"{kernels.kernel_name(device)}. Target: plugin >= 1.3x vLLM BF16.")
    report.add("rollout", md, data)


class _VllmGenerate:
    """A plain ``vllm.LLM`` behind the engines' ``generate`` and ``close``."""

    def __init__(self, llm):
        self.llm = llm

    def generate(self, prompts, *, n, max_new_tokens, seed):
        from vllm import SamplingParams

        params = [SamplingParams(n=n, max_tokens=max_new_tokens, seed=seed + i, detokenize=False, ignore_eos=True)
                  for i in range(len(prompts))]
        return [list(o.outputs) for o in self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]

    def close(self):
        from jetrl_compile.rollout import _vllm_compat

        _vllm_compat.shutdown(self.llm, keep_default_group=False)


# ---------------------------------------------------------------- 6. mismatch


def bench_mismatch(device, cfg: dict, prompts: int, n: int, new_tokens: int, report: Report, fp8_kernel: bool) -> None:
    import jetrl_compile
    from jetrl_compile.rl.mismatch import rollout_mismatch
    from jetrl_compile.rollout.engines import HfEngine

    use_fp8_kernel(fp8_kernel)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, cfg["vocab_size"], (int(k),), generator=g).tolist()
           for k in torch.randint(8, 40, (prompts,), generator=g)]
    eos = cfg["vocab_size"] + 1  # never sampled: every completion runs its full length

    def vllm_engine(model):
        import tempfile

        from jetrl_compile.rollout.engines import VllmEngine

        workdir = tempfile.mkdtemp(prefix="jetrl-gpu-mismatch-")
        last = cfg["vocab_size"] - 1  # vLLM refuses a stop token outside the vocabulary; this one is rarely sampled
        return VllmEngine(model, workdir=workdir, max_model_len=256, gpu_memory=0.4, eos_token_id=last, pad_token_id=0)

    flows = [("fp8_fwd_bf16_bwd", False, "hf"), ("fp8_fwd_bf16_bwd, exact mode", True, "hf")]
    if importlib.util.find_spec("vllm") is not None:
        flows.append(("fp8_fwd_bf16_bwd, exact mode, vLLM", True, "vllm"))
    rows, data = [], {}
    for name, exact, engine_name in flows:
        model = _llama(cfg, device, torch.float32).eval()
        jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", mode="eager", exact=exact)  # exact mode runs eagerly
        engine = None
        try:
            engine = vllm_engine(model) if engine_name == "vllm" else HfEngine(model, eos_token_id=eos, pad_token_id=0)
            t0 = time.perf_counter()
            metrics = rollout_mismatch(model, engine, ids, n=n, max_new_tokens=new_tokens, seed=0)
            seconds = time.perf_counter() - t0
            rows.append([name, f"{metrics['mismatch_kl']:.3g}", f"{metrics['logprob_abs_diff_max']:.3g}",
                         f"{metrics['tokens']:.0f}", f"{seconds:.1f}"])
            data[name] = {**metrics, "seconds": seconds}
        except Exception as e:  # noqa: BLE001 - one engine failing is a finding, not the end of the section
            rows.append([name, f"error: {str(e).splitlines()[0][:100]}", "", "", ""])
            data[name] = {"error": str(e)}
        finally:
            if engine is not None:
                engine.close()
        print(rows[-1], flush=True)
        del model, engine
    md = table(["flow", "k3 KL", "max abs dlogp", "tokens", "seconds"], rows)
    md += (f"\n\nLlama config {cfg}, random FP32 master weights, {prompts} prompts x {n} samples x {new_tokens} "
           f"tokens through HfEngine (KV-cache decode) or in-process vLLM (its Triton attention backend's KV "
           f"cache, read by exact mode's attention) against the eager trainer's packed teacher-forced forward. "
           f"FP8 GEMM: {kernels.kernel_name(device)}. Exact mode's other kernels: "
           f"{'Triton, fixed order (triton_invariant)' if invariant.uses_triton(device) else 'float64 fixed point'}. "
           "Exact mode must give 0 and 0.")
    report.add("mismatch", md, data)


# ---------------------------------------------------------------- driver


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu.md and gpu.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script itself)")
    parser.add_argument("--sections", default="kernels,linear,train_step,decode,rollout,mismatch")
    parser.add_argument("--budget-s", type=float, default=420, help="skip sections that start after this many seconds")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":  # the smoke run checks the Triton kernel under Triton's interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        # and the activation quantize as plain ops: compiling the fused one for each tiny width is
        # most of a cold smoke run, and it is a CPU speed-up, not what the smoke run checks
        os.environ.setdefault("JETRL_FUSED_QUANTIZE", "0")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit(
            "bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); use --smoke to check it on CPU"
        )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        where = (f"{props.name} (sm{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB), torch "
                 f"{torch.__version__}, CUDA {torch.version.cuda}, F.scaled_mm: {hasattr(F, 'scaled_mm')}, "
                 f"Triton {_version('triton')}, vLLM {_version('vllm')}")
    else:
        where = f"CPU smoke run, torch {torch.__version__}"
    report = Report(args.out, f"# bench/gpu.sh\n\nMachine: {where}\n")
    print(where, flush=True)

    size = SMOKE if args.smoke else FULL
    plan = {
        "kernels": lambda ok: check_kernels(device, size["kernel_mnk"], report),
        "linear": lambda ok: bench_linear(
            device, size["linear_shapes"], size["linear_tokens"], size["reps"], report, ok
        ),
        "train_step": lambda ok: bench_train_step(
            device, size["train_cfg"], *size["train_batch_seq"], size["reps"], report, ok
        ),
        "decode": lambda ok: bench_decode(
            device, size["decode_cfg"], *size["decode_batch_prompt_new"], size["decode_reps"], report, ok
        ),
        "rollout": lambda ok: bench_rollout(device, size["rollout_cfg"], *size["rollout_prompts_new_runs"], report, ok),
        "mismatch": lambda ok: bench_mismatch(device, size["mismatch_cfg"], *size["mismatch_prompts_new"], report, ok),
    }
    t0, fp8_ok, failed = time.perf_counter(), False, []
    for name in args.sections.split(","):
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            report.add(name, f"skipped: {elapsed:.0f} s of the {args.budget_s:.0f} s budget spent", None)
            continue
        try:
            result = plan[name](fp8_ok)
            if name == "kernels":
                fp8_ok = bool(result)
        except Exception:
            failed.append(name)
            report.add(name, "FAILED:\n\n```\n" + traceback.format_exc()[-3000:] + "```", None)
        print(f"[{name} done at {time.perf_counter() - t0:.0f} s]", flush=True)
    if failed:
        raise SystemExit(f"sections failed: {', '.join(failed)} (tracebacks in {args.out / 'gpu.md'})")


if __name__ == "__main__":
    main()
