"""Training through unify: one compiled 1-layer model per recipe, trained 30 AdamW steps and shared
by the tests of this module (the backward graph's FP8 rules, gradient dtypes, the loss, the
weight cache)."""

import pytest
import torch
import torch.nn as nn

import jetrl_compile
from tests.conftest import tiny_model, token_ids

TRAIN_RECIPES = ("bf16", "fp8_fwd_bf16_bwd", "jetrl", "fp8_rollout_only")


@pytest.fixture(scope="module")
def trained():
    """For each recipe: a 1-layer Llama with FP32 master weights, 30 AdamW steps on a fixed batch.
    No KV cache (as a trainer runs): the layer is one graph, forward and backward."""
    runs = {}
    ids = token_ids()
    for recipe in TRAIN_RECIPES:
        model = tiny_model("llama", layers=1, seed=0, use_cache=False)
        jetrl_compile.unify(model, recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(30):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[recipe] = (model, losses)
    return runs


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
def test_backward_graph_float8_rules(trained, recipe):
    model, _ = trained[recipe]
    (graph,) = jetrl_compile.unified_state(model).graphs
    assert graph.forward is not None and graph.backward is not None
    if recipe == "fp8_fwd_bf16_bwd":
        assert graph.forward_has_fp8 and not graph.backward_has_fp8
    elif recipe == "jetrl":
        assert graph.forward_has_fp8 and graph.backward_has_fp8
    else:
        assert not graph.forward_has_fp8 and not graph.backward_has_fp8
    fwd = "fp8" if recipe in ("fp8_fwd_bf16_bwd", "jetrl") else "bf16"
    bwd = "fp8" if recipe == "jetrl" else "bf16"
    for row in jetrl_compile.linear_precisions(model).values():
        if row["module"] == "lm_head":
            assert (row["fprop"], row["dgrad"], row["wgrad"]) == ("fp32", "fp32", "fp32")
        else:
            assert (row["fprop"], row["dgrad"], row["wgrad"]) == (fwd, bwd, bwd), row


def test_jetrl_gradients_between_ops_stay_bf16_or_wider(trained):
    model, _ = trained["jetrl"]
    (graph,) = jetrl_compile.unified_state(model).graphs
    # Every FP8 value in the backward graph feeds a GEMM operand, never an op's gradient output:
    # the GEMM outputs (dx handed to the previous op, dW) are BF16 or FP32.
    quantized = [r for r in graph.backward if r.module != "lm_head"]
    assert quantized and all(r.precision == "fp8" for r in quantized)
    assert {r.out_dtype for r in graph.backward} <= {"bfloat16", "float32"}
    assert {r.out_dtype for r in quantized} == {"bfloat16"}


def test_training_drives_loss_down_alike_for_every_recipe(trained):
    final = {}
    for recipe, (_, losses) in trained.items():
        assert losses[-1] < 0.7 * losses[0], (recipe, losses[0], losses[-1])
        final[recipe] = losses[-1]
    # FP8 forward noise changes the trajectory slightly; 30 steps land within 15% of BF16.
    for recipe in ("fp8_fwd_bf16_bwd", "jetrl"):
        assert abs(final[recipe] - final["bf16"]) < 0.15 * final["bf16"], final


def test_gradients_land_in_fp32_master_weights(trained):
    model, _ = trained["fp8_fwd_bf16_bwd"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.float32
    model.zero_grad()


def test_cpu_fprop_reads_the_cached_dequantized_weight(trained):
    from jetrl_compile.runtime import dequantize
    from jetrl_compile.runtime.kernels import gemm_operand_dtype

    model, _ = trained["fp8_fwd_bf16_bwd"]
    state = jetrl_compile.unified_state(model)
    (graph,) = state.graphs
    assert all(len(s.quant_inputs) == 3 for s in graph.rewrite.rewritten), "payload, scales, dequantized"
    dtype = gemm_operand_dtype("cpu")  # BF16, or FP32 on the fp32 GEMM path
    w = model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(state.cache.get_dequantized(w, dtype), dequantize(*state.cache.get(w), dtype))
    assert state.cache.get_dequantized(w, dtype) is state.cache.get_dequantized(w, dtype), "made once per step"
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]
    for p in weights:
        state.cache.get_dequantized(p, dtype)
    scales = sum(state.cache.get(p).scale.numel() * 4 for p in weights)
    per_element = 1 + dtype.itemsize  # FP8 payload + the dequantized copy the graphs read
    assert state.cache.nbytes() == per_element * sum(p.numel() for p in weights) + scales


def test_weights_quantized_once_per_optimizer_step(trained):
    model, _ = trained["fp8_fwd_bf16_bwd"]
    cache = jetrl_compile.unified_state(model).cache
    before = cache.quantizations
    ids = token_ids()
    with torch.no_grad():
        model(ids)
        model(ids)  # same weights: no re-quantization
    assert cache.quantizations == before
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.0)  # an in-place update bumps the version
    model(ids, labels=ids)
    assert cache.quantizations == before + 1
