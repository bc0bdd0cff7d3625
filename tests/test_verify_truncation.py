"""verify-kl past the sampler's edge: the kept sets' definitions by hand, every case passing through the trainer's
code, every planted bug caught, and a bug planted in the reference's renormalisation caught too."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.math.truncation import kept_counts, truncate_scores
from klgrpo.verify import truncation as tr


def _scores(probs):
    return [math.log(p) for p in probs]


@pytest.mark.parametrize("case, kept", [
    (tr.Case("k", 1.0, top_k=2), {0, 1}),
    # top-p: a token stays while the tokens above it hold less than top_p (0.75 < 0.8 keeps the third)
    (tr.Case("p", 1.0, top_p=0.8), {0, 1, 2}),
    (tr.Case("p", 1.0, top_p=0.7), {0, 1}),
    (tr.Case("p", 1.0, top_p=0.5), {0}),
    # min-p: p >= min_p * max p, max p = 0.5
    (tr.Case("m", 1.0, min_p=0.25), {0, 1, 2}),
    (tr.Case("m", 1.0, min_p=0.4), {0, 1}),
])
def test_kept_sets_by_their_definitions(case, kept):
    probs = [0.5, 0.25, 0.15, 0.1]
    assert tr.defined_kept_set(_scores(probs), case) == kept


def test_the_order_of_the_filters_matters_where_min_p_changes_top_p_s_mass():
    """p = (0.4, 0.3, 0.2, 0.1), top_p 0.75, min_p 0.3 (p >= 0.12): transformers' order (top-p first) keeps the
    third token (the two above hold 0.7 < 0.75); vLLM's (min-p first, the rest renormalised to 4/9, 3/9, 2/9)
    drops it (7/9 > 0.75). The trainer's filters agree with the definition in both orders."""
    scores = _scores([0.4, 0.3, 0.2, 0.1])
    hf = tr.Case("hf", 1.0, top_p=0.75, min_p=0.3)
    vllm = tr.Case("vllm", 1.0, top_p=0.75, min_p=0.3, min_p_first=True)
    assert tr.defined_kept_set(scores, hf) == {0, 1, 2}
    assert tr.defined_kept_set(scores, vllm) == {0, 1}
    x = torch.tensor(scores, dtype=torch.float64)
    assert int(kept_counts(truncate_scores(x, top_p=0.75, min_p=0.3))) == 3
    assert int(kept_counts(truncate_scores(x, top_p=0.75, min_p=0.3, min_p_first=True))) == 2


def test_every_case_passes_truncates_and_every_planted_bug_is_caught():
    values, gradients, bugs = tr.truncation_rows()
    cases = {v.case for v in values}
    for name in ("temperature 0.7", "temperature 1.3", "top_p 0.8", "top_p 0.95", "top_k 5", "top_k 2", "min_p 0.1",
                 "top_k 7 top_p 0.85 min_p 0.1", "the same, vLLM's order"):
        assert name in cases
    assert all(v.passed for v in values), [v for v in values if not v.passed][:3]
    assert all(g.passed for g in gradients), [g for g in gradients if not g.passed][:3]
    assert {v.estimator for v in values} == {"k1", "k2", "k3", "k1_st", "k3_st", "full"}
    assert {(g.placement, g.correction) for g in gradients} >= {
        (p, c) for p in ("loss", "reward") for c in ("none", "token_truncate", "token_mask", "sequence_truncate",
                                                    "sequence_mask")}
    for problem, case_list in ((tr.token_problem(), tr.TOKEN_CASES), (tr.sequence_problem(), tr.SEQUENCE_CASES)):
        for case in case_list:  # no filter row is vacuous: each cuts something
            assert tr.exact(problem, case).truncates == case.filters, (problem.level, case.name)
    caught = {(b.bug, b.level) for b in bugs if b.passed}
    for bug in (tr.BUG_WHOLE_SOFTMAX, tr.BUG_OTHER_TOP_P, tr.BUG_OTHER_ORDER):
        assert {(bug, "token"), (bug, "sequence")} <= caught
    assert all(b.passed for b in bugs)


def test_a_reference_left_unrenormalised_is_caught(monkeypatch):
    """A planted bug in the trainer's reference side: log ref(y) instead of log ref_S(y). k3's value is then off
    by ref(S) - 1 per token, so the value rows fail (k1's and k2's expectations shift by log ref(S) too)."""
    real = tr.reference_over_kept_set

    def unrenormalised(scores, ref_scores, targets, counts):
        _, log_mass, outside = real(scores, ref_scores, targets, counts)
        logp = ref_scores.log_softmax(-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
        return logp, log_mass, outside

    monkeypatch.setattr(tr, "reference_over_kept_set", unrenormalised)
    values, _ = tr.case_rows(tr.Trainer(), tr.token_problem(), tr.TOKEN_CASES[2])
    failed = {v.estimator for v in values if not v.passed}
    assert {"k1", "k3"} <= failed


def test_the_exact_answer_is_the_kl_of_the_truncated_distributions_by_hand():
    """The token problem at top_p 0.8: the definition's KL equals sum over the kept set of p_S log(p_S / r_S)
    written out with python floats."""
    problem, case = tr.token_problem(), tr.TOKEN_CASES[2]
    ex = tr.exact(problem, case)
    (kept,) = ex.kept
    x = [v / case.temperature for v in problem.theta[0].tolist()]
    r = [v / case.temperature for v in problem.ref_theta[0].tolist()]
    zx = sum(math.exp(x[i]) for i in kept)
    zr = sum(math.exp(r[i]) for i in kept)
    want = sum(math.exp(x[i]) / zx * (x[i] - math.log(zx) - r[i] + math.log(zr)) for i in kept)
    assert ex.kl["reverse"] == pytest.approx(want, abs=1e-12)
    assert 1 < len(kept) < problem.theta.shape[-1]
