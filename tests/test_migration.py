"""Migration from TRL and verl is exact: klgrpo's objective against TRL's real ``GRPOTrainer._compute_loss``
(float64, 1e-10, value and gradient) and against a hand-derived table of verl's formulas; the verify-kl rows of
the migration settings."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from klgrpo.math.advantages import group_advantages, kl_penalized_scores
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.kl import kl_estimate
from klgrpo.math.kl_shaping import shape_kl
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, PolicyTerm, grpo_objective
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.migration import migration_rows
from tests.helpers.one_process import OneProcessAccelerator

F64 = torch.float64
B, T, MAX_LEN = 4, 5, 6
EPS_LOW, EPS_HIGH = 0.2, 0.28

#: TRL loss_type -> klgrpo loss.aggregation (docs/explain.md's migration table). bnpo normalises by THIS micro-batch's
#: tokens (klgrpo's token_mean uses the step's: equal with one micro-batch, as here); dapo by the whole generation
#: batch.
TRL_AGGREGATION = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "constant", "dapo": "token_mean",
                   "luspo": "seq_mean_token_sum"}


def _inputs(seed: int = 0, off_policy: bool = True):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=F64) * 3 - 0.05
    old = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=F64) if off_policy else None
    ref = logp + 0.5 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, generator=gen, dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, old, ref, adv, mask


def _trl_loss(loss_type, beta, bias_correction, delta, logp, old, ref, adv, mask):
    """TRL 1.16's own GRPOTrainer._compute_loss on a minimal trainer object (only the attributes it reads)."""
    from trl import GRPOTrainer

    leaf = logp.clone().requires_grad_(True)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=OneProcessAccelerator(), _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, max_completion_length=MAX_LEN,
        args=SimpleNamespace(use_bias_correction_kl=bias_correction, delta=delta, steps_per_generation=1),
    )
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def _klgrpo_loss(loss_type, beta, bias_correction, delta, logp, old, ref, adv, mask):
    leaf = logp.clone().requires_grad_(True)
    kl = KLTerm(coef=beta, estimator="k3", placement="loss", is_correction="in_graph" if bias_correction else "none")
    old_logp = leaf.detach() if old is None else old
    terms = ObjectiveTerms(kl=kl, aggregation=TRL_AGGREGATION[loss_type],
                           policy=PolicyTerm(eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=delta))
    out = grpo_objective(ObjectiveInputs(leaf, old_logp, ref if beta else None, adv, mask), terms,
                         Normalizer.of(mask, max_len=MAX_LEN))
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach(), grad


TRL_GRID = list(itertools.product(sorted(TRL_AGGREGATION), (0.0, 0.04), (True, False), (False, True), (None, 1.5)))


@pytest.mark.parametrize("loss_type, beta, bias_correction, off_policy, delta", TRL_GRID)
def test_equals_trl_compute_loss(loss_type, beta, bias_correction, off_policy, delta):
    pytest.importorskip("trl")
    logp, old, ref, adv, mask = _inputs(off_policy=off_policy)
    trl_value, trl_grad = _trl_loss(loss_type, beta, bias_correction, delta, logp, old, ref, adv, mask)
    ours_value, ours_grad = _klgrpo_loss(loss_type, beta, bias_correction, delta, logp, old, ref, adv, mask)
    assert abs(float(trl_value - ours_value)) <= 1e-10
    assert float((trl_grad - ours_grad).abs().max()) <= 1e-10
    assert float(trl_grad.abs().max()) > 1e-3  # the comparison has something to compare


def test_trl_delta_and_off_policy_actually_bind():
    """The grid's inputs exercise the options (differences far above the 1e-10 tolerance): delta 1.5 and the
    bias correction both change TRL's loss off-policy."""
    pytest.importorskip("trl")
    logp, old, ref, adv, mask = _inputs(off_policy=True)
    plain = _trl_loss("dapo", 0.04, True, None, logp, old, ref, adv, mask)[0]
    assert abs(float(plain - _trl_loss("dapo", 0.04, True, 1.5, logp, old, ref, adv, mask)[0])) > 1e-4
    assert abs(float(plain - _trl_loss("dapo", 0.04, False, None, logp, old, ref, adv, mask)[0])) > 1e-6


