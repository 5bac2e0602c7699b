"""The driver's command line: what the user got wrong (flags, data, checkpoint, --out, model) is
one `error:` line and exit code 2, with the traceback behind --debug; nothing is lost."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import VLLM_TINY, load_example, tiny_model, word_tokenizer

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


# Every flag of the driver, with a value (or combination) that must be refused before anything
# loads: test_every_flag_has_a_bad_value fails for a flag added without an entry. {file} is an
# existing file, {missing} a path that does not exist. None: the flag takes no value to get wrong.
BAD = {
    "--model": [["--model", "{missing}"], ["--model", "{file}"]],
    "--task": [["--task", "chess"]],
    "--data": [["--task", "gsm8k", "--data", "{missing}"], ["--data", "{file}"]],
    "--difficulty": [["--difficulty", "7"]],
    "--recipe": [["--recipe", "fp9"]],
    "--engine": [["--engine", "tpu"]],
    "--steps": [["--steps", "-1"], ["--steps", "0"], ["--steps", "many"]],
    "--group-size": [["--group-size", "1"]],
    "--batch-size": [["--batch-size", "0"]],
    "--max-new-tokens": [["--max-new-tokens", "0"]],
    "--lr": [["--lr", "-1"], ["--lr", "nan"], ["--lr", "inf"]],
    "--seed": [["--seed", "-1"], ["--seed", "1.5"]],
    "--temperature": [["--temperature", "0"], ["--temperature", "0.001"]],
    "--clip-eps": [["--clip-eps", "-1"]],
    "--beta": [["--beta", "-1"]],
    "--rollout-correction": [["--rollout-correction", "is"]],
    "--correction-level": [["--correction-level", "batch"]],
    "--is-clip": [["--is-clip", "-1"]],
    "--is-low": [["--rollout-correction", "mis", "--is-low", "3"], ["--is-low", "-1"]],
    "--micro-batch": [["--micro-batch", "0"]],
    "--trainer-mode": [["--trainer-mode", "fast"], ["--exact", "--trainer-mode", "compile"]],
    "--exact": [["--exact", "--trainer-mode", "compile"]],
    "--parallel": [["--parallel", "ddp"], ["--parallel", "tp"]],
    "--device": [["--device", "tpu"]],
    "--vllm-memory": [["--vllm-memory", "1.5"], ["--vllm-memory", "0"]],
    "--out": [["--out", "{file}"], ["--out", "{file}/run"]],
    "--report-to": [["--report-to", "wandb"]],
    "--eval-every": [["--eval-every", "-1"]],
    "--save-every": [["--save-every", "0"]],
    "--plot-every": [["--plot-every", "0"]],
    "--resume": [["--resume"]],
    "--eval": [["--eval", "--resume"], ["--eval", "--overwrite"]],
    "--limit": [["--limit", "0"]],
    "--overwrite": [["--overwrite", "--resume"]],
    "--debug": None,
    "--verbose": None,
}


def _flags():
    parser = load_example("train_grpo").make_parser()
    return {a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}


def test_every_flag_has_a_bad_value():
    assert _flags() == set(BAD), "a flag without an entry in BAD (or an entry for no flag)"


CASES = [(name, argv) for name, cases in BAD.items() for argv in cases or []]


@pytest.mark.parametrize("name, argv", CASES, ids=[" ".join(argv) for _, argv in CASES])
def test_a_bad_setting_is_one_error_line_before_anything_is_written(capsys, tmp_path, monkeypatch, name, argv):
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # not under torchrun
        monkeypatch.delenv(variable, raising=False)
    existing = tmp_path / "notes.txt"
    existing.write_text("mine")
    places = {"file": str(existing), "missing": str(tmp_path / "missing")}
    argv = [part.format(**places) for part in argv]
    out = tmp_path / "run"
    code, err = _fails(capsys, ["--out", str(out), *argv])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert name in lines[0] and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and existing.read_text() == "mine"


def test_a_refusal_comes_before_any_model_library_is_imported(tmp_path):
    """In a fresh process: the refusal comes before transformers or vLLM is imported (what makes a
    model load take tens of seconds)."""
    script = (
        "import runpy, sys\n"
        "sys.argv = ['train_grpo.py', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_path('examples/train_grpo.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    heavy = [m for m in ('transformers', 'vllm', 'torch._inductor', 'matplotlib') if m in sys.modules]\n"
        "    print('HEAVY', heavy, file=sys.stderr)\n"
        "    raise\n"
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    for argv in (["--steps", "-1"], ["--out", str(tmp_path / "run")]):
        done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
        assert "HEAVY []" in done.stderr, done.stderr


def test_malformed_data_names_the_file_and_line(capsys, tmp_path):
    data = _gsm8k(tmp_path, [GOOD, "{not json\n"])
    code, err = _fails(capsys, ["--task", "gsm8k", "--data", str(data), "--out", str(tmp_path / "run")])
    assert code == 2 and f"error: {data}:2: not a GSM8K line" in err and "Traceback" not in err
    code, err = _fails(capsys, ["--task", "gsm8k", "--data", str(tmp_path / "none.jsonl"), "--out",
                                str(tmp_path / "run")])
    assert code == 2 and "none.jsonl: not found; pass --data PATH" in err


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
    code, err = _fails(capsys, ["--out", str(out)])
    assert code == 2 and "already holds a run (metrics.jsonl, checkpoints); pass --resume to continue it" in err
    code, err = _fails(capsys, ["--out", str(out), "--resume"])
    assert code == 2 and "step_000003.pt cannot be read as a jetrl_compile checkpoint" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing lost
    code, err = _fails(capsys, ["--out", str(tmp_path / "empty"), "--resume"])
    assert code == 2 and "holds no run (no checkpoint in" in err


def test_a_model_that_cannot_load_is_named(capsys, tmp_path, monkeypatch):
    code, err = _fails(capsys, ["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "run"), "--steps", "1"])
    assert code == 2 and f"error: --model {tmp_path / 'no-model'}: no such folder" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub name: the loader finds out, and names it
    code, err = _fails(capsys, ["--model", "no-such-owner/no-such-model", "--out", str(tmp_path / "run"),
                                "--engine", "hf", "--steps", "1"])
    assert code == 2 and "error: model 'no-such-owner/no-such-model' cannot be loaded" in err


def test_compare_recipes_refuses_a_misspelt_flow_before_training(capsys, tmp_path):
    code, err = _fails(capsys, ["--recipes", "bf16", "fp8+tis", "--out", str(tmp_path)], script="compare_recipes")
    assert code == 2 and "error: flow 'fp8+tis': write a recipe" in err
    assert not list(tmp_path.iterdir())  # bf16 was not trained first


def _documented(start: str) -> list[str]:
    """The flags of the command in docs/grpo-driver.md that starts ``python examples/train_grpo.py START``."""
    text = (ROOT / "docs" / "grpo-driver.md").read_text()
    prefix = f"python examples/train_grpo.py {start}"
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return shlex.split(line.split("#")[0])[2:]


def test_the_documented_resume_and_eval_commands_work_as_written(tmp_path, capsys, monkeypatch):
    """A run started with the docs' command; then their --resume and --eval commands, word for
    word: both take the run's settings from its config.json. A run-defining flag that differs is
    refused by name."""
    folder = tmp_path / "tiny-model"
    tiny_model("llama", layers=1, **VLLM_TINY).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)  # the docs' --out runs/jetrl is relative
    main = load_example("train_grpo").main
    small = ["--model", str(folder), "--engine", "hf", "--trainer-mode", "eager", "--group-size", "2",
             "--batch-size", "1", "--max-new-tokens", "3", "--steps", "2", "--plot-every", "100", "--save-every", "100"]
    main([*_documented("--recipe jetrl"), *small])
    resume = _documented("--resume")
    assert resume == ["--resume", "--steps", "50", "--out", "runs/jetrl"]
    main(resume)
    rows = [json.loads(line) for line in Path("runs/jetrl/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 51))
    settings = json.loads(Path("runs/jetrl/config.json").read_text())
    assert (settings["recipe"], settings["model"], settings["steps"], settings["group_size"]) == (
        "jetrl", str(folder), 50, 2)
    capsys.readouterr()

    main(_documented("--eval"))
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(Path("runs/jetrl/eval.json").read_text())
    assert result["recipe"] == "jetrl" and result["problems"] == 200
    assert result["checkpoint"].endswith("step_000050.pt")

    code, err = _fails(capsys, ["--resume", "--steps", "60", "--recipe", "bf16", "--out", "runs/jetrl"])
    assert code == 2 and "--recipe bf16: the run in runs/jetrl has recipe='jetrl'; drop --recipe to resume it" in err
    code, err = _fails(capsys, ["--eval", "--group-size", "4", "--out", "runs/jetrl"])
    assert code == 2 and "--group-size 4: the run in runs/jetrl has group_size=2; drop --group-size" in err
