"""Rollout correction (TIS and MIS, per token and per completion) by hand, its place in the
loss, the extended mismatch metrics, and the driver with a correction on."""

import math

import pytest
import torch

from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rl.correction import RolloutCorrection
from jetrl_compile.rl.grpo import clipped_policy_loss
from jetrl_compile.rl.mismatch import mismatch_metrics
from tests.rl.test_grpo import EarnableTask, _cfg, _run

LOG = math.log


def _two_completions():
    """Trainer/rollout ratios 3, 0.5 (first completion) and 1.2 (second)."""
    trainer = [torch.tensor([LOG(3.0), LOG(0.5)]), torch.tensor([LOG(1.2)])]
    rollout = [torch.zeros(2), torch.zeros(1)]
    return trainer, rollout


def test_tis_per_token_truncates_above_the_clip():
    trainer, rollout = _two_completions()
    c = RolloutCorrection("tis", "token", clip=2.0)
    w = c.weights(trainer, rollout)
    assert [x.tolist() for x in w] == [pytest.approx([2.0, 0.5]), pytest.approx([1.2])]
    m = c.metrics(trainer, rollout)
    assert m["is_ratio_mean"] == pytest.approx((3 + 0.5 + 1.2) / 3)
    assert m["is_ratio_min"] == pytest.approx(0.5) and m["is_ratio_max"] == pytest.approx(3.0)
    assert m["is_corrected_frac"] == pytest.approx(1 / 3)  # only the 3 was truncated


def test_mis_per_token_masks_outside_the_bounds():
    trainer, rollout = _two_completions()
    c = RolloutCorrection("mis", "token", clip=2.0, low=0.6)
    assert [x.tolist() for x in c.weights(trainer, rollout)] == [[0.0, 0.0], pytest.approx([1.2])]
    assert c.metrics(trainer, rollout)["is_corrected_frac"] == pytest.approx(2 / 3)
    upper_only = RolloutCorrection("mis", "token", clip=2.0)  # low = 0: 0.5 is kept, as TRL's token_mask does
    assert [x.tolist() for x in upper_only.weights(trainer, rollout)] == [[0.0, 0.5], pytest.approx([1.2])]


def test_sequence_level_gives_each_completion_one_ratio():
    trainer, rollout = _two_completions()  # completion ratios 3 * 0.5 = 1.5 and 1.2
    trainer[1] = torch.tensor([LOG(4.0)])
    tis = RolloutCorrection("tis", "sequence", clip=2.0)
    assert [x.tolist() for x in tis.weights(trainer, rollout)] == [pytest.approx([1.5, 1.5]), [2.0]]
    m = tis.metrics(trainer, rollout)
    assert (m["is_ratio_mean"], m["is_ratio_min"], m["is_ratio_max"]) == pytest.approx((2.75, 1.5, 4.0))
    assert m["is_corrected_frac"] == pytest.approx(1 / 3)  # the one token of the completion at 4
    mis = RolloutCorrection("mis", "sequence", clip=2.0)
    assert [x.tolist() for x in mis.weights(trainer, rollout)] == [pytest.approx([1.5, 1.5]), [0.0]]


def test_none_weighs_every_token_one_and_still_reports_the_ratio():
    trainer, rollout = _two_completions()
    c = RolloutCorrection()
    assert not c.active
    assert [x.tolist() for x in c.weights(trainer, rollout)] == [[1.0, 1.0], [1.0]]
    m = c.metrics(trainer, rollout)
    assert m["is_ratio_max"] == pytest.approx(3.0) and m["is_corrected_frac"] == 0.0


