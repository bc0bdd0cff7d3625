"""``klgrpo explain`` on real public files, verbatim (tests/data/explain_real/SOURCES names each one's repository,
path and commit): TRL's example scripts and notebook at three releases, open-r1's recipes at three commits (three
TRL pins), Unsloth's GRPO notebooks (exported as scripts, and one as Colab runs it), verl's launch scripts and
Hydra trainer config, OpenRLHF's launch scripts.

Each verdict is derived by hand below from the source's own formula at the release the file runs on:
- TRL (grpo_trainer.py at the tag): the KL is k3 = exp(ref - logp) - (ref - logp) - 1 added to each token's loss;
  multiplied by the importance ratio coef_1 only where use_bias_correction_kl exists and is true (0.26 on; default
  true from 1.10). Without the ratio its gradient is (1 - ref/pi) grad log pi, whose mean under pi is
  grad KL(ref||pi): "forward". beta 0 means no KL term at all: "zero".
- Unsloth (unsloth_zoo grpo_compute_loss): the same k3, never times coef_1, so "forward" whatever TRL says;
  beta 0.001 from Unsloth 2025.6.5 (unsloth/models/rl.py).
- verl: low_var_kl in the loss is k3 clamped at 10, no ratio: "forward" (and clipped); KL in the reward (k1,
  kl_penalty kl) is a reward the policy gradient follows: "reverse" on the first update; several mini-batches per
  batch make the later ones off-policy.
- OpenRLHF: k2 in the loss: grad 0.5 (logp - ref)^2 = (logp - ref) grad log pi, mean under pi grad KL(pi||ref):
  "reverse" per token; k3 in the loss (no ratio): "forward"; both clamped to [-10, 10].
The sequence verdict of a token-mean loss is "neither" (a token's KL weighs by its completion's length), of a KL
in the reward "reverse" (the summed sequence KL is the reward).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrpo.apps.explain import main

DATA = Path(__file__).resolve().parent / "data" / "explain_real"
#: Risk lines by their opening words.
#: explain's risk ids (its JSON's risk_ids) -> the short names the expectations below use
RISKS = {"beta_zero": "beta0", "kl_off": "kloff",
         "forward_kl": "forward", "off_policy": "offpolicy", "reward_kl_off_policy":
         "reward_offpolicy", "kl_clipped": "clip", "seq_mean_token_mean": "seqmean", "advantage_epsilon": "eps",
         "truncated_sampling": "truncated", "filter_default": "top_k50"}

# file: (--version or None, source, token verdict, sequence verdict, beta rule, risks)
EXPECTED = {
    # TRL 0.26.0 (the import trl.experimental.openenv exists from 0.26): beta default 0.0 -> no KL.
    "trl_v0.26.0_openenv_echo.py": (None, "trl", "zero", "zero", "fixed at 0", {"beta0"}),
    "trl_v0.26.0_openenv_catch.py": (None, "trl", "zero", "zero", "fixed at 0", {"beta0"}),
    # TRL 1.0 / 1.9 scripts: no beta set; the fields they set exist from 0.22, where beta's default is 0.0.
    "trl_v1.0.0_grpo_2048.py": (None, "trl", "zero", "zero", "fixed at 0", {"beta0"}),
    "trl_v1.9.0_openenv_sudoku.py": (None, "trl", "zero", "zero", "fixed at 0", {"beta0"}),
    "trl_v1.9.0_openenv_wordle.py": (None, "trl", "zero", "zero", "fixed at 0", {"beta0"}),
    # The notebook of tag v1.9.0 pins no TRL: run with the release it ships with.
    "trl_v1.9.0_grpo_trl_lora_qlora.ipynb": ("trl==1.9.0", "trl", "zero", "zero", "fixed at 0", {"beta0"}),
    # open-r1 3f9d75a pins TRL at commit 013d360b (first released in 0.16.0): beta 0.04 default, k3 without the
    # ratio -> forward; its trainer's loss is sum / token count (token_mean) -> sequence neither. The recipe sets
    # no top_k: TRL 0.16's GRPOConfig.top_k defaults to 50, which its vLLM SamplingParams receive -> top_k50.
    "openr1_3f9d75a_qwen2.5-1.5b_config_demo.yaml": ("trl==0.16", "trl", "forward", "neither", "fixed at 0.04",
                                                     {"forward", "top_k50"}),
    # open-r1 bf08f56 pins trl==0.16.0: the same.
    "openr1_bf08f56_qwen2.5-1.5b_config_demo.yaml": ("trl==0.16.0", "trl", "forward", "neither", "fixed at 0.04",
                                                     {"forward", "top_k50"}),
    "openr1_bf08f56_r1-distill-1.5b_config_demo.yaml": ("trl==0.16.0", "trl", "forward", "neither",
                                                        "fixed at 0.04", {"forward", "top_k50"}),
    # open-r1 b806e10 pins trl==0.18.0: beta 0.04, loss_type bnpo (token mean), no ratio -> forward.
    "openr1_b806e10_qwen2.5-1.5b_config_demo.yaml": ("trl==0.18.0", "trl", "forward", "neither", "fixed at 0.04",
                                                     {"forward"}),
    "openr1_b806e10_r1-distill-1.5b_config_demo.yaml": ("trl==0.18.0", "trl", "forward", "neither",
                                                        "fixed at 0.04", {"forward"}),
    # this recipe sets beta: 0.01.
    "openr1_b806e10_qwen2.5-1.5b_config_demo_code.yaml": ("trl==0.18.0", "trl", "forward", "neither",
                                                          "fixed at 0.01", {"forward"}),
    # Unsloth notebooks pin trl==0.22.2 and install the newest Unsloth: beta 0.001 (Unsloth's), k3 without the
    # ratio in unsloth_zoo's loss -> forward; bnpo / dapo are token means -> sequence neither.
    "unsloth_Gemma3_1B-GRPO.py": (None, "unsloth", "forward", "neither", "fixed at 0.001", {"forward"}),
    "unsloth_Llama3.1_8B-GRPO.py": (None, "unsloth", "forward", "neither", "fixed at 0.001", {"forward"}),
    # its vllm_sampling_params = SamplingParams(min_p = 0.1, top_p = 1.0, top_k = -1, ...): min-p sampling, scored
    # by unsloth_zoo's full softmax -> truncated.
    "unsloth_Qwen3_4B-GRPO.py": (None, "unsloth", "forward", "neither", "fixed at 0.001", {"forward", "truncated"}),
    "unsloth_Phi_4_14B-GRPO.py": (None, "unsloth", "forward", "neither", "fixed at 0.001", {"forward"}),
    "unsloth_Advanced_Llama3_1_3B_GRPO_LoRA.py": (None, "unsloth", "forward", "neither", "fixed at 0.001",
                                                  {"forward"}),
    # The notebook as Colab runs it (not exported): its first code cell's `!uv pip install` is the only body of
    # an `if`; it pins trl==0.22.2 and the newest Unsloth; no beta: Unsloth's 0.001, the same loss -> forward.
    "unsloth_gpt_oss_20B_GRPO_Minesweeper_BF16.ipynb": (None, "unsloth", "forward", "neither", "fixed at 0.001",
                                                        {"forward"}),
    # verl grpo + low_var_kl in the loss at 0.001: forward, clipped at 10; 1024 / 256 = 4 mini-batches ->
    # off-policy; (r - mean) / (std + 1e-6) -> the epsilon risk.
    "verl_run_qwen2-7b.sh": (None, "verl", "forward", "neither", "fixed at 0.001",
                             {"forward", "offpolicy", "clip", "eps"}),
    "verl_run_deepseek7b_llm.sh": (None, "verl", "forward", "neither", "fixed at 0.001",
                                   {"forward", "offpolicy", "clip", "eps"}),
    # the LoRA script: 16 prompts, mini-batch 16 -> one update per batch, no off-policy line.
    "verl_run_qwen2_5-3b_gsm8k_grpo_lora.sh": (None, "verl", "forward", "neither", "fixed at 0.001",
                                               {"forward", "clip", "eps"}),
    # rloo / remax: k1 in the reward at 0.001, 4 mini-batches -> the reward-KL off-policy risk; no group std ->
    # no epsilon risk.
    "verl_rloo_run_qwen2-7b.sh": (None, "verl", "reverse", "reverse", "fixed at 0.001", {"reward_offpolicy"}),
    "verl_remax_run_qwen2.5-3b_seq_balance.sh": (None, "verl", "reverse", "reverse", "fixed at 0.001",
                                                 {"reward_offpolicy"}),
    # reinforce++ (and its baseline form): k1 in the reward, mini-batch = batch -> one on-policy update; it
    # whitens over the batch, no group std -> no epsilon risk.
    "verl_run_qwen2-7b_math_rf.sh": (None, "verl", "reverse", "reverse", "fixed at 0.001", set()),
    "verl_run_qwen2-7b_math_rf_baseline.sh": (None, "verl", "reverse", "reverse", "fixed at 0.001", set()),
    # verl 0.8.0's synchronous trainer (python3 -m verl.trainer.main_ppo_sync, a module of 0.8.0 alone): the KL in
    # the reward (kl_penalty kl) at kl_ctrl.kl_coef 0.0: apply_kl_penalty subtracts 0 * k1, no KL: zero, beta 0.
    "verl_v0.8.0_remax_run_qwen2.5_math_7b_sync_fsdp.sh": (None, "verl", "zero", "zero", "fixed at 0", {"beta0"}),
    # verl 0.9.0's GDPO: +algorithm.gdpo_reward_keys (a key added by the script, named, not fatal); use_kl_loss
    # False and use_kl_in_reward at 0.9's default false: kl_loss_coef 0.001 is set but no KL term runs: zero.
    "verl_v0.9.0_gdpo_run_qwen3_8b_fsdp.sh": ("verl==0.9.0", "verl", "zero", "zero", "fixed at 0", {"kloff"}),
    # verl's GMPO DAPO script: no KL (use_kl_loss False, use_kl_in_reward False, both coefficients 0); it trains
    # with rollout.top_p=1.0 and top_k=-1 (off) and sets val_kwargs.top_p=0.7, validation only: no sampling risk.
    "verl_gmpo_test_dapo_7b_math.sh": (None, "verl", "zero", "zero", "fixed at 0", {"beta0", "eps"}),
    # gae without any KL (use_kl_loss False, use_kl_in_reward False): zero.
    "verl_ppo_run_gemma.sh": (None, "verl", "zero", "zero", "fixed at 0", {"kloff"}),
    # The Hydra trainer config (defaults: list): verl's defaults, no KL anywhere.
    "verl_ppo_trainer.yaml": (None, "verl", "zero", "zero", "fixed at 0", {"kloff"}),
    # OpenRLHF reinforce_baseline + k2 in the loss: reverse per token, clamped at 10; no group std.
    "openrlhf_train_reinforce_baseline_hybrid_engine.sh": (None, "openrlhf", "reverse", "neither", "fixed at 1e-05",
                                                           {"clip"}),
    "openrlhf_train_reinforce_baseline_ray_agent_async.sh": (None, "openrlhf", "reverse", "neither",
                                                             "fixed at 1e-05", {"clip"}),
    # init_coef 0: no KL.
    "openrlhf_train_vlm_math_hybrid_engine.sh": (None, "openrlhf", "zero", "zero", "fixed at 0", {"beta0"}),
    # PPO with the KL in the reward (k1, 0.01), 1024 samples trained 128 at a time -> off-policy reward KL.
    "openrlhf_train_ppo_ray_hybrid_engine.sh": (None, "openrlhf", "reverse", "reverse", "fixed at 0.01",
                                                {"reward_offpolicy"}),
    "openrlhf_train_ppo_with_reward_fn.sh": (None, "openrlhf", "reverse", "reverse", "fixed at 0.01",
                                             {"reward_offpolicy"}),
    # ProRL v2: k2 in the loss at 1e-4, 512 x 16 samples trained 1024 at a time -> off-policy (neither).
    "openrlhf_train_prorlv2_math_hybrid_engine.sh": (None, "openrlhf", "reverse", "neither", "fixed at 0.0001",
                                                     {"offpolicy", "clip"}),
    # DAPO: k3 in the loss at 1e-3 (no ratio) -> forward; group_norm (std + 1e-9) -> the epsilon risk.
    "openrlhf_train_dapo_ray_hybrid_engine.sh": (None, "openrlhf", "forward", "neither", "fixed at 0.001",
                                                 {"forward", "offpolicy", "clip", "eps"}),
}


def _kinds(risk_ids: list[str]) -> set[str]:
    return {RISKS[i] for i in risk_ids if i in RISKS}


def test_every_real_file_is_listed_with_its_source():
    listed = {line.split(" | ")[0] for line in (DATA / "SOURCES").read_text().splitlines() if line.strip()}
    files = {p.name for p in DATA.iterdir() if p.is_file() and p.name != "SOURCES"}  # folders: one framework each,
    # with their own SOURCES (tests/test_explain_fresh_files.py)
    assert listed == files == set(EXPECTED)
    assert len(files) >= 30
    frameworks = [name.split("_")[0] for name in files]
    assert all(frameworks.count(f) >= 5 for f in ("trl", "openr1", "unsloth", "verl", "openrlhf"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_file_verdict(name, tmp_path, capsys):
    version, source, token, sequence, beta, risks = EXPECTED[name]
    out = tmp_path / "report.json"
    argv = [str(DATA / name), "--json", str(out)] + (["--version", version] if version else [])
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert "versions" not in report, report.get("versions")  # one answer: the release is known or does not matter
    assert report["source"] == source
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    assert report["controller"] == beta
    assert _kinds(report["risk_ids"]) == risks, report["risk_ids"]
    assert len(_kinds(report["risk_ids"])) == len(report["risk_ids"])  # no risk line outside the known kinds
