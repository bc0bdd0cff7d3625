"""verify-kl's stale-samples section: with mu the policy K = 1, 2, 4 updates back, the sequence correction makes
every reverse-KL setting follow the reverse KL again, the token correction at one position only, none never; a
trainer that weights the KL by pi / pi_old alone is caught."""

from __future__ import annotations

import pytest

from klgrpo.verify import categorical, sequence_toy, staleness


@pytest.fixture(scope="module")
def section():
    return staleness.all_staleness_rows(categorical.make_categorical(), sequence_toy.make_toy())


def test_every_staleness_row_passes_at_k_1_2_4(section):
    rows, _ = section
    assert {r.staleness for r in rows} == {1, 2, 4} and {r.level for r in rows} == {"token", "sequence"}
    assert all(r.passed for r in rows)
    found = {(r.level, r.correction): set() for r in rows}
    for r in rows:
        found[r.level, r.correction].add(r.gradient_target)
    assert found["token", "none"] == found["sequence", "none"] == {"neither"}
    assert found["token", "token_mask (no bounds)"] == found["token", "sequence_mask (no bounds)"] == {"reverse"}
    assert found["sequence", "token_mask (no bounds)"] == {"neither"}
    assert found["sequence", "sequence_mask (no bounds)"] == {"reverse"}


def test_the_stale_policy_drifts_further_with_k(section):
    """K updates of the same step: KL(mu || pi) grows about as K^2 (0.005, 0.02, 0.07 per token)."""
    rows, _ = section
    kl = {(r.staleness, r.level): r.kl_stale for r in rows}
    for level in ("token", "sequence"):
        assert 0 < kl[1, level] < kl[2, level] < kl[4, level]
        assert 2.5 < kl[2, level] / kl[1, level] < 5.5


def test_neither_is_far_from_both_kls(section):
    """An uncorrected stale row is not a rounding miss: >= 1% of ||grad KL|| from each target at K = 1."""
    rows, _ = section
    assert min(min(r.rel_err_reverse, r.rel_err_forward) for r in rows if r.gradient_target == "neither") > 0.01


def test_the_kl_weighted_by_pi_over_pi_old_is_caught(section):
    _, bugs = section
    (bug,) = bugs
    assert bug.bug == staleness.BUG_KL_AT_PI_OLD and bug.passed and bug.failed >= bug.rows // 3
