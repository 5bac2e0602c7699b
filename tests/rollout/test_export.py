"""export_vllm writes the trainer's own quantized bytes; validate_export refuses broken exports by name."""

import json

import pytest
import torch
from safetensors.torch import load_file

import jetrl_compile
from jetrl_compile.rl.mismatch import mismatch_metrics
from jetrl_compile.rollout.export import WEIGHTS_FILE, export_vllm, rollout_tensors, validate_export
from tests.conftest import (
    VLLM_TINY,
    assert_same_quantization,
    corrupt_export,
    tiny_model,
    unified_tiny,
    word_tokenizer,
)


def test_export_holds_the_trainers_cached_bytes(tmp_path):
    model = unified_tiny()
    cache = jetrl_compile.unified_state(model).cache
    x = torch.randint(0, 256, (2, 9))
    model(input_ids=x).logits.sum().backward()  # the trainer's forward fills the cache
    path = export_vllm(model, tmp_path, tokenizer=False)
    tensors = load_file(str(path / WEIGHTS_FILE))
    config = json.loads((path / "config.json").read_text())
    qcfg = config["quantization_config"]
    assert qcfg["quant_method"] == "jetrl" and qcfg["recipe"] == "fp8_fwd_bf16_bwd" and qcfg["rollout"] == "fp8"
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert sorted(qcfg["modules"]) == sorted(linears) and len(linears) == 14
    quantizations = cache.quantizations
    for name in linears:
        weight = model.get_submodule(name).weight
        assert_same_quantization((tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]), cache.get(weight))
    assert cache.quantizations == quantizations, "export re-quantized instead of reading the cache"
    # everything else in the trainer's dtype, bit for bit
    for name, p in model.named_parameters():
        if name.removesuffix(".weight") not in linears:
            assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], p.detach())
    assert config["torch_dtype"] == "float32"
    assert validate_export(path) == qcfg


def test_bf16_recipe_exports_bf16_linears_and_native_fp8_format(tmp_path):
    model = unified_tiny("bf16", dtype=torch.float32)
    export_vllm(model, tmp_path / "bf16", tokenizer=False)
    t = load_file(str(tmp_path / "bf16" / WEIGHTS_FILE))
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.up_proj.weight_scale" not in t
    with pytest.raises(ValueError, match="native fp8 format needs an FP8 rollout"):
        export_vllm(model, tmp_path / "x", format="fp8", tokenizer=False)

    fp8 = unified_tiny("fp8_rollout_only", dtype=torch.float32)
    path = export_vllm(fp8, tmp_path / "native", format="fp8", tokenizer=False)
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "fp8" and qcfg["weight_block_size"] == [128, 128]
    t = load_file(str(path / WEIGHTS_FILE))
    w = fp8.model.layers[1].self_attn.k_proj.weight
    cache = jetrl_compile.unified_state(fp8).cache
    assert_same_quantization(
        (t["model.layers.1.self_attn.k_proj.weight"], t["model.layers.1.self_attn.k_proj.weight_scale_inv"]),
        cache.get(w),
    )
    assert t["model.norm.weight"].dtype == torch.bfloat16


def test_export_of_a_plain_model_needs_no_unify_and_refuses_a_conflicting_recipe(tmp_path):
    plain = tiny_model("llama", layers=1, **VLLM_TINY)
    names = dict(rollout_tensors(plain, "jetrl"))
    assert names["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="unified with recipe 'fp8_fwd_bf16_bwd'"):
        export_vllm(unified_tiny(), tmp_path, recipe="bf16", tokenizer=False)
    with pytest.raises(ValueError, match="export format 'int4' is unknown"):
        list(rollout_tensors(plain, "jetrl", fmt="int4"))


@pytest.mark.parametrize(
    "corruption, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.gate_proj.weight_scale"),
         "scale model.layers.1.mlp.gate_proj.weight_scale is missing"),
        (lambda t: t.pop("model.layers.0.self_attn.o_proj.weight"),
         "tensor model.layers.0.self_attn.o_proj.weight is missing"),
        (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].bfloat16()}),
         "model.layers.0.mlp.up_proj.weight has dtype BF16, expected F8_E4M3"),
        (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight_scale": torch.ones(2, 2)}),
         r"model.layers.0.self_attn.k_proj.weight_scale is torch.float32 \(2, 2\); expected float32 \(1, 2\)"),
        (lambda t: t["model.layers.0.self_attn.q_proj.weight_scale"].mul_(3), "not positive powers of two"),
    ],
)
def test_validate_export_names_the_broken_tensor(tmp_path, corruption, message):
    path = export_vllm(unified_tiny(), tmp_path, tokenizer=False)
    corrupt_export(path, corruption)
    with pytest.raises(ValueError, match=message):
        validate_export(path)


def test_validate_export_of_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a jetrl_compile export"):
        validate_export(tmp_path / "nothing")


def test_mismatch_metrics_by_hand():
    rollout = [[-1.0, -2.0], [-0.5]]
    trainer = torch.tensor([-1.0, -1.0, -0.5 - 1.0])  # d = 0, +1, -1
    m = mismatch_metrics(rollout, trainer)
    k3 = [0.0, torch.e - 2.0, torch.exp(torch.tensor(-1.0)).item()]  # e^d - 1 - d
    assert m["tokens"] == 3
    assert m["logprob_abs_diff_mean"] == pytest.approx(2 / 3)
    assert m["logprob_abs_diff_max"] == pytest.approx(1.0)
    assert m["mismatch_kl"] == pytest.approx(sum(k3) / 3)
    assert m["ratio_outside_frac"] == pytest.approx(2 / 3)  # |d| = 1 > ln 2 twice
    same = mismatch_metrics(rollout, rollout)
    assert same["mismatch_kl"] == 0.0 and same["ratio_outside_frac"] == 0.0
    with pytest.raises(ValueError, match="3 rollout logprobs but 2 trainer"):
        mismatch_metrics(rollout, [0.0, 0.0])


def test_export_without_a_tokenizer_copies_the_models_source_one(tmp_path):
    from transformers import AutoTokenizer

    source = tmp_path / "source"
    word_tokenizer().save_pretrained(source)
    model = unified_tiny()
    model.config._name_or_path = str(source)
    path = export_vllm(model, tmp_path / "export")
    assert AutoTokenizer.from_pretrained(path)("w3 w4").input_ids == [3, 4]


def test_export_of_the_embedded_default_copies_its_gguf_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from jetrl_compile.models import default_model_path

    model = unified_tiny()
    model.config._name_or_path = str(default_model_path()[0])  # what load_model() leaves there
    path = export_vllm(model, tmp_path)
    assert len(AutoTokenizer.from_pretrained(path)) == 49152  # SmolLM2's vocabulary


def test_export_without_any_tokenizer_says_how_to_pass_one_and_writes_nothing(tmp_path):
    model = unified_tiny()  # built in code: no source
    with pytest.raises(ValueError, match=r"config._name_or_path is empty\); pass tokenizer=AutoTokenizer"):
        export_vllm(model, tmp_path / "a")
    model.config._name_or_path = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"no tokenizer could be loaded from the model's source .*tokenizer=False"):
        export_vllm(model, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    export_vllm(model, tmp_path / "c", tokenizer=False)
    assert not list((tmp_path / "c").glob("tokenizer*"))
