"""The GRPO driver on tiny random models: formulas by hand, one step per recipe and engine,
bit-exact resume, refused NaN steps, engine failures, checkpoints of another run, GSM8K parsing."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import jetrl_compile
from jetrl_compile.rl import loop
from jetrl_compile.rl.checkpoint import latest_checkpoint
from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rl.grpo import clipped_policy_loss, group_advantages
from jetrl_compile.rl.loop import train
from jetrl_compile.rl.tasks import (
    ArithmeticTask,
    Gsm8kTask,
    Problem,
    answer_reward,
    conversational_rows,
    extract_answer,
    gsm8k_reference,
    reward,
)
from tests.conftest import VLLM_TINY, ByteTokenizer, requires_vllm, tiny_model

REQUIRED = ["step", "reward_mean", "accuracy", "mismatch_kl", "logprob_abs_diff_mean", "rollout_s", "train_s", "sync_s",
            "tokens_per_s"]
ENGINES = ["hf", pytest.param("vllm", marks=requires_vllm)]


def _cfg(tmp_path, **kw) -> GrpoConfig:
    base = dict(steps=1, batch_size=2, group_size=2, max_new_tokens=6, lr=1e-3, trainer_mode="eager", engine="hf",
                out=str(tmp_path / "run"), save_every=1, plot_every=1, micro_batch=3)
    return GrpoConfig(**{**base, **kw})


def _run(cfg, task=None, seed=0):
    model = tiny_model("llama", layers=1, seed=seed, **VLLM_TINY)
    return model, train(cfg, model=model, tokenizer=ByteTokenizer(), task=task, progress=False)


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]))
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    expected = 0.5 / (std + 1e-4)
    assert adv[0].tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)
    assert adv[1].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))


def test_clipped_loss_by_hand():
    new = [torch.tensor([math.log(1.5), math.log(0.9)])]
    old = [torch.zeros(2)]
    up = clipped_policy_loss(new, old, torch.tensor([1.0]), clip_eps=0.2)
    # A > 0: min(r, clip(r)) -> 1.2 for r = 1.5 (clipped), 0.9 for r = 0.9
    assert up.loss_sum.item() == pytest.approx(-(1.2 + 0.9)) and up.tokens == 2 and up.clipped == 1
    down = clipped_policy_loss(new, old, torch.tensor([-2.0]), clip_eps=0.2)
    # A < 0: min(-2r, -2 clip(r)) -> -3.0 for r = 1.5 (unclipped wins), -2 * 0.9 = -1.8 for r = 0.9
    assert down.loss_sum.item() == pytest.approx(3.0 + 1.8) and down.clipped == 0
    ref = [torch.tensor([0.0, math.log(0.9)])]
    kl = clipped_policy_loss(new, old, torch.tensor([1.0]), ref_logprobs=ref, beta=0.5)
    d = -math.log(1.5)
    assert kl.loss_sum.item() == pytest.approx(up.loss_sum.item() + 0.5 * (math.exp(d) - 1 - d))


def test_loss_gradient_raises_the_better_completion():
    good, bad = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    adv = group_advantages(torch.tensor([[1.0, 0.0]]))[0]
    parts = clipped_policy_loss([good, bad], [torch.zeros(3), torch.zeros(2)], adv)
    parts.loss_sum.backward()
    assert (good.grad < 0).all() and (bad.grad > 0).all()  # descent raises good's logprobs, lowers bad's


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("recipe", ["bf16", "fp8_fwd_bf16_bwd", "jetrl", "fp8_rollout_only"])
def test_one_step_end_to_end(tmp_path, recipe, engine):
    cfg = _cfg(tmp_path, recipe=recipe, engine=engine)
    model, metrics = _run(cfg)
    assert len(metrics) == 1
    row = metrics[0]
    for key in REQUIRED:
        assert key in row and math.isfinite(row[key]), key
    assert row["step"] == 1 and not row["refused"]
    out = Path(cfg.out)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert (out / "metrics.png").stat().st_size > 1000
    assert latest_checkpoint(out).name == "step_000001.pt"
    if recipe in ("bf16", "fp8_fwd_bf16_bwd", "jetrl"):
        assert row["logprob_abs_diff_mean"] < 1e-3, row  # one precision flow: the engine samples the trainer's function


class EarnableTask(ArithmeticTask):
    """A reward a tiny random model earns unevenly (a function of the sampled bytes), so group
    advantages, gradients and weight updates are nonzero: what a resume test needs to prove anything."""

    def score(self, completion, problem):
        return (sum(completion.encode()) % 5) / 4, False


def _resume_case(tmp_path, engine, **kw):
    """(uninterrupted run, run interrupted after step 2 and resumed to step 4)."""
    cfg = dict(steps=4, engine=engine, lr=1e-2, **kw)
    straight, straight_rows = _run(_cfg(tmp_path / "a", **cfg), task=EarnableTask(seed=0))
    _run(_cfg(tmp_path / "b", **{**cfg, "steps": 2}), task=EarnableTask(seed=0))
    resumed, resumed_rows = _run(_cfg(tmp_path / "b", **cfg, resume=True), task=EarnableTask(seed=0),
                                 seed=123)  # weights come from the checkpoint
    return (straight, straight_rows, tmp_path / "a"), (resumed, resumed_rows, tmp_path / "b")


def _untimed(rows):
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "tokens_per_s"} for r in rows]


def _checkpoint(root):
    return torch.load(latest_checkpoint(root / "run"), weights_only=True)


def test_the_trainer_is_compiled_by_default_and_eager_where_it_must_be():
    assert GrpoConfig().resolved_trainer_mode() == "compile"
    assert GrpoConfig(exact=True).resolved_trainer_mode() == "eager"  # exact mode runs eagerly
    assert GrpoConfig(parallel="fsdp", recipe="jetrl").resolved_trainer_mode() == "eager"  # FP8 all-gather is eager
    assert GrpoConfig(parallel="fsdp").resolved_trainer_mode() == "compile"  # no FP8 all-gather for the default
    assert GrpoConfig(trainer_mode="eager").resolved_trainer_mode() == "eager"


@pytest.mark.parametrize("engine, trainer_mode", [
    ("hf", "eager"),
    pytest.param("vllm", "auto", marks=requires_vllm),  # the default: vLLM and the compiled trainer
])
def test_resume_continues_bit_for_bit(tmp_path, engine, trainer_mode):
    (straight, rows, a), (resumed, resumed_rows, b) = _resume_case(tmp_path, engine, trainer_mode=trainer_mode)
    assert all(r["grad_norm"] > 0 for r in rows)  # every step moved the weights (the loss of an
    # on-policy step is about 0 by construction: normalised advantages average to 0)
    assert all(r["logprob_abs_diff_mean"] < 1e-3 for r in rows), rows  # the engine samples the trainer's function
    if trainer_mode == "auto":  # compiled: the trainer's linears are the compiled graph's, FP8 forward, BF16 backward
        precisions = jetrl_compile.linear_precisions(straight)
        layer = {k: v for k, v in precisions.items() if ".layers." in k}
        assert len(layer) == 7 and all(r["source"] == "graph 0" for r in layer.values()), precisions
        assert all((r["fprop"], r["dgrad"], r["wgrad"]) == ("fp8", "bf16", "bf16") for r in layer.values())
    initial = tiny_model("llama", layers=1, seed=0, **VLLM_TINY)
    assert not torch.equal(initial.lm_head.weight, straight.lm_head.weight.float())
    assert [m["step"] for m in resumed_rows] == [3, 4]
    for (name, x), (_, y) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(x, y), name
    opt_a, opt_b = _checkpoint(a)["optimizer"], _checkpoint(b)["optimizer"]
    for key, state in opt_a["state"].items():
        assert state["exp_avg"].abs().sum() > 0
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[field], opt_b["state"][key][field]), (key, field)
    assert _untimed(resumed_rows) == _untimed(rows[2:])
    lines = (b / "run" / "metrics.jsonl").read_text().splitlines()
    assert _untimed(json.loads(line) for line in lines) == _untimed(rows)


@pytest.mark.parametrize("broken", ["task_rng", "optimizer"])
def test_resume_test_fails_when_restore_is_broken(tmp_path, monkeypatch, broken):
    """The resume test above can fail: skip restoring the task's RNG (the problem stream) or the
    AdamW state and the resumed run leaves the uninterrupted one. (torch's and Python's global RNG
    states are restored too, but nothing in the loop draws from them: rollout sampling is seeded
    per request.)"""
    if broken == "task_rng":
        monkeypatch.setattr(EarnableTask, "load_state_dict", lambda self, state: None)
    else:
        monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", lambda self, state: None)
    (straight, _, _), (resumed, _, _) = _resume_case(tmp_path, "hf")
    assert not all(torch.equal(x, y) for x, y in zip(straight.state_dict().values(), resumed.state_dict().values()))


class PoisonedTask(ArithmeticTask):
    """A reward bug: every score is NaN."""

    def score(self, completion, problem):
        return float("nan"), False


def test_nan_step_is_refused_and_changes_nothing(tmp_path):
    cfg = _cfg(tmp_path, steps=1)
    model, _ = _run(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = torch.load(latest_checkpoint(cfg.out), weights_only=False)["optimizer"]
    cfg2 = _cfg(tmp_path, steps=2, resume=True)
    model2, metrics = _run(cfg2, task=PoisonedTask(seed=0))
    assert metrics[0]["refused"] and metrics[0]["refused_steps"] == 1
    assert math.isnan(metrics[0]["loss"])
    line = (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()[-1]
    written = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON: {line}"))
    assert written["loss"] is None and "loss" in written["non_finite"]
    for k, v in model2.state_dict().items():
        assert torch.equal(v, before[k]), k
    opt_after = torch.load(latest_checkpoint(cfg.out), weights_only=False)["optimizer"]
    for i, state in opt_before["state"].items():
        assert torch.equal(state["exp_avg"], opt_after["state"][i]["exp_avg"])


class FlakyEngine:
    """Wraps an engine: its first ``failures`` generate calls raise."""

    def __init__(self, engine, failures):
        self.engine, self.failures, self.name = engine, failures, "flaky"

    def generate(self, *a, **kw):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("engine fell over")
        return self.engine.generate(*a, **kw)

    def sync(self, model):
        return self.engine.sync(model)

    def close(self):
        self.engine.close()


def test_engine_error_is_retried_once_then_stops_with_a_checkpoint(tmp_path, monkeypatch):
    real = loop.make_engine
    monkeypatch.setattr(loop, "make_engine", lambda *a, **kw: FlakyEngine(real(*a, **kw), failures=1))
    _, metrics = _run(_cfg(tmp_path / "once", steps=1))
    assert len(metrics) == 1

    monkeypatch.setattr(loop, "make_engine", lambda *a, **kw: FlakyEngine(real(*a, **kw), failures=99))
    cfg = _cfg(tmp_path / "always", steps=2)
    with pytest.raises(SystemExit, match="failed twice at step 1: engine fell over") as stopped:
        _run(cfg)
    assert latest_checkpoint(cfg.out).name == "step_000000.pt"
    # the same error twice: a resume would meet it again, so no advice to resume
    assert "--resume" not in str(stopped.value) and "fix the cause first" in str(stopped.value)


class DeadEngine(FlakyEngine):
    """Its engine process is gone: every call fails as vLLM's engine client does then."""

    def generate(self, *a, **kw):
        raise BrokenPipeError("engine core process died")


