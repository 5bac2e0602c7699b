"""Our Triton FP8 GEMM (``runtime/triton_fp8.py``), the kernel a CUDA GPU runs by default, run here
on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``, FP8 ``tl.dot`` included) against
the emulation: bitwise where the float32 sums are exact, within the GEMM definition otherwise,
every row the same whatever the batch, and the dispatch that picks it on each device.

Triton is part of the test install (``make test``): a missing Triton fails here, it never skips."""

import pytest
import torch
import triton  # noqa: F401 - the install must have it

import jetrl_compile
from jetrl_compile.runtime import (
    Quantized,
    dequantize,
    fp8_linear,
    kernels,
    quantize_blockwise,
    quantize_groupwise,
    triton_fp8,
)
from jetrl_compile.runtime.fp8_linear import FP8_BACKWARD_INDUCTOR_OPTIONS
from tests.conftest import assert_within_gemm_definition, tiny_model

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_kernel(monkeypatch):
    """Every FP8 GEMM of the process through the Triton kernel, as on a GPU."""
    monkeypatch.setenv("JETRL_FP8_KERNEL", "triton")


def _codes(shape, generator, binades=(0, 1)):
    """FP8 payloads of sign x (1 + m/8) x 2^e, e in ``binades``: products of two have 8 significant
    bits over a few binades, so sums of hundreds of them are exact in float32."""
    sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
    mantissa = torch.randint(0, 8, shape, generator=generator)
    exponent = torch.randint(binades[0], binades[1] + 1, shape, generator=generator)
    return (sign * (1 + mantissa / 8) * 2.0**exponent).to(torch.float8_e4m3fn)


def _pow2(shape, generator, exponents=(-1, 0, 1)):
    pick = torch.randint(0, len(exponents), shape, generator=generator)
    return 2.0 ** torch.tensor(exponents, dtype=torch.float32)[pick]


