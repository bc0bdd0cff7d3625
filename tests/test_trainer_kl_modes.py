"""The trainer's sequence-score KL (in the advantages, before the group normalisation) and the delta / dual-clip
options, on the tiny local model."""

from __future__ import annotations

import math

import torch

from klgrpo.core.forward import completion_logprobs
from klgrpo.math.advantages import group_advantages
from klgrpo.math.kl import kl_estimate
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet


def test_sequence_score_enters_the_score_before_normalising(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "s",
                      kl={"coef": 0.5, "estimator": "k1", "placement": "reward", "reward_mode": "sequence_score"},
                      optim={"lr": 1e-2}, train={"steps": 2})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()  # move the policy away from the reference so the KL is non-zero
    batch = trainer.make_batch()
    with torch.no_grad():
        old = completion_logprobs(trainer.grpo_step.train_forward, batch.rollout, cfg.rollout.temperature)[0]
    torch.testing.assert_close(batch.old_logp, old, rtol=0, atol=1e-6)
    seq_kl = (kl_estimate(old, batch.ref_logp, "k1") * batch.loss_mask).sum(-1)
    assert float(seq_kl.abs().max()) > 1e-3
    expected = group_advantages(batch.rewards - 0.5 * seq_kl, cfg.rollout.group_size, cfg.loss.advantage_scale,
                                cfg.loss.std_eps, cfg.loss.std_ddof)
    torch.testing.assert_close(batch.advantages, expected, rtol=1e-5, atol=1e-5)
    # the per-token reward-to-go is not added on top inside the objective
    metrics, _ = trainer.grpo_step.update(batch)
    assert math.isfinite(metrics["train/loss"])


def test_delta_and_dual_clip_run(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "d", loss={"delta": 1.5, "dual_clip": 3.0},
                      train={"steps": 2, "num_iterations": 2})
    GRPOTrainer(cfg, log=quiet).train()
    rows = [r for r in read_metrics(tmp_path / "d") if "train/loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
