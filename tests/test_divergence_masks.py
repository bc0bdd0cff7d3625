"""Divergence masks (rollout.divergence_mask) and the KL term of masked tokens (kl.masked_tokens), by hand.

The log-ratios d_t = log pi_old - log mu are chosen so that every divergence is a number worked out on paper:
k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.config.terms import sampler_correction
from klgrpo.errors import KLGRPOError
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, PolicyTerm, grpo_objective, kl_factor
from klgrpo.math.sampler_correction import (
    DivergenceMask,
    SamplerCorrection,
    divergence_keep,
    sampler_factors,
    sampler_weight,
)

#: Three completions of up to three tokens; row 2 has two (its third position is padding, with a huge d that
#: no mask may see).
D = torch.tensor([[0.0, 0.1, -0.1],
                  [0.0, 1.0, 0.0],
                  [-0.5, -0.5, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.float64)


def _k3(d: float) -> float:
    return math.exp(d) - 1 - d


def _keep(*masks: DivergenceMask) -> torch.Tensor:
    return divergence_keep(D, MASK, masks)


def test_token_k1_is_a_two_sided_token_mask():
    """r = e^d: row 0 (1, 1.105, 0.905), row 1 (1, e = 2.718, 1), row 2 (0.607, 0.607, padding). Bounds [0.9, 2]:
    e is above, 0.607 below; the padding's e^9 is never looked at."""
    keep = _keep(DivergenceMask("token_k1", 0.9, 2.0))
    assert keep.tolist() == [[1, 1, 1], [1, 0, 1], [0, 0, 1]]
    # one side only: no lower bound keeps row 2
    assert _keep(DivergenceMask("token_k1", None, 2.0)).tolist() == [[1, 1, 1], [1, 0, 1], [1, 1, 1]]


def test_sequence_k1_masks_bound_the_product_and_the_geometric_mean():
    """Sums of d: 0, 1, -1 (row 2 over its two tokens); means 0, 1/3, -0.5. The product e^sum: 1, 2.718, 0.368;
    the geometric mean e^mean: 1, 1.396, 0.607."""
    assert _keep(DivergenceMask("seq_sum_k1", 0.5, 2.0)).tolist() == [[1], [0], [0]]
    assert _keep(DivergenceMask("seq_mean_k1", 0.5, 2.0)).tolist() == [[1], [1], [1]]
    assert _keep(DivergenceMask("seq_mean_k1", 0.7, 1.3)).tolist() == [[1], [0], [0]]
    assert _keep(DivergenceMask("seq_mean_k1", 0.6, 1.4)).tolist() == [[1], [1], [1]]  # 0.607 and 1.396 inside


def test_k2_and_k3_masks_at_token_sum_mean_and_max():
    """Row 0's k3: 0, k3(0.1) = 0.005171, k3(-0.1) = 0.004837; row 1: 0, k3(1) = 0.718282, 0; row 2: k3(-0.5) =
    0.106531 twice. k2: 0, 0.005, 0.005 / 0, 0.5, 0 / 0.125, 0.125."""
    k3_row0 = _k3(0.1) + _k3(-0.1)
    assert _keep(DivergenceMask("token_k3", high=0.005)).tolist() == [[1, 0, 1], [1, 0, 1], [0, 0, 1]]
    assert _keep(DivergenceMask("token_k2", high=0.2)).tolist() == [[1, 1, 1], [1, 0, 1], [1, 1, 1]]
    # the sums: k3 0.010008, 0.718282, 0.213061; k2 0.01, 0.5, 0.25
    assert _keep(DivergenceMask("seq_sum_k3", high=k3_row0 + 1e-9)).tolist() == [[1], [0], [0]]
    assert _keep(DivergenceMask("seq_sum_k2", high=0.3)).tolist() == [[1], [0], [1]]
    # the means: k3 0.003336, 0.239427, 0.106531 (over row 2's two tokens, not three); k2 0.00333, 0.16667, 0.125
    assert _keep(DivergenceMask("seq_mean_k3", high=0.11)).tolist() == [[1], [0], [1]]
    assert _keep(DivergenceMask("seq_mean_k3", high=0.1)).tolist() == [[1], [0], [0]]
    assert _keep(DivergenceMask("seq_mean_k2", high=0.13)).tolist() == [[1], [0], [1]]
    # the maxima: k3 0.005171, 0.718282, 0.106531
    assert _keep(DivergenceMask("seq_max_k3", high=0.5)).tolist() == [[1], [0], [1]]
    assert _keep(DivergenceMask("seq_max_k2", high=0.1)).tolist() == [[1], [0], [0]]


def test_several_masks_reject_what_any_rejects_and_an_empty_row_is_kept():
    both = _keep(DivergenceMask("token_k3", high=0.005), DivergenceMask("seq_max_k2", high=0.1))
    assert both.tolist() == [[1, 0, 1], [0, 0, 0], [0, 0, 1]]  # a padding position stays 1
    empty = divergence_keep(torch.tensor([[5.0, 5.0]]), torch.zeros(1, 2), (DivergenceMask("seq_sum_k3", high=0.1),))
    assert empty.tolist() == [[1.0]]


