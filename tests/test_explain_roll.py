"""``klgrpo explain`` on ROLL RLVR pipeline configs, by release (klgrpo/apps/explain/roll.json, read by hand from
alibaba/ROLL at every tag v0.1.0 - v0.3.0).

Each expected verdict is derived by hand from ROLL's source (l = log pi - log ref, r = ref / pi, s = grad log pi):
- use_kl_loss: kl_loss_coef x k3 (compute_approx_kl's "k3" = r - 1 - log r clamped to [-10, 10]), no importance
  weight: grad k3 = (1 - r) s, mean grad KL(ref||pi): "forward", and the clip risk; aggregated by loss_agg_mode
  (seq-mean-token-mean from 0.1.1: the sequence verdict "neither" and the seqmean risk; 0.1.0's default
  seq-mean-token-sum);
- add_token_level_kl: beta x kl_penalty's estimate at the rollout policy subtracted from each token's reward after
  the normalisation, summed to the end (gamma 1): kl (k1 = l) as a reward is REINFORCE on the KL: "reverse" per
  token, and per sequence under token-mean (seq-mean-token-mean weighs each sequence's score terms by 1 / its
  length: "neither"); mse (k2) in the reward: E[k2 s] is neither KL's gradient;
- init_kl_coef without add_token_level_kl adds nothing (compute_token_reward's beta stays 0);
- a generating_args block samples at top_p 0.7 / top_k 50 where it leaves them unset (GeneratingArguments).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from klgrpo.apps.explain import main
from klgrpo.apps.explain.frameworks import releases
from klgrpo.config.schema import GRPOConfig

DATA = Path(__file__).resolve().parent / "data" / "explain_roll"
#: explain's risk ids (its JSON's risk_ids) -> the short names the expectations below use
RISKS = {"beta_zero": "beta0", "forward_kl": "forward", "kl_clipped": "clip", "seq_mean_token_mean": "seqmean",
         "truncated_sampling": "truncated", "filter_default": "default_filters", "neither_kl": "neither",
         "off_policy": "offpolicy", "reward_kl_off_policy": "reward_offpolicy"}
#: A minimal RLVR config: ROLL's worker groups, GRPO, 8 samples a prompt.
BASE = "actor_train: {}\nactor_infer: {}\nadv_estimator: grpo\nnum_return_sequences_in_group: 8\n"


def _run(tmp_path, text=None, name="cfg.yaml", extra=(), source=None):
    src = source or tmp_path / name
    if source is None:
        src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _kinds(risk_ids: list[str]) -> set[str]:
    return {RISKS[i] for i in risk_ids if i in RISKS}


def test_the_table_holds_every_release_read():
    rows = [r.release for r in releases("roll")]
    assert [r["from"] for r in rows] == ["0.1.0", "0.1.1"]
    assert rows[0]["defaults"]["loss_agg_mode"] == "seq-mean-token-sum"
    assert rows[1]["defaults"]["loss_agg_mode"] == "seq-mean-token-mean"
    assert all(r["defaults"]["init_kl_coef"] == 0.2 and r["defaults"]["kl_loss_coef"] == 0 for r in rows)
    assert "v0.3.0" in " ".join(rows[1]["read"]) and "v0.1.0" in rows[0]["read"][0]


# file: (token, sequence, beta rule, risks)
REAL = {
    # reinforce, no KL term: use_kl_loss and add_token_level_kl false; init_kl_coef at its default 0.2 only loads
    # the reference; actor_infer samples at top_p 0.99, top_k 100.
    "v0.3.0_qwen2.5-7B-rlvr_megatron_rlvr_config.yaml": ("zero", "zero", "fixed at 0", {"beta0", "truncated"}),
    # grpo with k3 in the loss at 0.01 (init_kl_coef 0): forward, clipped, seq-mean-token-mean; top_p 0.99 / 100.
    "v0.3.0_qwen3-vl-4B-rlvr_megatron_rlvr_megatron_80G.yaml": ("forward", "neither", "fixed at 0.01",
                                                                {"forward", "clip", "seqmean", "truncated"}),
    "v0.1.3_qwen2.5-vl-7B-math_rlvr_math_megatron.yaml": ("forward", "neither", "fixed at 0.01",
                                                          {"forward", "clip", "seqmean", "truncated"}),
}


def test_every_real_file_is_listed_with_its_source_and_licence():
    rows = [line.split(" | ") for line in (DATA / "SOURCES").read_text().splitlines() if line.strip()]
    assert {row[0] for row in rows} == {p.name for p in DATA.glob("*.yaml")} == set(REAL)
    assert all(row[1] == "alibaba/ROLL" and row[4] == "Apache-2.0" for row in rows)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_file_verdict(name, tmp_path, capsys):
    token, sequence, beta, risks = REAL[name]
    status, report = _run(tmp_path, source=DATA / name, extra=["--version", "roll==0.3.0"])
    assert status == 0, capsys.readouterr().err
    assert report["source"] == "roll" and "versions" not in report
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    assert report["controller"] == beta
    assert _kinds(report["risk_ids"]) == risks and len(report["risk_ids"]) == len(risks), report["risk_ids"]
    assert (report["config"]["rollout"]["top_p"], report["config"]["rollout"]["top_k"]) == (0.99, 100)
    GRPOConfig.from_dict(report["config"])


def test_real_files_named_details(tmp_path):
    status, report = _run(tmp_path, source=DATA / "v0.3.0_qwen2.5-7B-rlvr_megatron_rlvr_config.yaml",
                          extra=["--version", "roll==0.3.0"])
    assert report["unmapped"]["init_kl_coef"] == ("0.2 without add_token_level_kl: ROLL loads the reference and "
                                                  "logs its KL (critic/kl) but adds none to the rewards")
    assert report["config"]["loss"]["dual_clip"] == pytest.approx(1.4)  # 1 + 2 x pg_clip
    assert report["unmapped"]["whiten_advantages"].startswith("ROLL whitens the advantages over the batch")
    status, report = _run(tmp_path, source=DATA / "v0.3.0_qwen3-vl-4B-rlvr_megatron_rlvr_megatron_80G.yaml",
                          extra=["--version", "roll==0.3.0"])
    kl = report["config"]["kl"]
    assert (kl["coef"], kl["estimator"], kl["placement"], kl["is_correction"], kl["shaping"], kl["clip_threshold"]) \
        == (0.01, "k3", "loss", "none", "clip", 10.0)


def test_the_0_1_0_default_aggregation_is_its_own_answer(tmp_path):
    # the v0.1.3 recipe sets no loss_agg_mode: 0.1.0 sums each sequence's tokens (seq-mean-token-sum), later
    # releases take their mean
    status, report = _run(tmp_path, source=DATA / "v0.1.3_qwen2.5-vl-7B-math_rlvr_math_megatron.yaml")
    answers = [(v["releases"], v["aggregation"]["name"]) for v in report["versions"]]
    assert answers == [(["ROLL 0.1.1 or later"], "seq_mean_token_mean"),
                       (["ROLL >= 0.1.0, < 0.1.1"], "seq_mean_token_sum")]


@pytest.mark.parametrize("penalty, mode, token, sequence, estimator", [
    ("kl", "token-mean", "reverse", "reverse", "k1"),
    # the policy term's 1 / length per sequence also weighs the reward KL's score terms: neither KL per sequence
    ("kl", "seq-mean-token-mean", "reverse", "neither", "k1"),
    ("mse", "token-mean", "neither", "neither", "k2")])
def test_the_reward_kl(tmp_path, penalty, mode, token, sequence, estimator):
    text = BASE + f"add_token_level_kl: true\ninit_kl_coef: 0.05\nkl_penalty: {penalty}\nloss_agg_mode: {mode}\n"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0"])
    assert status == 0
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    kl = report["config"]["kl"]
    assert (kl["coef"], kl["estimator"], kl["placement"], kl["reward_mode"]) == (0.05, estimator, "reward",
                                                                                 "reward_to_go")


def test_the_adaptive_controller_and_both_terms(tmp_path):
    text = BASE + "add_token_level_kl: true\ninit_kl_coef: 0.05\ntarget_kl: 0.1\n"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0"])
    assert report["config"]["kl"]["controller"] == "adaptive" and report["config"]["kl"]["target"] == 0.1
    text = BASE + "add_token_level_kl: true\ninit_kl_coef: 0.05\nuse_kl_loss: true\nkl_loss_coef: 0.01\n"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0"])
    assert report["config"]["kl"]["placement"] == "loss" and report["config"]["kl"]["coef"] == 0.01
    assert report["unmapped"]["add_token_level_kl"].startswith("klgrpo has one KL term: ROLL's reward KL (kl, beta "
                                                               "0.05)")
    assert isinstance(report["value"], list) and len(report["value"]) == 2  # both terms in the verdict


def test_use_kl_loss_with_coefficient_0_is_no_kl(tmp_path):
    status, report = _run(tmp_path, BASE + "use_kl_loss: true\ninit_kl_coef: 0.0\n", extra=["--version", "roll==0.3.0"])
    assert report["gradient"]["token_on_policy"] == "zero" and _kinds(report["risk_ids"]) == {"beta0"}


def test_a_generating_args_block_samples_top_p_0_7_and_top_k_50_unset(tmp_path):
    text = BASE.replace("actor_infer: {}", "actor_infer:\n  generating_args:\n    max_new_tokens: 512") + \
        "use_kl_loss: true\nkl_loss_coef: 0.01\ninit_kl_coef: 0.0\n"
    out = tmp_path / "k.yaml"
    status, report = _run(tmp_path, text, extra=["--version", "roll==0.3.0", "--write", str(out)])
    assert status == 0
    line = next(r for r in report["risks"] if "unset" in r)
    assert line.startswith(
        "actor_infer.generating_args.top_p and actor_infer.generating_args.top_k unset: on ROLL 0.1.0 or later the "
        "sampler truncates each position's distribution at top_p 0.7 and top_k 50 (GeneratingArguments' default, "
        "which a generating_args block takes for what it leaves unset) while ROLL's actor scores each token by the "
        "full softmax of its logits")
    rollout = yaml.safe_load(out.read_text())["rollout"]
    assert (rollout["top_p"], rollout["top_k"], rollout["truncation"]) == (0.7, 50, "policy")
    # no block: explain reads no filter
    status, report = _run(tmp_path, BASE + "use_kl_loss: true\nkl_loss_coef: 0.01\n", name="b.yaml",
                          extra=["--version", "roll==0.3.0"])
    assert not [r for r in report["risks"] if "unset" in r or r.startswith("sampling filter")]


def test_refusals(tmp_path, capsys):
    for text, said in ((BASE + "add_token_level_kl: true\nkl_penalty: full\n", "sampled tokens' log-probs only"),
                       (BASE + "add_token_level_kl: true\nkl_penalty: abs\n", "is |log pi - log ref|"),
                       (BASE + "kl_penalty: k3\n", "its config loader (dacite) refuses it"),
                       (BASE + "custom_envs: {}\n", "agentic pipeline")):
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        assert main([str(path), "--version", "roll==0.3.0"]) == 2
        assert said in capsys.readouterr().err
    path.write_text(BASE.replace("grpo", "gigpo"))
    assert main([str(path), "--version", "roll==0.1.0"]) == 2
    assert "adv_estimator 'gigpo' is none of ROLL >= 0.1.0, < 0.1.1's" in capsys.readouterr().err
