"""unify(model, recipe) on tiny random HF models: rewrite coverage, graphs, numerics, training."""

import json

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import jetrl_compile
from jetrl_compile.runtime import fp8_linear
from jetrl_compile.runtime.fp8_linear import INDUCTOR_OPTIONS
from tests.conftest import tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TRAIN_RECIPES = ("bf16", "fp8_fwd_bf16_bwd", "jetrl", "fp8_rollout_only")


def _ids(batch=2, length=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_projection_rewritten_and_lm_head_embeddings_not(family):
    model = tiny_model(family, layers=2)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", compiler="aot_eager")
    eager = jetrl_compile.unify(tiny_model(family, layers=2), "fp8_fwd_bf16_bwd", mode="eager")
    before = jetrl_compile.linear_precisions(model)
    assert {r["source"] for m, r in before.items() if m != "lm_head"} == {"not compiled yet"}
    with torch.no_grad():  # with a KV cache: its update runs between two graphs of the layer
        assert torch.equal(model(_ids(1, 8)).logits, eager(_ids(1, 8)).logits)
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
    [("bf16", "aot_eager"), ("fp8_fwd_bf16_bwd", "aot_eager"), ("jetrl", "aot_eager"), ("jetrl", "inductor")],
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
    ids = _ids(1, 8)
    model(ids, labels=ids).loss.backward()
    assert {report["bf16_gemm"] for report in jetrl_compile.precision_report(model)} == {gemm_path}
    fwd = "bf16" if recipe == "bf16" else "fp8"
    bwd = "fp8" if recipe == "jetrl" else "bf16"
    for row in jetrl_compile.linear_precisions(model).values():
        expected = ("fp32",) * 3 if row["module"] == "lm_head" else (fwd, bwd, bwd)
        assert (row["fprop"], row["dgrad"], row["wgrad"]) == expected, row
    (graph,) = jetrl_compile.unified_state(model).graphs
    quantized = [r for r in graph.backward if r.module != "lm_head"]
    assert {r.precision for r in quantized} == {bwd} and {r.out_dtype for r in quantized} == {"bfloat16"}


def test_include_lm_head_and_skip_patterns():
    model = tiny_model("llama", layers=2)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", include_lm_head=True, skip=["*.layers.1.mlp.*"],
                        compiler="aot_eager")
    ids = _ids(1, 8)
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


# --- training: one compiled model per recipe, shared by the tests below ----------------------


@pytest.fixture(scope="module")
def trained():
    """For each recipe: a 1-layer Llama with FP32 master weights, 30 AdamW steps on a fixed batch.
    No KV cache (as a trainer runs): the layer is one graph, forward and backward."""
    runs = {}
    ids = _ids()
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
    ids = _ids()
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
    ids = _ids()
    with torch.no_grad():
        model(ids)
        model(ids)  # same weights: no re-quantization
    assert cache.quantizations == before
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.0)  # an in-place update bumps the version
    model(ids, labels=ids)
    assert cache.quantizations == before + 1


# --- numerics, dump, dynamic shapes, generate --------------------------------------------------


