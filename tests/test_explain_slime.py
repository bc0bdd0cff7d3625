"""``klgrpo explain`` on slime launch scripts, by release (klgrpo/apps/explain/slime.json, read by hand from
THUDM/slime at every tag v0.1.0 - v0.3.1).

Each expected verdict is derived by hand from slime's source (l = log pi - log ref, r = ref / pi, s = grad log pi):
- --use-kl-loss adds --kl-loss-coef x the estimate, reduced per sample then over samples (seq-mean-token-mean):
  low_var_kl is k3 = r - 1 - log r clamped at 10, unweighted: grad (1 - r) s, mean grad KL(ref||pi): "forward",
  the clip and seqmean risks; --use-unbiased-kl (0.2.1 on) multiplies it by pi / pi_old in the graph: "reverse";
- --kl-coef is read by reinforce_plus_plus only: grpo's get_grpo_returns broadcasts the reward alone, so a
  --kl-coef there is silently ignored (its own risk line);
- --rollout-top-p < 1 is scored over the full softmax before 0.3.1; from 0.3.1 slime replays the sampler's top-p
  nucleus in the trainer (no sampling risk, named); --rollout-top-k is never replayed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrpo.apps.explain import main
from klgrpo.apps.explain.frameworks import releases

DATA = Path(__file__).resolve().parent / "data" / "explain_slime"
#: explain's risk ids (its JSON's risk_ids) -> the short names the expectations below use
RISKS = {"beta_zero": "beta0", "kl_off": "kloff",
         "forward_kl": "forward", "kl_clipped": "clip", "seq_mean_token_mean": "seqmean",
         "kl_coef_ignored": "kl_coef_ignored", "truncated_sampling": "truncated", "off_policy": "offpolicy"}


def _script(flags: str) -> str:
    return f"#!/bin/bash\nARGS=(\n{flags}\n)\npython3 train.py --rollout-batch-size 32 --n-samples-per-prompt 8 " \
           "--global-batch-size 256 ${ARGS[@]}\n"


def _run(tmp_path, text=None, name="run.sh", extra=(), source=None):
    src = source or tmp_path / name
    if source is None:
        src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _kinds(risk_ids: list[str]) -> set[str]:
    return {RISKS[i] for i in risk_ids if i in RISKS}


def test_the_table_holds_every_release_read():
    rows = [r.release for r in releases("slime")]
    assert [(r["from"], r["unbiased_kl"]) for r in rows] == [("0.1.0", False), ("0.2.0", False), ("0.2.1", True),
                                                              ("0.3.1", True)]
    assert rows[0]["defaults"]["kl-loss-type"] == "kl" and rows[1]["defaults"]["kl-loss-type"] == "k1"


def test_the_flag_table_agrees_with_the_hand_read_one():
    """slime_flags.json (generated from slime's argument files) against slime.json (read by hand): the releases
    are the table's, and --use-unbiased-kl exists exactly where slime.json says unbiased_kl."""
    import json

    from klgrpo.apps.explain.slime import _flag_releases
    from klgrpo.integrations.versions.clauses import parse_version

    table = _flag_releases()
    releases_read = list(table["read"])
    assert releases_read == sorted(releases_read, key=parse_version) and len(releases_read) == 9
    assert all(set(r) <= set(releases_read) and r == sorted(r, key=parse_version) for r in table["flags"].values())
    rows = [r.release for r in releases("slime")]
    for release in releases_read:
        row = next(r for r in reversed(rows) if parse_version(r["from"]) <= parse_version(release))
        assert (release in table["flags"]["use-unbiased-kl"]) == row["unbiased_kl"], release
    for flag in ("use-kl-loss", "kl-loss-coef", "advantage-estimator", "n-samples-per-prompt"):
        assert table["flags"][flag] == releases_read, flag  # slime's KL flags: every release
    assert "lr" not in table["flags"] and not any(f.startswith("sglang-") for f in table["flags"])  # not its own
    assert json.loads(json.dumps(table)) == table


REAL = {
    # grpo, --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl: a KL term at 0, none
    "v0.2.0_run-qwen3-4B.sh": ("zero", "fixed at 0", {"beta0"}),
    "v0.3.1_run-qwen3-4B.sh": ("zero", "fixed at 0", {"beta0"}),
    # search-r1: low_var_kl in the loss at 0.001, 32 x 8 = 256 samples in one step of 256
    "v0.3.1_search-r1_run_qwen2.5_3B.sh": ("forward", "fixed at 0.001", {"forward", "clip", "seqmean"}),
}


def test_every_real_file_is_listed_with_its_source_and_licence():
    rows = [line.split(" | ") for line in (DATA / "SOURCES").read_text().splitlines() if line.strip()]
    assert {row[0] for row in rows} == {p.name for p in DATA.glob("*.sh")} == set(REAL)
    assert all(row[1] == "THUDM/slime" and row[4] == "Apache-2.0" for row in rows)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_file_verdict(name, tmp_path, capsys):
    token, beta, risks = REAL[name]
    status, report = _run(tmp_path, source=DATA / name)
    assert status == 0, capsys.readouterr().err
    assert report["source"] == "slime" and "versions" not in report
    assert report["gradient"]["token_on_policy"] == token and report["controller"] == beta
    assert _kinds(report["risk_ids"]) == risks and len(report["risk_ids"]) == len(risks), report["risk_ids"]
    assert not report["off_policy"]
    # the model's flags come from a sourced file: named
    assert "${MODEL_ARGS[@]}" in report["unmapped"]


def test_kl_coef_is_silently_ignored_under_grpo(tmp_path):
    status, report = _run(tmp_path, _script("--advantage-estimator grpo\n--kl-coef 0.05"))
    assert report["gradient"]["token_on_policy"] == "zero"
    line = report["risks"][report["risk_ids"].index("kl_coef_ignored")]
    assert line.startswith("--kl-coef 0.05 is silently ignored: slime 0.3.1 or later's grpo advantages "
                           "(get_grpo_returns) broadcast each sample's reward alone")
    # reinforce_plus_plus reads it: the KL in the reward, summed to the end
    status, report = _run(tmp_path, _script("--advantage-estimator reinforce_plus_plus\n--kl-coef 0.05"),
                          name="b.sh")
    kl = report["config"]["kl"]
    assert (kl["coef"], kl["placement"], kl["reward_mode"], kl["estimator"]) == (0.05, "reward", "reward_to_go", "k1")
    assert report["gradient"]["token_on_policy"] == "reverse"


def test_the_unbiased_kl_by_release(tmp_path, capsys):
    text = _script("--use-kl-loss\n--kl-loss-coef 0.01\n--kl-loss-type k3\n--use-unbiased-kl")
    status, report = _run(tmp_path, text, extra=["--version", "slime==0.3.1"])
    assert report["gradient"]["token_on_policy"] == "reverse" and report["config"]["kl"]["is_correction"] == \
        "in_graph"
    assert main([str(tmp_path / "run.sh"), "--version", "slime==0.2.0"]) == 2
    assert "--use-unbiased-kl is not a flag of slime 0.2.0 (slime 0.2.1 to 0.3.1 declare it)" in capsys.readouterr().err


def test_top_p_is_replayed_from_0_3_1_and_top_k_never(tmp_path):
    text = _script("--use-kl-loss\n--kl-loss-coef 0.01\n--rollout-top-p 0.9\n--rollout-top-k 20")
    status, report = _run(tmp_path, text, extra=["--version", "slime==0.3.1"])
    line = report["risks"][report["risk_ids"].index("truncated_sampling")]
    assert line.startswith("sampling filter --rollout-top-k 20: ")
    assert report["unmapped"]["--rollout-top-p"].startswith("0.9: slime replays the sampler's top-p nucleus")
    status, report = _run(tmp_path, text, extra=["--version", "slime==0.3.0"])
    line = report["risks"][report["risk_ids"].index("truncated_sampling")]
    assert line.startswith("sampling filter --rollout-top-p 0.9, --rollout-top-k 20: ")
    assert (report["config"]["rollout"]["top_p"], report["config"]["rollout"]["top_k"]) == (0.9, 20)


def test_refusals(tmp_path, capsys):
    for flags, said in (("--advantage-estimator reinforce_plus_plus_baseline\n--kl-coef 0.1", "no sum over"),
                        ("--kl-loss-type k4\n--use-kl-loss", "argparse refuses it")):
        path = tmp_path / "bad.sh"
        path.write_text(_script(flags))
        assert main([str(path), "--version", "slime==0.3.1"]) == 2
        assert said in capsys.readouterr().err


def test_a_kl_coefficient_slime_never_reads_is_no_beta_0(tmp_path):
    """--kl-loss-coef without --use-kl-loss, and --kl-coef under grpo: no KL term, said as what is unread."""
    status, report = _run(tmp_path, _script("--advantage-estimator grpo\n--kl-loss-coef 0.05"))
    assert report["gradient"]["token_on_policy"] == "zero" and report["risk_ids"].count("kl_off") == 1
    assert "beta_zero" not in report["risk_ids"]
    assert "--kl-loss-coef 0.05 without --use-kl-loss is never read" in report["risks"][report["risk_ids"].index(
        "kl_off")]
    status, report = _run(tmp_path, _script("--advantage-estimator grpo\n--kl-coef 0.05"), name="b.sh")
    assert "kl_coef_ignored" in report["risk_ids"] and "beta_zero" not in report["risk_ids"]
