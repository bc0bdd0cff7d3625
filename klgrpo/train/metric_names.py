"""Every metric name the trainer logs, as a constant, and ``GLOSSARY``: each name's formula in one line.

Code that writes or reads a metric uses these constants; docs/metrics.md is the same list for users
(tests/test_metric_names.py checks both directions: every logged name is documented, every documented name is
logged or known here). Names with <...> are patterns: ``reward_function(name)``, ``eval_set(name)`` and
``custom(name)`` build them.
"""

from __future__ import annotations

LOSS = "train/loss"
POLICY_LOSS = "train/policy_loss"
KL_PENALTY = "train/kl_penalty"
REWARD = "train/reward"
REWARD_STD = "train/reward_std"
ADVANTAGE_ABS = "train/advantage_abs"
REPLAY_PENALTY = "train/replay_penalty"
RAW_KL = "adaptive_kl/raw_kl"
ADAPTED_KL = "adaptive_kl/adapted_kl"
BETA = "adaptive_kl/current_beta"
KL_K1 = "kl/k1"
KL_K2 = "kl/k2"
KL_K3 = "kl/k3"
KL_MAX = "kl/max"
KL_MIN = "kl/min"
LOGP_POLICY_MEAN = "logp/policy_mean"
LOGP_REFERENCE_MEAN = "logp/reference_mean"
KL_CLAMP_FRAC = "kl/clamp_frac"
KL_SHAPING_CLIP_FRAC = "kl/shaping_clip_frac"
KL_SEQUENCE_SUM = "kl/sequence_sum"
KL_LOG_RATIO_P50 = "kl/log_ratio_p50"
KL_LOG_RATIO_P90 = "kl/log_ratio_p90"
KL_LOG_RATIO_P99 = "kl/log_ratio_p99"
KL_K3_P50 = "kl/k3_p50"
KL_K3_P90 = "kl/k3_p90"
KL_K3_P99 = "kl/k3_p99"
KL_LOSS_SHARE = "kl/loss_share"
REPLAY_SHARE = "train/replay_share"
KL_REPLAY = "kl/replay"
MEAN_LENGTH = "completions/mean_length"
MAX_LENGTH = "completions/max_length"
TRUNCATED_RATIO = "completions/clipped_ratio"
CLIP_RATIO = "clip_ratio"
CLIP_RATIO_LOW = "clip_ratio/low"
CLIP_RATIO_HIGH = "clip_ratio/high"
ENTROPY = "entropy"
ENTROPY_P10 = "entropy/p10"
ENTROPY_P50 = "entropy/p50"
ENTROPY_MIN = "entropy/min"
ENTROPY_COEF = "entropy/coef"
ENTROPY_BONUS = "entropy/bonus"
OFF_POLICY_MASKED = "off_policy/masked_frac"
OFF_POLICY_KL = "off_policy/kl"
SAMPLER_LOGP_DIFF_MEAN = "sampler/logp_diff_mean"
SAMPLER_LOGP_DIFF_P99 = "sampler/logp_diff_p99"
SAMPLER_LOGP_DIFF_MAX = "sampler/logp_diff_max"
SAMPLER_KL = "sampler/kl"
SAMPLER_LOGP_DIFF_SIGNED = "sampler/logp_diff_signed"
SAMPLER_KEPT_MASS = "sampler/kept_mass"
SAMPLER_KEPT_MASS_P10 = "sampler/kept_mass_p10"
SAMPLER_KEPT_MASS_MIN = "sampler/kept_mass_min"
SAMPLER_KEPT_SET_MISMATCH = "sampler/kept_set_mismatch"
SAMPLER_KL_K1 = "sampler/kl_k1"
SAMPLER_KL_K3 = "sampler/kl_k3"
SAMPLER_CHI2_TOKEN = "sampler/chi2_token"
SAMPLER_CHI2_SEQ = "sampler/chi2_seq"
SAMPLER_ESS = "sampler/ess"
SAMPLER_PPL_RATIO = "sampler/ppl_ratio"
SAMPLER_RATIO_P01 = "sampler/ratio_p01"
SAMPLER_RATIO_P50 = "sampler/ratio_p50"
SAMPLER_RATIO_P99 = "sampler/ratio_p99"
SAMPLER_RATIO_MAX = "sampler/ratio_max"
SAMPLER_MASKED_TOKEN_FRAC = "sampler/masked_token_frac"
SAMPLER_MASKED_SEQ_FRAC = "sampler/masked_seq_frac"
#: The panel's metrics split by completion-length quartile (q1 the shortest quarter of the step's completions).
SAMPLER_BY_LENGTH = ("kl_k3", "chi2_token", "ess", "masked_token_frac")


