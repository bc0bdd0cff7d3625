"""verify-kl's rows for kl.estimator full: they pass as declared, and they fail when the trainer's KL term or
the chunked KL's gradient is wrong."""

from __future__ import annotations

import klgrpo.math.objective as objective
import klgrpo.verify.full_kl as full_kl
from klgrpo.math.full_kl import FULL_KL_GRADIENTS
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.report import format_report, run_all


def _problems():
    return categorical.make_categorical(), sequence_toy.make_toy()


def test_full_kl_rows_pass_and_are_the_declared_ones():
    rows = full_kl.gradient_rows(*_problems())
    assert len(rows) == 8 and all(r.passed for r in rows)
    assert {(r.level, r.sampling): r.gradient_target for r in rows} == {
        key: FULL_KL_GRADIENTS[key] for key in ((r.level, r.sampling) for r in rows)}
    token = [r for r in rows if r.level == "token"]
    assert all(r.gradient_target == "reverse" and abs(r.norm_ratio - 1) < 1e-12 for r in token)  # scale 1


def test_full_kl_values_equal_the_exact_kl_with_zero_variance_gradient():
    token, sequence = full_kl.value_rows(*_problems())
    assert token["passed"] and sequence["passed"]
    assert token["abs_diff"] < 1e-12 and token["per_sample_grad_max_err"] < 1e-12 and sequence["abs_diff"] < 1e-12


def test_report_carries_the_full_kl_section():
    report = run_all(monte_carlo=False, optimum_search=False)
    assert report.passed and len(report.full_kl) == 8 and len(report.full_kl_values) == 2
    assert "kl.estimator full" in format_report(report)


def test_rows_fail_when_the_objective_scales_the_full_kl(monkeypatch):
    real = objective.kl_penalty_terms

    def doubled(*args, full_kl_BT=None, **kwargs):
        return real(*args, full_kl_BT=None if full_kl_BT is None else 2 * full_kl_BT, **kwargs)

    monkeypatch.setattr(objective, "kl_penalty_terms", doubled)
    rows = full_kl.gradient_rows(*_problems())
    assert not any(r.passed for r in rows if r.level == "token")


def test_rows_fail_when_the_chunked_kl_has_no_gradient(monkeypatch):
    real = full_kl.token_logprobs_and_full_kl

    def detached(*args, **kwargs):
        logp, kl, entropy, ref_logp = real(*args, **kwargs)
        return logp, kl.detach(), entropy, ref_logp

    monkeypatch.setattr(full_kl, "token_logprobs_and_full_kl", detached)
    rows = full_kl.gradient_rows(*_problems())
    assert [r.gradient_target for r in rows if r.level == "token"] == ["zero"] * 4
    assert not full_kl.value_rows(*_problems())[0]["passed"]  # the per-draw gradient check catches it too
