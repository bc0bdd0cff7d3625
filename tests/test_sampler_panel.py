"""The sampler-to-trainer panel by hand on small batches, and impossible sampler log-probs refused before a step."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.core.rollout import check_sampler_logprobs
from klgrpo.errors import KLGRPOError
from klgrpo.math.sampler_correction import SamplerCorrection
from klgrpo.train import metric_names as m
from klgrpo.train.distributed import Distributed
from klgrpo.train.step_metrics import sampler_metrics

MASK = torch.tensor([[True, True, False], [True, True, True]])


def _panel(old, mu, correction=None):
    return sampler_metrics(torch.tensor(old, dtype=torch.float64), torch.tensor(mu, dtype=torch.float64), MASK, 3,
                           Distributed(), correction)


def test_a_matched_sampler_reads_zero_divergence_and_full_ess():
    logp = [[-0.5, -1.2, 0.0], [-0.1, -2.0, -0.7]]
    row = _panel(logp, logp)
    for name in (m.SAMPLER_KL_K1, m.SAMPLER_KL_K3, m.SAMPLER_CHI2_TOKEN, m.SAMPLER_CHI2_SEQ,
                 m.SAMPLER_MASKED_TOKEN_FRAC, m.SAMPLER_MASKED_SEQ_FRAC):
        assert row[name] == 0.0, name
    for name in (m.SAMPLER_ESS, m.SAMPLER_PPL_RATIO, m.SAMPLER_RATIO_P01, m.SAMPLER_RATIO_P50, m.SAMPLER_RATIO_MAX):
        assert row[name] == pytest.approx(1.0, abs=1e-7), name


def test_the_panel_by_hand():
    """log r per token (masked padding ignored): row 0 (0.2, -0.1), row 1 (0.0, 0.3, -0.4); the sums are reduced
    in float32 (across processes), hence 1e-7."""
    old = [[-0.3, -1.1, 5.0], [-1.0, -0.2, -0.9]]
    mu = [[-0.5, -1.0, 0.0], [-1.0, -0.5, -0.5]]
    log_r = [0.2, -0.1, 0.0, 0.3, -0.4]
    r = [math.exp(x) for x in log_r]
    big_r = [math.exp(0.2 - 0.1), math.exp(0.0 + 0.3 - 0.4)]
    row = _panel(old, mu)
    assert row[m.SAMPLER_KL_K1] == pytest.approx(-sum(log_r) / 5, abs=1e-7)
    assert row[m.SAMPLER_KL_K3] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 5, abs=1e-7)
    assert row[m.SAMPLER_KL_K3] == row[m.SAMPLER_KL]
    assert row[m.SAMPLER_CHI2_TOKEN] == pytest.approx(sum((x - 1) ** 2 for x in r) / 5, abs=1e-7)
    assert row[m.SAMPLER_CHI2_SEQ] == pytest.approx(sum((x - 1) ** 2 for x in big_r) / 2, abs=1e-7)
    assert row[m.SAMPLER_ESS] == pytest.approx(sum(big_r) ** 2 / (2 * sum(x * x for x in big_r)), abs=1e-7)
    ppl = [math.exp(-(0.2 - 0.1) / 2), math.exp(-(0.0 + 0.3 - 0.4) / 3)]
    assert row[m.SAMPLER_PPL_RATIO] == pytest.approx(sum(ppl) / 2, abs=1e-7)
    assert row[m.SAMPLER_RATIO_MAX] == pytest.approx(math.exp(0.3), abs=1e-6)
    assert row[m.SAMPLER_RATIO_P50] == pytest.approx(1.0, abs=1e-6)  # the middle of the five sorted ratios
    assert row[m.SAMPLER_RATIO_P01] == pytest.approx(math.exp(-0.4) + 0.04 * (math.exp(-0.1) - math.exp(-0.4)),
                                                      abs=1e-6)  # linear interpolation, as torch.quantile


def test_masked_fractions_follow_the_correction():
    old = [[-0.3, -1.1, 5.0], [-1.0, -0.2, -0.9]]
    mu = [[-0.5, -1.0, 0.0], [-1.0, -0.5, -0.5]]
    # token ratios above 1.2: exp(0.2) and exp(0.3), one in each row
    row = _panel(old, mu, SamplerCorrection("token_mask", None, 1.2))
    assert row[m.SAMPLER_MASKED_TOKEN_FRAC] == pytest.approx(2 / 5)
    assert row[m.SAMPLER_MASKED_SEQ_FRAC] == pytest.approx(1.0)
    # sequence weights exp(0.1) and exp(-0.1): truncating at 1.05 changes row 0 only (its 2 tokens)
    row = _panel(old, mu, SamplerCorrection("sequence_truncate", None, 1.05))
    assert row[m.SAMPLER_MASKED_TOKEN_FRAC] == pytest.approx(2 / 5)
    assert row[m.SAMPLER_MASKED_SEQ_FRAC] == pytest.approx(1 / 2)
    assert _panel(old, mu, SamplerCorrection("none"))[m.SAMPLER_MASKED_TOKEN_FRAC] == 0.0


@pytest.mark.parametrize("logp, fragment", [
    ([[-0.1, float("nan"), 0.0]], "1 log-prob(s) NaN or infinite"),
    ([[-0.1, 0.5, 0.0]], "1 log-prob(s) above 0"),
    ([[-0.1, -0.2]], "returned log-probs of shape (1, 2) for completions of shape (1, 3)"),
])
def test_impossible_sampler_log_probs_are_refused(logp, fragment):
    ids = torch.tensor([[5, 6, 0]])
    mask = torch.tensor([[True, True, False]])
    with pytest.raises(KLGRPOError, match="rollout.sampler kv_loop") as exc:
        check_sampler_logprobs(torch.tensor(logp), ids, mask, "kv_loop")
    assert fragment in str(exc.value)


def test_padding_after_eos_is_not_checked_and_rounding_above_zero_passes():
    ids = torch.tensor([[5, 6, 0]])
    mask = torch.tensor([[True, True, False]])
    check_sampler_logprobs(torch.tensor([[-0.1, 1e-7, float("nan")]]), ids, mask, "kv_loop")


def _run(tmp_path, tiny_model_dir, addition_file, name, **rollout):
    from klgrpo.run.metrics import read_metrics
    from klgrpo.run.trainer import GRPOTrainer
    from tests.helpers.configs import make_config, quiet

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / name, train={"steps": 1},
                      rollout={"sampler": "kv_loop", "sampler_correction": "token_mask", **rollout},
                      kl={"coef": 0.1, "warn_window": 1})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()
    return read_metrics(trainer.run_dir)[-1]


def test_a_planted_mismatch_moves_the_panel(tmp_path, tiny_model_dir, addition_file, monkeypatch):
    """The KV loop matched reads chi-square 0 and ESS 1 to rounding; a sampler drawing at temperature 1.1 while
    the trainer scores 1.0 raises both chi-squares and lowers the ESS."""
    matched = _run(tmp_path, tiny_model_dir, addition_file, "matched")
    assert matched[m.SAMPLER_CHI2_TOKEN] < 1e-9 and matched[m.SAMPLER_CHI2_SEQ] < 1e-9
    assert matched[m.SAMPLER_ESS] == pytest.approx(1.0, abs=1e-6)
    from klgrpo.backends import kv_decoder

    real = kv_decoder.filter_logits
    monkeypatch.setattr(kv_decoder, "filter_logits",
                        lambda logits, temperature=1.0, *a, **k: real(logits, temperature * 1.1, *a, **k))
    planted = _run(tmp_path, tiny_model_dir, addition_file, "planted")
    assert planted[m.SAMPLER_CHI2_TOKEN] > 1e-4 and planted[m.SAMPLER_CHI2_SEQ] > planted[m.SAMPLER_CHI2_TOKEN]
    assert planted[m.SAMPLER_ESS] < 1.0 - 1e-3  # 0.998 here, against 1 to 1e-6 matched
    assert planted[m.SAMPLER_RATIO_MAX] > 1.0 > planted[m.SAMPLER_RATIO_P01]


def test_the_sampler_warning_fires_on_the_planted_mismatch_only(tmp_path, tiny_model_dir, addition_file, monkeypatch,
                                                                capsys):
    """With the ESS band at 1 - 1e-3 (the tiny model's planted drift is small: ESS 0.998) the planted sampler
    warns once, naming the ESS and what to do; the matched KV loop (ESS 1 to 1e-6) says nothing."""
    said = {}
    _run(tmp_path, tiny_model_dir, addition_file, "matched", warn_ess_below=1 - 1e-3)
    said["matched"] = capsys.readouterr().out.splitlines()
    from klgrpo.backends import kv_decoder

    real = kv_decoder.filter_logits
    monkeypatch.setattr(kv_decoder, "filter_logits",
                        lambda logits, temperature=1.0, *a, **k: real(logits, temperature * 1.1, *a, **k))
    _run(tmp_path, tiny_model_dir, addition_file, "planted", warn_ess_below=1 - 1e-3)
    said["planted"] = capsys.readouterr().out.splitlines()
    warned = {name: [line for line in lines if line.startswith("sampler warning")] for name, lines in said.items()}
    assert warned["matched"] == []
    (line,) = warned["planted"]
    assert "sampler/ess" in line and "rollout.warn_ess_below 0.999" in line and "rollout.sampler_correction" in line


def test_the_panel_by_completion_length_quartile():
    """Eight completions of lengths 1, 8, 2, 7, 3, 6, 4, 5 (one token of log r = 0.1 x the length each, the rest
    matched): the quartiles are lengths {1, 2}, {3, 4}, {5, 6}, {7, 8}; q1's k3 per token is (k3(0.1) + k3(0.2)) /
    3 and its ESS is that of R = e^0.1, e^0.2 (the sequences' one non-zero log r each)."""
    lengths = [1, 8, 2, 7, 3, 6, 4, 5]
    mask = torch.zeros(8, 8, dtype=torch.bool)
    old = torch.full((8, 8), -1.0, dtype=torch.float64)
    mu = old.clone()
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        mu[i, 0] = old[i, 0] - 0.1 * n  # log r = 0.1 n on the first token
    row = sampler_metrics(old, mu, mask, 8, Distributed())

    def k3(x):
        return math.exp(x) - 1 - x

    for q, members in enumerate(([1, 2], [3, 4], [5, 6], [7, 8]), start=1):
        tokens = sum(members)
        assert row[m.sampler_quartile(q, "kl_k3")] == pytest.approx(sum(k3(0.1 * n) for n in members) / tokens,
                                                                    rel=1e-6)
        weights = [math.exp(0.1 * n) for n in members]
        ess = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
        assert row[m.sampler_quartile(q, "ess")] == pytest.approx(ess, rel=1e-6)
        assert row[m.sampler_quartile(q, "masked_token_frac")] == 0.0
    assert set(m.SAMPLER_QUARTILE_NAMES) <= set(row)
    # fewer than 4 completions: no split
    assert not set(m.SAMPLER_QUARTILE_NAMES) & set(_panel([[-0.5, -1.0, 0.0], [-0.1, -2.0, -0.7]],
                                                           [[-0.5, -1.0, 0.0], [-0.1, -2.0, -0.7]]))


class _BadLogprobSampler:
    """kv_loop's tokens with planted impossible log-probs: NaN, positive, or one short."""

    @staticmethod
    def make(kind):
        from klgrpo.backends.samplers import KVLoopSampler

        class Bad(KVLoopSampler):
            def sample(self, model, prompt_ids, prompt_mask, params, pad_id, eos_ids):
                drawn = super().sample(model, prompt_ids, prompt_mask, params, pad_id, eos_ids)
                if kind == "nan":
                    drawn.logp[0, 0] = float("nan")
                elif kind == "positive":
                    drawn.logp[0, 0] = 0.5
                else:
                    drawn.logp = drawn.logp[:, :-1]
                return drawn

        return Bad


@pytest.mark.parametrize(("kind", "said"), [("nan", "NaN or infinite"), ("positive", "above 0"),
                                            ("short", "of shape")])
def test_klgrpo_train_stops_on_impossible_sampler_logprobs(kind, said, tmp_path, tiny_model_dir, addition_file,
                                                          monkeypatch, capsys):
    """Through the klgrpo entry point: exit 2, one line naming the sampler, no step taken (no metrics row)."""
    from klgrpo.apps.cli import main
    from klgrpo.backends.samplers import SAMPLERS
    from klgrpo.run.metrics import read_metrics
    from tests.helpers.configs import make_config

    monkeypatch.setitem(SAMPLERS._items, "kv_loop", _BadLogprobSampler.make(kind))
    config = tmp_path / "c.yaml"
    config.write_text(make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 2},
                                  rollout={"sampler": "kv_loop"}).to_yaml())
    assert main(["train", "--config", str(config)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "rollout.sampler kv_loop returned" in err[0] and said in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or read_metrics(tmp_path / "run") == []