def sampler_quartile(quartile: int, name: str) -> str:
    """``sampler/q<quartile>/<name>``: ``name`` (SAMPLER_BY_LENGTH) over the completions of that length quartile."""
    return f"sampler/q{quartile}/{name}"


SAMPLER_QUARTILE_NAMES = tuple(sampler_quartile(q, n) for q in range(1, 5) for n in SAMPLER_BY_LENGTH)
#: rollout.max_staleness > 0: how many optimizer updates old the weights that drew the step's batch were
ROLLOUT_STALENESS_MEAN = "rollout/staleness_mean"
ROLLOUT_STALENESS_MAX = "rollout/staleness_max"
GRAD_NORM = "grad_norm"
LR = "lr"
SKIPPED_STEPS = "train/skipped_steps"
TIME_GENERATE = "time/generate"
TIME_REWARD = "time/reward"
TIME_REWARD_MODEL = "time/reward_model"
TIME_REFERENCE = "time/reference"
TIME_REPLAY = "time/replay"
TIME_UPDATE = "time/update"
TIME_STEP = "time/step"

REWARD_PREFIX, EVAL_PREFIX, CUSTOM_PREFIX = "rewards/", "eval/", "custom/"
REWARD_FUNCTION = REWARD_PREFIX + "<function>"
REWARD_TIMEOUTS_PREFIX = "reward_timeouts/"
REWARD_TIMEOUTS = REWARD_TIMEOUTS_PREFIX + "<function>"
EVAL_SET = EVAL_PREFIX + "<name>"
EVAL_ENTROPY = EVAL_SET + "/entropy"
CUSTOM = CUSTOM_PREFIX + "<name>"


def reward_function(name: str) -> str:
    """The metric of one reward function: rewards/<function>."""
    return REWARD_PREFIX + name


def reward_metric(column: str) -> str:
    """The metric of a reward column: rewards/<function>, or reward_timeouts/<function> for the column of the
    rows whose check ran out of time ("<function>#timed_out", see core/rewards)."""
    base, _, flag = column.partition("#")
    return REWARD_TIMEOUTS_PREFIX + base if flag == "timed_out" else REWARD_PREFIX + column


def eval_set(name: str) -> str:
    """The metric of one evaluation set: eval/<name>."""
    return EVAL_PREFIX + name


def eval_entropy(name: str) -> str:
    """The mean per-token entropy of one evaluation set's greedy completions: eval/<name>/entropy."""
    return EVAL_ENTROPY.replace("<name>", name)


def is_eval_accuracy(key: str) -> bool:
    """Whether ``key`` is an evaluation set's accuracy (eval/<name>), not another eval/ metric."""
    return key.startswith(EVAL_PREFIX) and not key.endswith(EVAL_ENTROPY.removeprefix(EVAL_SET))


def custom(name: str) -> str:
    """A metric a custom loss returns: custom/<name>."""
    return CUSTOM_PREFIX + name


#: The per-token KL percentiles logged each step (p50 / p90 / p99 of l and of k3 over the loss-mask tokens).
PERCENTILES = (0.5, 0.9, 0.99)
PERCENTILE_NAMES = (KL_LOG_RATIO_P50, KL_LOG_RATIO_P90, KL_LOG_RATIO_P99, KL_K3_P50, KL_K3_P90, KL_K3_P99)
#: The entropy's spread logged each step: its minimum, 10th percentile and median over the completion tokens.
ENTROPY_QUANTILES = (0.0, 0.1, 0.5)
ENTROPY_QUANTILE_NAMES = (ENTROPY_MIN, ENTROPY_P10, ENTROPY_P50)

