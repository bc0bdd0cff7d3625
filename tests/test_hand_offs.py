"""Typed hand-offs inside the loop: the controller gets the step's KLObservation, the same numbers the metrics log."""

from __future__ import annotations

import math

import pytest

from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet


@pytest.mark.parametrize("measure,metric", [("token_mean", "adaptive_kl/raw_kl"), ("sequence_sum", "kl/sequence_sum")])
def test_controller_observes_the_logged_kl(tiny_model_dir, addition_file, tmp_path, measure, metric):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / measure,
                      kl={"coef": 0.1, "controller": "dual", "target": 0.05, "dual_lr": 0.1, "kl_measure": measure})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train_step()  # the first step samples at the reference itself (KL 0); the second has moved away
    metrics = trainer.train_step()
    beta = metrics["adaptive_kl/current_beta"]
    # dual ascent, no clipping, so a different measure gives a different beta:
    # log beta <- log beta + 0.1 * (KL - 0.05) / 0.05
    assert metrics[metric] != 0.0
    expected = beta * math.exp(0.1 * (metrics[metric] - 0.05) / 0.05)
    assert trainer.controller.value == pytest.approx(expected, rel=1e-12)
