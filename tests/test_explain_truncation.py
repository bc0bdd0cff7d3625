"""``klgrpo explain``: a sampling filter (top_p < 1, top_k > 0, min_p > 0) in a TRL, Unsloth, verl or OpenRLHF file
is a risk line, and --write carries it into klgrpo's rollout keys, trained as drawn (rollout.truncation policy).

What each line says was read from the frameworks' sources (klgrpo/apps/explain/truncation.json names the files and
tags): every trainer read scores the full softmax of logits / temperature while the sampler draws from the
truncated, renormalised distribution; TRL's GRPOConfig.top_k defaults to 50 in 0.16 and 0.17 (None from 0.18, 0
from 0.29), and 0.14 / 0.15 build transformers' GenerationConfig without a top_k (transformers' default 50); from
0.24 TRL's colocated vLLM returns the processed (truncated) log-probs; verl's val_kwargs are validation only;
OpenRLHF has --top_p (0.3.6 - 0.10.1) and --rollout.top_p (0.10.2 on), no top_k or min_p flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from klgrpo.apps.explain import main
from klgrpo.apps.explain.truncation import filter_on, table
from klgrpo.config.schema import GRPOConfig

DATA = Path(__file__).resolve().parent / "data" / "explain_real"
CONSEQUENCE = ("the sampler draws each token from the truncated, renormalised distribution while {trainer}, so the "
               "old-policy/sampler ratios carry the kept mass and the KL it logs and trains estimates neither "
               "KL(pi||ref) nor the KL of the distribution sampled")
EXACT = "klgrpo's rollout.truncation policy trains the truncated distribution exactly"


def _run(tmp_path, text, name="cfg.yaml", extra=(), source=None):
    src = source or tmp_path / name
    if source is None:
        src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _sampling(report):
    return [line for risk_id, line in zip(report["risk_ids"], report["risks"])
            if risk_id in ("truncated_sampling", "filter_default")]


def test_which_values_truncate():
    assert filter_on("top_p", 0.95) and not filter_on("top_p", 1.0) and not filter_on("top_p", 1)
    assert filter_on("actor_rollout_ref.rollout.top_k", 20) and not filter_on("top_k", -1)
    assert not filter_on("top_k", 0) and not filter_on("top_k", None) and not filter_on("top_k", True)
    assert filter_on("min_p", 0.1) and not filter_on("min_p", 0.0)


def test_every_table_names_its_sources_and_klgrpo_keys():
    keys = {"rollout.top_p", "rollout.top_k", "rollout.min_p"}
    for framework in ("trl", "unsloth", "verl", "openrlhf"):
        rules = table()[framework]
        assert rules["read"] and "full softmax" in rules["trainer"]
        assert set(rules["fields"].values()) <= keys
    assert table()["verl"]["validation_only"] == "actor_rollout_ref.rollout.val_kwargs."


def test_trl_filters_are_a_risk_line_and_written_into_the_config(tmp_path):
    status, report = _run(tmp_path, "beta: 0.04\ntop_p: 0.9\ntop_k: 20\nmin_p: 0.05\n",
                          extra=["--version", "trl==1.16.0", "--write", str(tmp_path / "k.yaml")])
    assert status == 0
    trainer = "TRL's trainer scores each token by the full softmax of logits / temperature"
    assert _sampling(report) == [
        "sampling filter top_p 0.9, top_k 20, min_p 0.05: " + CONSEQUENCE.format(trainer=trainer) + "; " + EXACT
        + " (rollout.top_p 0.9, rollout.top_k 20, rollout.min_p 0.05 below)"]
    assert "min_p" not in report["unmapped"]
    written = yaml.safe_load((tmp_path / "k.yaml").read_text())["rollout"]
    assert (written["top_p"], written["top_k"], written["min_p"], written["truncation"]) == (0.9, 20, 0.05, "policy")
    cfg = GRPOConfig.from_dict(yaml.safe_load((tmp_path / "k.yaml").read_text()))
    assert (cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.min_p) == (0.9, 20, 0.05)


def test_trl_generation_kwargs_override_the_fields(tmp_path):
    # TRL (0.19 on): generation_kwargs replace top_p / min_p / ... where both are given
    status, report = _run(tmp_path, "beta: 0.04\ntop_p: 0.9\ngeneration_kwargs: {top_p: 0.7}\n",
                          extra=["--version", "trl==1.16.0"])
    assert status == 0 and _sampling(report)[0].startswith("sampling filter generation_kwargs.top_p 0.7: ")
    assert report["config"]["rollout"]["top_p"] == 0.7


def test_trl_off_values_give_no_line(tmp_path):
    status, report = _run(tmp_path, "beta: 0.04\ntop_p: 1.0\ntop_k: 0\nmin_p: null\n",
                          extra=["--version", "trl==1.16.0"])
    assert status == 0 and _sampling(report) == []
    assert (report["config"]["rollout"]["top_k"], report["config"]["rollout"]["min_p"]) == (0, 0.0)


def test_trl_vllm_importance_ratio_is_the_kept_mass_from_0_24(tmp_path):
    text = "beta: 0.04\ntop_p: 0.95\nuse_vllm: true\n"
    status, report = _run(tmp_path, text, extra=["--version", "trl==1.16.0"])
    assert status == 0
    assert _sampling(report)[0].endswith(
        "distribution sampled; TRL's colocated vLLM returns the truncated distribution's log-probs (logprobs_mode "
        "processed_logprobs; its vllm-serve from 1.0.0), so the importance ratio TRL puts on the policy term, "
        "pi / pi_S, is the kept mass pi(S_t) <= 1 on every token; " + EXACT + " (rollout.top_p 0.95 below)")
    # the range 0.22 - 0.25 starts before 0.24: the release is named
    status, report = _run(tmp_path, text, extra=["--version", "trl==0.23.0"])
    assert "; from TRL 0.24.0, TRL's colocated vLLM returns" in _sampling(report)[0]
    # without the correction, or without vLLM, no ratio
    status, report = _run(tmp_path, text + "vllm_importance_sampling_correction: false\n",
                          extra=["--version", "trl==1.16.0"])
    assert "importance ratio" not in _sampling(report)[0]


def test_trl_0_16_and_0_17_sample_top_k_50_when_unset(tmp_path):
    status, report = _run(tmp_path, "beta: 0.04\n", extra=["--version", "trl==0.17.0"])
    assert status == 0
    assert _sampling(report) == [
        "top_k unset: on TRL >= 0.16.0, < 0.18.0 the sampler truncates each position's distribution at top_k 50 "
        "(GRPOConfig.top_k defaults to 50 there, passed to generate and to vLLM alike; None from 0.18.0, off) "
        "while TRL's trainer scores each token by the full softmax of logits / temperature, so the old-policy/"
        "sampler ratios carry the kept mass and the KL it logs and trains estimates neither KL(pi||ref) nor the KL "
        "of the distribution sampled; set top_k 0 (or None) to sample the full softmax, or train the truncated "
        "distribution exactly with klgrpo's rollout.truncation policy (rollout.top_k 50 below)"]
    assert report["config"]["rollout"]["top_k"] == 50
    # set: no default line
    status, report = _run(tmp_path, "beta: 0.04\ntop_k: 0\n", extra=["--version", "trl==0.17.0"])
    assert _sampling(report) == [] and report["config"]["rollout"]["top_k"] == 0
    # 0.18 on: None, off
    status, report = _run(tmp_path, "beta: 0.04\n", extra=["--version", "trl==0.18.0"])
    assert _sampling(report) == []


def test_trl_0_14_generate_keeps_transformers_top_k_50_unless_vllm(tmp_path):
    status, report = _run(tmp_path, "beta: 0.04\n", extra=["--version", "trl==0.15.0"])
    assert _sampling(report)[0].startswith(
        "top_k unset: on TRL >= 0.14.0, < 0.16.0 the sampler truncates each position's distribution at top_k 50 "
        "(GRPOConfig has no top_k there and builds transformers' GenerationConfig without one, so generate keeps "
        "the default top_k 50 of transformers 4 (the releases those TRL run on; transformers 5 has None); the vLLM "
        "path's SamplingParams sets none)")
    assert "set use_vllm true (its SamplingParams sets no top_k) or run TRL 0.18.0 or later" in _sampling(report)[0]
    status, report = _run(tmp_path, "beta: 0.04\nuse_vllm: true\n", extra=["--version", "trl==0.15.0"])
    assert _sampling(report) == [] and report["config"]["rollout"]["top_k"] == 0


def test_real_open_r1_recipe_on_trl_0_16_samples_top_k_50(tmp_path):
    source = DATA / "openr1_bf08f56_qwen2.5-1.5b_config_demo.yaml"
    assert "top_k" not in source.read_text() and "use_vllm: true" in source.read_text()
    status, report = _run(tmp_path, "", source=source, extra=["--version", "trl==0.16.0"])
    assert status == 0 and _sampling(report)[0].startswith("top_k unset: on TRL >= 0.16.0, < 0.18.0 ")
    assert report["config"]["rollout"]["top_k"] == 50


def test_real_unsloth_notebook_vllm_sampling_params_min_p(tmp_path):
    # Unsloth's Qwen3 (4B) GRPO notebook: vllm_sampling_params = SamplingParams(min_p = 0.1, top_p = 1.0,
    # top_k = -1, seed = 3407, ...) at line 588, passed to GRPOConfig(vllm_sampling_params = ...)
    source = DATA / "unsloth_Qwen3_4B-GRPO.py"
    out = tmp_path / "k.yaml"
    status, report = _run(tmp_path, "", source=source, extra=["--write", str(out)])
    assert status == 0
    trainer = "Unsloth's loss scores each token by the full softmax of logits / temperature"
    assert _sampling(report) == [
        "sampling filter vllm_sampling_params min_p 0.1 (line 588): " + CONSEQUENCE.format(trainer=trainer) + "; "
        + EXACT + " (rollout.min_p 0.1 below)"]
    assert report["unmapped"]["vllm_sampling_params"].startswith(
        "Unsloth's GRPOConfig field: the SamplingParams(...) of line 588, read: its top_p, top_k and min_p replace "
        "the config's")
    rollout = yaml.safe_load(out.read_text())["rollout"]
    assert (rollout["min_p"], rollout["top_p"], rollout["top_k"], rollout["truncation"]) == (0.1, 1.0, 0, "policy")


def test_unsloth_sampling_params_written_in_the_call(tmp_path):
    script = ("from unsloth import FastLanguageModel\nfrom vllm import SamplingParams\nfrom trl import GRPOConfig\n"
              "args = GRPOConfig(beta=0.04, vllm_sampling_params=SamplingParams(top_p=0.8, top_k=40))\n")
    status, report = _run(tmp_path, script, name="train.py", extra=["--version", "unsloth==2025.10.1;trl==0.22.2"])
    assert status == 0
    assert _sampling(report)[0].startswith("sampling filter vllm_sampling_params top_p 0.8, vllm_sampling_params "
                                           "top_k 40 (line 4): ")
    # a name never assigned a SamplingParams(...): computed, as before
    script = script.replace("vllm_sampling_params=SamplingParams(top_p=0.8, top_k=40)", "vllm_sampling_params=sp")
    status, report = _run(tmp_path, script, name="train2.py", extra=["--version", "unsloth==2025.10.1;trl==0.22.2"])
    assert status == 0 and _sampling(report) == []
    assert "computed when the script runs" in report["unmapped"]["vllm_sampling_params"]


def test_verl_rollout_filters_and_validation_only_ones(tmp_path):
    status, report = _run(tmp_path, "actor_rollout_ref.actor.use_kl_loss=True\nactor_rollout_ref.rollout.top_p=0.9\n"
                                    "actor_rollout_ref.rollout.top_k=20\n", name="cfg.txt")
    assert status == 0
    trainer = "verl's actor scores each token by the full softmax of logits / temperature"
    assert _sampling(report) == [
        "sampling filter actor_rollout_ref.rollout.top_p 0.9, actor_rollout_ref.rollout.top_k 20: "
        + CONSEQUENCE.format(trainer=trainer) + "; " + EXACT + " (rollout.top_p 0.9, rollout.top_k 20 below)"]
    assert not {"actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.top_k"} & set(report["ignored"])
    # val_kwargs are validation only: no line, nothing written; top_k -1 and 0 are off
    status, report = _run(tmp_path, "actor_rollout_ref.actor.use_kl_loss=True\n"
                                    "actor_rollout_ref.rollout.val_kwargs.top_p=0.7\n"
                                    "actor_rollout_ref.rollout.val_kwargs.top_k=20\n"
                                    "actor_rollout_ref.rollout.top_k=-1\n", name="cfg2.txt")
    assert status == 0 and _sampling(report) == []
    assert report["config"]["rollout"]["top_k"] == 0 and "top_p" not in report["config"]["rollout"]
    assert "actor_rollout_ref.rollout.val_kwargs.top_p" in report["ignored"]


def test_verl_script_value_held_by_an_argument_is_named(tmp_path):
    script = ("#!/bin/bash\nTOP_P=$1\npython3 -m verl.trainer.main_ppo actor_rollout_ref.actor.use_kl_loss=True "
              "actor_rollout_ref.rollout.top_p=$TOP_P\n")
    status, report = _run(tmp_path, script, name="run.sh", extra=["--version", "verl==0.7.0"])
    assert status == 0 and _sampling(report) == []
    assert report["unmapped"]["actor_rollout_ref.rollout.top_p"].startswith("set when the script runs ($1): ")


def test_real_verl_files_with_validation_only_filters_give_no_line(tmp_path):
    # verl's trainer YAML (rollout top_k -1, top_p 1, val_kwargs top_p 1.0) and its GMPO DAPO script (top_p=1.0,
    # top_k=-1, val_kwargs.top_p=0.7): nothing truncates the trained samples
    for name in ("verl_ppo_trainer.yaml", "verl_gmpo_test_dapo_7b_math.sh"):
        status, report = _run(tmp_path, "", source=DATA / name)
        for entry in report.get("versions", [report]):
            assert _sampling(entry) == [], name
    assert "actor_rollout_ref.rollout.val_kwargs.top_p" in report["ignored"]


def test_openrlhf_top_p_under_both_names(tmp_path):
    trainer = "OpenRLHF's actor scores each token by the full softmax of logits / temperature"
    new = "--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.01 --rollout.top_p 0.9\n"
    status, report = _run(tmp_path, new, name="cmd.txt")
    assert status == 0
    assert _sampling(report) == ["sampling filter --rollout.top_p 0.9: " + CONSEQUENCE.format(trainer=trainer)
                                 + "; " + EXACT + " (rollout.top_p 0.9 below)"]
    assert "rollout.top_p" not in report["ignored"]
    old = "--init_kl_coef 0.01 --use_kl_loss --kl_estimator k3 --top_p 0.8\n"
    status, report = _run(tmp_path, old, name="cmd2.txt", extra=["--version", "openrlhf==0.8.5"])
    assert status == 0 and _sampling(report)[0].startswith("sampling filter --top_p 0.8: ")
    assert report["config"]["rollout"]["top_p"] == 0.8