class RefusingEngine(FlakyEngine):
    """Refuses the request itself, as vLLM's SamplingParams validation does."""

    def generate(self, *a, **kw):
        self.failures += 1
        raise ValueError("n must be 1 when using greedy sampling, got 2.")


def test_only_a_failure_a_resume_can_help_advises_one(tmp_path, monkeypatch):
    real = loop.make_engine
    monkeypatch.setattr(loop, "make_engine", lambda *a, **kw: DeadEngine(real(*a, **kw), failures=0))
    with pytest.raises(SystemExit, match="failed twice at step 1: engine core process died") as stopped:
        _run(_cfg(tmp_path / "dead", steps=2))
    assert str(stopped.value).endswith("written to " + str(tmp_path / "dead" / "run" / "checkpoints" /
                                                               "step_000000.pt") + "; continue with --resume")

    engines = []
    monkeypatch.setattr(loop, "make_engine", lambda *a, **kw: engines.append(RefusingEngine(real(*a, **kw), 0))
                        or engines[-1])
    cfg = _cfg(tmp_path / "refused", steps=2)
    with pytest.raises(SystemExit, match="refused step 1's request: ValueError: n must be 1") as stopped:
        _run(cfg)
    assert engines[0].failures == 1  # not retried: asking again gets the same answer
    assert "--resume" not in str(stopped.value) and latest_checkpoint(cfg.out).name == "step_000000.pt"


