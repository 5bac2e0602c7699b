"""The BF16 GEMM dispatch (``kernels.bf16_gemm``): which path runs, and that both paths compute the
GEMM definition for every recipe's forward and backward GEMMs, whichever CPU the suite lands on."""

import pytest
import torch
import torch.nn.functional as F

from jetrl_compile.recipes import RECIPES, get_recipe
from jetrl_compile.runtime import dequantize, fp8_linear, quantize_blockwise, quantize_groupwise
from jetrl_compile.runtime.kernels import (
    bf16_gemm,
    bf16_gemm_path,
    cpu_has_bf16_dot_product,
    gemm_operand_dtype,
)
from tests.conftest import assert_within_gemm_definition

BF16, F64 = torch.bfloat16, torch.float64


def test_switch_forces_each_path_and_auto_follows_the_cpu(monkeypatch):
    for path in ("native", "fp32"):
        monkeypatch.setenv("JETRL_BF16_GEMM", path)
        assert bf16_gemm_path("cpu") == path
        assert gemm_operand_dtype("cpu") == (torch.float32 if path == "fp32" else BF16)
    monkeypatch.setenv("JETRL_BF16_GEMM", "auto")
    assert bf16_gemm_path("cpu") == ("native" if cpu_has_bf16_dot_product() else "fp32")
    monkeypatch.delenv("JETRL_BF16_GEMM")
    assert bf16_gemm_path("cpu") == ("native" if cpu_has_bf16_dot_product() else "fp32")
    monkeypatch.setenv("JETRL_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match="JETRL_BF16_GEMM='fast' is unknown; choose one of auto, native, fp32"):
        bf16_gemm_path("cpu")


def test_each_path_runs_the_kernel_it_names(gemm_path):
    torch.manual_seed(0)
    a, b, bias = (torch.randn(37, 300).to(BF16), torch.randn(70, 300).to(BF16), torch.randn(70).to(BF16))
    y = bf16_gemm(a, b, bias)
    assert y.dtype == BF16
    if gemm_path == "native":
        assert torch.equal(y, F.linear(a, b, bias))
    else:
        assert torch.equal(y, F.linear(a.float(), b.float(), bias.float()).to(BF16))
    # Operands given as exact FP32 upcasts (the weight cache's dequantized weights) give the same bits.
    assert torch.equal(bf16_gemm(a.float(), b.float(), bias.float()), y)


def test_the_path_decision_compiles_without_a_graph_break(monkeypatch):
    monkeypatch.delenv("JETRL_BF16_GEMM", raising=False)  # auto: the hardware probe is read
    torch._dynamo.reset()
    x, w = torch.randn(4, 200).to(BF16), torch.randn(300, 200)
    compiled = torch.compile(lambda x, w: fp8_linear(x, w), fullgraph=True)
    assert torch.equal(compiled(x, w), fp8_linear(x, w))


def test_bf16_gemm_is_the_definition_on_both_paths(gemm_path):
    torch.manual_seed(1)
    a, b = (torch.randn(64, 1536) * 3).to(BF16), (torch.randn(96, 1536) * 0.02).to(BF16)
    assert_within_gemm_definition(bf16_gemm(a, b), a.double(), b.double())


def _q_act(t: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize_groupwise(t), F64)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_gemm_forward_and_backward_is_the_definition_on_both_paths(recipe, gemm_path):
    """y, dx and dW of the op against float64 GEMMs of exactly the operands the recipe names:
    FP8 operands dequantized, BF16 operands the BF16 copies; FP32 master weights."""
    r = get_recipe(recipe)
    torch.manual_seed(2)
    m, k, n = 96, 200, 300  # partial 128-groups along every dim
    x = (torch.randn(m, k) * 2).requires_grad_()
    w = (torch.randn(n, k) * 0.05).requires_grad_()
    dy = torch.randn(m, n).to(BF16)
    y = fp8_linear(x, w, recipe=r)
    y.backward(dy.float())
    x16, w16 = x.detach().to(BF16), w.detach().to(BF16)
    w8 = dequantize(*quantize_blockwise(w.detach()), F64)

    fprop_a, fprop_b = (_q_act(x16), w8) if r.fprop.is_fp8 else (x16.double(), w16.double())
    assert_within_gemm_definition(y.detach(), fprop_a, fprop_b)
    dgrad_a, dgrad_b = (_q_act(dy), w8.t()) if r.dgrad.is_fp8 else (dy.double(), w16.double().t())
    dx = x.grad
    if r.grad_handoff == "fp8":  # fp8_all hands on the dgrad's output quantized in 1x128 groups
        x.grad, dw = None, w.grad.clone()
        fp8_linear(x, w, fprop=r.fprop.dtype, dgrad=r.dgrad.dtype, wgrad=r.wgrad.dtype).backward(dy.float())
        dx, handed, w.grad = x.grad, dx, dw
        assert torch.equal(handed, _q_act(dx.to(BF16)).float())
    assert_within_gemm_definition(dx, dgrad_a, dgrad_b)
    if r.wgrad.is_fp8:
        wgrad_a, wgrad_b = _q_act(dy.t()), _q_act(x16.t())
    else:
        wgrad_a, wgrad_b = dy.double().t(), x16.double().t()
    assert_within_gemm_definition(w.grad, wgrad_a, wgrad_b)
    assert x.grad.dtype == w.grad.dtype == torch.float32


def test_switches_are_read_when_used_and_refuse_unknown_values(monkeypatch):
    from jetrl_compile.runtime import switches

    for value, want in [("native", "native"), ("fp32", "fp32")]:
        monkeypatch.setenv("JETRL_BF16_GEMM", value)
        assert bf16_gemm_path("cpu") == want  # no cache to clear between settings
    monkeypatch.setenv("JETRL_BF16_GEMM", "bf16")
    with pytest.raises(ValueError, match="JETRL_BF16_GEMM='bf16' is unknown; choose one of auto, native, fp32"):
        bf16_gemm_path("cpu")
    monkeypatch.setenv("JETRL_FUSED_QUANTIZE", "yes")
    with pytest.raises(ValueError, match="JETRL_FUSED_QUANTIZE='yes' is not a switch value"):
        switches.fused_quantize()
    monkeypatch.setenv("JETRL_FP8_KERNEL", "scaled_mm")
    assert switches.fp8_kernel() == "scaled_mm"
