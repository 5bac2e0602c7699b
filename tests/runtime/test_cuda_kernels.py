"""CUDA kernels against the CPU emulation. Run on a GPU machine with ``pytest -m cuda``; the default
suite runs the Triton kernel on CPU under Triton's interpreter (``test_triton_fp8.py``)."""

import pytest
import torch

from jetrl_compile.runtime import Quantized, dequantize, kernels, quantize_blockwise, quantize_groupwise
from tests.conftest import assert_same_quantization, assert_within_gemm_definition

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _operands(layout, x, w, dy):
    """fp8_gemm's (a, b) as fp8_linear builds them for each GEMM of a linear layer."""
    if layout == "fprop":
        return quantize_groupwise(x), quantize_blockwise(w)
    if layout == "dgrad":
        q, s = quantize_blockwise(w)
        return quantize_groupwise(dy), Quantized(q.t(), s.t())
    return quantize_groupwise(dy.t()), quantize_groupwise(x.t())


def _inputs(m, k, n):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda") * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return x, w, dy


@pytest.mark.parametrize("layout", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("m,k,n", [(128, 576, 192), (4096, 4096, 14336)])
def test_the_default_kernel_is_triton_and_computes_the_gemm_definition(layout, m, k, n):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm89 or later")
    assert kernels.fp8_kernel("cuda") == "triton"
    a, b = _operands(layout, *_inputs(m, k, n))
    y = kernels.fp8_gemm(a, b)
    assert_within_gemm_definition(y, dequantize(*a).double(), dequantize(*b).double())


def test_the_triton_kernel_gives_each_row_the_same_bits_whatever_the_batch():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm89 or later")
    a, b = _operands("fprop", *_inputs(1000, 4096, 4096))
    full = kernels.fp8_gemm(a, b)
    for rows in (slice(0, 1), slice(7, 8), slice(100, 164), slice(999, 1000)):
        assert torch.equal(kernels.fp8_gemm(Quantized(a.data[rows], a.scale[rows]), b), full[rows])


@pytest.mark.parametrize("layout", ["fprop", "dgrad", "wgrad"])
def test_blockwise_scaled_mm_matches_emulation_within_summation_error(layout, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLAS blockwise scaling needs sm90")
    monkeypatch.setenv("JETRL_FP8_KERNEL", "scaled_mm")
    a, b = _operands(layout, *_inputs(4096, 4096, 14336))
    assert kernels._scaled_mm_fits(a.data, b)
    y = kernels.fp8_gemm(a, b)
    assert_within_gemm_definition(y, dequantize(*a).double(), dequantize(*b).double())


def test_emulation_on_cuda_equals_cpu_bitwise_for_the_quantizer():
    torch.manual_seed(1)
    w = torch.randn(300, 200)
    assert_same_quantization(quantize_blockwise(w), quantize_blockwise(w.cuda()))


def test_exact_modes_gpu_kernels_give_each_row_the_same_bits_whatever_the_batch():
    """``triton_invariant`` compiled for the GPU (the default suite runs it under the interpreter):
    a row alone equals the row in a batch of 300, and a decode query equals its row in a causal
    batch, on the hardware's own reductions and tensor cores."""
    from jetrl_compile.runtime import triton_invariant

    torch.manual_seed(0)
    a, b = torch.randn(300, 576, device="cuda").bfloat16(), torch.randn(4096, 576, device="cuda").bfloat16()
    full = triton_invariant.gemm(a, b)
    assert all(torch.equal(triton_invariant.gemm(a[r : r + 1], b), full[r : r + 1]) for r in (0, 77, 299))
    x = torch.randn(300, 576, device="cuda")
    assert torch.equal(triton_invariant.rms_norm(x[5:6], 1e-6), triton_invariant.rms_norm(x, 1e-6)[5:6])
    logits = torch.randn(8, 49152, device="cuda") * 3
    assert torch.equal(triton_invariant.log_softmax(logits[3:4]), triton_invariant.log_softmax(logits)[3:4])
    q, k, v = (torch.randn(1, n, 200, 64, device="cuda") for n in (9, 3, 3))
    causal = torch.ones(200, 200, dtype=torch.bool, device="cuda").tril()[None]
    full = triton_invariant.attention(q, k, v, causal, 0.125)
    alone = torch.ones(1, 1, 151, dtype=torch.bool, device="cuda")
    decode = triton_invariant.attention(q[:, :, 150:151], k[:, :, :151], v[:, :, :151], alone, 0.125)
    assert torch.equal(decode[:, :, 0], full[:, :, 150])