class InterruptedEngine(FlakyEngine):
    """Ctrl-C arrives during the rollout of the second step."""

    def generate(self, *a, **kw):
        self.failures += 1
        if self.failures == 2:
            raise KeyboardInterrupt
        return self.engine.generate(*a, **kw)


def test_ctrl_c_writes_a_checkpoint_of_the_last_completed_step(tmp_path, monkeypatch):
    real = loop.make_engine
    monkeypatch.setattr(loop, "make_engine", lambda *a, **kw: InterruptedEngine(real(*a, **kw), failures=0))
    cfg = _cfg(tmp_path, steps=3, save_every=10)
    with pytest.raises(SystemExit, match="interrupted: checkpoint of step 1 written to .*; continue with --resume"):
        _run(cfg)
    assert latest_checkpoint(cfg.out).name == "step_000001.pt"


def test_a_folder_holding_a_run_is_never_written_over(tmp_path):
    """A run killed before its first checkpoint left metrics.jsonl only: a new run there is refused,
    naming --resume and --overwrite; --resume says there is no checkpoint; --overwrite deletes the
    driver's files (and no other) and starts over."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"already holds a run \(metrics.jsonl\); pass --resume to continue it, "
                                              r"--overwrite to delete it and start over"):
        _run(_cfg(tmp_path, steps=1))
    with pytest.raises(FileNotFoundError, match="has no checkpoint yet .*nothing to resume; start it over with "
                                                "--overwrite"):
        _run(_cfg(tmp_path, steps=1, resume=True))
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    _, rows = _run(_cfg(tmp_path, steps=2, overwrite=True))
    assert [r["step"] for r in rows] == [1, 2] and (out / "notes.txt").read_text() == "mine"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with pytest.raises(ValueError, match="--steps 2: the run in .* has done 2 steps already; pass --steps N with "
                                         "N > 2"):
        _run(_cfg(tmp_path, steps=2, resume=True))


def test_resume_refuses_another_runs_or_a_corrupt_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, steps=1)
    _run(cfg)
    with pytest.raises(FileExistsError, match="pass --resume"):
        _run(cfg)
    with pytest.raises(ValueError, match="belongs to another run: lr=0.001 there, 0.5 now"):
        _run(_cfg(tmp_path, steps=2, resume=True, lr=0.5))
    latest_checkpoint(cfg.out).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        _run(_cfg(tmp_path, steps=2, resume=True))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _run(_cfg(tmp_path / "empty", steps=2, resume=True))


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_never_unpickles_code(tmp_path):
    cfg = _cfg(tmp_path, steps=1)
    _run(cfg)
    path, marker = latest_checkpoint(cfg.out), tmp_path / "code-ran"
    state = torch.load(path, weights_only=True)
    state["task"]["payload"] = _RunsCodeWhenUnpickled(marker)
    torch.save(state, path)
    with pytest.raises(ValueError, match="cannot be read as a jetrl_compile checkpoint"):
        _run(_cfg(tmp_path, steps=2, resume=True))
    assert not marker.exists()


def test_gsm8k_lines_and_answer_extraction(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3 * 4 = <<3*4=12>>12\n#### 12"},
        {"question": "A car costs $1,234 plus $6. Total?", "answer": "1234 + 6 = 1240\n#### 1,240"},
        {"question": "Half of 7?", "answer": "7 / 2 = 3.5\n#### 3.5"},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = Gsm8kTask(data, seed=0, eval_path=data)
    assert sorted(p.answer for p in task.problems) == ["12", "1240", "3.5"]
    assert {task.sample().answer for _ in range(3)} == {"12", "1240", "3.5"}
    assert gsm8k_reference("so #### -5") == "-5"
    assert extract_answer("12 apples in all.\nAnswer: 12") == "12"
    assert extract_answer("The total is $1,240.") == "1240"
    assert extract_answer("x = 3\n#### 3.50") == "3.5"
    assert extract_answer("no digits here") is None
    assert reward("Answer: 12", Problem("q", "12")) == (1.1, True)
    assert reward("it is 12", Problem("q", "12")) == (1.0, True)
    assert reward("Answer: 13", Problem("q", "12")) == (pytest.approx(0.1), False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: not a GSM8K line"):
        Gsm8kTask(bad)


def test_arithmetic_task_is_seeded_and_resumable():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert [a.sample() for _ in range(5)] == [b.sample() for _ in range(5)]
    state = a.state_dict()
    nxt = [a.sample() for _ in range(3)]
    c = ArithmeticTask(seed=99)
    c.load_state_dict(state)
    assert [c.sample() for _ in range(3)] == nxt
    for p in ArithmeticTask(seed=1, difficulty=3).eval_problems(20):
        assert p.answer.lstrip("-").isdigit()


def test_conversational_rows_and_their_reward_function():
    """The rows other trainers (TRL) take: the same problems as the task's stream, each scored
    against its own answer."""
    rows = conversational_rows(ArithmeticTask(seed=3), 4)
    stream = ArithmeticTask(seed=3)
    problems = [stream.sample() for _ in range(4)]
    assert [r["answer"] for r in rows] == [p.answer for p in problems]
    assert all(p.question in r["prompt"][0]["content"] for p, r in zip(problems, rows))
    replies = [[{"role": "assistant", "content": f"Answer: {r['answer']}"}] for r in rows]
    replies[1] = [{"role": "assistant", "content": "no idea"}]
    scores = answer_reward(replies, [r["answer"] for r in rows])
    assert scores[0] == reward(f"Answer: {rows[0]['answer']}", problems[0])[0] > scores[1] == 0.0


def test_help_documents_every_flag():
    out = subprocess.run(
        [sys.executable, "examples/train_grpo.py", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ["--model", "--task", "--data", "--recipe", "--engine", "--steps", "--group-size", "--batch-size",
                 "--max-new-tokens", "--lr", "--seed", "--out", "--resume", "--eval", "--limit", "--rollout-correction",
                 "--is-clip", "--is-low", "--correction-level", "--report-to", "--eval-every", "--debug",
                 "--overwrite"]:
        assert flag in out, flag


def test_evaluate_scores_the_latest_checkpoint_on_held_out_problems(tmp_path):
    from jetrl_compile.rl.loop import evaluate

    cfg = _cfg(tmp_path, steps=1, lr=1e-2, limit=5)
    trained, _ = _run(cfg, task=EarnableTask(seed=0))
    fresh = tiny_model("llama", layers=1, seed=7, **VLLM_TINY)
    result = evaluate(cfg, model=fresh, tokenizer=ByteTokenizer(), task=ArithmeticTask(seed=0))
    assert result["problems"] == 5 and 0.0 <= result["accuracy"] <= 1.0
    assert result["checkpoint"] == str(latest_checkpoint(cfg.out))
    assert json.loads((Path(cfg.out) / "eval.json").read_text()) == result
    for (name, a), (_, b) in zip(trained.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name  # the checkpoint's weights, not the fresh model's


_KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, {root!r})
from jetrl_compile.rl import loop
from tests.rl.test_grpo import EarnableTask, _cfg, _run
from pathlib import Path

save = loop.save_checkpoint
def save_then_die(out, step, *args, **kwargs):
    path = save(out, step, *args, **kwargs)
    if step == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no Ctrl-C checkpoint: a hard crash
    return path
loop.save_checkpoint = save_then_die
_run(_cfg(Path({tmp!r}), steps=6, lr=1e-2, save_every=2), task=EarnableTask(seed=0))
"""