#: Every metric name the trainer logs -> its formula or meaning, in one line. "Per token" means over the
#: step's completion tokens (the completion mask, EOS included), pooled over all B*G completions.
#: l = log pi(y_t) - log pi_ref(y_t) is the per-token log-ratio of the sampled token (docs/kl_math.md).
#: Names with <...> are patterns: one metric per reward function or evaluation set.
GLOSSARY: dict[str, str] = {
    # train
    LOSS: "the GRPO loss of the step: policy loss + beta * KL loss term, aggregated per loss.aggregation "
          "with the global normaliser (summed over micro-batches it equals the full-batch loss); the replay "
          "anchor's term is logged apart as train/replay_penalty",
    POLICY_LOSS: "clipped surrogate -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), "
                 "rho_t = pi(y_t) / pi_old(y_t), aggregated as the loss",
    KL_PENALTY: "beta times the KL that entered the objective: the shaped, importance-corrected loss "
                "term aggregated as the loss, plus (KL in the reward) beta * mean over completions of "
                "the summed per-token KL",
    REWARD: "mean over the step's B*G completions of the total reward (weighted sum of the reward functions)",
    REWARD_STD: "mean over the B prompts of the std of the G total rewards within each group "
                "(ddof as the advantages); 0 means no group had a learning signal",
    REWARD_FUNCTION: "mean over the step's completions of one reward function's unweighted value",
    REWARD_TIMEOUTS: "share of the step's completions a time-bounded reward function (math_verify) did not "
                     "check in time (its per-completion limit or the step's budget): scored 0",
    ADVANTAGE_ABS: "mean over completions of |A_i|, the group-normalised advantage "
                   "(before any KL-in-reward term)",
    CUSTOM: "one per metric a custom loss (loss.function) returns: its values averaged over the step's "
            "micro-batches and processes",
    REPLAY_PENALTY: "replay coefficient times the replay KL term that entered the loss "
                    "(KL to the reference on replay prompts, the retention guard); absent when off",
    # adaptive_kl
    RAW_KL: "mean per token of the configured estimator's KL value, before shaping",
    ADAPTED_KL: "mean per token of the KL value after shaping (none/clip/sigmoid/length_normalized)",
    BETA: "the beta that multiplied the KL in this step; the controller updates it "
          "after the step, so the next row shows the new value",
    # kl diagnostics
    KL_K1: "mean per token of k1 = l (unbiased for KL(pi||ref), either sign)",
    KL_K2: "mean per token of k2 = l^2 / 2 (biased, >= 0), on the same tokens as kl/k1",
    KL_K3: "mean per token of k3 = exp(-l) + l - 1 (unbiased, >= 0), on the same tokens as kl/k1",
    KL_MAX: "max over the step's completion tokens of k3, with |l| clamped at the k3 guard (default 20): "
            "the spikes of the heavy-tailed estimator",
    KL_MIN: "min over the step's loss-mask tokens of the configured estimator's per-token KL value (the one "
            "adaptive_kl/raw_kl averages): negative for k1 (a token the policy makes less likely than the "
            "reference); for k2, k3, k3_st and full a negative value means a bug",
    LOGP_POLICY_MEAN: "mean per loss-mask token of log pi(y_t), the policy's log-prob of the sampled token "
                      "(at the sampling temperature, with the weights of the update)",
    LOGP_REFERENCE_MEAN: "mean per loss-mask token of log pi_ref(y_t) on the same tokens: "
                         "logp/policy_mean - logp/reference_mean = kl/k1",
    KL_CLAMP_FRAC: "fraction of completion tokens whose |l| exceeded the k3 guard (clamped; no KL gradient there)",
    KL_SHAPING_CLIP_FRAC: "fraction of completion tokens whose KL exceeded kl_clip_threshold under the clip "
                          "shaping (zero KL gradient there); 0 for other shapings",
    KL_SEQUENCE_SUM: "mean over completions of sum_t l_t (summed k1): the sequence KL estimate, "
                     "Ziegler's controller input",
    KL_LOG_RATIO_P50: "median over the step's loss-mask tokens of l (linear interpolation, as torch.quantile); "
                      "kl/log_ratio_p90 and kl/log_ratio_p99 the 90th and 99th percentiles",
    KL_LOG_RATIO_P90: "90th percentile over the step's loss-mask tokens of l",
    KL_LOG_RATIO_P99: "99th percentile over the step's loss-mask tokens of l: where a few tokens run off",
    KL_K3_P50: "median over the step's loss-mask tokens of k3 = exp(-l) + l - 1 (|l| clamped at the k3 guard)",
    KL_K3_P90: "90th percentile over the step's loss-mask tokens of k3",
    KL_K3_P99: "99th percentile over the step's loss-mask tokens of k3: with kl/max, the heavy tail of the KL",
    KL_LOSS_SHARE: "|beta * KL loss term| / (P + |beta * KL loss term|), in [0, 1], P = the per-token |policy "
                   "loss| aggregated as the loss: how much of the loss's magnitude the KL is; logged when the KL "
                   "is in the loss with beta > 0",
    REPLAY_SHARE: "|train/replay_penalty| / (|train/loss| + |train/replay_penalty|), in [0, 1] (0 when "
                  "both are 0): the anchor's share of the objective's magnitude",
    KL_REPLAY: "mean per token of the configured estimator's KL value on the replay prompts' completions",
    # completions
    MEAN_LENGTH: "mean over the step's completions of the completion length in tokens (EOS included)",
    MAX_LENGTH: "longest completion of the step, in tokens",
    TRUNCATED_RATIO: "fraction of completions cut at max_new_tokens without an EOS",
    # clipping
    CLIP_RATIO: "fraction of completion tokens where the PPO clip was active: clip_ratio/low + clip_ratio/high",
    CLIP_RATIO_LOW: "fraction of completion tokens with A < 0 and rho_t < 1 - eps_low",
    CLIP_RATIO_HIGH: "fraction of completion tokens with A > 0 and rho_t > 1 + eps_high",
    # optimisation
    ENTROPY: "mean per token of the policy's next-token entropy -sum_v pi(v) log pi(v) (nats, at the "
             "sampling temperature)",
    ENTROPY_P10: "10th percentile over the step's completion tokens of the per-token entropy (linear "
                 "interpolation, as torch.quantile): the low tail, where collapse starts",
    ENTROPY_P50: "median over the step's completion tokens of the per-token entropy",
    ENTROPY_MIN: "smallest per-token entropy over the step's completion tokens",
    ENTROPY_COEF: "the entropy bonus's coefficient that multiplied it in this step (loss.entropy_coef, or the "
                  "adaptive entropy controller's applied value: 0 while the entropy is above loss.entropy_target); "
                  "logged when the loss reads the entropy",
    ENTROPY_BONUS: "the entropy bonus subtracted from the loss: coefficient times the mean per-token entropy over "
                   "the tokens the policy term acts on, summed over the step's micro-batches by their share",
    OFF_POLICY_MASKED: "fraction of loss-mask tokens whose policy term the off-policy sequence mask dropped "
                       "(sequences with A < 0 and off_policy/kl above loss.off_policy_mask_threshold)",
    OFF_POLICY_KL: "mean over completions of mean_t (log pi_old(y_t) - log pi(y_t)): the off-policy mask's "
                   "per-sequence KL(pi_old || pi) estimate (0 in a batch's first update)",
    SAMPLER_LOGP_DIFF_MEAN: "mean over the step's completion tokens of |log pi_old(y_t) - log mu(y_t)|, mu the "
                            "sampler's own log-prob of the token (every sampler gives them)",
    SAMPLER_LOGP_DIFF_P99: "99th percentile of |log pi_old(y_t) - log mu(y_t)| over the step's completion tokens",
    SAMPLER_LOGP_DIFF_MAX: "largest |log pi_old(y_t) - log mu(y_t)| over the step's completion tokens",
    SAMPLER_KL: "mean per completion token of r - 1 - log r, r = pi_old(y_t) / mu(y_t): an estimate of "
                "KL(mu || pi_old) from the sampler's samples (second order in a lost mass: it reads small where a "
                "filter's truncation, ignored, biases the logged KL by far more)",
    SAMPLER_LOGP_DIFF_SIGNED: "mean over the step's completion tokens of log pi_old(y_t) - log mu(y_t): negative "
                              "where the trainer scores the whole vocabulary while the sampler truncated (the mean "
                              "log kept mass), about 0 when both score the same distribution",
    SAMPLER_KEPT_MASS: "mean over the step's completion tokens of pi_old(S_t), the probability the rollout's "
                       "filters (top-k, top-p, min-p) kept at that position; logged under truncated sampling",
    SAMPLER_KEPT_MASS_P10: "10th percentile of pi_old(S_t) over the step's completion tokens",
    SAMPLER_KEPT_MASS_MIN: "smallest pi_old(S_t) over the step's completion tokens",
    SAMPLER_KEPT_SET_MISMATCH: "fraction of the step's completion tokens whose kept set the trainer rebuilt "
                               "differently from the sampler's (another size under the filters on the trainer's "
                               "logits, or the sampled token ranked outside it: near ties, another kernel)",
    SAMPLER_KL_K1: "mean per completion token of log mu(y_t) - log pi_old(y_t): the k1 estimate of KL(mu || "
                   "pi_old) from the sampler's samples (unbiased, either sign per token)",
    SAMPLER_KL_K3: "mean per completion token of r - 1 - log r, r = pi_old(y_t) / mu(y_t): the k3 estimate of "
                   "KL(mu || pi_old), the same value as sampler/kl",
    SAMPLER_CHI2_TOKEN: "mean per completion token of (r - 1)^2: the chi-square divergence chi2(pi_old || mu) "
                        "per position, the variance of a token importance weight (0 with a matched sampler)",
    SAMPLER_CHI2_SEQ: "mean over completions of (R - 1)^2, R = prod_t r_t (log R bounded at 20): the variance of "
                      "a sequence importance weight",
    SAMPLER_ESS: "(sum R)^2 / (N sum R^2) over the step's N completions: the normalised effective sample size of "
                 "the sequence weights, 1 with a matched sampler, near 1/N when one sequence holds all the weight",
    SAMPLER_PPL_RATIO: "mean over completions of exp(mean_t (log mu(y_t) - log pi_old(y_t))): the trainer's "
                       "perplexity over the sampler's per completion (1 when matched, above 1 when the trainer "
                       "finds the samples less likely)",
    SAMPLER_RATIO_P01: "1st percentile of the raw token ratio r over the completion tokens, before any correction",
    SAMPLER_RATIO_P50: "median of the raw token ratio r over the completion tokens",
    SAMPLER_RATIO_P99: "99th percentile of the raw token ratio r over the completion tokens",
    SAMPLER_RATIO_MAX: "largest raw token ratio r over the completion tokens (log r bounded at 20)",
    SAMPLER_MASKED_TOKEN_FRAC: "fraction of the completion tokens whose weight rollout.sampler_correction "
                               "truncated or masked, or that a rollout.divergence_mask rejected (0 with both off)",
    SAMPLER_MASKED_SEQ_FRAC: "fraction of the completions with a token (token modes) or a weight (sequence modes) "
                             "that rollout.sampler_correction truncated or masked, or a rollout.divergence_mask "
                             "rejected",
    **{sampler_quartile(q, n): f"sampler/{n} over the completions of completion-length quartile {q} of 4 (q1 the "
                               f"shortest quarter of the step's completions, ranked by length over every process; "
                               f"logged with 4 or more completions)"
       for q in range(1, 5) for n in SAMPLER_BY_LENGTH},
    ROLLOUT_STALENESS_MEAN: "with rollout.max_staleness > 0, the mean over the step's completions of how many "
                            "optimizer updates old the weights that drew them were (min(step - 1, K) under the "
                            "fixed lag: each batch comes from one version)",
    ROLLOUT_STALENESS_MAX: "with rollout.max_staleness > 0, the largest staleness among the step's completions "
                           "(never above rollout.max_staleness: an older batch is refused)",
    GRAD_NORM: "global L2 norm of the gradient over the trainable parameters, before clipping",
    LR: "learning rate of this optimizer step",
    SKIPPED_STEPS: "steps skipped so far because the loss or the gradient norm was NaN or infinite (the "
                   "optimizer, scheduler and KL controller did not move on them); the run stops after "
                   "train.max_skipped_steps in a row",
    # timing
    TIME_GENERATE: "wall seconds spent sampling the step's completions (with rollout.max_staleness > 0: waiting "
                   "for the generation process, the part of its time the update did not hide)",
    TIME_REWARD: "wall seconds spent in the reward functions (the reward models' time is time/reward_model)",
    TIME_REWARD_MODEL: "wall seconds the reward models spent scoring the step's completions (logged when "
                       "rewards.functions has a reward model)",
    TIME_REFERENCE: "wall seconds spent computing the reference log-probs",
    TIME_REPLAY: "wall seconds of the replay anchor's forward/backward",
    TIME_UPDATE: "wall seconds of the policy forward/backward passes and optimizer step(s)",
    TIME_STEP: "wall seconds of the whole step, from sampling to logging",
    # eval
    EVAL_SET: "greedy accuracy (fraction correct, 0..1) on the named evaluation or retention set, "
              "logged at evaluation steps only",
    EVAL_ENTROPY: "mean per token of the policy's next-token entropy (nats, at the sampling temperature, as "
                  "entropy) over the named set's greedy completions, EOS included; logged with eval/<name> "
                  "unless train.entropy_metrics is false",
}
