"""verify-kl's "Masks and the KL" section: every mask x kl.masked_tokens x estimator agrees with the rule built
from the masks' definitions, every mask is tested where it bites, and each planted bug fails rows."""

from __future__ import annotations

import json
import math

import pytest

from klgrpo.math.objective import KL_MASKED_TOKENS
from klgrpo.verify import masked_kl
from klgrpo.verify.report import VerifyReport


@pytest.fixture(scope="module")
def section():
    return masked_kl.masked_kl_rows()


def test_every_mask_rule_and_estimator_agrees_with_the_rule(section):
    rows, _ = section
    loss = [r for r in rows if r.placement == "loss"]
    assert len(loss) == len(masked_kl.MASKS) * len(KL_MASKED_TOKENS) * len(masked_kl.ESTIMATOR_NAMES)
    assert {(r.mask, r.rule, r.estimator) for r in loss} == {
        (m.name, rule, e) for m in masked_kl.MASKS for rule in KL_MASKED_TOKENS for e in masked_kl.ESTIMATOR_NAMES}
    assert all(r.passed for r in rows)
    assert max(abs(r.value - r.expected) / abs(r.expected) for r in loss) < masked_kl.RTOL
    assert max(r.grad_rel_err for r in rows) < masked_kl.RTOL


def test_each_mask_rejects_some_tokens_and_keeps_others(section):
    """A mask that rejects nothing or everything would make the three rules agree (or all vanish) and prove
    nothing: each mask's thresholds bite on the toy."""
    rows, _ = section
    fracs = {r.mask: r.rejected_frac for r in rows if r.placement == "loss"}
    assert all(0.1 < f < 0.9 for f in fracs.values()), fracs


def test_the_rules_differ_where_they_should(section):
    """Where a sampler mask rejects, keep counts more KL than auto (= drop): k3's values are positive per token.
    Where a policy mask selects, auto keeps the KL (= keep) and drop loses it."""
    rows, _ = section
    value = {(r.mask, r.rule): r.value for r in rows if r.placement == "loss" and r.estimator == "k3"}
    for mask in ("token_k3", "seq_mean_k1", "sequence_mask [0.7, 1.8]"):
        assert value[mask, "auto"] == value[mask, "drop"] < value[mask, "keep"]
    for mask in ("off-policy sequence mask", "top-entropy mask"):
        assert value[mask, "auto"] == value[mask, "keep"] > value[mask, "drop"]


def test_the_reward_placement_does_not_depend_on_the_rule(section):
    rows, _ = section
    reward = [r for r in rows if r.placement == "reward"]
    assert len(reward) == len(masked_kl.MASKS) * 2 and all(r.passed for r in reward)


def test_each_planted_bug_is_caught(section):
    _, bugs = section
    assert [b.bug for b in bugs] == list(masked_kl.BUGS)
    for bug in bugs:
        assert bug.passed and bug.failed > 0, bug


def test_the_planted_bugs_are_put_back():
    """After the planted runs the trainer's own code is in place again: the rows pass."""
    with masked_kl.planted(masked_kl.BUG_RULE_IGNORED):
        pass
    toy, problem = masked_kl.make_toy()
    assert all(r.passed for r in masked_kl.loss_rows(toy, problem))


def test_the_section_is_in_the_report_and_its_json(section):
    rows, bugs = section
    report = VerifyReport(masked_kl=rows, masked_kl_bugs=bugs)
    out = json.loads(json.dumps(report.as_dict()))  # strict JSON: no NaN
    assert len(out["masked_kl"]) == len(rows) and all(b["caught"] for b in out["masked_kl_bugs"])
    text = masked_kl.format_masked_kl(rows, bugs)
    assert text.count(" ok\n") + text.endswith(" ok") >= len(masked_kl.MASKS)
    assert not math.isnan(sum(r.grad_rel_err for r in rows))
