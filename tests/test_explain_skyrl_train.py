"""``klgrpo explain`` on SkyRL configs and launch scripts, by release (klgrpo/apps/explain/skyrl_train.json, read by
hand from NovaSky-AI/SkyRL at every skyrl-train tag, 0.1.0 - 0.4.0, and the renamed skyrl package's 0.1.0 - 0.3.0).

Each expected verdict is derived by hand from SkyRL's source (l = log pi - log ref, r = ref / pi, s = grad log pi):
- use_kl_loss (the default, kl_loss_coef 0.001, kl_estimator_type k3): the estimator's per-sequence token mean,
  averaged over sequences, times the coefficient, without an importance weight: k3 (clamped to [-10, 10]) has the
  gradient (1 - r) s, mean grad KL(ref||pi): "forward", and the clip risk; k2: l s, "reverse"; k1: s, "zero";
- use_kl_in_reward: the coefficient x the estimator at the rollout policy subtracted from each token's reward; grpo
  sums them into the sequence's score (verl's placement): k1 gives "reverse"; k2's E[k2 s] is neither;
- train_batch_size 1024 over policy_mini_batch_size 256: four updates per batch, the later ones off-policy (an
  unweighted k3 follows neither KL there); grpo's (score - mean) / (std + 1e-6): the epsilon risk.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrpo.apps.explain import main
from klgrpo.apps.explain.frameworks import releases

DATA = Path(__file__).resolve().parent / "data" / "explain_skyrl"
#: explain's risk ids (its JSON's risk_ids) -> the short names the expectations below use
RISKS = {"beta_zero": "beta0", "kl_off": "kloff",
         "forward_kl": "forward", "kl_clipped": "clip", "neither_kl": "neither",
         "off_policy": "offpolicy", "reward_kl_off_policy": "reward_offpolicy", "advantage_epsilon": "eps",
         "truncated_sampling": "truncated", "zero_kl": "zero"}
ONE_UPDATE = "trainer.train_batch_size=256\ntrainer.policy_mini_batch_size=256\n"


def _run(tmp_path, text=None, name="cfg.txt", extra=(), source=None):
    src = source or tmp_path / name
    if source is None:
        src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _kinds(risk_ids: list[str]) -> set[str]:
    return {RISKS[i] for i in risk_ids if i in RISKS}


def test_the_table_holds_every_release_read():
    rows = [r.release for r in releases("skyrl_train")]
    assert [(r["from"], r["to"]) for r in rows] == [("0.1.0", "0.4.0"), ("0.4.0", None)]
    assert rows[0]["deprecated"] == {"trainer.algorithm.use_abs_kl": "abs",
                                     "trainer.algorithm.use_kl_estimator_k3": "k3"}
    assert all(r["defaults"]["trainer.algorithm.use_kl_loss"] is True for r in rows)
    assert "skyrl-v0.3.0" in " ".join(rows[1]["read"])


# file: (token, sequence, off-policy token, beta rule, risks)
REAL = {
    # GRPO, use_kl_loss=true at the default 0.001 and k3; 1024 prompts in mini-batches of 256.
    "skyrl_train-v0.2.0_gsm8k_run_gsm8k.sh": ("forward", "neither", "neither", "fixed at 0.001",
                                              {"forward", "offpolicy", "clip", "eps"}),
    # REINFORCE++ with k2 in the reward (USE_KL_IN_REWARD=true, KL_ESTIMATOR_TYPE="k2", substituted), summed to the
    # end: neither; four mini-batches: the reward KL off-policy; no group std.
    "skyrl_train-v0.2.0_reinforce++_run_reinforce++.sh": ("neither", "neither", "neither", "fixed at 0.001",
                                                          {"neither", "reward_offpolicy"}),
    # the trainer YAML: the defaults themselves (use_kl_loss true, k3, 0.001, 1024 / 256).
    "skyrl_train-v0.4.0_ppo_base_config.yaml": ("forward", "neither", "neither", "fixed at 0.001",
                                                {"forward", "offpolicy", "clip", "eps"}),
}


def test_every_real_file_is_listed_with_its_source_and_licence():
    rows = [line.split(" | ") for line in (DATA / "SOURCES").read_text().splitlines() if line.strip()]
    assert {row[0] for row in rows} == {p.name for p in DATA.iterdir() if p.name not in ("SOURCES", "README.md")} \
        == set(REAL)
    assert all(row[1] == "NovaSky-AI/SkyRL" and row[4] == "Apache-2.0" for row in rows)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_file_verdict(name, tmp_path, capsys):
    token, sequence, off, beta, risks = REAL[name]
    status, report = _run(tmp_path, source=DATA / name)
    assert status == 0, capsys.readouterr().err
    assert report["source"] == "skyrl_train" and "versions" not in report  # every release: the same KL
    assert report["releases"] == ["SkyRL 0.1.0 or later"]
    g = report["gradient"]
    assert (g["token_on_policy"], g["sequence_on_policy"], g["token_off_policy"]) == (token, sequence, off)
    assert report["controller"] == beta
    assert _kinds(report["risk_ids"]) == risks and len(report["risk_ids"]) == len(risks), report["risk_ids"]


def test_the_reinforce_plus_plus_script_reads_its_variables(tmp_path):
    status, report = _run(tmp_path, source=DATA / "skyrl_train-v0.2.0_reinforce++_run_reinforce++.sh")
    kl = report["config"]["kl"]
    assert (kl["estimator"], kl["placement"], kl["reward_mode"]) == ("k2", "reward", "reward_to_go")
    assert report["unmapped"]["trainer.algorithm.advantage_estimator"].startswith("'reinforce++': the returns")


@pytest.mark.parametrize("estimator, token", [("k1", "zero"), ("k2", "reverse"), ("k3", "forward")])
def test_each_loss_estimator(tmp_path, estimator, token):
    status, report = _run(tmp_path, ONE_UPDATE + f"trainer.algorithm.kl_estimator_type={estimator}\n")
    assert status == 0 and report["gradient"]["token_on_policy"] == token and not report["off_policy"]


def test_k1_in_the_reward_under_grpo_is_a_sequence_score(tmp_path):
    text = ONE_UPDATE + ("trainer.algorithm.use_kl_loss=false\ntrainer.algorithm.use_kl_in_reward=true\n"
                         "trainer.algorithm.kl_estimator_type=k1\ntrainer.algorithm.kl_ctrl.type=adaptive\n")
    status, report = _run(tmp_path, text)
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == ("reverse", "reverse")
    kl = report["config"]["kl"]
    assert (kl["reward_mode"], kl["controller"], kl["target"], kl["horizon"]) == ("sequence_score", "adaptive", 0.1,
                                                                                  10000.0)


def test_deprecated_flags_by_release(tmp_path, capsys):
    text = ONE_UPDATE + "trainer.algorithm.use_kl_estimator_k3=true\ntrainer.algorithm.kl_estimator_type=k2\n"
    # before 0.4.0 validate_cfg turns kl_estimator_type to k3
    status, report = _run(tmp_path, text, extra=["--version", "skyrl_train==0.3.0"])
    assert report["config"]["kl"]["estimator"] == "k3" and report["gradient"]["token_on_policy"] == "forward"
    # 0.4.0 has no such key
    path = tmp_path / "cfg.txt"
    assert main([str(path), "--version", "skyrl_train==0.4.0"]) == 2
    assert "removed in 0.4.0" in capsys.readouterr().err


def test_refusals_and_named_settings(tmp_path, capsys):
    for text, said in (("trainer.algorithm.use_kl_in_reward=true\n", "mutually exclusive"),
                       ("trainer.algorithm.kl_estimator_type=abs\n", "klgrpo has no such estimator"),
                       ("trainer.algorithm.kl_estimator_type=k4\n", "compute_approx_kl raises ValueError")):
        path = tmp_path / "bad.txt"
        path.write_text(text)
        assert main([str(path)]) == 2
        assert said in capsys.readouterr().err
    status, report = _run(tmp_path, ONE_UPDATE + "trainer.algorithm.use_kl_loss=false\n")
    assert report["gradient"]["token_on_policy"] == "zero" and _kinds(report["risk_ids"]) == {"kloff", "eps"}
    assert report["unmapped"]["trainer.algorithm.kl_loss_coef"].endswith("no KL term")


def test_sampling_filters_and_validation_only_ones(tmp_path):
    status, report = _run(tmp_path, ONE_UPDATE + "generator.sampling_params.top_p=0.9\n"
                                                 "generator.sampling_params.min_p=0.05\n"
                                                 "generator.eval_sampling_params.top_k=20\n")
    line = report["risks"][report["risk_ids"].index("truncated_sampling")]
    assert line.startswith("sampling filter generator.sampling_params.top_p 0.9, generator.sampling_params.min_p "
                           "0.05: the sampler draws each token from the truncated, renormalised distribution while "
                           "SkyRL's policy worker scores each token by the full softmax of logits / temperature")
    assert (report["config"]["rollout"]["top_p"], report["config"]["rollout"]["min_p"]) == (0.9, 0.05)
    status, report = _run(tmp_path, ONE_UPDATE + "generator.eval_sampling_params.top_p=0.5\n", name="b.txt")
    assert "truncated_sampling" not in report["risk_ids"]


def test_the_key_table_agrees_with_the_hand_read_one():
    """skyrl_train_keys.json (generated from each release's ppo_base_config.yaml) against what skyrl_train.json and
    its reader say by hand: use_kl_estimator_k3 and use_abs_kl gone in 0.4.0, the KL keys in every release; a key of
    a defaults-list subtree is never judged."""
    from klgrpo.apps.explain.skyrl_train import _has_key, _key_table

    table = _key_table()
    releases = list(table["read"])
    assert releases == ["0.1.0", "0.2.0", "0.3.0", "0.4.0"]
    for key in ("trainer.algorithm.use_kl_estimator_k3", "trainer.algorithm.use_abs_kl"):
        assert table["keys"][key] == ["0.1.0", "0.2.0", "0.3.0"], key
    for key in ("trainer.algorithm.use_kl_loss", "trainer.algorithm.kl_loss_coef",
                "trainer.algorithm.kl_estimator_type", "generator.n_samples_per_prompt", "trainer.train_batch_size",
                "trainer.policy_mini_batch_size"):
        assert table["keys"][key] == releases, key
    assert _has_key("trainer.policy.megatron_config.tensor_model_parallel_size", "0.4.0")  # a defaults target
    assert not _has_key("trainer.algorithm.no_such_key", "0.4.0")