def _exact_operands(m, k, n, layout, seed=0):
    """(a, b) whose every float32 sum is exact: any summation order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // 128)
    a = Quantized(_codes((m, k), g), _pow2((m, groups), g))
    if layout == "blocks":  # fprop: the weight's 128 x 128 blocks
        b = Quantized(_codes((n, k), g), _pow2((-(-n // 128), groups), g))
    elif layout == "groups":  # wgrad, and the vLLM plugin's per-row scales
        b = Quantized(_codes((n, k), g), _pow2((n, groups), g))
    else:  # dgrad: the transposed weight, a strided view, as fp8_linear's backward passes it
        w = Quantized(_codes((k, n), g), _pow2((groups, -(-n // 128)), g))
        b = Quantized(w.data.t(), w.scale.t())
        if k % 128 or n % 128:  # the transpose of partial blocks is only a layout where both fit
            b = Quantized(b.data.contiguous(), _pow2(tuple(kernels.block_scale_shape((n, k))), g))
    return a, b


@pytest.mark.parametrize("layout", ["blocks", "groups", "transposed"])
@pytest.mark.parametrize("m,k,n", [(1, 200, 300), (130, 576, 256), (37, 256, 130)])
def test_the_kernel_is_the_emulation_bit_for_bit_where_sums_are_exact(gemm_path, layout, m, k, n, monkeypatch):
    a, b = _exact_operands(m, k, n, layout)
    bias = torch.randint(-8, 9, (n,)).to(BF16)
    monkeypatch.setenv("JETRL_FP8_KERNEL", "emulate")
    want = kernels.fp8_gemm(a, b, bias)
    monkeypatch.setenv("JETRL_FP8_KERNEL", "triton")
    got = kernels.fp8_gemm(a, b, bias)
    assert got.dtype == BF16 and got.shape == (m, n)
    assert torch.equal(got, want)
    assert torch.equal(triton_fp8.fp8_gemm(a, b), kernels.fp8_gemm(a, b))  # and without the bias
    # the exact product, rounded once: the inputs really do sum exactly
    exact = dequantize(*a, torch.float64) @ dequantize(*b, torch.float64).t() + bias.double()
    assert torch.equal(got, exact.to(BF16))


def test_partial_and_transposed_scales_are_read_where_they_belong():
    """The exact inputs above with one scale changed: only the outputs that scale feeds move."""
    a, b = _exact_operands(20, 200, 300, "blocks", seed=3)
    before = triton_fp8.fp8_gemm(a, b)
    b.scale[2, 1] *= 2  # rows 256..299, the partial K group 128..199
    after = triton_fp8.fp8_gemm(a, b)
    moved = (before != after).any(0)
    assert moved[256:].all() and not moved[:256].any()


def test_each_rounding_to_bf16_is_to_nearest_even():
    """Sums that fall halfway between two BF16 numbers round to the even one, the others to the
    nearest, as torch's cast does; a truncating cast (the interpreter's own) or a half-up rounding
    fails here."""
    sums = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 1 + 5 * 2**-9, -(1 + 2**-8), -(1 + 3 * 2**-8)])
    tails = sums.abs() - 1  # each an FP8 number (subnormal): 1 + tail is exact in float32
    b = Quantized(torch.stack([sums.sign(), sums.sign() * tails], 1).to(torch.float8_e4m3fn), torch.ones(6, 1))
    a = Quantized(torch.ones(1, 2).to(torch.float8_e4m3fn), torch.ones(1, 1))
    assert torch.equal(dequantize(*b, torch.float32).sum(1), sums)
    assert torch.equal(triton_fp8.fp8_gemm(a, b)[0], sums.to(BF16))


@pytest.mark.parametrize("layout", ["blocks", "groups"])
def test_the_kernel_computes_the_gemm_definition_on_real_activations(layout):
    torch.manual_seed(0)
    x, w = torch.randn(150, 576) * 3, torch.randn(300, 576) * 576**-0.5
    a = quantize_groupwise(x)
    b = quantize_blockwise(w) if layout == "blocks" else quantize_groupwise(w)
    assert_within_gemm_definition(triton_fp8.fp8_gemm(a, b), dequantize(*a).double(), dequantize(*b).double())


def test_a_row_is_the_same_whatever_the_batch_and_wherever_it_sits():
    """Batch invariance: one fixed tile configuration, no split-K, so row r of a 300-row GEMM is
    the same bits alone, in a batch of 1, or at another place in another batch."""
    torch.manual_seed(1)
    a, b = quantize_groupwise(torch.randn(300, 576)), quantize_blockwise(torch.randn(640, 576) * 0.05)
    full = triton_fp8.fp8_gemm(a, b)
    for rows in (slice(0, 1), slice(129, 130), slice(100, 260), slice(290, 300)):
        part = triton_fp8.fp8_gemm(Quantized(a.data[rows], a.scale[rows]), b)
        assert torch.equal(part, full[rows])
    moved = torch.cat([a.data[5:6], a.data[:5]]), torch.cat([a.scale[5:6], a.scale[:5]])
    assert torch.equal(triton_fp8.fp8_gemm(Quantized(*moved), b)[0], full[5])


def test_a_non_finite_group_turns_its_row_nan():
    torch.manual_seed(2)
    x = torch.randn(4, 256)
    x[2, 140] = float("nan")
    y = triton_fp8.fp8_gemm(quantize_groupwise(x), quantize_blockwise(torch.randn(130, 256)))
    assert y[2].isnan().all() and not y[[0, 1, 3]].isnan().any()


def test_the_kernel_refuses_what_it_cannot_compute(monkeypatch):
    a, b = _exact_operands(4, 256, 128, "blocks")
    with pytest.raises(ValueError, match=r"b's scales \(3, 2\) fit neither 128 x 128 blocks \(1, 2\)"):
        triton_fp8.fp8_gemm(a, Quantized(b.data, torch.ones(3, 2)))
    with pytest.raises(TypeError, match="float8_e4m3fn payloads"):
        triton_fp8.fp8_gemm(Quantized(a.data.float(), a.scale), b)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="on CPU under Triton's interpreter with TRITON_INTERPRET=1"):
        triton_fp8.fp8_gemm(a, b)


def test_the_default_kernel_on_each_device(monkeypatch):
    """Triton's kernel on a CUDA GPU with FP8 (sm89+), the emulation on older GPUs and on CPU;
    the switch forces either. The capability is a stand-in here: no GPU on this machine."""
    monkeypatch.delenv("JETRL_FP8_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_CUDA_CAPABILITY", {0: (9, 0), 1: (8, 9), 2: (8, 0)})
    assert kernels.fp8_kernel("cpu") == "emulate"
    assert [kernels.fp8_kernel(f"cuda:{i}") for i in range(3)] == ["triton", "triton", "emulate"]
    assert kernels.kernel_name("cuda:0") == "triton fp8 GEMM (tensor cores)"
    monkeypatch.setenv("JETRL_FP8_KERNEL", "emulate")
    assert kernels.fp8_kernel("cuda:0") == "emulate" and kernels.uses_emulation("cuda:0")
    monkeypatch.setenv("JETRL_FP8_KERNEL", "triton")
    assert kernels.fp8_kernel("cpu") == "triton"
    assert kernels.kernel_name("cpu") == "triton fp8 GEMM (Triton interpreter)"
    monkeypatch.setenv("JETRL_FP8_KERNEL", "scaled_mm")
    assert kernels.fp8_kernel("cuda:0") == "scaled_mm"
    with pytest.raises(ValueError, match="JETRL_FP8_KERNEL=scaled_mm: cuBLAS blockwise scaling runs on sm90"):
        kernels.fp8_kernel("cuda:1")


@pytest.mark.parametrize("recipe", ["fp8_fwd_bf16_bwd", "jetrl"])
def test_fp8_linear_forward_and_backward_run_the_kernel_eager_and_compiled(triton_kernel, recipe, monkeypatch):
    """Each FP8 GEMM of the op (jetrl: fprop, dgrad, wgrad) through the kernel, eagerly and inside
    a compiled graph (an opaque op there), the same bits; and the same as the emulation where the
    emulation's float32 sums happen to agree, which they need not: within the definition."""
    torch.manual_seed(3)
    x, w, b = torch.randn(2, 70, 200), torch.randn(300, 200) * 0.07, torch.randn(300)
    dy = torch.randn(2, 70, 300)

    def grads(fn):
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xx, ww, bb)
        y.backward(dy)
        return y.detach(), xx.grad, ww.grad

    def op(x, w, b):
        return fp8_linear(x, w, b, recipe=recipe)

    eager = grads(op)
    torch._dynamo.reset()
    compiled_op = torch.compile(op, fullgraph=True, dynamic=False, options=FP8_BACKWARD_INDUCTOR_OPTIONS)
    for e, c in zip(eager, grads(compiled_op)):
        assert torch.equal(e, c)
    monkeypatch.setenv("JETRL_FP8_KERNEL", "emulate")
    for e, r in zip(eager, grads(op)):
        assert (e.float() - r.float()).abs().max() <= 2**-6 * r.float().abs().max()


