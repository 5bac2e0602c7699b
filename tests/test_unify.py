"""unify(model, recipe) on tiny random HF models: which linears it rewrites, the precision report
it reads off the graphs, and the API's behaviour (state dicts, eager mode, restore, errors).
Training through unify: tests/test_unify_training.py; numerics and graphs: tests/test_unify_graphs.py."""

import pytest
import torch
import torch.nn as nn

import jetrl_compile
from tests.conftest import tiny_model, token_ids

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_projection_rewritten_and_lm_head_embeddings_not(family):
    model = tiny_model(family, layers=2)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", compiler="aot_eager")
    eager = jetrl_compile.unify(tiny_model(family, layers=2), "fp8_fwd_bf16_bwd", mode="eager")
    before = jetrl_compile.linear_precisions(model)
    assert {r["source"] for m, r in before.items() if m != "lm_head"} == {"not compiled yet"}
    with torch.no_grad():  # with a KV cache: its update runs between two graphs of the layer
        assert torch.equal(model(token_ids(1, 8)).logits, eager(token_ids(1, 8)).logits)
    state = jetrl_compile.unified_state(model)
    assert list(state.layer_groups.values()) == [["model.layers.0", "model.layers.1"]], "one layer compile for both"
    rows = jetrl_compile.linear_precisions(model)
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn." + q for q in PROJECTIONS[:4])}
    expected |= {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in PROJECTIONS[4:]}
    assert {m for m, r in rows.items() if r["fprop"] == "fp8"} == expected
    assert all(rows[m]["source"].startswith("graph ") for m in expected), "read off the compiled graphs"
    assert rows["lm_head"]["fprop"] == "fp32" and rows["lm_head"]["source"].startswith("not quantized: lm_head")
    assert set(rows) == expected | {"lm_head"}, "embeddings are lookups, never GEMM sites"


@pytest.mark.parametrize(
    "recipe,compiler",
    [("bf16", "aot_eager"), ("fp8_fwd_bf16_bwd", "aot_eager"), ("jetrl", "aot_eager"), ("jetrl", "inductor"),
     ("fp8_all", "aot_eager"), ("fp8_all", "inductor")],
)
def test_precision_report_reads_every_gemm_on_either_bf16_gemm_path(recipe, compiler, gemm_path):
    """On the fp32 path a BF16 GEMM runs as an FP32 matmul of upcast operands; the report still
    reads its operands as BF16 (or FP8), and names the path the graphs were traced with.

    jetrl under Inductor: its partitioner saves the FP8 dgrad's ``deq(W)^T`` (FP32 on the fp32
    path) as a view the forward made, so the backward reads an FP8 operand as a saved tensor, not
    as a graph input. On an AVX2-only CPU (the fp32 path by default) the report called that dgrad
    ``mixed(fp8xfp32)`` until saved tensors were traced back to the forward."""
    model = tiny_model("llama", layers=1, use_cache=False)
    jetrl_compile.unify(model, recipe, compiler=compiler)
    ids = token_ids(1, 8)
    model(ids, labels=ids).loss.backward()
    assert {report["bf16_gemm"] for report in jetrl_compile.precision_report(model)} == {gemm_path}
    fwd = "bf16" if recipe == "bf16" else "fp8"
    bwd = "fp8" if recipe in ("jetrl", "fp8_all") else "bf16"
    handoff = "fp8" if recipe == "fp8_all" else "bf16"  # jetrl's dx is the dgrad's BF16 output
    for row in jetrl_compile.linear_precisions(model).values():
        expected = ("fp32",) * 4 if row["module"] == "lm_head" else (fwd, bwd, bwd, handoff)
        assert (row["fprop"], row["dgrad"], row["wgrad"], row["handoff"]) == expected, row
    (graph,) = jetrl_compile.unified_state(model).graphs
    quantized = [r for r in graph.backward if r.module != "lm_head"]
    assert {r.precision for r in quantized} == {bwd} and {r.out_dtype for r in quantized} == {"bfloat16"}


def test_include_lm_head_and_skip_patterns():
    model = tiny_model("llama", layers=2)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", include_lm_head=True, skip=["*.layers.1.mlp.*"],
                        compiler="aot_eager")
    ids = token_ids(1, 8)
    model(ids, labels=ids).loss.backward()
    rows = jetrl_compile.linear_precisions(model)
    fp8 = {m for m, r in rows.items() if r["fprop"] == "fp8"}
    assert "lm_head" in fp8 and "model.layers.1.mlp.up_proj" not in fp8 and "model.layers.0.mlp.up_proj" in fp8
    assert rows["lm_head"] == dict(rows["lm_head"], dgrad="bf16", wgrad="bf16", source="eager op")
    # layer 1 skips its MLP, so it compiles apart from layer 0: its MLP GEMMs read FP32 off its graphs
    assert list(jetrl_compile.unified_state(model).layer_groups.values()) == [["model.layers.0"], ["model.layers.1"]]
    for name in ("gate_proj", "up_proj", "down_proj"):
        row = rows[f"model.layers.1.mlp.{name}"]
        assert (row["fprop"], row["dgrad"], row["wgrad"]) == ("fp32",) * 3 and row["source"].startswith("graph ")


