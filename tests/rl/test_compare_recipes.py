"""examples/compare_recipes.py: a complete run is read back instead of retrained, summaries give
the spread across seeds, and the seed-band plot draws an exact flow's zero mismatch."""

import json
from pathlib import Path

import pytest

from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rl.plot import plot_seed_bands
from tests.conftest import load_example


def _compare():
    return load_example("compare_recipes")


def _rows(steps, reward, kl):
    return [dict(step=s + 1, reward_mean=reward + 0.1 * s, accuracy=reward, mismatch_kl=kl, logprob_abs_diff_max=kl,
                 step_s=2.0) for s in range(steps)]


def test_a_complete_run_is_read_back_not_retrained(tmp_path, monkeypatch):
    compare = _compare()
    out = tmp_path / "fp8_fwd_bf16_bwd-exact" / "seed1"
    out.mkdir(parents=True)
    rows = _rows(3, 0.2, 0.0)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(compare, "train", lambda cfg: (_ for _ in ()).throw(AssertionError("retrained")))
    assert compare.run(GrpoConfig(steps=3), "fp8_fwd_bf16_bwd+exact", 1, out) == rows


def test_an_incomplete_run_trains_in_exact_mode_with_its_seed(tmp_path, monkeypatch):
    compare = _compare()
    seen = []

    def fake_train(cfg):
        seen.append(cfg)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(2, 0.1, 0.0)))

    monkeypatch.setattr(compare, "train", fake_train)
    compare.run(GrpoConfig(steps=2), "jetrl+exact", 2, tmp_path / "run")
    assert (seen[0].recipe, seen[0].exact, seen[0].seed, seen[0].resume) == ("jetrl", True, 2, False)
    assert seen[0].overwrite  # no checkpoint: a run killed before its first one starts over


def test_summary_spreads_over_seeds_and_plot_is_written(tmp_path):
    compare = _compare()
    runs = {"fp8_fwd_bf16_bwd+exact": [_rows(8, 0.1, 0.0), _rows(8, 0.3, 0.0)],
            "fp8_rollout_only": [_rows(8, 0.2, 0.05), _rows(8, 0.2, 0.07)]}
    row = compare.summarize("fp8_fwd_bf16_bwd+exact", "eager", runs["fp8_fwd_bf16_bwd+exact"], window=2)
    assert row[1:4] == ["eager", 2, 8]
    assert row[4] == "0.250 (0.150..0.350) -> 0.850 (0.750..0.950)"
    assert row[6] == "0.00e+00" and row[7] == "0"
    refused = _rows(8, 0.1, 0.05)
    refused[3]["mismatch_kl"] = None  # a refused step's non-finite value, null in metrics.jsonl
    assert compare.summarize("bf16", "compile", [refused], window=2)[6] == "5.00e-02"
    png = plot_seed_bands(runs, tmp_path / "compare.png", title="t")
    assert png.stat().st_size > 10_000


def test_flows_name_recipe_exact_mode_and_rollout_correction():
    compare = _compare()
    base = GrpoConfig(is_clip=3.0)
    tis = compare.flow_config(base, "fp8_rollout_only+tis")
    assert (tis.recipe, tis.exact, tis.rollout_correction, tis.is_clip) == ("fp8_rollout_only", False, "tis", 3.0)
    both = compare.flow_config(base, "jetrl+exact+mis")
    assert (both.recipe, both.exact, both.rollout_correction) == ("jetrl", True, "mis")
    assert compare.flow_config(base, "bf16").rollout_correction == "none"
    # the driver's trainer: compiled, eager where exact mode needs it (the table names it)
    assert [compare.flow_config(base, f).resolved_trainer_mode() for f in ("bf16", "jetrl+exact")] == [
        "compile", "eager"]
    for bad in ("fp8", "bf16+tis+mis", "bf16+fast"):
        with pytest.raises(ValueError, match="flow .*: write a recipe"):
            compare.flow_config(base, bad)
