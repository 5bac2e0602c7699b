"""The driver's command line: what the user got wrong (flags, data, checkpoint, --out, model) is
one `error:` line and exit code 2, with the traceback behind --debug; nothing is lost."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_example

ROOT = Path(__file__).resolve().parents[2]


def _fails(capsys, argv, script="train_grpo"):
    """(exit code, stderr) of the example's main(argv), which must stop."""
    with pytest.raises(SystemExit) as stopped:
        load_example(script).main(argv)
    return stopped.value.code, capsys.readouterr().err


def _gsm8k(tmp_path, lines):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(lines))
    return path


GOOD = json.dumps({"question": "1 + 1?", "answer": "2\n#### 2"}) + "\n"


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "fp9"], "argument --recipe: invalid choice: 'fp9'"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["--is-clip", "-1"], "error: --is-clip must be a positive number; got -1.0"),
    (["--rollout-correction", "tis", "--is-low", "3"], r"error: --is-low must be in \[0, --is-clip\)"),
    (["--task", "gsm8k"], "error: --task gsm8k needs --data PATH"),
    (["--difficulty", "7"], "error: arithmetic difficulty 7 must be 1, 2 or 3"),
    (["--exact", "--trainer-mode", "compile"], "error: --exact runs the trainer eagerly"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--vllm-memory", "1.5"], r"error: --vllm-memory 1.5 is a share of the GPU's memory: 0 < share <= 1"),
])
def test_bad_flags_are_one_error_line_and_exit_2(capsys, tmp_path, argv, message):
    code, err = _fails(capsys, [*argv, "--out", str(tmp_path / "run")])
    assert code == 2 and "Traceback" not in err
    assert re.search(message, err), err


def test_malformed_data_names_the_file_and_line(capsys, tmp_path):
    data = _gsm8k(tmp_path, [GOOD, "{not json\n"])
    code, err = _fails(capsys, ["--task", "gsm8k", "--data", str(data), "--out", str(tmp_path / "run")])
    assert code == 2 and f"error: {data}:2: not a GSM8K line" in err and "Traceback" not in err
    code, err = _fails(capsys, ["--task", "gsm8k", "--data", str(tmp_path / "none.jsonl"), "--out",
                                str(tmp_path / "run")])
    assert code == 2 and "none.jsonl not found; pass --data PATH" in err


def test_debug_shows_the_traceback(tmp_path):
    data = _gsm8k(tmp_path, ["{not json\n"])
    command = [sys.executable, str(ROOT / "examples" / "train_grpo.py"), "--task", "gsm8k", "--data", str(data),
               "--out", str(tmp_path / "run")]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert plain.returncode == 2 and plain.stderr.startswith("error: ") and "Traceback" not in plain.stderr
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "UsageValueError" in debug.stderr


def test_occupied_out_and_missing_or_truncated_checkpoints_stop_before_a_model_loads(capsys, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_000003.pt").write_bytes(b"truncated")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    no_model = ["--model", str(tmp_path / "no-model")]  # loading it would be another error
    code, err = _fails(capsys, ["--out", str(out), *no_model])
    assert code == 2 and "already holds a run (checkpoints/); pass --resume to continue it" in err
    code, err = _fails(capsys, ["--out", str(out), *no_model, "--resume"])
    assert code == 2 and "step_000003.pt cannot be read as a jetrl_compile checkpoint" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing lost
    code, err = _fails(capsys, ["--out", str(tmp_path / "empty"), "--resume"])
    assert code == 2 and "--resume: no checkpoint in" in err


def test_a_model_that_cannot_load_is_named(capsys, tmp_path):
    code, err = _fails(capsys, ["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "run"), "--steps", "1"])
    assert code == 2 and f"error: model '{tmp_path / 'no-model'}' cannot be loaded" in err


def test_compare_recipes_refuses_a_misspelt_flow_before_training(capsys, tmp_path):
    code, err = _fails(capsys, ["--recipes", "bf16", "fp8+tis", "--out", str(tmp_path)], script="compare_recipes")
    assert code == 2 and "error: flow 'fp8+tis': write a recipe" in err
    assert not list(tmp_path.iterdir())  # bf16 was not trained first