# ------------------------------------------------------------------------------------------------------ verl
# verl's formulas, derived by hand from its documentation (not its code), on two tokens:
#   low_var_kl(l)       = clamp(exp(-l) + l - 1, -10, 10)      (k3, capped at 10 with zero gradient beyond)
#   dual clip (A < 0)    loss = min(max(-A rho, -A clip(rho)), -c A), c = clip_ratio_c = 3
#   GRPO advantage       (r - mean) / (std + 1e-6), std the sample std (ddof 1)
#   KL in the reward     score_i - beta * sum_t k1_t, then the GRPO advantage
def test_verl_low_var_kl_is_k3_with_clip_shaping_at_10():
    l = torch.tensor([[0.5, -3.0]], dtype=F64, requires_grad=True)  # k3(-3) = e^3 - 4 = 16.0855 > 10
    ref = torch.zeros(1, 2, dtype=F64)
    capped = shape_kl(kl_estimate(l, ref, "k3"), torch.ones(1, 2), "clip", kl_clip_threshold=10.0)
    expected = [math.exp(-0.5) + 0.5 - 1, 10.0]  # 0.1065307, 10
    torch.testing.assert_close(capped.detach(), torch.tensor([expected], dtype=F64), rtol=1e-14, atol=0)
    capped.sum().backward()
    # d k3 / d l = 1 - e^{-l}: 1 - e^{-0.5} = 0.3934693 below the cap, 0 above it
    torch.testing.assert_close(l.grad, torch.tensor([[1 - math.exp(-0.5), 0.0]], dtype=F64), rtol=1e-14, atol=0)


def test_verl_dual_clip_table():
    # rho = [0.5, 1, 2, 4], A = -1: -A rho = [0.5, 1, 2, 4]; -A clip(rho, 0.8, 1.28) = [0.8, 1, 1.28, 1.28];
    # max = [0.8, 1, 2, 4]; min(., 3) = [0.8, 1, 2, 3]. A = +1: -min(rho, clip) = [-0.5, -1, -1.28, -1.28].
    logp = torch.log(torch.tensor([[0.5, 1.0, 2.0, 4.0]] * 2, dtype=F64))
    mask = torch.ones(2, 4)
    inputs = ObjectiveInputs(logp, torch.zeros(2, 4, dtype=F64), None, torch.tensor([-1.0, 1.0], dtype=F64), mask)
    terms = ObjectiveTerms(kl=KLTerm(), aggregation="seq_mean_token_sum",
                           policy=PolicyTerm(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=3.0))
    out = grpo_objective(inputs, terms, Normalizer(1.0, 8.0, 4.0))
    assert float(out.loss) == pytest.approx((0.8 + 1 + 2 + 3) + (-0.5 - 1 - 1.28 - 1.28), rel=1e-14)


def test_verl_grpo_advantage_eps():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)  # mean 0.5, sample std sqrt(1/3) = 0.5773503
    adv = group_advantages(r, 4, "group", eps=1e-6, ddof=1)
    std = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=F64) / (std + 1e-6),
                               rtol=1e-14, atol=0)


def test_verl_kl_in_reward_is_sequence_score():
    # two groups of 2: scores [1, 0 | 1, 1], k1 per token [[0.2, 0.1], [0.3, 0 (masked)], [0.5, 0.5], [0.1, 0.1]]
    # beta 0.1: penalised scores [1 - 0.03, 0 - 0.03, 1 - 0.1, 1 - 0.02] = [0.97, -0.03, 0.9, 0.98]
    k1 = torch.tensor([[0.2, 0.1], [0.3, 7.0], [0.5, 0.5], [0.1, 0.1]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    scores = kl_penalized_scores(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64), k1, mask, 0.1)
    torch.testing.assert_close(scores, torch.tensor([0.97, -0.03, 0.9, 0.98], dtype=F64), rtol=1e-14, atol=1e-15)
    # group of 2 with ddof 1: A = +-(d / 2) / (|d| / sqrt 2 + eps) = +-1/sqrt(2) up to eps: d = 1.0 and -0.08
    adv = group_advantages(scores, 2, "group", eps=1e-6)
    half = 1 / math.sqrt(2)
    expected = [0.5 / (1.0 * half + 1e-6), -0.5 / (1.0 * half + 1e-6),
                -0.04 / (0.08 * half + 1e-6), 0.04 / (0.08 * half + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------ verify-kl rows
def test_verify_kl_migration_rows_pass_and_say_which_kl():
    rows = migration_rows(categorical.make_categorical(), sequence_toy.make_toy())
    assert rows and all(r.passed for r in rows)
    follows = {(r.setting, r.estimator, r.placement, r.sampling, r.level): r.gradient_target for r in rows}
    assert follows[("reward_mode=sequence_score", "k1", "reward", "on_policy", "sequence")] == "reverse"
    assert follows[("delta=1.5", "k3", "loss", "off_policy_in_graph", "token")] == "reverse"
    assert follows[("dual_clip=3", "k1", "reward", "on_policy", "sequence")] == "reverse"


def test_verify_kl_sequence_score_rows_fail_on_a_planted_bug(monkeypatch):
    """If the sequence-score path added the KL (sign bug), the rows must fail."""
    import klgrpo.verify.penalty as penalty

    monkeypatch.setattr(penalty, "kl_penalized_scores", lambda r, kl, m, c: kl_penalized_scores(r, kl, m, -c))
    rows = migration_rows(categorical.make_categorical(), sequence_toy.make_toy())
    failed = {(r.setting, r.estimator, r.placement, r.sampling) for r in rows if not r.passed}
    assert ("reward_mode=sequence_score", "k1", "reward", "on_policy") in failed
