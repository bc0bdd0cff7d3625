"""``klgrpo explain`` on prime-rl RL configs (TOML), by release (klgrpo/apps/explain/prime_rl.json, read by hand from
PrimeIntellect-ai/prime-rl at tags v0.2 - v0.8.0).

What each expected verdict rests on: no release's RL loss reads a reference model's log-probs, so the KL to the
reference is absent ("zero", the beta-0 risk); trainer.loss.kl_tau weighs log(pi / pi_inference), the log-ratio to
the policy that sampled the batch: in the advantage before 0.5 (default 0), squared in the loss from 0.5 (default
1e-3, CHANGELOG 2026-03-02). It is named as no KL to a reference. On-policy distillation (algorithm opd / opsd,
0.6 on) and 0.4 - 0.5's teacher_tau read another model and are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrpo.apps.explain import main
from klgrpo.apps.explain.frameworks import releases

DATA = Path(__file__).resolve().parent / "data" / "explain_prime_rl"
BASE = "[trainer]\n[orchestrator]\nbatch_size = 8\n[inference]\n"


def _run(tmp_path, text=None, name="rl.toml", extra=(), source=None):
    src = source or tmp_path / name
    if source is None:
        src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _tau_lines(report):
    return [line for risk_id, line in zip(report["risk_ids"], report["risks"]) if risk_id == "kl_tau"]


def test_the_table_holds_every_release_read():
    rows = [r.release for r in releases("prime_rl")]
    assert [(r["from"], r["to"], r["kl_tau_default"], r["teacher_tau"]) for r in rows] == [
        ("0.2.0", "0.5.0", 0.0, True), ("0.5.0", "0.6.0", 0.001, True), ("0.6.0", "0.7.0", 0.001, False),
        ("0.7.0", None, 0.001, False)]
    read = " ".join(line for r in rows for line in r["read"])
    assert all(f"tag {tag} " in read for tag in ("v0.2", "v0.3.0", "v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0",
                                                "v0.8.0"))


REAL = {
    # v0.2's example sets no kl_tau: its default 0 there -> no term at all; from 0.5 the default 1e-3 would apply
    "v0.2_alphabet_sort_rl.toml": ("prime_rl==0.2.0", 0),
    # v0.5.0's and v0.8.0's examples set no kl_tau either: the default 1e-3 to the inference policy
    "v0.5.0_alphabet_sort_rl.toml": ("prime_rl==0.5.0", 1),
    "v0.8.0_basic_alphabet-sort_rl.toml": ("prime_rl==0.8.0", 1),
}


def test_every_real_file_is_listed_with_its_source_and_licence():
    rows = [line.split(" | ") for line in (DATA / "SOURCES").read_text().splitlines() if line.strip()]
    assert {row[0] for row in rows} == {p.name for p in DATA.glob("*.toml")} == set(REAL)
    assert all(row[1] == "PrimeIntellect-ai/prime-rl" and row[4] == "Apache-2.0" for row in rows)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_file_verdict(name, tmp_path, capsys):
    version, lines = REAL[name]
    status, report = _run(tmp_path, source=DATA / name, extra=["--version", version])
    assert status == 0, capsys.readouterr().err
    assert report["source"] == "prime_rl" and "versions" not in report
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == ("zero", "zero")
    assert report["controller"] == "fixed at 0" and report["risk_ids"] == ["beta_zero"] + ["kl_tau"] * lines
    assert report["config"]["kl"]["coef"] == 0.0


def test_the_default_kl_tau_line(tmp_path):
    status, report = _run(tmp_path, source=DATA / "v0.8.0_basic_alphabet-sort_rl.toml",
                          extra=["--version", "prime_rl==0.8.0"])
    assert _tau_lines(report) == [
        "trainer.loss.kl_tau 0.001 (prime-rl's default from 0.5.0) is no KL to a reference: in the loss: kl_tau "
        "x (log pi - log pi_inference)^2 per token beside the policy term, a squared log-ratio to the inference "
        "(sampler) policy; it keeps each update near the policy that sampled the batch, not the policy near its "
        "start, and prime-rl's loss has no reference model; set kl.coef > 0 in klgrpo for a KL to the reference "
        "(its config below has none)"]
    # the group size is read
    assert report["config"]["rollout"]["group_size"] == 16


def test_a_set_kl_tau_by_release(tmp_path):
    text = BASE.replace("[trainer]\n", "[trainer.loss]\nkl_tau = 0.05\n")
    status, report = _run(tmp_path, text, extra=["--version", "prime_rl==0.3.0"])
    assert _tau_lines(report)[0].startswith(
        "trainer.loss.kl_tau 0.05 is no KL to a reference: in the advantage: "
        "importance_ratio x (advantage - kl_tau x (log pi - log pi_inference))")
    status, report = _run(tmp_path, text.replace("0.05", "0.0"), name="b.toml", extra=["--version",
                                                                                      "prime_rl==0.8.0"])
    assert report["risk_ids"] == ["beta_zero"]
    # without a release: both answers (the default differs)
    status, report = _run(tmp_path, BASE, name="c.toml")
    assert [(v["releases"], len(_tau_lines(v))) for v in report["versions"]] == [
        (["prime-rl 0.5.0 or later"], 1), (["prime-rl >= 0.2.0, < 0.5.0"], 0)]


def test_refusals(tmp_path, capsys):
    for text, version, said in (
            (BASE.replace("[inference]\n", "[[orchestrator.env]]\nalgorithm = \"opd\"\n[inference]\n"), "0.8.0",
             "on-policy distillation"),
            (BASE.replace("[trainer]\n", "[trainer.loss]\nteacher_tau = 0.5\n"), "0.4.0", "a teacher's log-ratio"),
            (BASE.replace("[trainer]\n", "[trainer.loss]\nkl_tau = -1\n"), "0.8.0", "must be a finite number >= 0"),
            ("[orchestrator]\nbatch_size = \n", "0.8.0", "is not valid TOML")):
        path = tmp_path / "bad.toml"
        path.write_text(text)
        assert main([str(path), "--version", f"prime_rl=={version}"]) == 2
        assert said in capsys.readouterr().err
    path.write_text(BASE)
    assert main([str(path), "--version", "prime_rl==0.1"]) == 2
    assert "outside every prime-rl release range" in capsys.readouterr().err
