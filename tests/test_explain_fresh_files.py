"""``klgrpo explain`` on real public files of slime, prime-rl, NeMo-RL, ROLL and SkyRL that the readers were not
written from, verbatim (tests/data/explain_real/<framework>/SOURCES: each file's repository, path, commit with its
tag, licence). Each verdict is derived by hand from the framework's loss and KL code at the file's tag:

- slime (loss.py, ppo_utils.compute_approx_kl): --use-kl-loss adds --kl-loss-coef x the estimate, no weight; k1 =
  log pi - log ref has the score function alone as gradient, whose mean under pi is 0 ("zero" per token; the
  sequence mean of a length-normalised sum is "neither"); low_var_kl is k3 clamped at 10 ("forward"). gspo's
  ratio is the sequence's exp(mean_t (log pi - log pi_old)): klgrpo's gspo.
- prime-rl: no release's RL loss reads a reference model ("zero", beta 0); kl_tau is a term to the sampler. The
  configs are pydantic models that forbid unknown keys, so a key of another release range places the file there;
  distillation (trainer.loss.type sft at 0.5, training_mode opd / sft at 0.6, an algo.type opd / opsd / sft from
  0.7, at the orchestrator or per env) trains on another model and is refused.
- NeMo-RL (ClippedPGLossFn, calculate_kl): a recipe inherits its ``defaults:`` file (OmegaConf merge); the samples
  per step over train_global_batch_size are the updates per step (several: off-policy).
- ROLL (actor_worker.py): use_kl_loss adds kl_loss_coef x k3 clamped at 10, no weight: "forward".
- SkyRL (ppo_utils, trainer.py): use_kl_loss adds kl_loss_coef x k3 (clamped at 10), no weight: "forward"; an
  example's own entry module (``-m examples.algorithms.dapo.main_dapo``) is BasePPOExp with SkyRL's config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrpo.apps.explain import main

DATA = Path(__file__).resolve().parent / "data" / "explain_real"
FRAMEWORKS = ("slime", "prime_rl", "nemo_rl", "roll", "skyrl_train")
#: Risk lines by their opening words.
#: explain's risk ids (its JSON's risk_ids) -> the short names the expectations below use
RISKS = {"beta_zero": "beta0", "kl_off": "kloff",
         "forward_kl": "forward", "off_policy": "offpolicy", "reward_kl_off_policy":
         "reward_offpolicy", "kl_clipped": "clip", "seq_mean_token_mean": "seqmean", "advantage_epsilon": "eps",
         "truncated_sampling": "truncated", "filter_default": "top_k50", "kl_tau": "kl_tau", "zero_kl": "zero_kl",
         "neither_kl": "neither_kl"}

# (framework, file): (--version, token verdict, sequence verdict, beta, risks) or ("refused", --version or None,
# the key the one-line refusal names); REFUSED_AT: a release the file cannot run on and the key that says so.
EXPECTED = {
    # prime-rl 0.3 / 0.4: inference_gpu_ids, trainer_gpu_ids, seq_len are RLConfig's own keys there (the reader
    # refused them as unknown TRL fields); kl_tau's default is 0 before 0.5: no term, no line.
    ("prime_rl", "v0.3.0_configs_deepscaler_stage1.toml"): ("prime_rl==0.3.0", "zero", "zero", "fixed at 0",
                                                            {"beta0"}),
    ("prime_rl", "v0.4.0_examples_wordle_rl.toml"): ("prime_rl==0.4.0", "zero", "zero", "fixed at 0", {"beta0"}),
    # 0.6.0's hendrycks recipe: group_size and [orchestrator.train.*] (0.6 on), kl_tau unset: 1e-3 to the sampler.
    ("prime_rl", "v0.6.0_configs_hendrycks_math_rl.toml"): ("prime_rl==0.6.0", "zero", "zero", "fixed at 0",
                                                            {"beta0", "kl_tau"}),
    # 0.8.0: algo.type rae (the rl loss, its own advantages), and an advanced recipe with deployment / slurm.
    ("prime_rl", "v0.8.0_configs_debug_algo_rae.toml"): ("prime_rl==0.8.0", "zero", "zero", "fixed at 0",
                                                         {"beta0", "kl_tau"}),
    ("prime_rl", "v0.8.0_examples_advanced_qwen3-30b-a3b_math.toml"): ("prime_rl==0.8.0", "zero", "zero",
                                                                        "fixed at 0", {"beta0", "kl_tau"}),
    # distillation: refused in one line naming the key (the reader gave "zero" with the beta-0 risk)
    ("prime_rl", "v0.5.0_examples_alphabet_sort_sft_distill_hard.toml"): ("refused", "prime_rl==0.5.0",
                                                                          "trainer.loss.type"),
    ("prime_rl", "v0.6.0_configs_debug_training_modes_opd.toml"): ("refused", "prime_rl==0.6.0",
                                                                   "orchestrator.training_mode"),
    ("prime_rl", "v0.8.0_configs_debug_algo_opd.toml"): ("refused", "prime_rl==0.8.0", "orchestrator.algo.type"),
    ("prime_rl", "v0.8.0_configs_debug_algo_mixed_grpo_opd.toml"): ("refused", "prime_rl==0.8.0",
                                                                    "orchestrator.train.source.algo.type"),
    # NeMo-RL 0.2.1's 24K recipe inherits grpo-deepscaler-1.5b-8K.yaml (beside it, as in the repository): 128
    # prompts x 8 generations over train_global_batch_size 64 = 16 updates per step -> off-policy (the reader took
    # grpo_math_1B's 512 / 512 and missed it); its own beta 1e-4; k3 without a weight at 0.2.1 -> forward.
    ("nemo_rl", "v0.2.1/grpo_deepscaler-1.5b-24K.yaml"): ("nemo_rl==0.2.1", "forward", "neither", "fixed at 0.0001",
                                                          {"forward", "offpolicy"}),
    ("nemo_rl", "v0.2.1/grpo-deepscaler-1.5b-8K.yaml"): ("nemo_rl==0.2.1", "zero", "zero", "fixed at 0", {"beta0"}),
    ("nemo_rl", "v0.2.1_examples_configs_recipes_llm_grpo-gemma3-1b-it-1n8g-fsdp2tp1.yaml"): (
        "nemo_rl==0.2.1", "forward", "neither", "fixed at 0.01", {"forward"}),
    # GSPO recipe at 0.4.0: beta 0 -> no KL term.
    ("nemo_rl", "v0.4.0_examples_configs_recipes_llm_grpo-gspo-deepscaler-1.5b-8K.yaml"): (
        "nemo_rl==0.4.0", "zero", "zero", "fixed at 0", {"beta0"}),
    # ProRL v2 at 0.6.0: k2 in the loss, no weight: (logp - ref) grad logp -> reverse; output clamp 10 -> clip.
    ("nemo_rl", "v0.6.0_examples_configs_prorlv2.yaml"): ("nemo_rl==0.6.0", "reverse", "neither", "fixed at 0.0001",
                                                          {"clip"}),
    # at 0.7.0 the weight exp(logp - logp.detach()) is in the graph: grad E_pi[k2], k2 no KL's estimate -> neither;
    # with k3 the same weight gives grad E_pi[k3] = grad KL(pi||ref) -> reverse.
    ("nemo_rl", "v0.7.0_examples_configs_prorlv2.v2.yaml"): ("nemo_rl==0.7.0", "neither", "neither",
                                                             "fixed at 0.0001", {"clip", "neither_kl"}),
    ("nemo_rl", "v0.7.0_examples_configs_grpo_math_8B.yaml"): ("nemo_rl==0.7.0", "reverse", "neither", "fixed at 0.01",
                                                               {"clip"}),
    ("nemo_rl", "v0.7.0_examples_configs_recipes_llm_dapo-qwen2.5-7b.v2.yaml"): ("nemo_rl==0.7.0", "zero", "zero",
                                                                                 "fixed at 0", {"beta0"}),
    # slime 0.2.4: --use-kl-loss 0.001 without --kl-loss-type: k1 (the default from 0.2.0), no weight -> zero per
    # token; 32 x 8 samples over --global-batch-size 256: one update.
    ("slime", "v0.2.4_scripts_run-gpt-oss-20B.sh"): ("slime==0.2.4", "zero", "neither", "fixed at 0.001",
                                                     {"seqmean", "zero_kl"}),
    # low_var_kl at 0.001: k3 clamped at 10, no weight -> forward, clipped.
    ("slime", "v0.3.1_slime_plugins_rollout_buffer_rollout_buffer_example.sh"): (
        "slime==0.3.1", "forward", "neither", "fixed at 0.001", {"forward", "clip", "seqmean"}),
    # gspo with --kl-loss-coef 0, and scripts without --use-kl-loss: no KL term.
    ("slime", "v0.1.0_scripts_run-glm4.5-355B-A32B.sh"): ("slime==0.1.0", "zero", "zero", "fixed at 0", {"beta0"}),
    ("slime", "v0.3.1_scripts_run-qwen3-next-80B-A3B.sh"): ("slime==0.3.1", "zero", "zero", "fixed at 0", {"beta0"}),
    ("slime", "v0.3.1_examples_geo3k_vlm_run_geo3k_qwen35.sh"): ("slime==0.3.1", "zero", "zero", "fixed at 0",
                                                                 {"beta0"}),
    # ROLL: use_kl_loss -> k3 clamped at 10, no weight: forward; top_p < 1 in actor_infer -> truncated.
    ("roll", "v0.1.0_examples_docs_examples_example_grpo.yaml"): ("roll==0.1.0", "forward", "neither", "fixed at 0.001",
                                                                  {"forward", "clip", "truncated"}),
    ("roll", "v0.2.0_examples_docs_examples_example_reinforce_pp.yaml"): (
        "roll==0.2.0", "forward", "neither", "fixed at 0.001", {"forward", "clip", "seqmean", "truncated"}),
    ("roll", "v0.3.0_examples_docs_examples_example_gspo.yaml"): (
        "roll==0.3.0", "forward", "neither", "fixed at 0.001", {"forward", "clip", "seqmean", "truncated"}),
    ("roll", "v0.3.0_examples_qwen2_5-vl-3B-rlvr_fsdp2_rlvr_fsdp2_offload.yaml"): (
        "roll==0.3.0", "forward", "neither", "fixed at 0.01", {"forward", "clip", "seqmean", "truncated"}),
    ("roll", "v0.2.0_examples_qwen3-30BA3B-rlvr_megatron_rlvr_config.yaml"): ("roll==0.2.0", "zero", "zero",
                                                                              "fixed at 0", {"kloff", "truncated"}),
    # SkyRL: use_kl_loss (default true) -> kl_loss_coef x k3 clamped at 10, no weight: forward; 1024 / 256
    # mini-batches -> off-policy; grpo's std + 1e-6 -> the epsilon risk.
    ("skyrl_train", "skyrl_train-v0.2.0_skyrl-train_examples_search_run_search.sh"): (
        None, "forward", "neither", "fixed at 0.001", {"forward", "clip", "offpolicy", "eps"}),
    ("skyrl_train", "skyrl-v0.3.0_examples_train_gsm8k_run_gsm8k.sh"): (
        None, "forward", "neither", "fixed at 0.001", {"forward", "clip", "offpolicy", "eps"}),
    # rloo: k3 in the reward summed into the sequence score -> neither; several mini-batches per batch.
    ("skyrl_train", "skyrl_train-v0.4.0_skyrl-train_examples_algorithms_rloo_run_rloo.sh"): (
        None, "neither", "neither", "fixed at 0.001", {"reward_offpolicy", "neither_kl"}),
    ("skyrl_train", "skyrl_train-v0.4.0_skyrl-train_examples_gsm8k_run_32b_gsm8k.sh"): (
        None, "zero", "zero", "fixed at 0", {"kloff", "eps"}),
    ("skyrl_train", "skyrl-v0.3.0_examples_train_algorithms_cispo_run_cispo_gsm8k.sh"): (
        None, "zero", "zero", "fixed at 0", {"kloff", "eps"}),
    # examples' own entry modules: DAPO's main_dapo (USE_KL_LOSS=false: no KL), the fully asynchronous trainer
    # (use_kl_loss true at the default 0.001: k3 unweighted, forward; 4 mini-batches: off-policy), and on-policy
    # distillation, which trains towards a teacher: refused.
    ("skyrl_train", "skyrl_train-v0.4.0_skyrl-train_examples_algorithms_dapo_run_dapo_gsm8k.sh"): (
        None, "zero", "zero", "fixed at 0", {"kloff", "eps"}),
    ("skyrl_train", "skyrl-v0.3.0_examples_train_fully_async_fully_async_run_gsm8k.sh"): (
        None, "forward", "neither", "fixed at 0.001", {"forward", "clip", "offpolicy", "eps"}),
    ("skyrl_train", "skyrl-v0.3.0_examples_train_on_policy_distillation_run_on_policy_distill_math_qwen3_1.7b.sh"): (
        "refused", None, "SkyRL's example of distillation"),
}
REFUSED_AT = {
    # SkyRL: a Hydra key the release's config lacks (klgrpo/apps/explain/skyrl_train_keys.json): the search recipe's
    # generator.sampling_params.stop came in 0.2.0; the renamed package's generator.inference_engine.* is no
    # skyrl-train release's
    ("skyrl_train", "skyrl_train-v0.2.0_skyrl-train_examples_search_run_search.sh"): (
        "skyrl_train==0.1.0", "generator.sampling_params.stop is not a key of skyrl-train 0.1.0's config"),
    ("skyrl_train", "skyrl-v0.3.0_examples_train_gsm8k_run_gsm8k.sh"): (
        "skyrl_train==0.4.0", "generator.inference_engine.num_engines is not a key of skyrl-train 0.4.0's config"),
    # slime: a flag its release declares that another does not (klgrpo/apps/explain/slime_flags.json)
    ("slime", "v0.2.4_scripts_run-gpt-oss-20B.sh"): ("slime==0.3.1", "--train-memory-margin-bytes is not a flag"),
    ("slime", "v0.3.1_examples_geo3k_vlm_run_geo3k_qwen35.sh"): ("slime==0.1.0", "--multimodal-keys is not a flag"),
    ("prime_rl", "v0.3.0_configs_deepscaler_stage1.toml"): ("prime_rl==0.6.0", "inference_gpu_ids"),
    ("prime_rl", "v0.4.0_examples_wordle_rl.toml"): ("prime_rl==0.8.0", "inference_gpu_ids"),
    ("prime_rl", "v0.6.0_configs_hendrycks_math_rl.toml"): ("prime_rl==0.4.0", "orchestrator.group_size"),
    ("prime_rl", "v0.8.0_configs_debug_algo_rae.toml"): ("prime_rl==0.6.0", "orchestrator.algo"),
    ("prime_rl", "v0.8.0_examples_advanced_qwen3-30b-a3b_math.toml"): ("prime_rl==0.4.0", "deployment"),
    ("prime_rl", "v0.8.0_configs_debug_algo_opd.toml"): ("prime_rl==0.6.0", "orchestrator.algo"),
    # NeMo-RL: a loss_fn key of a later release (the inherited 8K file's ratio_clip_min, 0.2.0 on)
    ("nemo_rl", "v0.2.1/grpo_deepscaler-1.5b-24K.yaml"): ("nemo_rl==0.1.0", "loss_fn.ratio_clip_min"),
    ("nemo_rl", "v0.2.1_examples_configs_recipes_llm_grpo-gemma3-1b-it-1n8g-fsdp2tp1.yaml"): (
        "nemo_rl==0.1.0", "loss_fn.ratio_clip_min"),
    ("nemo_rl", "v0.6.0_examples_configs_prorlv2.yaml"): ("nemo_rl==0.4.0", "loss_fn.reference_policy_kl_type"),
    ("nemo_rl", "v0.7.0_examples_configs_prorlv2.v2.yaml"): ("nemo_rl==0.4.0", "loss_fn.reference_policy_kl_type"),
    ("nemo_rl", "v0.7.0_examples_configs_recipes_llm_dapo-qwen2.5-7b.v2.yaml"): ("nemo_rl==0.1.0",
                                                                                 "loss_fn.ratio_clip_max"),
}
# ROLL refuses none of its files at another release: its loader (dacite's from_dict, not strict) drops a key the
# release's dataclasses lack (klgrpo/apps/explain/roll_keys.json), and none of these files puts a mapping under a
# plain-valued field. file: (--version, a key of the file that release lacks (None: it lacks none the file's own
# release has), token verdict, sequence verdict, beta, risks)
ROLL_ELSEWHERE = {
    # 0.1.0 is the first release read: at 0.3.0, reward_norm / reward_shift / reward_scale are no fields (0.1.1
    # replaced them; null / false here, nothing lost); loss_agg_mode seq-mean-token-sum is set: no seqmean risk
    "v0.1.0_examples_docs_examples_example_grpo.yaml": ("roll==0.3.0", "reward_norm", "forward", "neither",
                                                        "fixed at 0.001", {"forward", "clip", "truncated"}),
    # 0.1.0 has no norm_mean_type / norm_std_type (0.1.1 on; ~ here, what 0.1.0 does without them); no KL term
    "v0.2.0_examples_qwen3-30BA3B-rlvr_megatron_rlvr_config.yaml": ("roll==0.1.0", "norm_mean_type", "zero", "zero",
                                                                    "fixed at 0", {"kloff", "truncated"}),
    # every key these files have at their own release is a key of 0.1.0's config too (their dataset_dir,
    # interleave_probs, flash_attn and validation.eval_steps are no release's fields)
    "v0.2.0_examples_docs_examples_example_reinforce_pp.yaml": ("roll==0.1.0", None, "forward", "neither",
                                                                "fixed at 0.001",
                                                                {"forward", "clip", "seqmean", "truncated"}),
    "v0.3.0_examples_docs_examples_example_gspo.yaml": ("roll==0.1.0", None, "forward", "neither", "fixed at 0.001",
                                                        {"forward", "clip", "seqmean", "truncated"}),
    # no loss_agg_mode: 0.1.0's default seq-mean-token-sum, no seqmean risk
    "v0.3.0_examples_qwen2_5-vl-3B-rlvr_fsdp2_rlvr_fsdp2_offload.yaml": ("roll==0.1.0", None, "forward", "neither",
                                                                        "fixed at 0.01",
                                                                        {"forward", "clip", "truncated"}),
}


def _kinds(risk_ids: list[str]) -> set[str]:
    return {RISKS[i] for i in risk_ids if i in RISKS}


def _explain(path: Path, version: str | None, tmp_path: Path, capsys) -> tuple[int, dict | None, str]:
    out = tmp_path / "report.json"
    out.unlink(missing_ok=True)
    status = main([str(path), "--json", str(out)] + (["--version", version] if version else []))
    err = capsys.readouterr().err
    return status, (json.loads(out.read_text()) if status == 0 else None), err


def _listed(framework: str) -> dict[str, list[str]]:
    rows = [line.split(" | ") for line in (DATA / framework / "SOURCES").read_text().splitlines() if line.strip()]
    return {row[0]: row for row in rows}


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if (DATA / f).is_dir()])
def test_every_file_is_listed_with_its_origin_and_a_free_licence(framework):
    listed = _listed(framework)
    files = {str(p.relative_to(DATA / framework)) for p in (DATA / framework).rglob("*")
             if p.is_file() and p.name not in ("SOURCES", "README.md")}  # a recipe's defaults: file beside it
    assert set(listed) == files == {name for fw, name in EXPECTED if fw == framework}
    assert len(files) >= 5
    for name, (_, repository, path, commit, licence) in listed.items():
        assert "/" in repository and path and "(tag " in commit and len(commit.split()[0]) == 40, name
        assert licence in ("Apache-2.0", "MIT", "BSD-3-Clause"), name


@pytest.mark.parametrize("framework, name", sorted(EXPECTED))
def test_fresh_file_verdict(framework, name, tmp_path, capsys):
    expected = EXPECTED[framework, name]
    status, report, err = _explain(DATA / framework / name, expected[1] if expected[0] == "refused" else expected[0],
                                   tmp_path, capsys)
    if expected[0] == "refused":
        assert status == 2 and report is None
        assert len(err.strip().splitlines()) == 1 and expected[2] in err, err
        return
    version, token, sequence, beta, risks = expected
    assert status == 0, err
    assert "versions" not in report, report.get("versions")
    assert report["source"] == framework
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    assert report["controller"] == beta
    assert _kinds(report["risk_ids"]) == risks, report["risk_ids"]
    assert len(_kinds(report["risk_ids"])) == len(report["risk_ids"])
    if report["config"]["kl"]["coef"] > 0:  # never the beta-0 line where a coefficient is set
        assert "beta0" not in risks


@pytest.mark.parametrize("framework, name", sorted(REFUSED_AT))
def test_fresh_file_refused_on_a_release_it_cannot_run_on(framework, name, tmp_path, capsys):
    version, key = REFUSED_AT[framework, name]
    status, report, err = _explain(DATA / framework / name, version, tmp_path, capsys)
    assert status == 2 and report is None
    assert len(err.strip().splitlines()) == 1 and key in err, err


@pytest.mark.parametrize("name", sorted(ROLL_ELSEWHERE))
def test_roll_file_at_another_release_runs_without_the_keys_it_lacks(name, tmp_path, capsys):
    version, key, token, sequence, beta, risks = ROLL_ELSEWHERE[name]
    status, report, err = _explain(DATA / "roll" / name, version, tmp_path, capsys)
    assert status == 0, err
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    assert report["controller"] == beta and _kinds(report["risk_ids"]) == risks, report["risk_ids"]
    if key is not None:  # dropped by ROLL, set to what the release does without it: listed as ignored
        assert key in report["ignored"]
    assert not [k for k, why in report["unmapped"].items() if "dacite" in why]  # nothing the verdict reads lost


def test_slime_gspo_writes_klgrpo_gspo(tmp_path, capsys):
    """slime's gspo clips the sequence ratio exp(mean_t (log pi - log pi_old)): klgrpo's gspo, not ppo_clip."""
    status, report, err = _explain(DATA / "slime" / "v0.1.0_scripts_run-glm4.5-355B-A32B.sh", "slime==0.1.0",
                                   tmp_path, capsys)
    assert status == 0, err
    assert report["config"]["loss"]["policy_loss"] == "gspo"
    status, report, err = _explain(DATA / "slime" / "v0.2.4_scripts_run-gpt-oss-20B.sh", "slime==0.2.4",
                                   tmp_path, capsys)
    assert report["config"]["loss"]["policy_loss"] == "ppo_clip"  # grpo
