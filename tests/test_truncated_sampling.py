"""Truncated sampling trained as the distribution drawn from (rollout.truncation policy): the trainer's log-probs
of the sampled tokens equal the sampler's own under top-p, top-k and min-p, through the KV loop and generate;
with rollout.truncation ignore they differ by the log kept mass, as before."""

from __future__ import annotations

import pytest
import torch

from klgrpo.math.logprobs import token_logprobs
from klgrpo.math.truncation import kept_counts, kept_set, truncate_scores
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import metric_names as m
from tests.helpers.configs import make_config, quiet


def _last_row(tmp_path, tiny_model_dir, addition_file, name, kl=None, steps=1, **rollout):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / name, train={"steps": steps},
                      rollout={"temperature": 0.7, **rollout}, **({"kl": kl} if kl else {}))
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()
    return read_metrics(trainer.run_dir)[-1]


@pytest.mark.parametrize("sampler", ["kv_loop", "generate"])
@pytest.mark.parametrize("filters", [{"top_p": 0.8}, {"top_k": 5}, {"min_p": 0.5},
                                     {"top_p": 0.9, "top_k": 8, "min_p": 0.2}])
def test_the_trainer_scores_the_truncated_distribution_the_sampler_drew_from(tmp_path, tiny_model_dir,
                                                                             addition_file, sampler, filters):
    row = _last_row(tmp_path, tiny_model_dir, addition_file, "policy", sampler=sampler, **filters)
    assert row[m.SAMPLER_LOGP_DIFF_MAX] <= 1e-4
    assert abs(row[m.SAMPLER_LOGP_DIFF_SIGNED]) <= 1e-4
    assert 0.0 < row[m.SAMPLER_KEPT_MASS_MIN] <= row[m.SAMPLER_KEPT_MASS_P10] <= row[m.SAMPLER_KEPT_MASS] < 1.0
    assert row[m.SAMPLER_KEPT_SET_MISMATCH] <= 0.01


def test_ignoring_the_truncation_scores_the_whole_softmax(tmp_path, tiny_model_dir, addition_file):
    """The planted bug the definition removes: the trainer's log pi_old - log mu is the log kept mass (< 0)."""
    row = _last_row(tmp_path, tiny_model_dir, addition_file, "ignore", sampler="kv_loop", top_p=0.8,
                    truncation="ignore")
    assert row[m.SAMPLER_LOGP_DIFF_SIGNED] < -1e-3
    assert row[m.SAMPLER_LOGP_DIFF_MAX] > 1e-2
    assert m.SAMPLER_KEPT_MASS not in row


def test_ignore_with_a_sampler_correction_is_refused(tmp_path, tiny_model_dir, addition_file):
    from klgrpo.errors import ConfigError

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "r", train={"steps": 1},
                      rollout={"top_p": 0.8, "truncation": "ignore", "sampler_correction": "token_mask"})
    with pytest.raises(ConfigError, match="no importance weight repairs a truncation"):
        cfg.validate()


def test_kept_set_log_probs_and_gradient_are_the_renormalised_softmax():
    """Hand-built: the log-prob over the kept set and its gradient equal log_softmax over the kept logits alone
    (float64, exact); the sampled token is always in the set, and a count that ranks it outside is flagged."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    scores = truncate_scores(logits.detach() / 0.7, top_k=6, top_p=0.85, min_p=0.05)
    counts = kept_counts(scores)
    targets = torch.multinomial(scores.reshape(-1, 12).softmax(-1), 1, generator=gen).reshape(2, 4)
    got = token_logprobs(logits, targets, 0.7, kept_BT=counts)
    kept_logits = torch.where(torch.isfinite(scores), logits / 0.7, torch.tensor(float("-inf"), dtype=torch.float64))
    want = kept_logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-14, rtol=0)
    weights = torch.randn(2, 4, dtype=torch.float64, generator=gen)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
    assert torch.allclose(g_got, g_want, atol=1e-14, rtol=0)
    assert (g_got.abs() * (~torch.isfinite(scores))).max() == 0  # no gradient outside the kept set
    # a count of 1 at a position whose sampled token is not the top one: the set is that token alone, flagged
    x = torch.tensor([[3.0, 2.0, 1.0]], dtype=torch.float64)
    kept, outside = kept_set(x, torch.tensor([1]), torch.tensor([1]))
    assert kept.tolist() == [[False, True, False]] and outside.item()
    assert token_logprobs(x.unsqueeze(0), torch.tensor([[1]]), kept_BT=torch.tensor([[1]])).item() == 0.0


def test_a_near_tie_at_the_boundary_keeps_the_sampler_s_set():
    """The sampler kept its top 2, (0, 2); the trainer's logits rank token 1 a hair above token 2, so the sampled
    token 2 is third for it. The trainer's set is then its top 1 and the sampled token, (0, 2), the sampler's own:
    log pi_S equal to the sampler's to rounding, where widening the set to (0, 1, 2) would miss it by ~0.11."""
    sampler = torch.tensor([3.0, 1.0, 1.0 + 1e-6, -2.0], dtype=torch.float64)
    trainer = torch.tensor([3.0, 1.0 + 1e-6, 1.0, -2.0], dtype=torch.float64)
    want = torch.log_softmax(sampler[[0, 2]], -1)[1]
    got = token_logprobs(trainer.view(1, 1, 4), torch.tensor([[2]]), kept_BT=torch.tensor([[2]]))
    assert abs(got.item() - want.item()) < 1e-5
    kept, outside = kept_set(trainer.view(1, 4), torch.tensor([2]), torch.tensor([2]))
    assert outside.item() and kept.tolist() == [[True, False, True, False]]
    widened = torch.log_softmax(trainer[:3], -1)[2]
    assert abs(widened.item() - want.item()) > 0.1  # the check is not vacuous


