"""The sampler's mismatch in a training run: the metrics every step where the sampler gives its log-probs, and
rollout.sampler_correction reaching the step's loss. A planted sampler (kv_loop whose reported log-probs are off
by a known constant) gives numbers derived by hand."""

from __future__ import annotations

import math

import pytest

from klgrpo.backends.samplers import SAMPLERS, KVLoopSampler
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import metric_names as m
from tests.helpers.configs import make_config, quiet

SHIFT = 0.1  # the planted sampler reports log mu = log pi_old + SHIFT on every token


class _ShiftedSampler(KVLoopSampler):
    """kv_loop's tokens, with log-probs SHIFT above the ones it drew them with."""

    def sample(self, model, prompt_ids, prompt_mask, params, pad_id, eos_ids):
        drawn = super().sample(model, prompt_ids, prompt_mask, params, pad_id, eos_ids)
        drawn.logp = drawn.logp + SHIFT
        return drawn


def _run(tmp_path, tiny_model_dir, addition_file, name, **rollout):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / name, train={"steps": 1},
                      rollout={"sampler": "kv_loop", **rollout})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()
    return read_metrics(trainer.run_dir)[-1]


def test_kv_loop_scores_its_tokens_as_the_trainer_does(tmp_path, tiny_model_dir, addition_file):
    """kv_loop samples from softmax(logits / T) of the same weights: only float32 rounding separates its
    log-probs from the trainer's pi_old."""
    row = _run(tmp_path, tiny_model_dir, addition_file, "kv")
    assert 0.0 <= row[m.SAMPLER_LOGP_DIFF_MEAN] <= row[m.SAMPLER_LOGP_DIFF_P99] <= row[m.SAMPLER_LOGP_DIFF_MAX] < 1e-4
    assert 0.0 <= row[m.SAMPLER_KL] < 1e-8


def test_a_shifted_sampler_is_measured_and_corrected(tmp_path, tiny_model_dir, addition_file, monkeypatch):
    """log pi_old - log mu = -SHIFT on every token (to float32 rounding):
        |diff| = 0.1 (mean, p99 and max); sampler/kl = r - 1 - log r, r = e^-0.1: 0.904837 - 1 + 0.1 = 0.0048374;
        token_truncate's weight e^-0.1 = 0.904837 (inside [0, 3]) multiplies every token's loss, policy and KL:
        the step's loss is 0.904837 times the uncorrected one (same seed, same batch)."""
    monkeypatch.setitem(SAMPLERS._items, "kv_loop", _ShiftedSampler)
    plain = _run(tmp_path, tiny_model_dir, addition_file, "plain")
    for key in (m.SAMPLER_LOGP_DIFF_MEAN, m.SAMPLER_LOGP_DIFF_P99, m.SAMPLER_LOGP_DIFF_MAX):
        assert plain[key] == pytest.approx(SHIFT, abs=1e-5)
    assert plain[m.SAMPLER_KL] == pytest.approx(math.exp(-SHIFT) - 1 + SHIFT, abs=1e-6)
    corrected = _run(tmp_path, tiny_model_dir, addition_file, "corrected", sampler_correction="token_truncate")
    assert corrected[m.SAMPLER_KL] == plain[m.SAMPLER_KL]  # the same batch was drawn
    assert abs(plain[m.LOSS]) > 1e-4  # a loss whose scaling shows
    assert corrected[m.LOSS] == pytest.approx(math.exp(-SHIFT) * plain[m.LOSS], rel=1e-4)
    # a bound that binds: token_mask with max 0.9 drops every token (e^-0.1 = 0.905 > 0.9): loss 0
    masked = _run(tmp_path, tiny_model_dir, addition_file, "masked", sampler_correction="token_mask",
                  sampler_correction_max=0.9)
    assert masked[m.LOSS] == 0.0


def test_vllm_memory_fraction_default_is_the_samplers():
    """The config declares its default without importing the sampler (the config imports no torch)."""
    from klgrpo.backends.vllm_sampler import DEFAULT_MEMORY_FRACTION
    from klgrpo.config.schema import VLLMConfig

    assert VLLMConfig().memory_fraction == DEFAULT_MEMORY_FRACTION
