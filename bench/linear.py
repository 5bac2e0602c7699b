"""FP8 linear op vs the BF16 recipe's linear, compiled, on SmolLM2-135M and 8B shapes.

Both run through the same GEMM path (``kernels.bf16_gemm``: torch's BF16 matmul where the CPU
has BF16 dot products, an FP32 matmul of the BF16 values elsewhere; the machine line says which),
so the ratio is the cost of FP8 on this machine, not of one CPU's slow BF16 kernel.

Forward, and forward+backward for each FP8 training recipe, at 1, 64 and 2048 tokens. The weight
is quantized (and, for the CPU emulation, dequantized to BF16) once outside the timed region, as
``unify``'s weight cache does once per optimizer step. Medians of interleaved runs; the ratios
(FP8 time / BF16 time, lower is better) are what to read.

    python bench/linear.py            # all shapes
    python bench/linear.py --quick    # SmolLM2 shapes only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, interleaved_medians, table, write_result  # noqa: E402

from jetrl_compile.runtime import dequantize, fp8_linear, quantize_blockwise  # noqa: E402
from jetrl_compile.runtime.fp8_linear import FP8_BACKWARD_INDUCTOR_OPTIONS, INDUCTOR_OPTIONS  # noqa: E402

SMOLLM2 = [(576, 1536), (1536, 576), (576, 576), (576, 192)]  # (K in, N out)
LLAMA_8B = [(4096, 14336), (14336, 4096)]
TOKENS = [1, 64, 2048]
BF16 = torch.bfloat16


def _recipe_linear(fprop, dgrad, wgrad):
    def fn(x, w, q, s, deq):
        return fp8_linear(x, w, None, q, s, deq, fprop=fprop, dgrad=dgrad, wgrad=wgrad)

    return fn


def _compiled(fn, options=None):
    return torch.compile(fn, dynamic=False, options=options)


# Every shape x token count x grad mode is its own static-shape entry on the same three code
# objects; past Dynamo's default limit of 8 it would silently fall back to eager.
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.fail_on_recompile_limit_hit = True


def bench_shape(k: int, n: int, tokens: list[int], reps: int) -> list[list]:
    torch.manual_seed(0)
    w = (torch.randn(n, k) * k**-0.5).to(BF16).requires_grad_()
    q, s = quantize_blockwise(w.detach())
    deq = dequantize(q, s)  # what unify's weight cache feeds the emulated GEMM, once per step
    bf16 = _compiled(_recipe_linear("bf16", "bf16", "bf16"), INDUCTOR_OPTIONS)
    fp8_fwd = _compiled(_recipe_linear("fp8", "bf16", "bf16"), INDUCTOR_OPTIONS)
    jetrl = _compiled(_recipe_linear("fp8", "fp8", "fp8"), FP8_BACKWARD_INDUCTOR_OPTIONS)
    rows = []
    for m in tokens:
        x = torch.randn(m, k).to(BF16).requires_grad_()
        dy = torch.randn(m, n).to(BF16)

        def fwd(f, *args):
            def run():
                with torch.no_grad():
                    f(x, w, *args)

            return run

        def fwd_bwd(f, *args):
            def run():
                f(x, w, *args).backward(dy)
                x.grad = w.grad = None

            return run

        r = reps if m * k * n < 2**33 else max(3, reps // 3)
        t = interleaved_medians(
            {
                "bf16_f": fwd(bf16, None, None, None),
                "fp8_f": fwd(fp8_fwd, q, s, deq),
                "bf16_fb": fwd_bwd(bf16, None, None, None),
                "fp8_fb": fwd_bwd(fp8_fwd, q, s, deq),
                "jetrl_fb": fwd_bwd(jetrl, q, s, deq),
            },
            reps=r,
        )
        rows.append([
            f"{k}->{n}", m,
            f"{t['bf16_f'] * 1e3:.3g}", f"{t['fp8_f'] / t['bf16_f']:.2f}x",
            f"{t['bf16_fb'] * 1e3:.3g}", f"{t['fp8_fb'] / t['bf16_fb']:.2f}x", f"{t['jetrl_fb'] / t['bf16_fb']:.2f}x",
        ])
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2 shapes only")
    parser.add_argument("--reps", type=int, default=9, help="timed runs per variant (fewer for the largest GEMMs)")
    parser.add_argument("--result-name", default="linear", help="write bench/results/<name>.md")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    shapes = SMOLLM2 + ([] if args.quick else LLAMA_8B)
    rows = []
    for k, n in shapes:
        rows += bench_shape(k, n, TOKENS, args.reps)
    body = table(
        ["shape K->N", "tokens", "BF16 fwd ms", "FP8 fwd / BF16", "BF16 fwd+bwd ms",
         "fp8_fwd_bf16_bwd fwd+bwd / BF16", "jetrl fwd+bwd / BF16"],
        rows,
    )
    body += (
        "\n\nBF16 is the `bf16` recipe's op. CPU FP8 is the exact emulation (quantize x per 1x128 group, "
        "dequantize, one GEMM on the machine's BF16 GEMM path);"
        " the ratio is the cost of the quantize/dequantize passes next to the matmul. Target: "
        "fp8_fwd_bf16_bwd forward+backward within 1.3x of BF16 at 2048 tokens on the 8B shapes."
    )
    write_result(args.result_name, command_line(__file__, argv), body)


if __name__ == "__main__":
    main()