def test_weights_scale_each_tokens_gradient_and_carry_none():
    trainer, rollout = _two_completions()
    new = [t.clone().requires_grad_(True) for t in trainer]
    c = RolloutCorrection("tis", "token", clip=2.0)
    w = c.weights(new, rollout)
    assert not any(x.requires_grad for x in w)
    parts = clipped_policy_loss(new, [n.detach() for n in new], torch.tensor([1.0, -2.0]), weights=w)
    # the PPO ratio against the trainer itself is 1 in value with gradient 1, so d loss / d logp = -w * A
    assert parts.loss_sum.item() == pytest.approx(-(2.0 + 0.5) + 2 * 1.2)
    parts.loss_sum.backward()
    assert new[0].grad.tolist() == pytest.approx([-2.0, -0.5]) and new[1].grad.tolist() == pytest.approx([2.4])


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="is"), "choose one of none, tis, mis"),
    (dict(level="batch"), "choose one of token, sequence"),
    (dict(clip=0.0), "--is-clip must be a positive number"),
    (dict(clip=2.0, low=2.0), r"--is-low must be in \[0, --is-clip\)"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrection(**kwargs)
    names = {"mode": "rollout_correction", "level": "correction_level", "clip": "is_clip", "low": "is_low"}
    with pytest.raises(ValueError, match=match):
        GrpoConfig(**{names[k]: v for k, v in kwargs.items()})


def test_sequence_mismatch_metrics_by_hand():
    rollout = [[-1.0, -2.0], [-0.5]]
    trainer = torch.tensor([-1.0, -1.0, -1.5])  # flat: takes the rollout's completions; d = 0, +1 | -1
    m = mismatch_metrics(rollout, trainer)
    e = math.e
    assert m["mismatch_k1"] == pytest.approx(0.0)  # -(0 + 1 - 1) / 3
    assert m["mismatch_chi2"] == pytest.approx((1 + e**2 + e**-2) / 3 - 1)
    assert m["mismatch_k1_seq"] == pytest.approx(0.0)  # completions' D = 1 and -1
    assert m["mismatch_k3_seq"] == pytest.approx(((e - 2) + (e**-1 - 1 + 1)) / 2)
    assert m["mismatch_chi2_seq"] == pytest.approx((e**2 + e**-2) / 2 - 1)
    with pytest.raises(ValueError, match="differ in length"):
        mismatch_metrics([[-1.0], [-2.0, -0.5]], [[-1.0, -2.0], [-0.5]])


def test_driver_masking_every_token_leaves_no_gradient(tmp_path):
    """The weights reach the gradient: with every ratio masked (clip far below any ratio) an
    earnable reward gives no gradient, where without a correction it does."""
    rows = {}
    for mode, clip in (("none", 2.0), ("mis", 1e-9)):
        cfg = _cfg(tmp_path / mode, recipe="fp8_rollout_only", rollout_correction=mode, is_clip=clip, lr=1e-2)
        _, rows[mode] = _run(cfg, task=EarnableTask(seed=0))
    assert rows["none"][0]["grad_norm"] > 0 and rows["none"][0]["is_corrected_frac"] == 0.0
    assert rows["mis"][0]["grad_norm"] == 0.0 and rows["mis"][0]["is_corrected_frac"] == 1.0
    assert rows["mis"][0]["is_ratio_min"] > 1e-9


def test_driver_tis_logs_the_peers_metrics(tmp_path):
    cfg = _cfg(tmp_path, recipe="fp8_rollout_only", rollout_correction="tis", correction_level="sequence",
               is_clip=1.5, lr=1e-2, steps=2)
    _, rows = _run(cfg, task=EarnableTask(seed=0))
    for row in rows:
        for key in ("is_ratio_mean", "is_ratio_min", "is_ratio_max", "is_corrected_frac", "mismatch_k1",
                    "mismatch_chi2", "mismatch_k1_seq", "mismatch_k3_seq", "mismatch_chi2_seq"):
            assert math.isfinite(row[key]), key
        assert row["is_ratio_min"] <= row["is_ratio_mean"] <= row["is_ratio_max"]
        assert row["grad_norm"] > 0 and not row["refused"]