class _SwappedLinear(nn.Module):
    """Reference: an nn.Linear replaced by the eager FP8 op (weight quantized inside the call)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return fp8_linear(x, self.weight, self.bias, recipe="fp8_fwd_bf16_bwd")


def _swap_linears(model):
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if (isinstance(child, nn.Linear) and not f"{name}.{child_name}".endswith("lm_head")
                    and child_name != "lm_head"):
                setattr(module, child_name, _SwappedLinear(child))
    return model


def test_fp8_logits_differ_slightly_from_bf16_and_equal_swapped_op_reference():
    ids = _ids(2, 24)
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    with torch.no_grad():
        bf16_logits = model(ids).logits.float()
    reference = _swap_linears(tiny_model("llama", layers=2, dtype=torch.bfloat16))
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd")
    for layer in reference.model.layers:  # compiled per layer with the op's Inductor options, as unify does
        layer.compile(options=INDUCTOR_OPTIONS)
    with torch.no_grad():
        fp8_logits = model(ids, use_cache=False).logits.float()
        ref_logits = reference(ids, use_cache=False).logits.float()
    diff = (fp8_logits - bf16_logits).abs()
    # Random tiny-model logits are small (mean |logit| about 0.2); two FP8 layers move them by
    # a few percent of that. 15% is far below what a wrong GEMM or a skipped scale would do.
    assert 0 < diff.mean() < 0.15 * bf16_logits.abs().mean()
    assert torch.equal(fp8_logits, ref_logits), (fp8_logits - ref_logits).abs().max()


def test_dump_writes_graphs_and_precision_report(tmp_path, monkeypatch):
    monkeypatch.setenv("JETRL_BF16_GEMM", "fp32")  # the report names the path; fixed for the expectation
    monkeypatch.setenv("JETRL_DUMP", "1")
    monkeypatch.setenv("JETRL_DUMP_DIR", str(tmp_path))
    model = tiny_model("llama", layers=2)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd")
    ids = _ids(1, 16)
    model(ids, labels=ids, use_cache=False).loss.backward()  # graph 0: the decoder layer, run by both
    # a second model in the same process (a reference model, another recipe) gets its own folder
    other = jetrl_compile.unify(tiny_model("llama", layers=1), "bf16", compiler="aot_eager")
    with torch.no_grad():
        other(ids)
    (run,) = tmp_path.iterdir()
    first, second = sorted(run.iterdir(), key=lambda p: int(p.name.split("-")[0].removeprefix("model_")))
    assert first.name.endswith("-fp8_fwd_bf16_bwd") and second.name.endswith("-bf16")
    files = sorted(p.name for p in (first / "graph_000").iterdir())
    assert files == [
        "aot_backward.py", "aot_forward.py", "dynamo_after.py", "dynamo_before.py",
        "precision_report.json", "precision_report.md",
    ]
    assert {"dynamo_before.py", "dynamo_after.py", "precision_report.json"} <= {
        p.name for p in (second / "graph_000").iterdir()
    }
    assert json.loads((second / "graph_000" / "precision_report.json").read_text())["recipe"] == "bf16"
    graph = first / "graph_000"
    assert "f8e4m3fn" in (graph / "aot_forward.py").read_text()
    assert "f8e4m3fn" not in (graph / "aot_backward.py").read_text()
    assert "fp8_linear" in (graph / "dynamo_after.py").read_text()
    assert "fp8_linear" not in (graph / "dynamo_before.py").read_text()
    report = json.loads((graph / "precision_report.json").read_text())
    assert report["backward_compiled"] and len(report["linears"]) == 14
    assert (report["region"], report["modules"]) == ("LlamaDecoderLayer", ["model.layers.0", "model.layers.1"])
    assert_expected_inline(
        (graph / "precision_report.md").read_text(),
        """\
# Precision report, graph 0

Recipe `fp8_fwd_bf16_bwd`: rewrote 7 of 7 linears.
Read off the compiled graphs: forward yes, backward yes.
FP8 GEMM kernel: emulated (dequantize + fp32 matmul of bf16 values); BF16 GEMM path: `fp32`.
Regional compilation: a compiled `LlamaDecoderLayer`, run by 2 layers
(`model.layers.0` ... `model.layers.1`); the table lists each.