def test_a_mask_mode_and_a_divergence_mask_keep_their_product():
    """token_mask [0.95, 2] rejects r = 0.905 (row 0, last) and 0.607 (row 2); token_k3 0.005 rejects row 0's
    middle token and row 1's e: the keep is their product, the weight the raw ratio."""
    old = D.clone()
    mu = torch.zeros_like(D)
    correction = SamplerCorrection("token_mask", 0.95, 2.0, masks=(DivergenceMask("token_k3", high=0.005),))
    factors = sampler_factors(old, mu, MASK, correction)
    assert (factors.keep * MASK).tolist() == [[1, 0, 0], [1, 0, 1], [0, 0, 0]]
    assert torch.allclose(factors.weight * MASK, D.exp() * MASK)
    assert torch.equal(sampler_weight(old, mu, MASK, correction), factors.product)
    alone = sampler_factors(old, mu, MASK, SamplerCorrection("none", masks=(DivergenceMask("token_k3", high=0.005),)))
    assert alone.weight.tolist() == [[1.0]] * 3  # no weight mode: the mask alone


@pytest.mark.parametrize("mode", ["auto", "drop", "keep"])
def test_masked_tokens_rule_in_the_loss(mode):
    """One row of 4 tokens, pi = pi_old (ratio 1), log pi - log ref = 0.2 everywhere, so k3 = e^-0.2 - 1 + 0.2
    = 0.018731 per token and the policy term is -A = -1 per token. The sampler's log-ratio d = (0, 0, 2, 0):
    token_k3 0.5 rejects token 2 (k3(2) = 4.389); the top-entropy mask keeps tokens 0 and 2 (entropies 2, 0, 3, 1,
    quantile 0.5). With beta 0.5 and token-mean aggregation over the 4 tokens, the loss is
        (sum_t v_t e_t (-1) + 0.5 sum_t u_t k3) / 4, v = (1, 1, 0, 1), e = (1, 0, 1, 0);
    u: auto = v, drop = v e = (1, 0, 0, 0), keep = v + (1 - keep) = (1, 1, 1, 1)."""
    logp = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 4), -1.2, dtype=torch.float64)
    sampler_logp = logp.detach() - torch.tensor([[0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    entropy = torch.tensor([[2.0, 0.0, 3.0, 1.0]], dtype=torch.float64)
    from klgrpo.math.objective import EntropyTerm

    inputs = ObjectiveInputs(logp, logp.detach(), ref, torch.ones(1, dtype=torch.float64), mask, entropy_BT=entropy,
                             sampler_logp_BT=sampler_logp)
    terms = ObjectiveTerms(kl=KLTerm(coef=0.5, estimator="k3", masked_tokens=mode), aggregation="token_mean",
                           policy=PolicyTerm(), entropy=EntropyTerm(top_quantile=0.5),
                           sampler_correction=SamplerCorrection(masks=(DivergenceMask("token_k3", high=0.5),)))
    out = grpo_objective(inputs, terms, Normalizer.of(mask))
    k3 = math.exp(-0.2) - 1 + 0.2
    kept_kl = {"auto": 3, "drop": 1, "keep": 4}[mode]
    assert out.loss.item() == pytest.approx((-1.0 + 0.5 * kept_kl * k3) / 4, rel=1e-12)


def test_keep_gives_a_rejected_token_weight_one_and_a_kept_one_its_weight():
    """sequence_mask [0.5, 2]: row 0's ratio e^0.3 = 1.35 is kept, row 1's e^1 rejected. u under keep: 1.35 for
    row 0, 1 for row 1; under auto and drop: 1.35 and 0."""
    factors = sampler_factors(torch.tensor([[0.3], [1.0]]), torch.zeros(2, 1), torch.ones(2, 1),
                              SamplerCorrection("sequence_mask", 0.5, 2.0))
    assert kl_factor("keep", factors, None).flatten().tolist() == pytest.approx([math.exp(0.3), 1.0])
    assert kl_factor("auto", factors, None).flatten().tolist() == pytest.approx([math.exp(0.3), 0.0])
    assert kl_factor("drop", factors, torch.tensor([[1.0], [1.0]])).flatten().tolist() == pytest.approx(
        [math.exp(0.3), 0.0])
    assert kl_factor("auto", None, torch.tensor([[0.0]])) is None  # the policy masks alone keep the KL
    assert kl_factor("drop", None, torch.tensor([[0.0]])).tolist() == [[0.0]]


@pytest.mark.parametrize(("names", "bounds", "field"), [
    ("token_k1", "2.0", "LOW_HIGH"), ("seq_max_k1", "0.5_2", "unknown mask"), ("", "0.1", "divergence_mask is empty"),
    ("token_k3", "-1", "not a positive number"), ("token_k3,seq_sum_k2", "1,2,3", "one per mask"),
    ("token_k1", "2_1", "LOW must be below HIGH"), ("token_k3", "0.5_2", "one upper bound"),
    ("token_k1", "_", "no bound"), ("token_k2", "nan", "not a positive number"), ("token_k3", "", "one per mask")])
def test_bad_divergence_settings_are_refused_in_one_line(names, bounds, field):
    cfg = GRPOConfig()
    cfg.rollout.divergence_mask, cfg.rollout.divergence_threshold = names, bounds
    with pytest.raises(KLGRPOError) as err:
        cfg.validate()
    assert field in str(err.value) and "\n" not in str(err.value)
    assert "rollout.divergence" in str(err.value)


def test_divergence_settings_reach_the_correction():
    cfg = GRPOConfig()
    cfg.rollout.divergence_mask, cfg.rollout.divergence_threshold = "token_k1, seq_mean_k3", "0.5_2.0,0.01"
    cfg.validate()
    assert sampler_correction(cfg.rollout).masks == (DivergenceMask("token_k1", 0.5, 2.0),
                                                     DivergenceMask("seq_mean_k3", None, 0.01))
    again = GRPOConfig()  # one entry for both: k1's form, refused for seq_mean_k3
    again.rollout.divergence_mask, again.rollout.divergence_threshold = "token_k1,seq_mean_k3", "_3"
    with pytest.raises(KLGRPOError, match="seq_mean_k3"):
        again.validate()
