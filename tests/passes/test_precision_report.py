"""The precision report's reading of what a dgrad hands to the previous op, on backward graphs of
linears that feed each other directly: the case where ``jetrl``'s next GEMMs quantize the handed
gradient themselves, which a reading that looked only for a downstream float8 cast would call FP8."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from jetrl_compile.passes.precision_report import gemms_in_graph
from jetrl_compile.runtime import fp8_linear

BF16 = torch.bfloat16


def _backward_records(recipe: str, bias: bool):
    graphs = {}

    def capture(name):
        def compiler(gm, _inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def two_linears(x, w1, b1, w2, b2):  # x -> linear 1 -> linear 2: linear 2's dx is linear 1's dy
        return fp8_linear(fp8_linear(x, w1, b1, recipe=recipe), w2, b2, recipe=recipe)

    torch.manual_seed(0)
    x = torch.randn(32, 256, dtype=BF16, requires_grad=True)
    w1, w2 = torch.randn(384, 256, dtype=BF16), torch.randn(128, 384, dtype=BF16)
    b1, b2 = (torch.randn(384, dtype=BF16), torch.randn(128, dtype=BF16)) if bias else (None, None)
    params = [t.requires_grad_() for t in (w1, b1, w2, b2) if t is not None]
    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    fn = torch.compile(two_linears, backend=backend, fullgraph=True, dynamic=False)
    fn(x, w1, b1, w2, b2).float().square().sum().backward()
    assert all(p.grad is not None for p in params)
    return gemms_in_graph(graphs["backward"], "backward")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("recipe", "expected"), [("jetrl", "bf16"), ("fp8_all", "fp8"), ("bf16", "bf16")])
def test_the_gradient_handed_on_is_read_off_the_backward_graph(recipe, expected, bias):
    records = _backward_records(recipe, bias)
    # linear 2's dx: (32 tokens, 384 features), handed to linear 1 (whose FP8 dgrad and wgrad,
    # in jetrl, quantize it along its features and along the tokens)
    (dgrad2,) = [r for r in records if tuple(r.out_shape) == (32, 384)]
    assert dgrad2.handoff == expected, records
    (dgrad1,) = [r for r in records if tuple(r.out_shape) == (32, 256)]  # x's gradient: the graph's output
    assert dgrad1.handoff == expected, records