| module | shape (N, K) | fprop | dgrad | wgrad |
|---|---|---|---|---|
| `model.layers.0.self_attn.q_proj` | 200x200 | fp8 | bf16 | bf16 |
| `model.layers.0.self_attn.k_proj` | 100x200 | fp8 | bf16 | bf16 |
| `model.layers.0.self_attn.v_proj` | 100x200 | fp8 | bf16 | bf16 |
| `model.layers.0.self_attn.o_proj` | 200x200 | fp8 | bf16 | bf16 |
| `model.layers.0.mlp.gate_proj` | 320x200 | fp8 | bf16 | bf16 |
| `model.layers.0.mlp.up_proj` | 320x200 | fp8 | bf16 | bf16 |
| `model.layers.0.mlp.down_proj` | 200x320 | fp8 | bf16 | bf16 |
| `model.layers.1.self_attn.q_proj` | 200x200 | fp8 | bf16 | bf16 |
| `model.layers.1.self_attn.k_proj` | 100x200 | fp8 | bf16 | bf16 |
| `model.layers.1.self_attn.v_proj` | 100x200 | fp8 | bf16 | bf16 |
| `model.layers.1.self_attn.o_proj` | 200x200 | fp8 | bf16 | bf16 |
| `model.layers.1.mlp.gate_proj` | 320x200 | fp8 | bf16 | bf16 |
| `model.layers.1.mlp.up_proj` | 320x200 | fp8 | bf16 | bf16 |
| `model.layers.1.mlp.down_proj` | 200x320 | fp8 | bf16 | bf16 |
""",
    )


def test_one_layer_compile_serves_every_layer_and_every_length():
    """Regional compilation: a 4-layer model compiles its decoder layer once, and with
    ``dynamic=True`` no sequence length of 5..64 recompiles it. With a KV cache the layer is
    the graphs around the cache update, again shared by every layer; generate works."""
    model = tiny_model("llama", layers=4, dtype=torch.bfloat16)
    # aot_eager: shape specialisation is decided by Dynamo and AOTAutograd, before Inductor.
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", dynamic=True, compiler="aot_eager")
    state = jetrl_compile.unified_state(model)
    whole = tiny_model("llama", layers=4, dtype=torch.bfloat16)
    jetrl_compile.unify(whole, "fp8_fwd_bf16_bwd", dynamic=True, compiler="aot_eager", regional=False)
    shallow = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    jetrl_compile.unify(shallow, "fp8_fwd_bf16_bwd", dynamic=True, compiler="aot_eager")
    with torch.no_grad():
        logits = model(_ids(2, 5), use_cache=False).logits
        assert state.compiles == 1, "one graph for the four layers"
        assert torch.equal(logits, whole(_ids(2, 5), use_cache=False).logits)
        for length in (9, 17, 30, 64):
            model(_ids(2, length), use_cache=False)
        assert state.compiles == 1
        model(_ids(2, 5))
        shallow(_ids(2, 5))
        with_cache = state.compiles
        for length in (9, 17, 30, 64):
            model(_ids(2, length))
    # the graphs around the cache update: as many for 4 layers as for 2, and no more per length
    assert 1 < with_cache == state.compiles == jetrl_compile.unified_state(shallow).compiles + 1
    out = model.generate(_ids(1, 6), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)
    eager = jetrl_compile.unify(tiny_model("llama", layers=4, dtype=torch.bfloat16), "fp8_fwd_bf16_bwd", mode="eager")
    assert torch.equal(out, eager.generate(_ids(1, 6), max_new_tokens=4, do_sample=False))


def test_the_kv_cache_is_left_as_it_was_and_a_static_compile_refuses_it():
    from transformers import DynamicCache

    model = tiny_model("llama", layers=2)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", compiler="aot_eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(_ids(1, 6), past_key_values=cache, use_cache=True)
    assert "update" not in vars(cache), "the eager cache update is set for the layer's call only"
    assert cache.get_seq_length() == 6
    static = jetrl_compile.unify(tiny_model("llama", layers=2), "fp8_fwd_bf16_bwd", compiler="aot_eager", dynamic=False)
    with torch.no_grad(), pytest.raises(ValueError, match="dynamic=False.* use_cache=False"):
        static(_ids(1, 6))


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
    ids = _ids(1, 12)
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
    ids = _ids(1, 8)
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
    ids = _ids(2, 12)

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
    ids = _ids(1, 8)
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