def test_tokens_tied_at_the_boundary_count_once():
    """A quantized model's tied rows give exactly equal logits (SmolLM2's GGUF has such pairs): the sampler kept
    its top 2 where its own kernels ordered the pair; the trainer sees them tied and must keep 2 tokens, not 3."""
    trainer = torch.tensor([[[3.0, 1.0, 1.0, -2.0]]], dtype=torch.float64)
    sampler = torch.tensor([3.0, 1.0 + 1e-7, 1.0, -2.0], dtype=torch.float64)
    want = torch.log_softmax(sampler[:2], -1)[0]
    got = token_logprobs(trainer, torch.tensor([[0]]), kept_BT=torch.tensor([[2]]))
    assert abs(got.item() - want.item()) < 1e-6
    kept, outside = kept_set(trainer[0], torch.tensor([0]), torch.tensor([2]))
    assert int(kept.sum()) == 2 and not outside.item()
    # the sampled token is one of the tied pair: it is in the set, and the set still holds 2
    kept, _ = kept_set(trainer[0], torch.tensor([2]), torch.tensor([2]))
    assert kept[0, 2] and int(kept.sum()) == 2


def test_full_kl_over_kept_sets_is_the_kl_between_both_renormalised_distributions():
    """kl.estimator full under truncated sampling: KL(pi_S || ref_S) with both sides renormalised over the
    policy's kept set, its gradient, log pi_S and log ref_S, against the masked softmaxes written out (float64)."""
    from klgrpo.math.full_kl import token_logprobs_and_full_kl

    gen = torch.Generator().manual_seed(5)
    v, h, temperature = 12, 4, 0.7
    logits = torch.randn(2, 3, v, dtype=torch.float64, generator=gen, requires_grad=True)
    hidden = torch.randn(2, 3, h, dtype=torch.float64, generator=gen)
    head = torch.nn.Linear(h, v, bias=False).double()
    scores = truncate_scores(logits.detach() / temperature, top_p=0.8, top_k=7)
    counts = kept_counts(scores)
    counts[1, 2] = 0  # one position without a filter: the whole vocabulary on both sides
    targets = torch.multinomial(scores.reshape(-1, v).softmax(-1), 1, generator=gen).reshape(2, 3)
    logp, kl, entropy, ref_logp = token_logprobs_and_full_kl(logits, targets, hidden, head, temperature,
                                                             kept_BT=counts)
    kept = torch.isfinite(scores)
    kept[1, 2] = True
    minus_inf = torch.tensor(float("-inf"), dtype=torch.float64)
    a = torch.where(kept, logits / temperature, minus_inf).log_softmax(-1)
    with torch.no_grad():
        r = torch.where(kept, head(hidden) / temperature, minus_inf).log_softmax(-1)
    p, zero = a.exp(), torch.zeros((), dtype=torch.float64)
    want_kl = (p * (torch.where(kept, a, zero) - torch.where(kept, r, zero))).sum(-1)  # no inf - inf anywhere
    assert torch.allclose(kl, want_kl, atol=1e-13, rtol=0)
    assert torch.allclose(logp, a.gather(-1, targets[..., None]).squeeze(-1), atol=1e-13, rtol=0)
    assert torch.allclose(ref_logp, r.gather(-1, targets[..., None]).squeeze(-1), atol=1e-13, rtol=0)
    want_entropy = -(p * torch.where(kept, a, zero)).sum(-1)
    assert torch.allclose(entropy.double(), want_entropy.detach(), atol=1e-6, rtol=0)  # stored in float32
    weights = torch.randn(2, 2, 3, dtype=torch.float64, generator=gen)
    (g_got,) = torch.autograd.grad((kl * weights[0] + logp * weights[1]).sum(), logits)
    (g_want,) = torch.autograd.grad((want_kl * weights[0] + a.gather(-1, targets[..., None]).squeeze(-1)
                                     * weights[1]).sum(), logits)
    assert torch.allclose(g_got, g_want, atol=1e-13, rtol=0)
    assert (g_got.abs() * ~kept).max() == 0  # no gradient outside the kept set
    assert float(want_kl[0].min()) > 0  # the check is not vacuous


@pytest.mark.parametrize("sampler", ["kv_loop", "generate"])
def test_full_kl_trains_over_the_kept_sets(tmp_path, tiny_model_dir, addition_file, sampler):
    """The whole step with kl.estimator full and top-p: the update's log-probs are the sampler's (pi_S), the
    reference check of the full KL's rebuilt log ref_S against the kept-set pass's passes, and the KL is logged."""
    row = _last_row(tmp_path, tiny_model_dir, addition_file, "full", kl={"estimator": "full", "coef": 0.1},
                    steps=2, sampler=sampler, top_p=0.8)  # step 2: the policy has moved off the reference
    assert row[m.SAMPLER_LOGP_DIFF_MAX] <= 1e-4
    assert row[m.SAMPLER_KEPT_MASS] < 1.0
    assert row[m.RAW_KL] > 1e-6 and row[m.KL_MIN] >= 0  # full: KL(pi_S || ref_S) >= 0 at every position