# --- API behaviour --------------------------------------------------------------------------------


def test_state_dict_round_trips_and_keys_are_untouched():
    model = tiny_model("llama")
    keys = list(model.state_dict())
    jetrl_compile.unify(model, "jetrl")
    state = model.state_dict()
    assert list(state) == keys
    fresh = tiny_model("llama", seed=1)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))


def test_eager_mode_and_restore():
    ids = token_ids(1, 12)
    model = tiny_model("llama", dtype=torch.bfloat16)
    with torch.no_grad():
        original = model(ids).logits
        jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", mode="eager")
        eager_fp8 = model(ids).logits
        assert not torch.equal(eager_fp8, original)
        assert (eager_fp8 - original).abs().mean() < 0.15 * original.abs().mean()
        jetrl_compile.restore(model)
        assert torch.equal(model(ids).logits, original)
    jetrl_compile.unify(model, "bf16", mode="eager")  # unify again after restore is fine


def test_restore_after_regional_compile_gives_back_the_plain_model():
    ids = token_ids(1, 8)
    model = tiny_model("llama", layers=2)
    with torch.no_grad():
        original = model(ids).logits
        jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", include_lm_head=True, compiler="aot_eager")
        unified = model(ids).logits
        jetrl_compile.restore(model)
        assert not torch.equal(unified, original)
        assert torch.equal(model(ids).logits, original)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    assert "forward" not in vars(model.lm_head), "lm_head's eager op is taken back too"


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_the_recipe_holds_under_gradient_checkpointing(mode):
    """transformers' gradient checkpointing recomputes each layer in the backward. Eager mode's
    patched linears and regional compilation's compiled layers (the very call transformers
    checkpoints) recompute the recipe's FP8 forward and run its BF16 backward, so the gradients
    are bitwise those without checkpointing and those of the eager op (and not the plain model's)."""
    ids = token_ids(2, 12)

    def grads(unified: str | None, checkpointing: bool) -> list[torch.Tensor]:
        model = tiny_model("llama", layers=2)
        if unified:
            jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", mode=unified, compiler="aot_eager")
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model(ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()]

    plain, eager, recomputed = grads(None, False), grads("eager", False), grads(mode, True)
    assert all(torch.equal(a, b) for a, b in zip(eager, recomputed))
    assert not all(torch.equal(a, b) for a, b in zip(plain, eager)), "the recipe changes the gradients"


def test_whole_model_compile_refuses_gradient_checkpointing():
    """Compiled as one graph, the model would run its checkpointed layers outside that graph as
    plain modules (the gradients would be the plain model's, bitwise): refused, naming the fixes."""
    model = tiny_model("llama", layers=1)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", compiler="aot_eager", regional=False)
    model.gradient_checkpointing_enable()
    model.train()
    ids = token_ids(1, 8)
    fixes = r"regional=True .*gradient_checkpointing_disable\(\), or unify with mode='eager'"
    with pytest.raises(Exception, match=fixes):
        model(ids, labels=ids)
    model.eval()  # transformers checkpoints only while training
    with torch.no_grad():
        model(ids)
    (report,) = jetrl_compile.precision_report(model)
    assert {r["fprop"] for r in report["linears"] if r["module"] != "lm_head"} == {"fp8"}


def test_clear_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="recipe 'fp16' is unknown; choose one of"):
        jetrl_compile.unify(model, "fp16")
    jetrl_compile.unify(model, "jetrl")
    with pytest.raises(RuntimeError, match=r"already unified \(recipe 'jetrl'\); call jetrl_compile.restore"):
        jetrl_compile.unify(model, "bf16")
    with pytest.raises(ValueError, match="found no nn.Linear in Sequential"):
        jetrl_compile.unify(nn.Sequential(nn.Embedding(4, 4), nn.ReLU()))
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        jetrl_compile.unify("gpt2")
    with pytest.raises(ValueError, match="is not unified"):
        jetrl_compile.precision_report(tiny_model("llama"))
    compiled = tiny_model("llama")
    compiled.compile()
    with pytest.raises(RuntimeError, match="already torch.compile'd"):
        jetrl_compile.unify(compiled)
    with pytest.raises(ValueError, match="unify mode 'fast' is unknown"):
        jetrl_compile.unify(tiny_model("llama"), mode="fast")


def test_unify_and_restore_leave_the_process_as_they_found_it():
    import logging

    limit = torch._dynamo.config.recompile_limit
    root_handlers = list(logging.getLogger().handlers)
    models = [jetrl_compile.unify(tiny_model("llama"), "bf16", compiler="aot_eager") for _ in range(3)]
    assert torch._dynamo.config.recompile_limit > limit  # room for each model's graphs
    eager = jetrl_compile.unify(tiny_model("llama"), "bf16", mode="eager")
    for model in [*models, eager]:
        jetrl_compile.restore(model)
    assert torch._dynamo.config.recompile_limit == limit
    library = logging.getLogger("jetrl_compile")
    assert all(isinstance(h, logging.NullHandler) for h in library.handlers) and library.level == logging.NOTSET
    assert logging.getLogger().handlers == root_handlers