def test_the_compiled_model_calls_the_kernel_and_its_report_says_so(triton_kernel, tmp_path, monkeypatch):
    """A model unified with the compile pass, its FP8 GEMMs on the Triton kernel: the graphs hold
    the kernel's op, the precision report names it, and no BF16 copy of a weight is cached."""
    monkeypatch.setenv("JETRL_DUMP", "1")
    monkeypatch.setenv("JETRL_DUMP_DIR", str(tmp_path))
    model = jetrl_compile.unify(tiny_model(layers=1), "fp8_fwd_bf16_bwd", mode="compile")
    ids = torch.randint(0, 256, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    reports = jetrl_compile.precision_report(model)
    assert {r["fp8_kernel"] for r in reports} == {"triton fp8 GEMM (Triton interpreter)"}
    rows = [row for row in jetrl_compile.linear_precisions(model).values() if row["module"] != "lm_head"]
    assert len(rows) == 7 and {row["fprop"] for row in rows} == {"fp8"}, rows
    aot = "\n".join(p.read_text() for p in tmp_path.rglob("aot_forward.py"))
    assert aot.count("torch.ops.jetrl.fp8_gemm_triton.default(") == 7, "one kernel call per projection"
    # the cache holds the FP8 payloads and their scales, no dequantized copy
    weights = [m.weight for n, m in model.named_modules() if n.endswith("_proj")]
    fp8_bytes = sum(w.numel() + 4 * -(-w.shape[0] // 128) * -(-w.shape[1] // 128) for w in weights)
    assert jetrl_compile.unified_state(model).cache.nbytes() == fp8_bytes
