"""unify's compiled graphs: FP8 logits against the swapped eager op, JETRL_DUMP's files and report,
one regional compile for every layer and length, the KV cache left as it was."""

import json

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import jetrl_compile
from jetrl_compile.runtime import fp8_linear
from jetrl_compile.runtime.fp8_linear import INDUCTOR_OPTIONS
from tests.conftest import tiny_model, token_ids


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
    ids = token_ids(2, 24)
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
    ids = token_ids(1, 16)
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

| module | shape (N, K) | fprop | dgrad | wgrad | dx handed on |
|---|---|---|---|---|---|
| `model.layers.0.self_attn.q_proj` | 200x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.0.self_attn.k_proj` | 100x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.0.self_attn.v_proj` | 100x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.0.self_attn.o_proj` | 200x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.0.mlp.gate_proj` | 320x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.0.mlp.up_proj` | 320x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.0.mlp.down_proj` | 200x320 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.1.self_attn.q_proj` | 200x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.1.self_attn.k_proj` | 100x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.1.self_attn.v_proj` | 100x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.1.self_attn.o_proj` | 200x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.1.mlp.gate_proj` | 320x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.1.mlp.up_proj` | 320x200 | fp8 | bf16 | bf16 | bf16 |
| `model.layers.1.mlp.down_proj` | 200x320 | fp8 | bf16 | bf16 | bf16 |
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
        logits = model(token_ids(2, 5), use_cache=False).logits
        assert state.compiles == 1, "one graph for the four layers"
        assert torch.equal(logits, whole(token_ids(2, 5), use_cache=False).logits)
        for length in (9, 17, 30, 64):
            model(token_ids(2, length), use_cache=False)
        assert state.compiles == 1
        model(token_ids(2, 5))
        shallow(token_ids(2, 5))
        with_cache = state.compiles
        for length in (9, 17, 30, 64):
            model(token_ids(2, length))
    # the graphs around the cache update: as many for 4 layers as for 2, and no more per length
    assert 1 < with_cache == state.compiles == jetrl_compile.unified_state(shallow).compiles + 1
    out = model.generate(token_ids(1, 6), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)
    eager = jetrl_compile.unify(tiny_model("llama", layers=4, dtype=torch.bfloat16), "fp8_fwd_bf16_bwd", mode="eager")
    assert torch.equal(out, eager.generate(token_ids(1, 6), max_new_tokens=4, do_sample=False))


def test_the_kv_cache_is_left_as_it_was_and_a_static_compile_refuses_it():
    from transformers import DynamicCache

    model = tiny_model("llama", layers=2)
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", compiler="aot_eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(token_ids(1, 6), past_key_values=cache, use_cache=True)
    assert "update" not in vars(cache), "the eager cache update is set for the layer's call only"
    assert cache.get_seq_length() == 6
    static = jetrl_compile.unify(tiny_model("llama", layers=2), "fp8_fwd_bf16_bwd", compiler="aot_eager", dynamic=False)
    with torch.no_grad(), pytest.raises(ValueError, match="dynamic=False.* use_cache=False"):
        static(token_ids(1, 6))
