import dataclasses

import pytest

import jetrl_compile
from jetrl_compile.recipes import BF16, FP8_FPROP, get_recipe


def test_named_recipes_match_the_design_table():
    r = jetrl_compile.RECIPES
    assert list(r) == ["bf16", "fp8_fwd_bf16_bwd", "jetrl", "fp8_rollout_only", "fp8_all"]
    assert (r["bf16"].fprop, r["bf16"].dgrad, r["bf16"].wgrad, r["bf16"].rollout) == (BF16,) * 4
    d = r["fp8_fwd_bf16_bwd"]
    assert d.fprop == FP8_FPROP and d.rollout == FP8_FPROP and d.dgrad == BF16 and d.wgrad == BF16
    j = r["jetrl"]
    assert all(g.is_fp8 for g in (j.fprop, j.dgrad, j.wgrad, j.rollout))
    assert (j.fprop.lhs, j.fprop.rhs) == ("1x128", "128x128")
    assert (j.wgrad.lhs, j.wgrad.rhs) == ("1x128", "128x1")
    o = r["fp8_rollout_only"]
    assert o.fprop == BF16 and o.rollout.is_fp8
    a = r["fp8_all"]
    assert dataclasses.replace(a, name="jetrl", description=j.description, grad_handoff="bf16") == j
    assert a.grad_handoff == "fp8" and {x.grad_handoff for n, x in r.items() if n != "fp8_all"} == {"bf16"}
    with pytest.raises(ValueError, match="grad_handoff 'fp16' is unknown"):
        dataclasses.replace(a, grad_handoff="fp16")


def test_only_the_off_policy_baseline_is_off_policy():
    assert [n for n, r in jetrl_compile.RECIPES.items() if not r.on_policy] == ["fp8_rollout_only"]
    assert jetrl_compile.get_recipe().name == "fp8_fwd_bf16_bwd"


def test_which_recipes_read_the_weights_fp8_blocks_in_training():
    needs = {n for n, r in jetrl_compile.RECIPES.items() if r.needs_quantized_weight}
    assert needs == {"fp8_fwd_bf16_bwd", "jetrl", "fp8_all"}  # fprop or dgrad FP8; fp8_rollout_only trains in BF16


def test_unknown_recipe_lists_the_valid_ones():
    with pytest.raises(
        ValueError,
        match="recipe 'fp8' is unknown; choose one of bf16, fp8_fwd_bf16_bwd, jetrl, fp8_rollout_only, fp8_all",
    ):
        get_recipe("fp8")


def test_skip_rules():
    r = get_recipe("fp8_fwd_bf16_bwd")
    assert "lm_head" in r.skip_reason("lm_head")
    assert r.with_options(include_lm_head=True).skip_reason("lm_head") is None
    assert "router" in r.skip_reason("model.layers.3.mlp.gate")
    assert r.skip_reason("model.layers.3.mlp.gate_proj") is None
    custom = r.with_options(skip=["*.layers.0.*"])
    assert "skip pattern" in custom.skip_reason("model.layers.0.self_attn.q_proj")
    assert custom.skip_reason("model.layers.1.self_attn.q_proj") is None


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_recipe("bf16").fprop = FP8_FPROP