def test_a_run_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path):
    straight, rows = _run(_cfg(tmp_path / "a", steps=6, lr=1e-2, save_every=2), task=EarnableTask(seed=0))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN.format(root=str(root), tmp=str(tmp_path / "b"))],
                          cwd=root, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert latest_checkpoint(tmp_path / "b" / "run").name == "step_000004.pt"
    resumed, resumed_rows = _run(_cfg(tmp_path / "b", steps=6, lr=1e-2, save_every=2, resume=True),
                                 task=EarnableTask(seed=0), seed=123)
    assert [r["step"] for r in resumed_rows] == [5, 6]
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    lines = (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    assert _untimed(json.loads(line) for line in lines) == _untimed(rows)


def test_tensorboard_report_and_periodic_eval(tmp_path):
    """--report-to tensorboard writes every step's metrics as scalars, --eval-every adds the
    held-out accuracy to the rows it falls on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(tmp_path, steps=2, report_to="tensorboard", eval_every=2, limit=3)
    _, rows = _run(cfg)
    assert "eval_accuracy" not in rows[0] and 0.0 <= rows[1]["eval_accuracy"] <= 1.0
    events = EventAccumulator(str(Path(cfg.out) / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward_mean", "train/mismatch_kl", "train/is_ratio_mean", "eval/accuracy"} <= tags
    assert [e.step for e in events.Scalars("train/reward_mean")] == [1, 2]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows])
    assert [e.step for e in events.Scalars("eval/accuracy")] == [2]


def test_tensorboard_missing_is_a_usage_error(tmp_path, monkeypatch):
    from jetrl_compile.errors import UsageError
    from jetrl_compile.rl.report import make_report

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(UsageError, match="needs the tensorboard package"):
        make_report("tensorboard", tmp_path)
