"""The verifier: sequence-level table, docs/kl_math.md facts, the optimum, Monte Carlo, the command and --from-run."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from klgrpo.apps.verify_kl import main as verify_main
from klgrpo.core.kl_dump import save_dump
from klgrpo.math.advantages import reward_to_go
from klgrpo.math.kl import ESTIMATORS, kl_estimate
from klgrpo.verify import categorical, montecarlo, sequence_toy
from klgrpo.verify.penalty import GRADIENT_RTOL, classify_gradient, flat_grad
from klgrpo.verify.report import torch_threads
from klgrpo.verify.sequence_toy import TOY


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def toy():
    return sequence_toy.make_toy()


@pytest.fixture(scope="module")
def toy_kl(toy):
    return sequence_toy.kl_values_and_gradients(toy)


def _target(toy, toy_kl, name, placement, sampling="on_policy"):
    g = sequence_toy.expected_gradient(toy, name, placement, sampling)
    return classify_gradient(g, toy_kl["grad_reverse"], toy_kl["grad_forward"])["gradient_target"]


# ---------------------------------------------------------------- the toy itself


def test_toy_enumeration():
    # 15 prefixes (lengths 0..3 over {a, b}), 31 sequences (15 ending in EOS + 16 of length 4), 45 parameters.
    assert len(TOY.prefixes) == 15 and len(TOY.sequences) == 31 and TOY.num_params == 45
    assert TOY.mask_BT.shape == (31, 4)
    theta = torch.randn(15, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    assert float(TOY.seq_logp(theta).exp().sum()) == pytest.approx(1.0, abs=1e-14)
    # uniform rows: P(EOS first) = 1/3, P(aaaa) = 1/81, E[len] = 1 + 2/3 + 4/9 + 8/27 = 65/27
    uniform = torch.zeros(15, 3, dtype=torch.float64)
    prob = TOY.seq_logp(uniform).exp()
    assert float(prob[0]) == pytest.approx(1 / 3, abs=1e-15)
    assert float((prob * TOY.lengths_B).sum()) == pytest.approx(65 / 27, abs=1e-14)


# ---------------------------------------------------------------- the sequence-level table


def test_sequence_table_agrees_with_every_declaration(toy):
    rows = sequence_toy.gradient_rows(toy)
    assert len(rows) == len(ESTIMATORS) * 3 * 4
    wrong = [f"{r.estimator}/{r.placement}/{r.sampling}: declared {r.declared}, found {r.gradient_target}"
             for r in rows if not r.passed]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_sequence_values(toy, name):
    """E_pi[sum_t k_t] = sequence KL for unbiased values (tower property), to 1e-12."""
    assert sequence_toy.value_check(toy, name)["passed"]


def test_kl_math_facts_token_level():
    cat = categorical.make_categorical()
    kl = categorical.kl_values_and_gradients(cat)

    def target(name, placement, sampling="on_policy"):
        g = categorical.expected_gradient(cat, name, placement, sampling)
        return classify_gradient(g, kl["grad_reverse"], kl["grad_forward"])["gradient_target"]

    assert target("k3", "loss") == "forward"
    assert target("k1", "loss") == "zero"
    assert target("k3", "loss", "off_policy_in_graph") == "reverse"     # w = pi/mu in the graph
    assert target("k3", "loss", "off_policy_detached") == "forward"     # sg(w) * k3: the detach bug


def test_kl_math_facts_sequence_level(toy, toy_kl):
    assert _target(toy, toy_kl, "k1", "reward") == "reverse"
    assert _target(toy, toy_kl, "k3", "both") == "reverse"
    assert _target(toy, toy_kl, "k2", "loss") == "neither"    # token-sum k2 loss: partial gradient
    assert _target(toy, toy_kl, "k3", "loss") == "neither"
    assert _target(toy, toy_kl, "k3", "reward") == "neither"
    assert _target(toy, toy_kl, "k1", "loss") == "zero"


def test_kl_math_exact_sequence_surrogates(toy, toy_kl):
    """docs/kl_math.md (3) 0.5 (sum_t l_t)^2 and (4) per-token k2 plus the detached future sum_{t'>t} l_t'
    as a return are exact for the sequence KL on-policy; dropping the future term is not."""
    theta = toy.params()
    logp_BT, ref_BT = TOY.logp_BT(theta), TOY.logp_BT(toy.ref_theta)
    weights = logp_BT.sum(-1).exp().detach()
    l_BT = (logp_BT - ref_BT) * TOY.mask_BT
    seq_sq = (weights * 0.5 * l_BT.sum(-1) ** 2).sum()
    future_BT = (reward_to_go(kl_estimate(logp_BT, ref_BT, "k1").detach(), TOY.mask_BT) - l_BT.detach())
    k2_plus = (weights.unsqueeze(-1) * (kl_estimate(logp_BT, ref_BT, "k2") + future_BT * logp_BT)
               * TOY.mask_BT).sum()
    k2_only = (weights.unsqueeze(-1) * kl_estimate(logp_BT, ref_BT, "k2") * TOY.mask_BT).sum()
    rev, fwd = toy_kl["grad_reverse"], toy_kl["grad_forward"]
    for objective, want in ((seq_sq, "reverse"), (k2_plus, "reverse"), (k2_only, "neither")):
        g = flat_grad(objective, theta, retain_graph=True)
        assert classify_gradient(g, rev, fwd)["gradient_target"] == want


def test_classification_tolerance_can_fail(toy_kl):
    rev, fwd = toy_kl["grad_reverse"], toy_kl["grad_forward"]
    nudged = rev + 10 * GRADIENT_RTOL * rev.norm() * torch.nn.functional.normalize(fwd - rev, dim=0)
    assert classify_gradient(nudged, rev, fwd)["gradient_target"] == "neither"
    assert classify_gradient(2 * rev, rev, fwd)["gradient_target"] == "neither"   # the scale matters
    assert classify_gradient(0 * rev, rev, fwd)["gradient_target"] == "zero"


# ---------------------------------------------------------------- Monte Carlo


def test_monte_carlo_passes_with_fixed_seed():
    cat = categorical.make_categorical()
    toy = sequence_toy.make_toy()
    checks = montecarlo.run_monte_carlo(samples=4000, seed=0, cat_problem=cat, toy_problem=toy)
    assert len(checks) == 6 * len(ESTIMATORS) + len(montecarlo.SEQUENCE_CASES)
    failed = [c for c in checks if not c.passed]
    assert not failed, failed


def test_monte_carlo_detects_a_wrong_target(toy, toy_kl):
    """Negative control: k3-in-loss samples are far (many standard errors) from the reverse-KL gradient."""
    gen = torch.Generator().manual_seed(0)
    per_sample = montecarlo.sequence_gradient_samples(toy, "k3", "loss", "on_policy", 20000, gen)
    exact = sequence_toy.expected_gradient(toy, "k3", "loss", "on_policy")
    assert montecarlo._max_z(per_sample, exact) < montecarlo.bonferroni_z(1e-3, 45)
    assert montecarlo._max_z(per_sample, toy_kl["grad_reverse"]) > 10


def test_bonferroni_z():
    # Two-sided normal quantiles: alpha 0.05 -> 1.95996; 1e-3 over 45 coordinates -> 4.2413.
    assert montecarlo.bonferroni_z(0.05, 1) == pytest.approx(1.959964, abs=1e-5)
    assert montecarlo.bonferroni_z(1e-3, 45) == pytest.approx(4.2413, abs=1e-3)


# ---------------------------------------------------------------- the command (runs everything once)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "out" / "verify.json"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = verify_main(["--json", str(path), "--samples", "3000", "--seed", "0"])
    return rc, json.loads(path.read_text()), out.getvalue()


def test_cli_passes_and_writes_schema(cli_run):
    rc, data, text = cli_run
    assert rc == 0 and data["passed"] is True
    assert set(data) >= {"rows", "values", "monte_carlo", "optimum", "passed"}
    keys = {"estimator", "placement", "sampling", "level", "gradient_target", "declared", "passed",
            "cosine_reverse", "cosine_forward"}
    assert len(data["rows"]) == 2 * len(ESTIMATORS) * 3 * 4
    for row in data["rows"]:
        assert keys <= set(row)
        assert row["gradient_target"] in ("reverse", "forward", "zero", "neither")
        assert row["level"] in ("token", "sequence")
        assert -1.0 - 1e-12 <= row["cosine_reverse"] <= 1.0 + 1e-12
    assert {(r["estimator"], r["level"]) for r in data["values"]} == {
        (n, lvl) for n in ESTIMATORS.names() for lvl in ("token", "sequence")}
    assert len(data["first_epoch"]) == len(ESTIMATORS) * 2 * 2 * 2 and all(r["passed"] for r in data["first_epoch"])
    first = {(r["estimator"], r["placement"], r["sampling"], r["level"]): r["gradient_target"]
             for r in data["first_epoch"]}
    assert first[("k3", "loss", "first_epoch_in_graph", "token")] == "reverse"
    assert first[("k3_st", "loss", "first_epoch_in_graph", "token")] == "neither"   # k3_st needs detached
    assert {m["samples"] for m in data["monte_carlo"]} == {3000, montecarlo.MIN_SEQUENCE_SAMPLES}
    assert "PASSED" in text and "level sequence" in text and "k3_st" in text
    assert "The entropy bonus" in text and len(data["entropy"]) == 5 and all(e["passed"] for e in data["entropy"])


def _uniform_optimum():
    """pi* = ref exp(R / beta) / Z by plain enumeration: ref uniform over {a, b, EOS} in every row,
    R = 0.5 per 'a', beta = 0.5, so pi*(seq) is proportional to 3^-len e^{#a}."""
    seqs = [p + ("$",) for n in range(4) for p in itertools.product("ab", repeat=n)]
    seqs += list(itertools.product("ab", repeat=4))
    w = [3.0 ** -len(s) * math.exp(s.count("a")) for s in seqs]
    z = sum(w)
    p = [x / z for x in w]
    mean_len = sum(pi * len(s) for pi, s in zip(p, seqs))
    kl = sum(pi * math.log(pi / 3.0 ** -len(s)) for pi, s in zip(p, seqs))
    return mean_len, kl


def test_optimum_numbers(cli_run):
    _, data, _ = cli_run
    res = {r["label"]: r for r in data["optimum"]}
    star_len, star_kl = _uniform_optimum()
    assert star_len == pytest.approx(3.45020, abs=1e-5) and star_kl == pytest.approx(0.74924, abs=1e-5)
    for r in data["optimum"]:
        assert r["grad_norm"] < 1e-6 and r["passed"], f"{r['label']} did not converge"
    # exact sequence gradient -> the optimum itself
    for label in ("k1 in reward", "k3 in reward and loss"):
        assert res[label]["tv_to_optimum"] < 1e-6
        assert res[label]["mean_length"] == pytest.approx(star_len, abs=1e-6)
        assert res[label]["kl"] == pytest.approx(star_kl, abs=1e-6)
    # token-sum losses stop short of it (measured; stationary points, so tight tolerances)
    assert res["k2 loss, token sum"]["tv_to_optimum"] == pytest.approx(0.05871, abs=2e-4)
    assert res["k3_st loss, token sum"]["tv_to_optimum"] == pytest.approx(0.05871, abs=2e-4)  # = k2 gradient
    assert res["k3 loss, token sum"]["tv_to_optimum"] == pytest.approx(0.04961, abs=2e-4)
    # per-sequence token mean: long sequences regularised less -> longer, ~3x the optimum's KL
    smtm = res["k3 loss, seq_mean_token_mean"]
    assert smtm["tv_to_optimum"] == pytest.approx(0.3796, abs=1e-3)
    assert smtm["mean_length"] == pytest.approx(3.617, abs=2e-3)
    assert smtm["kl"] == pytest.approx(2.130, abs=5e-3)
    assert smtm["mean_length"] > star_len + 0.1 and smtm["kl"] > 2.5 * star_kl
    for label in ("k3 loss, token_mean", "k3 loss, constant (L_max 4)"):
        assert res[label]["mean_length"] > smtm["mean_length"] and res[label]["kl"] > smtm["kl"]
    # When the policy-gradient term is aggregated the same way (as the trainer does), token_mean only rescales
    # both terms by 1 / E[len]: the stationary point is the token-sum one, and k1 in the reward stays exact.
    assert res["k1 in reward, token_mean (PG too)"]["tv_to_optimum"] < 1e-6
    for pg_too, token_sum in (("k3 loss, token_mean (PG too)", "k3 loss, token sum"),
                              ("k3_st loss, token_mean (PG too)", "k3_st loss, token sum")):
        assert res[pg_too]["tv_to_optimum"] == pytest.approx(res[token_sum]["tv_to_optimum"], abs=1e-6)
    # seq_mean_token_mean on both terms: no longer a pure rescale, but no length exploitation on this toy
    both = res["k3 loss, seq_mean_token_mean (PG too)"]
    assert both["tv_to_optimum"] == pytest.approx(0.0682, abs=1e-3) and both["mean_length"] < star_len


# ---------------------------------------------------------------- --from-run


def _write_dump(run_dir, step=10):
    # l = logp - ref_logp on the 5 unmasked tokens: 0.5, -0.5, 1.0 | 0.0, 2.0 (the masked one has l = 100).
    ref_logp = torch.full((2, 3), -2.0)
    l = torch.tensor([[0.5, -0.5, 1.0], [0.0, 2.0, 100.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    (run_dir / "kl_dumps").mkdir(parents=True)
    save_dump(run_dir / "kl_dumps" / f"step_{step:06d}.safetensors", step, ref_logp + l, ref_logp, mask)


def test_from_run_hand_computed(tmp_path, capsys):
    _write_dump(tmp_path)
    out_json = tmp_path / "dumps.json"
    assert verify_main(["--from-run", str(tmp_path), "--json", str(out_json)]) == 0
    stats = {s["estimator"]: s for s in json.loads(out_json.read_text())["dumps"]}
    # k1 = l: sorted (-0.5, 0, 0.5, 1, 2); mean 3/5; p50 = 0.5; p90 at position 3.6 -> 1 + 0.6 = 1.6;
    # p99 at 3.96 -> 1.96; max 2; one of five negative.
    k1 = stats["k1"]
    assert k1["tokens"] == 5 and k1["step"] == 10
    for key, want in (("mean", 0.6), ("p50", 0.5), ("p90", 1.6), ("p99", 1.96), ("max", 2.0), ("frac_negative", 0.2)):
        assert k1[key] == pytest.approx(want, abs=1e-12), key
    # k2 = l^2/2: sorted (0, 0.125, 0.125, 0.5, 2); mean 2.75/5 = 0.55; p90 = 0.5 + 0.6 * 1.5 = 1.4.
    k2 = stats["k2"]
    for key, want in (("mean", 0.55), ("p50", 0.125), ("p90", 1.4), ("p99", 1.94), ("max", 2.0)):
        assert k2[key] == pytest.approx(want, abs=1e-12), key
    assert k2["frac_negative"] is None
    # k3 = e^-l + l - 1: 0.1065307, 0.1487213, 0.3678794, 0, 1.1353353 (l = 0.5, -0.5, 1, 0, 2);
    # mean 1.7584667 / 5 = 0.3516933; p50 = 0.1487213; p90 = 0.3678794 + 0.6 * 0.7674558 = 0.8283529.
    k3 = stats["k3"]
    for key, want in (("mean", 0.3516933), ("p50", 0.1487213), ("p90", 0.8283529), ("max", 1.1353353)):
        assert k3[key] == pytest.approx(want, abs=1e-6), key
    assert k3["clamp_frac"] == 0.0  # the only |l| > 20 token is masked out
    text = capsys.readouterr().out
    k1_line = next(line for line in text.splitlines() if " k1 " in line)
    assert "step_000010.safetensors" in k1_line and "0.6" in k1_line and "1.6" in k1_line and "0.2000" in k1_line


def test_from_run_missing_folder_and_dumps(tmp_path, capsys):
    assert verify_main(["--from-run", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err
    assert verify_main(["--from-run", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no KL dumps" in err
    (tmp_path / "kl_dumps").mkdir()
    (tmp_path / "kl_dumps" / "step_000001.safetensors").write_text("not a safetensors file")
    assert verify_main(["--from-run", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step_000001.safetensors" in err


def test_top_level_cli_dispatches(tmp_path, capsys):
    from klgrpo.apps.cli import main as klgrpo_main

    assert klgrpo_main(["verify-kl", "--from-run", str(tmp_path / "missing")]) == 2
    assert "klgrpo verify-kl:" in capsys.readouterr().err


# ---------------------------------------------------------------- the entropy bonus's gradient


def test_entropy_bonus_follows_the_per_position_entropy_not_the_sequence_entropy():
    from klgrpo.verify.entropy import entropy_rows

    rows = entropy_rows(categorical.make_categorical(), sequence_toy.make_toy())
    assert [(r.level, r.expected) for r in rows] == [("token", "equal"), ("sequence", "equal"),
                                                    ("sequence", "equal"), ("sequence", "differs"),
                                                    ("sequence", "equal")]
    assert all(r.passed for r in rows)
    assert rows[3].rel_diff > 0.1  # the prefixes' score term is large on the toy, not a rounding effect


def test_entropy_check_catches_a_bonus_without_the_entropys_gradient(monkeypatch):
    """Planted bug: the blocked pass's entropy detached (a metric only, as before the bonus existed): the bonus
    then has no gradient and the per-position rows fail."""
    import klgrpo.verify.entropy as entropy_check

    real = entropy_check.token_logprobs_and_entropy
    monkeypatch.setattr(entropy_check, "token_logprobs_and_entropy",
                        lambda *a, **k: (lambda lp, h: (lp, h.detach()))(*real(*a, **k)))
    rows = entropy_check.entropy_rows(categorical.make_categorical(), sequence_toy.make_toy())
    failed = {(r.level, r.target) for r in rows if not r.passed}
    assert ("token", "grad H(pi)") in failed and ("sequence", "grad of the per-position entropy") in failed


# ------------------------------------------------------------------------------------ a sampler that is not pi
def _mismatch_rows():
    from klgrpo.verify.sampler_mismatch import sampler_mismatch_rows

    return sampler_mismatch_rows(categorical.make_categorical(), sequence_toy.make_toy())


def test_a_mismatched_sampler_needs_the_correction_for_the_reverse_kl():
    """Without the correction no setting follows either KL; with the exact weight (per token at one position,
    per sequence on sequences) every one follows the reverse KL; a bound that binds biases it again."""
    from klgrpo.verify.sampler_mismatch import sequence_ratios_bind

    rows = _mismatch_rows()
    assert all(r.passed for r in rows)
    found = {(r.level, r.estimator, r.placement, r.correction): r.gradient_target for r in rows}
    assert {v for (level, *_, c), v in found.items() if c == "none"} == {"neither"}
    assert {v for (level, *_, c), v in found.items() if c == "sequence_mask (no bounds)"} == {"reverse"}
    assert {v for (level, *_, c), v in found.items() if c == "token_mask (no bounds)" and level == "token"} == {
        "reverse"}
    assert {v for (level, *_, c), v in found.items() if c == "token_mask (no bounds)" and level == "sequence"} == {
        "neither"}
    assert {level for level, *_ in found} == {"token", "sequence"}
    assert sequence_ratios_bind(sequence_toy.make_toy(), 1.0)  # the truncated row's bound does bind
    # "neither" is far from both KLs, not a rounding miss: >= 5% of ||grad KL(pi||ref)|| away from each
    assert min(min(r.rel_err_reverse, r.rel_err_forward) for r in rows if r.gradient_target == "neither") > 0.05


def test_the_mismatch_rows_catch_an_ignored_or_per_token_correction(monkeypatch):
    """Planted bugs: the weight computed and then ignored (1) fails every corrected row; a sequence mode whose
    weight is taken per token fails the sequence-level rows only."""
    import klgrpo.math.objective as objective
    from klgrpo.math.sampler_correction import SamplerCorrection, SamplerFactors

    with monkeypatch.context() as patch:
        patch.setattr(objective, "sampler_factors",
                      lambda old, *a: SamplerFactors(torch.ones_like(old), torch.ones_like(old)))
        failed = {(r.level, r.correction) for r in _mismatch_rows() if not r.passed}
    assert ("token", "token_mask (no bounds)") in failed and ("sequence", "sequence_mask (no bounds)") in failed
    with monkeypatch.context() as patch:
        patch.setattr(SamplerCorrection, "sequence_level", property(lambda self: False))
        failed = {(r.level, r.correction) for r in _mismatch_rows() if not r.passed}
    assert ("sequence", "sequence_mask (no bounds)") in failed
    assert not any(level == "token" for level, _ in failed)
