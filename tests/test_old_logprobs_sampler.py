"""rollout.old_logprobs sampler: the sampler's log-probs mu are pi_old (no trainer forward before the update), the
policy ratio becomes pi / mu, and the sampler panel still compares mu with the trainer's own log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.backends.samplers import SAMPLERS, KVLoopSampler
from klgrpo.config.schema import GRPOConfig
from klgrpo.errors import KLGRPOError
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import metric_names as m
from klgrpo.train.step import GRPOStep
from tests.helpers.configs import make_config, quiet

SHIFT = 0.1  # the planted sampler reports log mu = log pi_old + SHIFT on every token


class _ShiftedSampler(KVLoopSampler):
    def sample(self, model, prompt_ids, prompt_mask, params, pad_id, eos_ids):
        drawn = super().sample(model, prompt_ids, prompt_mask, params, pad_id, eos_ids)
        drawn.logp = drawn.logp + SHIFT
        return drawn


def _trainer(tmp_path, tiny_model_dir, addition_file, name, steps=1, **groups):
    rollout = {"sampler": "kv_loop", **groups.pop("rollout", {})}
    train = {"steps": steps, **groups.pop("train", {})}
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / name, train=train, rollout=rollout, **groups)
    return GRPOTrainer(cfg, log=quiet)


def _forwards(monkeypatch) -> list[int]:
    """Counts the trainer's no-grad pi_old forwards."""
    calls = []
    original = GRPOStep._rollout_logprobs

    def counted(self, rollout):
        calls.append(rollout.size)
        return original(self, rollout)

    monkeypatch.setattr(GRPOStep, "_rollout_logprobs", counted)
    return calls


SEQUENCE_SCORE = {"estimator": "k1", "placement": "reward", "reward_mode": "sequence_score", "coef": 0.1}


def test_the_sampler_gives_pi_old_and_the_forward_is_skipped(tmp_path, tiny_model_dir, addition_file, monkeypatch):
    """KL in the reward as a sequence score needs pi_old before the update: the trainer's forward under trainer,
    the sampler's log-probs under sampler; with kv_loop in float32 both give the same step to float rounding."""
    calls = _forwards(monkeypatch)
    runs = {}
    for mode in ("trainer", "sampler"):
        trainer = _trainer(tmp_path, tiny_model_dir, addition_file, mode, steps=2, kl=SEQUENCE_SCORE,
                           rollout={"old_logprobs": mode})
        trainer.train()
        runs[mode] = (read_metrics(trainer.run_dir), [p.detach().clone() for p in trainer.grpo_step.model.parameters()])
        runs[mode + "_forwards"] = len(calls)
    assert runs["trainer_forwards"] == 2 and runs["sampler_forwards"] == 2  # none added by the sampler run
    (rows_t, weights_t), (rows_s, weights_s) = runs["trainer"], runs["sampler"]
    for a, b in zip(rows_t, rows_s):
        assert b[m.REWARD] == a[m.REWARD]  # the same completions were drawn
        for key in (m.LOSS, m.GRAD_NORM):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
    # AdamW's first steps move each weight by about lr x sign(gradient): a weight whose gradient is at rounding level
    # may move either way, so the weights are compared as a whole (relative L2), not entry by entry
    diff = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(weights_t, weights_s)))
    norm = torch.sqrt(sum((a ** 2).sum() for a in weights_t))
    assert float(diff / norm) < 1e-3


