"""``klgrpo explain`` by verl and OpenRLHF release: each range's rules from klgrpo/integrations/versions/verl.json
and openrlhf.json, the release --version names or the file pins, one verdict per range where they differ.

Each expected verdict is derived by hand from the table row it cites (l = log pi - log ref):
- a KL in the reward is a reward the policy gradient follows: with k1 (= l) its expected gradient is
  grad KL(pi||ref), "reverse", per token and per sequence (the sequence's summed KL is the reward);
- k3 = exp(-l) - 1 + l in the loss without an importance weight: its gradient (1 - ref/pi) grad log pi has mean
  grad KL(ref||pi) under pi, "forward"; a sequence verdict of a token-mean loss is "neither";
- k3 in the reward: E_pi[k3 grad log pi] = grad KL(pi||ref) - grad KL(ref||pi), "neither";
- no KL term at all: "zero".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrpo.apps.explain import main
from klgrpo.integrations.versions import _table, parse_option, profiles, stated_in, table_estimator

#: A verl config that never mentions the KL: GRPO, 4 samples a prompt, one update per batch.
VERL_NO_KL = ("algorithm.adv_estimator=grpo\nactor_rollout_ref.rollout.n=4\n"
              "actor_rollout_ref.actor.ppo_mini_batch_size=1024\n")
#: OpenRLHF's flat names: k3 in the loss at 0.01; 128 prompts x 4 samples trained 512 at a time (one update).
OPENRLHF_K3_LOSS = ("--init_kl_coef 0.01 --use_kl_loss --kl_estimator k3 --n_samples_per_prompt 4 "
                    "--rollout_batch_size 128 --train_batch_size 512 --advantage_estimator group_norm\n")
OPENRLHF_NO_KL = ("--n_samples_per_prompt 4 --rollout_batch_size 128 --train_batch_size 512 "
                  "--advantage_estimator group_norm\n")


def _run(tmp_path, text, name="cfg.txt", extra=()):
    src = tmp_path / name
    src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"  # a new file each run
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _answers(report):
    return [(v["releases"], v["gradient"]["token_on_policy"], v["gradient"]["sequence_on_policy"], v["controller"])
            for v in report.get("versions", [report])]


def test_a_verl_config_without_use_kl_loss_has_its_kl_in_the_reward_before_0_4(tmp_path, capsys):
    status, report = _run(tmp_path, VERL_NO_KL)
    # verl.json 0.4.0 and 0.6.0 rows: the reward KL only "with algorithm.use_kl_in_reward" (default false) and
    # use_kl_loss false: no KL term, zero. 0.2 row: "whenever actor.use_kl_loss is false" (its default), 0.1 row:
    # "always": k1 (kl_penalty kl, "k1 = l") at kl_ctrl.kl_coef 0.001 in the reward: reverse, reverse
    assert status == 0
    assert _answers(report) == [(["verl 0.4.0 or later"], "zero", "zero", "fixed at 0"),
                                (["verl >= 0.1, < 0.4.0"], "reverse", "reverse", "fixed at 0.001")]
    last = capsys.readouterr().out.splitlines()[-1]
    assert "which do you run?" in last and "--version verl==" in last
    docs = (Path(__file__).resolve().parents[1] / "docs" / "explain.md").read_text()
    assert "    " + last.replace(str(tmp_path / "cfg.txt"), "cfg.txt") + "\n" in docs  # the page shows this line
    # --version picks the 0.2 range: the KL in the reward, summed into the sequence's score (verl's GRPO)
    status, report = _run(tmp_path, VERL_NO_KL, extra=["--version", "verl==0.3"])
    assert _answers(report) == [(["verl >= 0.2, < 0.4.0"], "reverse", "reverse", "fixed at 0.001")]
    kl = report["config"]["kl"]
    assert (kl["placement"], kl["estimator"], kl["reward_mode"], kl["coef"]) == ("reward", "k1", "sequence_score",
                                                                                 0.001)
    status, report = _run(tmp_path, VERL_NO_KL, extra=["--version", "verl>=0.6"])
    assert _answers(report) == [(["verl 0.6.0 or later"], "zero", "zero", "fixed at 0")]


def test_a_verl_pin_in_the_launch_script_picks_the_range(tmp_path):
    script = ("pip install verl==0.3.0.post1\npython3 -m verl.trainer.main_ppo \\\n    " +
              VERL_NO_KL.replace("\n", " \\\n    ") + "trainer.n_gpus_per_node=8\n")
    status, report = _run(tmp_path, script, "run.sh")
    # 0.3.0.post1 is in the 0.2 row (last_read 0.3.0.post1): the KL in the reward, as above
    assert status == 0 and "versions" not in report
    assert _answers(report) == [(["verl >= 0.2, < 0.4.0"], "reverse", "reverse", "fixed at 0.001")]
    # the same pin in a requirements file given as --version
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("verl==0.5.0\n")
    status, report = _run(tmp_path, VERL_NO_KL, extra=["--version", str(requirements)])
    assert _answers(report) == [(["verl >= 0.4.0, < 0.6.0"], "zero", "zero", "fixed at 0")]


def test_a_verl_key_of_later_releases_rules_the_earlier_out(tmp_path, capsys):
    text = VERL_NO_KL + "algorithm.use_kl_in_reward=true\n"
    status, report = _run(tmp_path, text)
    # use_kl_in_reward exists from the 0.4.0 row: one answer there, k1 in the reward at 0.001
    assert _answers(report) == [(["verl 0.4.0 or later"], "reverse", "reverse", "fixed at 0.001")]
    capsys.readouterr()
    assert main([str(tmp_path / "cfg.txt"), "--version", "verl==0.3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "algorithm.use_kl_in_reward is not a key of verl >= 0.2, < 0.4.0" in err


def test_verl_estimator_names_are_each_ranges(tmp_path, capsys):
    text = VERL_NO_KL + "actor_rollout_ref.actor.use_kl_loss=true\nactor_rollout_ref.actor.kl_loss_type=k3\n"
    status, report = _run(tmp_path, text)
    # 0.4.0 row on: k3 is "exp(-l) - 1 + l, clamped to [-10, 10]" in the loss: forward, clipped at 10. 0.2 row:
    # no name k3 (kl, abs, mse, low_var_kl): verl's kl_penalty raises there, so the file cannot run on it
    assert _answers(report) == [(["verl 0.4.0 or later"], "forward", "neither", "fixed at 0.001")]
    assert "10" in report["risks"][report["risk_ids"].index("kl_clipped")]
    capsys.readouterr()
    assert main([str(tmp_path / "cfg.txt"), "--version", "verl==0.3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'k3' is not a KL type of verl >= 0.2, < 0.4.0" in err, err


@pytest.mark.parametrize("kl_type, version, said", [
    # core_algos.py v0.6.0 - v0.7.1: kl_penalty_forward gets "k3+" with its "+" and raises
    ("k3+", "verl==0.7", "'k3+': verl's kl_penalty raises NotImplementedError in verl >= 0.6.0, < 0.8.0"),
    # every release: kl_penalty_forward's "full" branch raises (the logits are never passed)
    ("full", None, "'full': verl's kl_penalty raises NotImplementedError in verl 0.9.0 or later"),
    # no release has the name: unknown, one line
    ("k9", None, "kl_loss_type 'k9' is no KL type of any verl release; verl's are: kl, abs, mse"),
])
def test_a_verl_kl_type_that_cannot_run_is_refused(tmp_path, capsys, kl_type, version, said):
    text = VERL_NO_KL + f"actor_rollout_ref.actor.use_kl_loss=true\nactor_rollout_ref.actor.kl_loss_type={kl_type}\n"
    (tmp_path / "cfg.txt").write_text(text)
    assert main([str(tmp_path / "cfg.txt"), *(["--version", version] if version else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_verl_k3_plus_is_k3_st_from_0_8(tmp_path):
    text = (VERL_NO_KL + "actor_rollout_ref.actor.use_kl_loss=true\nactor_rollout_ref.actor.kl_loss_type=k3+\n"
            "actor_rollout_ref.actor.kl_loss_coef=0.01\n")
    status, report = _run(tmp_path, text)
    # 0.8.0 on: value k3 (capped at 10), gradient of k2 = (logp - ref) grad logp, mean under pi grad KL(pi||ref):
    # reverse per token, at 0.01 (no false "beta is 0"); 0.6.0 - 0.7.1 raise: ruled out; before 0.6: no such name
    assert _answers(report) == [(["verl 0.8.0 or later"], "reverse", "neither", "fixed at 0.01")]
    assert report["config"]["kl"]["estimator"] == "k3_st" and report["config"]["kl"]["coef"] == 0.01
    assert "beta_zero" not in report["risk_ids"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_verl_coefficient_that_is_no_number_is_refused(tmp_path, capsys, value):
    (tmp_path / "cfg.yaml").write_text(f"actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n"
                                       f"    kl_loss_coef: {value}\n")
    assert main([str(tmp_path / "cfg.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "actor_rollout_ref.actor.kl_loss_coef must be a finite number" in err, err


def test_openrlhf_flat_flags_are_read_per_range(tmp_path, capsys):
    status, report = _run(tmp_path, OPENRLHF_K3_LOSS)
    # --use_kl_loss and --kl_estimator: the 0.6.0.post1, 0.7.1 and 0.8.6 rows (0.10.2 renames them --algo.kl.*).
    # 0.8.6 row: "k3 = exp(-l) - 1 + l, clamped to [-10, 10]" in the loss: forward and clipped at 10; the two
    # earlier rows: k3 without a clamp: forward, no clip
    assert status == 0
    assert _answers(report) == [(["OpenRLHF >= 0.8.6, < 0.10.2"], "forward", "neither", "fixed at 0.01"),
                                (["OpenRLHF >= 0.6.0.post1, < 0.8.6"], "forward", "neither", "fixed at 0.01")]
    clipped = ["kl_clipped" in v["risk_ids"] for v in report["versions"]]
    assert clipped == [True, False]
    assert "the KL is clipped at 10 per token" in capsys.readouterr().out.splitlines()[-1]
    # a release whose KL flags are others: one line naming the flag
    assert main([str(tmp_path / "cfg.txt"), "--version", "openrlhf==0.5.9.post1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--use_kl_loss is not a flag of OpenRLHF >= 0.4.6, < 0.6.0" in err


def test_openrlhf_defaults_differ_by_range(tmp_path):
    status, report = _run(tmp_path, OPENRLHF_NO_KL)
    # no KL flag: k1 in the reward in every row (reward_kl "always" or "unless --use_kl_loss", unset) -> reverse;
    # --init_kl_coef's default is 0.02 in the 0.0.1 row, 0.01 from the 0.3.6 row on
    assert _answers(report) == [(["OpenRLHF 0.3.6 or later"], "reverse", "reverse", "fixed at 0.01"),
                                (["OpenRLHF >= 0.0.1, < 0.3.6"], "reverse", "reverse", "fixed at 0.02")]
    status, report = _run(tmp_path, OPENRLHF_NO_KL, extra=["--version", "openrlhf==0.3.5"])
    assert _answers(report) == [(["OpenRLHF >= 0.0.1, < 0.3.6"], "reverse", "reverse", "fixed at 0.02")]


def test_openrlhf_k3_switch_of_0_4_6_and_a_pin_in_a_script(tmp_path):
    status, report = _run(tmp_path, "--init_kl_coef 0.01 --use_kl_estimator_k3\n")
    # --use_kl_estimator_k3 exists in the 0.4.6 and 0.6.0 rows only; true picks k3 (the rows' second estimator),
    # in the reward (0.4.6: "always"; 0.6.0: "unless --use_kl_loss", unset): neither, in both: one answer
    assert _answers(report) == [(["OpenRLHF >= 0.4.6, < 0.6.0.post1"], "neither", "neither", "fixed at 0.01")]
    assert (report["config"]["kl"]["estimator"], report["config"]["kl"]["placement"]) == ("k3", "reward")
    script = "pip install openrlhf==0.7.0\npython3 -m openrlhf.cli.train_ppo_ray " + OPENRLHF_K3_LOSS
    status, report = _run(tmp_path, script, "train.sh")
    # 0.7.0 is in the 0.6.0.post1 row: k3 in the loss without a clamp: forward, not clipped
    assert _answers(report) == [(["OpenRLHF >= 0.6.0.post1, < 0.7.1"], "forward", "neither", "fixed at 0.01")]
    assert "kl_clipped" not in report["risk_ids"]


@pytest.mark.parametrize("text, version, named", [
    (VERL_NO_KL, "verl==0.0.9", "verl==0.0.9 is outside every verl release range klgrpo knows (0.1 and later"),
    (OPENRLHF_NO_KL, "openrlhf<0.0.1", "openrlhf<0.0.1 is outside every OpenRLHF release range klgrpo knows"),
    (VERL_NO_KL, "trl==0.18", "--version trl==0.18 names no release of what"),
])
def test_a_version_outside_every_range_is_one_line(tmp_path, capsys, text, version, named):
    status, _ = _run(tmp_path, text, extra=["--version", version])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and named.lower() in err.lower(), err


def test_pins_of_post_releases_and_exact_releases():
    found = stated_in('pip install "openrlhf[vllm]==0.6.0.post1" verl>=0.4,<0.6\n')
    assert [str(c) for c in found["openrlhf"]] == ["==0.6.0.post1"]
    assert [str(c) for c in found["verl"]] == [">=0.4", "<0.6"]
    # ==0.6.0 is that release, not its post releases (a range of their own in openrlhf.json)
    assert [p.label for p in profiles("openrlhf", parse_option("openrlhf==0.6.0"))] == ["OpenRLHF >= 0.6.0, < "
                                                                                       "0.6.0.post1"]
    assert [p.label for p in profiles("openrlhf", parse_option("openrlhf==0.6"))] == [
        "OpenRLHF >= 0.6.0, < 0.6.0.post1", "OpenRLHF >= 0.6.0.post1, < 0.7.1"]


def test_the_mappings_read_their_defaults_and_formulas_from_the_tables():
    from klgrpo.integrations.openrlhf_mapping import KL_NAMES, OPENRLHF_DEFAULTS
    from klgrpo.integrations.verl_mapping import VERL_DEFAULTS
    from klgrpo.math.kl import ESTIMATORS

    newest = _table("verl")["ranges"][-1]["defaults"]
    assert {k: VERL_DEFAULTS[k] for k in newest} == newest
    newest = _table("openrlhf")["ranges"][-1]["defaults"]
    assert {KL_NAMES[w]: OPENRLHF_DEFAULTS[KL_NAMES[w]] for w in newest} == {
        e["flag"][2:]: e["default"] for e in newest.values()}
    # every formula of both tables is one klgrpo estimator (with its cap), or named as having none
    for name in ("verl", "openrlhf"):
        for row in _table(name)["ranges"]:
            for formula in row["estimators"].values():
                found = table_estimator(formula)
                assert found.estimator in ESTIMATORS or formula.startswith("abs = |l|") or formula == (
                    "raises NotImplementedError")
    assert table_estimator("k3 = exp(-l) - 1 + l, clamped to [-10, 10]") == table_estimator("k3 = x, clamped to "
                                                                                            "[-10, 10]")
    assert (table_estimator("k3 = exp(-l) - 1 + l; gradient of k2").estimator, table_estimator("k1 = l").cap) == (
        "k3_st", None)
    # planted: a formula tools/rl_versions.py could not name maps to nothing
    assert table_estimator("none of k1, k2, k3, |l|").estimator is None


def test_a_verl_trainer_module_rules_out_the_releases_without_it(tmp_path, capsys):
    script = ("#!/bin/bash\npython3 -m verl.trainer.main_ppo_sync algorithm.adv_estimator=grpo "
              "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 "
              "actor_rollout_ref.actor.ppo_mini_batch_size=1024 actor_rollout_ref.rollout.n=4\n")
    status, report = _run(tmp_path, script, "run.sh")
    # main_ppo_sync.py is a Hydra main at v0.8.0 only: the 0.8.0 row; low_var_kl (the default) in the loss at
    # 0.01 -> k3 clamped at 10 without the ratio: forward
    assert status == 0 and _answers(report) == [(["verl >= 0.8.0, < 0.9.0"], "forward", "neither", "fixed at 0.01")]
    capsys.readouterr()
    assert main([str(tmp_path / "run.sh"), "--version", "verl==0.7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "verl.trainer.main_ppo_sync is no trainer of verl >= 0.6.0, < 0.8.0" in err, err


def test_an_unknown_verl_key_is_listed_while_others_are_known(tmp_path, capsys):
    text = VERL_NO_KL + "+algorithm.gdpo_reward_keys=[a,b]\nactor_rollout_ref.actor.kl_los_coef=0.1\n"
    status, report = _run(tmp_path, text, extra=("--version", "verl==0.9"))
    assert status == 0 and report["controller"] == "fixed at 0"
    assert report["unmapped"]["algorithm.gdpo_reward_keys"].startswith("not a verl key explain knows")
    assert "did you mean actor_rollout_ref.actor.kl_loss_coef?" in report["unmapped"][
        "actor_rollout_ref.actor.kl_los_coef"]
    # nothing verl knows: no verl config
    (tmp_path / "bad.txt").write_text("algorithm.gdpo_reward_keys=[a]\n")
    capsys.readouterr()
    assert main([str(tmp_path / "bad.txt")]) == 2
    assert "unknown verl key 'algorithm.gdpo_reward_keys'" in capsys.readouterr().err


def test_a_coefficient_the_switches_leave_unread_is_said_so_not_beta_0(tmp_path):
    """verl reads kl_loss_coef only with use_kl_loss and kl_ctrl.kl_coef only with use_kl_in_reward: a file that
    sets them with both off trains without a KL, and explain names the switches and the values, not "beta is 0"."""
    text = ("actor_rollout_ref.actor.use_kl_loss=false\nactor_rollout_ref.actor.kl_loss_coef=0.05\n"
            "algorithm.use_kl_in_reward=false\nalgorithm.kl_ctrl.kl_coef=0.02\n")
    status, report = _run(tmp_path, text, extra=["--version", "verl==0.9.0"])
    assert status == 0 and report["gradient"]["token_on_policy"] == "zero" and report["config"]["kl"]["coef"] == 0
    assert "kl_off" in report["risk_ids"] and "beta_zero" not in report["risk_ids"]
    line = report["risks"][report["risk_ids"].index("kl_off")]
    assert "actor_rollout_ref.actor.kl_loss_coef 0.05 and algorithm.kl_ctrl.kl_coef 0.02 are never read" in line
    # both coefficients at 0: nothing is left unread, and beta is 0 is the right line
    status, report = _run(tmp_path, text.replace("0.05", "0").replace("0.02", "0"), name="zero.txt",
                          extra=["--version", "verl==0.9.0"])
    assert "beta_zero" in report["risk_ids"] and "kl_off" not in report["risk_ids"]
