"""GRPO checkpoints: plain data, written atomically, only the latest kept, another run's refused."""

import random

import pytest
import torch

from jetrl_compile.rl.checkpoint import latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint

RUN = {"recipe": "jetrl", "lr": 1e-5}


def _save(tmp_path, step, model, opt):
    return save_checkpoint(tmp_path, step, model, opt, {"position": step}, RUN, {"refused_steps": 0})


def test_only_the_latest_is_kept_and_a_write_leaves_no_temporary(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    for step in (2, 4, 6):
        _save(tmp_path, step, model, opt)
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert files == ["step_000006.pt"] and latest_checkpoint(tmp_path).name == "step_000006.pt"


def test_round_trip_restores_model_optimizer_task_and_rng(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.manual_seed(5)
    random.seed(5)
    path = _save(tmp_path, 1, model, opt)
    expected = (torch.rand(3), random.random())
    state = load_checkpoint(path, RUN)
    assert state["step"] == 1 and state["task"] == {"position": 1} and state["counters"] == {"refused_steps": 0}
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    restore_rng(state)
    again = (torch.rand(3), random.random())
    assert torch.equal(again[0], expected[0]) and again[1] == expected[1]


def test_another_runs_checkpoint_names_the_setting_that_differs(tmp_path):
    model = torch.nn.Linear(4, 3)
    path = _save(tmp_path, 1, model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="belongs to another run: lr=1e-05 there, 0.001 now; pass --lr 1e-05"):
        load_checkpoint(path, {**RUN, "lr": 1e-3})
    torch.save({"format": 99}, path)
    with pytest.raises(ValueError, match="not a jetrl_compile GRPO checkpoint"):
        load_checkpoint(path, RUN)
