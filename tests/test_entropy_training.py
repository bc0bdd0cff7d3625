"""The entropy in klgrpo's own trainer: its spread and the switch that turns it off, the bonus with the adaptive
entropy controller resumed exactly from a checkpoint, and the masks' metrics."""

from __future__ import annotations

import pytest

from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.store.state_io import load_state
from tests.helpers.configs import make_config, quiet

ENTROPY_NAMES = {"entropy", "entropy/p10", "entropy/p50", "entropy/min"}


def _rows(run):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "wall_time"))} for r in read_metrics(run)
            if "train/loss" in r]


def test_entropy_spread_is_logged_and_the_switch_turns_it_off(tiny_model_dir, addition_file, tmp_path):
    on = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "on", train={"steps": 1}), log=quiet)
    on.train()
    (row,) = _rows(tmp_path / "on")
    assert ENTROPY_NAMES <= set(row)
    assert 0 <= row["entropy/min"] <= row["entropy/p10"] <= row["entropy/p50"]
    assert row["entropy/min"] <= row["entropy"]
    off = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "off", train={"steps": 1,
                                                                                        "entropy_metrics": False}),
                      log=quiet)
    off.train()
    (row_off,) = _rows(tmp_path / "off")
    assert not ENTROPY_NAMES & set(row_off)
    assert row_off["train/loss"] == pytest.approx(row["train/loss"], abs=1e-6)  # the loss does not read it
    # the loss reads the entropy: it is computed, so it is logged
    bonus = make_config(tiny_model_dir, addition_file, tmp_path / "bonus",
                        train={"steps": 1, "entropy_metrics": False}, loss={"entropy_coef": 0.01})
    GRPOTrainer(bonus, log=quiet).train()
    (row_bonus,) = _rows(tmp_path / "bonus")
    assert ENTROPY_NAMES <= set(row_bonus) and row_bonus["entropy/coef"] == 0.01
    assert row_bonus["entropy/bonus"] == pytest.approx(0.01 * row_bonus["entropy"], rel=1e-5)  # every token acts


def test_adaptive_entropy_resume_equals_uninterrupted(tiny_model_dir, addition_file, tmp_path):
    """Skywork-OR1's rule in the trainer: the target is above every entropy, so the coefficient rises by delta
    each step (0.05, 0.06, ...) and applies from the second step on; stopped after 3 steps (mid-batch) and resumed,
    the run equals the uninterrupted one, masks and all."""
    groups = dict(train={"steps": 4, "num_iterations": 2},
                  loss={"entropy_coef": 0.05, "entropy_controller": "adaptive", "entropy_target": 100.0,
                        "entropy_coef_delta": 0.01, "top_entropy_quantile": 0.5, "off_policy_mask_threshold": 1e-4})
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "a", **groups), log=quiet).train()
    part = make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups).override({"train.steps": 3})
    GRPOTrainer(part, log=quiet).train()
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups), log=quiet).train(
        resume="latest")
    rows_a, rows_b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert rows_a == rows_b
    assert [r["entropy/coef"] for r in rows_a] == pytest.approx([0.0, 0.06, 0.07, 0.08])
    assert [r["off_policy/kl"] == 0.0 for r in rows_a] == [True, False, True, False]  # second update: off policy
    state = load_state(tmp_path / "a" / "checkpoints" / "step_4", "trainer_state")
    assert state["entropy_controller"]["value"] == pytest.approx(0.09)
    assert state["entropy_controller"]["num_updates"] == 4
