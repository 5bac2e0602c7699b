"""The FX pass on hand-built graphs: no model, no compile."""

import torch
import torch.fx as fx
from expecttest import assert_expected_inline

from jetrl_compile.passes import ParamInfo, rewrite_linears
from jetrl_compile.recipes import get_recipe
from jetrl_compile.runtime.fp8_linear import fp8_linear


def _graph(build):
    """A GraphModule from ``build(graph, placeholders...)`` with placeholders x, w1, w2, b, emb."""
    g = fx.Graph()
    x, w1, w2, b, emb = (g.placeholder(n) for n in ("x", "w1", "w2", "b", "emb"))
    g.output(build(g, x, w1, w2, b, emb))
    return fx.GraphModule(torch.nn.Module(), g)


PARAMS = {
    "w1": ParamInfo("layers.0.q_proj.weight", "layers.0.q_proj", True, (300, 200)),
    "w2": ParamInfo("lm_head.weight", "lm_head", True, (256, 300)),
    "b": ParamInfo("layers.0.q_proj.bias", "layers.0.q_proj", False, (300,)),
    "emb": ParamInfo("embed.weight", "embed", False, (256, 300)),
}


def _linear_chain(g, x, w1, w2, b, emb):
    h = g.call_function(torch._C._nn.linear, (x, w1, b))
    return g.call_function(torch._C._nn.linear, (h, w2, None))


def test_rewrites_eligible_linear_and_skips_lm_head():
    gm = _graph(_linear_chain)
    result = rewrite_linears(gm, PARAMS, get_recipe("fp8_fwd_bf16_bwd"))
    assert result.summary() == "rewrote 1 of 2 linears; skipped lm_head"
    assert_expected_inline(
        gm.code.strip(),
        """\
def forward(self, x, w1, w2, b, emb, w1_fp8, w1_scale):
    fp8_linear = jetrl_compile_runtime_fp8_linear_fp8_linear(x, w1, b, w1_fp8, w1_scale, fprop = 'fp8', dgrad = 'bf16', wgrad = 'bf16');  x = w1 = b = w1_fp8 = w1_scale = None
    linear_1 = torch._C._nn.linear(fp8_linear, w2, None);  fp8_linear = w2 = None
    return linear_1""",  # noqa: E501
    )
    (site,) = result.rewritten
    assert site.quant_inputs == (5, 6) and site.weight_input == 1


def test_include_lm_head_rewrites_both():
    gm = _graph(_linear_chain)
    result = rewrite_linears(gm, PARAMS, get_recipe("jetrl").with_options(include_lm_head=True))
    assert result.summary() == "rewrote 2 of 2 linears"
    calls = [n for n in gm.graph.nodes if n.target is fp8_linear]
    assert [n.kwargs for n in calls] == [{"fprop": "fp8", "dgrad": "fp8", "wgrad": "fp8"}] * 2


def test_bf16_recipe_rewrites_without_quantized_inputs():
    gm = _graph(_linear_chain)
    result = rewrite_linears(gm, PARAMS, get_recipe("bf16"))
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["x", "w1", "w2", "b", "emb"]
    assert result.rewritten[0].quant_inputs is None


def test_matmul_with_transposed_weight_is_matched():
    def build(g, x, w1, w2, b, emb):
        t = g.call_method("t", (w1,))
        mm = g.call_function(torch.matmul, (x, t))
        wt = g.call_function(getattr, (w2, "T"))
        computed_bias = g.call_function(torch.zeros, (256,))
        return g.call_function(torch.addmm, (computed_bias, mm, wt))

    gm = _graph(build)
    result = rewrite_linears(gm, PARAMS, get_recipe("fp8_fwd_bf16_bwd").with_options(include_lm_head=True))
    assert len(result.rewritten) == 1 and result.rewritten[0].module == "layers.0.q_proj"
    (skipped,) = result.skipped
    assert skipped.module == "lm_head" and skipped.reason == "bias is not a parameter"
    x = torch.randn(3, 200)
    w1, w2, b = torch.randn(300, 200), torch.randn(256, 300), torch.randn(256)
    from jetrl_compile.runtime import quantize_blockwise

    out = gm(x, w1, w2, b, None, *quantize_blockwise(w1))
    assert out.shape == (3, 256)


def test_gemm_on_a_non_linear_parameter_is_reported_not_rewritten():
    def build(g, x, w1, w2, b, emb):
        return g.call_function(torch._C._nn.linear, (x, emb, None))  # tied-embedding style GEMM

    gm = _graph(build)
    result = rewrite_linears(gm, PARAMS, get_recipe("fp8_fwd_bf16_bwd"))
    (site,) = result.sites
    assert not site.rewritten and "not the weight of an nn.Linear" in site.reason


def test_gemm_on_activations_is_not_a_site():
    def build(g, x, w1, w2, b, emb):
        return g.call_function(torch._C._nn.linear, (x, x, None))

    gm = _graph(build)
    assert rewrite_linears(gm, PARAMS, get_recipe("fp8_fwd_bf16_bwd")).sites == []


