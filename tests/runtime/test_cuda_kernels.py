"""CUDA kernels against the CPU emulation. Run on a GPU machine with ``pytest -m cuda``."""

import pytest
import torch

from jetrl_compile.runtime import Quantized, dequantize, kernels, quantize_blockwise, quantize_groupwise
from tests.conftest import assert_same_quantization, assert_within_gemm_definition

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def scaled_mm_enabled(monkeypatch):
    monkeypatch.setenv("JETRL_FP8_KERNEL", "scaled_mm")
    return kernels._cuda_blockwise_enabled(torch.cuda.current_device())


def _operands(layout, x, w, dy):
    """fp8_gemm's (a, b) as fp8_linear builds them for each GEMM of a linear layer."""
    if layout == "fprop":
        return quantize_groupwise(x), quantize_blockwise(w)
    if layout == "dgrad":
        q, s = quantize_blockwise(w)
        return quantize_groupwise(dy), Quantized(q.t(), s.t())
    return quantize_groupwise(dy.t()), quantize_groupwise(x.t())


@pytest.mark.parametrize("layout", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("m,k,n", [(128, 512, 256), (4096, 4096, 14336)])
def test_blockwise_scaled_mm_matches_emulation_within_summation_error(scaled_mm_enabled, layout, m, k, n):
    if not scaled_mm_enabled:
        pytest.skip("cuBLAS blockwise scaling needs sm90")
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda") * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    a, b = _operands(layout, x, w, dy)
    assert kernels._use_cuda_blockwise(a.data, b)
    y = kernels.fp8_gemm(a, b)
    assert_within_gemm_definition(y, dequantize(*a).double(), dequantize(*b).double())


def test_emulation_on_cuda_equals_cpu_bitwise_for_the_quantizer():
    torch.manual_seed(1)
    w = torch.randn(300, 200)
    assert_same_quantization(quantize_blockwise(w), quantize_blockwise(w.cuda()))