def test_the_ratio_is_pi_over_mu_and_the_panel_still_measures(tmp_path, tiny_model_dir, addition_file, monkeypatch):
    """With mu = pi_old e^0.1 the first update's ratio pi / mu is e^-0.1 = 0.905 on every token: below
    1 - eps_low = 0.95, so every token with A < 0 is clipped low and none high; under trainer the ratio is 1 (no
    clip). The panel compares mu with the trainer's own log-probs: |log pi_old - log mu| = 0.1, not 0."""
    monkeypatch.setitem(SAMPLERS._items, "kv_loop", _ShiftedSampler)
    rows = {}
    for mode in ("trainer", "sampler"):
        trainer = _trainer(tmp_path, tiny_model_dir, addition_file, mode, loss={"eps_low": 0.05},
                           rollout={"old_logprobs": mode})
        trainer.train()
        rows[mode] = read_metrics(trainer.run_dir)[-1]
    assert rows["trainer"][m.CLIP_RATIO_LOW] == 0.0 and rows["trainer"][m.CLIP_RATIO_HIGH] == 0.0
    assert rows["sampler"][m.CLIP_RATIO_LOW] > 0.0 and rows["sampler"][m.CLIP_RATIO_HIGH] == 0.0
    for mode in ("trainer", "sampler"):
        assert rows[mode][m.SAMPLER_LOGP_DIFF_MEAN] == pytest.approx(SHIFT, abs=1e-5)
        assert rows[mode][m.SAMPLER_KL] == pytest.approx(math.exp(-SHIFT) - 1 + SHIFT, abs=1e-6)


def test_later_updates_of_a_batch_keep_the_panel(tmp_path, tiny_model_dir, addition_file, monkeypatch):
    """train.num_iterations 2: the second update's panel compares mu with the first update's pi_old (kept), so
    it reads the same 0.1."""
    monkeypatch.setitem(SAMPLERS._items, "kv_loop", _ShiftedSampler)
    trainer = _trainer(tmp_path, tiny_model_dir, addition_file, "iters", steps=2, train={"num_iterations": 2},
                       rollout={"old_logprobs": "sampler"})
    trainer.train()
    first, second = read_metrics(trainer.run_dir)
    assert first[m.SAMPLER_LOGP_DIFF_MEAN] == pytest.approx(SHIFT, abs=1e-5)
    assert second[m.SAMPLER_LOGP_DIFF_MEAN] == first[m.SAMPLER_LOGP_DIFF_MEAN]


@pytest.mark.parametrize(("settings", "named"), [
    ({"rollout": {"sampler": "vllm"}}, "rollout.sampler vllm"),
    ({"rollout": {"sampler": "vllm_server", "vllm": {"server_url": "http://127.0.0.1:8000"}}}, "vllm_server"),
    ({"model": {"dtype": "bfloat16"}}, "model.dtype float32"),
    ({"rollout": {"sampler_correction": "token_truncate"}}, "rollout.sampler_correction"),
    ({"rollout": {"divergence_mask": "token_k3", "divergence_threshold": "0.1"}}, "rollout.divergence_mask"),
    ({"rollout": {"top_p": 0.8, "truncation": "ignore"}}, "rollout.truncation policy"),
])
def test_a_sampler_that_is_not_the_trainer_is_refused(settings, named):
    cfg = {"rollout": {"old_logprobs": "sampler"}}
    for group, values in settings.items():
        cfg.setdefault(group, {}).update(values)
    with pytest.raises(KLGRPOError) as err:
        GRPOConfig.from_dict(cfg).validate()
    assert named in str(err.value) and "rollout.old_logprobs" in str(err.value) and "\n" not in str(err.value)


def test_the_resolved_sampler_and_dtype_are_checked():
    """auto may resolve to vLLM, model.dtype auto to bfloat16: checked once the run knows them."""
    from klgrpo.train.step_build import check_old_logprobs_source

    class Other:
        name, scores_as_trainer = "vllm", False

    with pytest.raises(KLGRPOError, match="samples with vllm"):
        check_old_logprobs_source("sampler", Other(), torch.float32)
    with pytest.raises(KLGRPOError, match="bfloat16"):
        check_old_logprobs_source("sampler", KVLoopSampler(), torch.bfloat16)
    check_old_logprobs_source("sampler", KVLoopSampler(), torch.float32)
    check_old_logprobs_source("trainer", Other(), torch.bfloat16)
