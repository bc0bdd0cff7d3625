"""Checks on a resolved GRPOConfig: errors name the field and the fix; warnings explain a biased KL choice."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from klgrpo.backends.samplers import LEGACY_GENERATE_CACHES, SAMPLERS
from klgrpo.backends.vllm_sampler import VLLMSampler, missing_vllm_message
from klgrpo.backends.vllm_server import VLLMServerSampler, check_server_url, check_weights_dir
from klgrpo.config.entries import eval_set_specs, reward_specs
from klgrpo.config.fields import bound_problem, leaves
from klgrpo.config.trackers import active_trackers as trackers_of
from klgrpo.config.trackers import check_report_to
from klgrpo.errors import ConfigError
from klgrpo.math.full_kl import FULL_KL, FULL_KL_GRADIENTS
from klgrpo.math.kl import ESTIMATORS
from klgrpo.math.kl_control import CONTROLLERS, init_keywords
from klgrpo.math.policy_loss import POLICY_LOSSES
from klgrpo.math.sampler_correction import DIVERGENCE_MASKS, DivergenceMask

#: What these checks read: a klgrpo.config.schema.GRPOConfig. Not imported: schema.py imports this module
#: (GRPOConfig.validate, when it first checks), and the import runs one way.
GRPOConfig = Any


def kl_gradient_sampling(placement: str, is_correction: str, num_iterations: int) -> str:
    """The sampling row of docs/kl_math.md that a trainer configuration realises for the KL loss term.

    With w in the graph the term is w * k even on the first (on-policy) iteration, where w = 1 in value but
    carries the score: the first_epoch rows; ``none`` is on-policy only while num_iterations == 1. KL in the
    reward is read at the rollout policy, which is the current one on the first iteration (the reward rows
    describe that; later iterations get their own warning).
    """
    if placement == "reward":
        return "on_policy"  # the PPO ratio is the importance weight of the advantage
    if is_correction == "none":
        return "on_policy" if num_iterations == 1 else "off_policy_none"
    if num_iterations == 1:
        return f"first_epoch_{is_correction}"
    return f"off_policy_{is_correction}"


def kl_gradient_target(cfg: GRPOConfig) -> str:
    """What the expected KL gradient of this configuration follows, per token (ESTIMATORS' declarations)."""
    sampling = kl_gradient_sampling(cfg.kl.placement, cfg.kl.is_correction, cfg.train.num_iterations)
    if cfg.kl.estimator == FULL_KL:
        return FULL_KL_GRADIENTS[("token", sampling)]
    return ESTIMATORS[cfg.kl.estimator].gradient_target(cfg.kl.placement, sampling, level="token")


def need(ok: bool, message: str) -> None:
    """The one form of every check across fields: refuse (ConfigError, one line: the field and the fix) unless
    ``ok``. A single field's bound is declared on the field instead (klgrpo/config/fields.py:setting)."""
    if not ok:
        raise ConfigError(message)


def validate_replay(cfg: GRPOConfig) -> None:
    """The kl.replay settings of an active anchor (kl.replay.coef > 0); the one place that checks them.
    kl.replay.estimator is refused, like every named choice, when the config is built."""
    r = cfg.kl.replay
    need(bool(r.source), "kl.replay.source is empty: name a file of replay prompts (other skills, no answers "
                         "needed), or set kl.replay.coef 0")
    need(r.num_prompts >= 1, "kl.replay.num_prompts must be >= 1")
    need(r.completions_per_prompt >= 1, "kl.replay.completions_per_prompt must be >= 1")
    need(r.batch_size >= 1, "kl.replay.batch_size must be >= 1")
    need(r.max_new_tokens >= 0, "kl.replay.max_new_tokens must be >= 0 (0: rollout.max_new_tokens)")
    need(r.temperature > 0, "kl.replay.temperature must be > 0")


def validate_full_kl(cfg: GRPOConfig) -> None:
    """kl.estimator full: the exact KL over the vocabulary, a loss term of the built-in objective only."""
    need(cfg.kl.placement == "loss", f"kl.estimator=full is the exact KL over the vocabulary and enters the loss "
                                     f"only: set kl.placement loss (not {cfg.kl.placement}), or pick a "
                                     f"per-token estimator for the reward")
    need(not cfg.loss.function, "kl.estimator=full needs the built-in objective: leave loss.function empty, or "
                                "use a per-token estimator with your own loss")


def validate_entropy(cfg: GRPOConfig) -> None:
    """The entropy bonus, its controller and the top-entropy mask."""
    loss = cfg.loss
    need(loss.entropy_coef_min <= loss.entropy_coef_max,
         f"loss.entropy_coef_min ({loss.entropy_coef_min:g}) must be <= loss.entropy_coef_max "
         f"({loss.entropy_coef_max:g})")
    uses_entropy = loss.entropy_coef != 0 or loss.entropy_controller != "fixed" or loss.top_entropy_quantile < 1
    need(not (uses_entropy and cfg.kl.estimator == "full"),
         "loss.entropy_coef, loss.entropy_controller adaptive and loss.top_entropy_quantile need the policy's "
         "entropy with its gradient, which kl.estimator full's pass does not give; use another kl.estimator")
    need(not (uses_entropy and loss.function),
         "loss.entropy_coef, loss.entropy_controller adaptive and loss.top_entropy_quantile shape the built-in "
         "objective; with loss.function set them in your own loss")


def validate_config(cfg: GRPOConfig, dataset_given: bool = False) -> list[str]:
    """Raise ConfigError (one line: the field and the fix) for a config that cannot run; return the warnings of one
    that runs with a surprising choice. ``dataset_given``: the prompts come from Python (GRPOTrainer's
    train_dataset), data.source may be empty."""
    check_finite_and_ranges(cfg)
    _check_rollout_and_update(cfg)
    _check_kl(cfg)
    validate_entropy(cfg)
    policy_params_problems(cfg.loss)
    k = cfg.kl
    need(not (cfg.model.lora.r > 0 and k.reference and k.sync_every),
         "kl.sync_every with LoRA needs the adapter-disabled reference: leave kl.reference empty (a separate "
         "reference checkpoint cannot be synced from adapter weights)")
    need(cfg.model.fast_path or cfg.model.forward != "fast",
         "model.forward fast with model.fast_path false: fast_path false means transformers' forward everywhere; "
         "set model.forward auto (or transformers), or model.fast_path true")
    need(not (cfg.model.gguf_file and not cfg.model.name_or_path),
         "model.gguf_file needs model.name_or_path: the folder that holds the GGUF file")
    if cfg.model.name_or_path and not dataset_given:
        need(bool(cfg.data.source), "data.source is empty: name a prompt file or dataset (or leave "
                                    "model.name_or_path empty to run the embedded demo)")
    need(len(cfg.rewards.functions) > 0, "rewards.functions is empty: name at least one reward function")
    if k.replay.coef > 0:
        validate_replay(cfg)
    eval_set_specs(cfg.eval.sets)
    check_sampler_installed(cfg.rollout)
    return _warnings(cfg)


def check_sampler_installed(rollout) -> None:
    """rollout.sampler vllm needs the vllm package in this environment: refused before any model loads (and by
    ``klgrpo train --print-config``), not at the first rollout. Checked after the config's own rules, so a config
    that breaks one of them is told that first. ``auto`` never needs it (it takes vLLM only where installed)."""
    if rollout.sampler == VLLMSampler.name and (missing := missing_vllm_message()):
        raise ConfigError(missing)


def _check_rollout_and_update(cfg: GRPOConfig) -> None:
    r, t, loss = cfg.rollout, cfg.train, cfg.loss
    batch = r.prompts_per_step * r.group_size
    if t.micro_batch_size:
        need(t.micro_batch_size > 0 and batch % t.micro_batch_size == 0,
             f"train.micro_batch_size={t.micro_batch_size} must divide the batch of "
             f"rollout.prompts_per_step x rollout.group_size = {batch} sequences")
    need(loss.std_ddof in (0, 1), "loss.std_ddof must be 0 (population std) or 1 (sample std)")
    need(loss.delta == 0 or loss.delta > 1, "loss.delta must be > 1 (TRL recommends > 1 + eps_high), or 0 for off")
    need(loss.dual_clip == 0 or loss.dual_clip > 1, "loss.dual_clip must be > 1 (verl uses 3), or 0 for off")
    need(loss.policy_loss == "ppo_clip" or not (loss.delta or loss.dual_clip),
         f"loss.delta and loss.dual_clip guard PPO's clip only: set them to 0 with "
         f"loss.policy_loss={loss.policy_loss}, or use loss.policy_loss ppo_clip")

    _check_sampler_correction(r, loss, cfg.kl)
    _check_old_logprobs(r, cfg.model.dtype)
    _check_staleness(r, t)
    if r.sampler == VLLMServerSampler.name:
        check_vllm_server(r.vllm)


def check_vllm_server(v) -> None:
    """rollout.sampler vllm_server's settings (rollout.vllm): the server's address and the folder the weights are
    written to for it, before any model loads."""
    check_server_url(v.server_url)
    if v.weights_dir and v.weight_transfer == "folder":
        check_weights_dir(v.weights_dir)


def divergence_masks(rollout) -> tuple[DivergenceMask, ...]:
    """rollout.divergence_mask's masks with rollout.divergence_threshold's bounds; a ConfigError naming the field
    and the entry for anything that is not one."""
    names = [n.strip() for n in rollout.divergence_mask.split(",") if n.strip()]
    if not names:
        need(not rollout.divergence_threshold.strip(),
             "rollout.divergence_threshold is set but rollout.divergence_mask is empty: name the masks it bounds "
             "(e.g. --rollout.divergence_mask seq_mean_k3)")
        return ()
    for name in names:  # an unknown name is named first: a threshold for it cannot be right either
        need(name in DIVERGENCE_MASKS, f"rollout.divergence_mask: unknown mask {_short(name)}; choose from "
                                       f"{', '.join(DIVERGENCE_MASKS)}")
    twice = sorted({name for name in names if names.count(name) > 1})
    need(not twice, f"rollout.divergence_mask names {', '.join(twice)} twice: name each mask once")
    entries = [t.strip() for t in rollout.divergence_threshold.split(",")]
    need(rollout.divergence_threshold.strip() != "" and len(entries) in (1, len(names)),
         f"rollout.divergence_threshold {_short(rollout.divergence_threshold)} must give one bound, or one per "
         f"mask of rollout.divergence_mask ({len(names)}: {', '.join(names)})")
    bounds = entries * len(names) if len(entries) == 1 else entries
    return tuple(_divergence_mask(name, entry) for name, entry in zip(names, bounds))


def _short(text: str, limit: int = 60) -> str:
    """``text`` quoted for a one-line message, cut to ``limit`` characters (a pasted blob is not echoed whole)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _divergence_mask(name: str, entry: str) -> DivergenceMask:
    ratio = name.endswith("k1")
    low_text, sep, high_text = entry.partition("_")
    need(ratio == bool(sep), f"rollout.divergence_threshold {_short(entry)} for {name}: "
                             + ("give the ratio bounds as LOW_HIGH, e.g. 0.5_2.0" if ratio
                                else "give one upper bound, e.g. 0.01 (LOW_HIGH is for the k1 masks)"))
    low, high = (_bound(low_text, name), _bound(high_text, name)) if ratio else (None, _bound(entry, name))
    need(low is not None or high is not None, f"rollout.divergence_threshold for {name} gives no bound")
    need(not ratio or low is None or high is None or low < high,
         f"rollout.divergence_threshold {entry!r} for {name}: LOW must be below HIGH")
    return DivergenceMask(name, low, high)


def _bound(text: str, name: str) -> float | None:
    if not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    need(math.isfinite(value) and value > 0,
         f"rollout.divergence_threshold: {_short(text)} for {name} is not a positive number")
    return value


#: the largest train.steps: torch counts steps in 64-bit integers
MAX_STEPS = 2**63 - 1
#: the samplers a generation process of its own can run (rollout.max_staleness > 0)
PIPELINED_SAMPLERS = ("auto", "kv_loop", "generate", "vllm_server")


def _check_staleness(r, t) -> None:
    """rollout.max_staleness > 0: one generated batch per update, on a sampler the generation process runs."""
    if r.max_staleness == 0:
        need(r.generation_threads == 0, "rollout.generation_threads is set but rollout.max_staleness is 0: set "
                                        "rollout.max_staleness (e.g. 1) to generate while training, or leave "
                                        "rollout.generation_threads at 0")
        return
    need(t.num_iterations == 1,
         f"rollout.max_staleness {r.max_staleness} with train.num_iterations {t.num_iterations}: generating ahead "
         f"draws one batch per update; set train.num_iterations 1 or rollout.max_staleness 0")
    need(r.sampler in PIPELINED_SAMPLERS,
         f"rollout.max_staleness {r.max_staleness}: rollout.sampler {r.sampler} does not draw ahead; use "
         f"rollout.sampler kv_loop, generate or vllm_server, or rollout.max_staleness 0")


def _check_old_logprobs(r, dtype: str) -> None:
    """rollout.old_logprobs sampler needs a sampler whose log-probs are the trainer's to float rounding, in
    float32, over the distribution the trainer scores; what the sampler correction would correct is then nothing."""
    if r.old_logprobs != "sampler":
        return
    exact = [name for name in SAMPLERS if SAMPLERS[name].scores_as_trainer]
    need(r.sampler == "auto" or r.sampler not in SAMPLERS or SAMPLERS[r.sampler].scores_as_trainer,
         f"rollout.old_logprobs sampler takes the sampler's log-probs as pi_old, which only {', '.join(exact)} give "
         f"to float rounding; rollout.sampler {r.sampler} computes them with other kernels: set rollout.old_logprobs "
         f"trainer (rollout.sampler_correction weighs the mismatch)")
    need(dtype in ("auto", "float32"),
         f"rollout.old_logprobs sampler needs model.dtype float32 (the sampler's {dtype} log-probs are not the "
         f"trainer's forward's to float rounding): set model.dtype float32 or rollout.old_logprobs trainer")
    need(r.sampler_correction == "none" and not divergence_masks(r),
         "rollout.old_logprobs sampler makes the sampler's log-probs pi_old, so rollout.sampler_correction and "
         "rollout.divergence_mask would compare them with themselves: turn those off, or set rollout.old_logprobs "
         "trainer")
    filtered = r.top_p < 1.0 or r.top_k > 0 or r.min_p > 0.0
    need(not (filtered and r.truncation == "ignore"),
         "rollout.old_logprobs sampler with rollout.truncation ignore: the sampler's log-probs are the truncated "
         "distribution's while the trainer scores the whole softmax; set rollout.truncation policy")


def _check_sampler_correction(r, loss, kl) -> None:
    if divergence_masks(r):
        need(not loss.function, "rollout.divergence_mask masks the built-in objective; with loss.function apply "
                                 "the mask in your own loss, or leave rollout.divergence_mask empty")
    filtered = r.top_p < 1.0 or r.top_k > 0 or r.min_p > 0.0
    need(not (filtered and r.truncation == "ignore" and r.sampler_correction != "none"),
         f"rollout.sampler_correction {r.sampler_correction} with rollout.truncation ignore: no importance weight "
         "repairs a truncation (a token outside the kept set is never sampled, so the weight only scales the loss "
         "down by the kept mass); set rollout.truncation policy")
    if r.sampler_correction == "none":
        return
    low, high = r.sampler_correction_min, r.sampler_correction_max
    need(not (r.sampler_correction.endswith("truncate") and not low and not high),
          f"rollout.sampler_correction {r.sampler_correction} needs a bound: set rollout.sampler_correction_max "
          "(TRL's default 3.0) or rollout.sampler_correction_min")
    need(not (low and high and low >= high), f"rollout.sampler_correction_min ({low}) must be below "
                                              f"rollout.sampler_correction_max ({high})")
    need(not loss.function, "rollout.sampler_correction weights the built-in objective; with loss.function apply "
                             "the weight in your own loss, or set rollout.sampler_correction none")
    need(loss.policy_loss != "vespo", "rollout.sampler_correction with loss.policy_loss vespo: VESPO weighs whole "
                                       "sequences itself; set rollout.sampler_correction none (or another policy "
                                       "loss)")


def _check_kl(cfg: GRPOConfig) -> None:
    k = cfg.kl
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    need(k.coef >= 0, "kl.coef must be >= 0")
    if k.estimator == FULL_KL:
        validate_full_kl(cfg)
    need(k.log_ratio_clamp > 0 or k.estimator == FULL_KL or not ESTIMATORS[k.estimator].uses_clamp,
         f"kl.log_ratio_clamp=0 lets kl.estimator={k.estimator}'s exp(-l) overflow to inf: set kl.log_ratio_clamp "
         f"to a positive value (default 20)")
    if k.controller in CONTROLLERS and "target" in init_keywords(CONTROLLERS[k.controller]):  # steers to a target
        need(k.target > 0, f"kl.target must be > 0 for kl.controller={k.controller}")
        need(k.coef > 0, f"kl.controller={k.controller} multiplies beta, so kl.coef=0 would stay 0: set kl.coef > 0 "
                         f"as its starting value, or for no KL penalty use kl.controller fixed "
                         f"(--kl.controller fixed --kl.coef 0)")
    if k.controller == "adaptive" and k.horizon != "auto":  # auto is sized above the bound (auto_horizon)
        # Ziegler's factor 1 + e * n / horizon with |e| <= 0.2 stays positive only if horizon > 0.2 * n.
        need(k.horizon > 0.2 * batch, f"kl.horizon={k.horizon:g} must exceed 0.2 x the batch of {batch} sequences "
                                      f"(Ziegler et al. use ~10000), or beta could reach 0 in one update")
    need(k.horizon != "auto" or cfg.train.steps > 0, "kl.horizon auto is sized from train.steps: set train.steps > 0 "
                                                      "or give kl.horizon a number")
    _check_runaway(cfg)


def _check_runaway(cfg: GRPOConfig) -> None:
    """kl.on_runaway stop and rollback need a KL to watch, and a rollback something to change."""
    k = cfg.kl
    if k.on_runaway == "warn":
        return
    need(k.coef > 0 or k.monitor, f"kl.on_runaway {k.on_runaway} watches the KL, which kl.coef 0 with kl.monitor "
                                  f"false does not compute: set kl.monitor true or kl.on_runaway warn")
    need(k.on_runaway != "rollback" or k.runaway_beta_factor != 1 or k.runaway_lr_factor != 1,
         "kl.on_runaway rollback with kl.runaway_beta_factor 1 and kl.runaway_lr_factor 1 would repeat the same "
         "steps: set kl.runaway_beta_factor > 1 or kl.runaway_lr_factor < 1")


def _reverse_kl_fix(estimator: str, placement: str) -> str:
    """The advice of the reverse-KL warning, starting from the estimator the user already chose."""
    if estimator in ("k3_st", "k2") and placement == "loss":
        return (f"kl.is_correction=detached with kl.estimator={estimator} (a straight-through estimator already "
                f"carries the reverse-KL gradient; the weight in the graph adds to it)")
    return ("kl.estimator=k3_st or k2 in the loss (kl.placement=loss, kl.is_correction=detached), kl.estimator=k3 with "
            "kl.is_correction=in_graph (TRL's default, use_bias_correction_kl=True), or k1 with kl.placement=reward")


def _warnings(cfg: GRPOConfig) -> list[str]:
    """The surprising but runnable choices: a deprecated field, a KL gradient that is not the reverse KL's, the
    reward KL reused across updates, a one-sided clip."""
    r, k, t = cfg.rollout, cfg.kl, cfg.train
    warnings: list[str] = []
    if r.generate_cache:
        warnings.append(f"rollout.generate_cache is deprecated: use rollout.sampler "
                        f"{LEGACY_GENERATE_CACHES[r.generate_cache]} (it means the same)")
    if k.coef > 0 or k.controller != "fixed":
        target = kl_gradient_target(cfg)
        if target != "reverse":
            warnings.append(
                f"kl.estimator={k.estimator} with kl.placement={k.placement} and kl.is_correction={k.is_correction}"
                f" (num_iterations={t.num_iterations}) has an expected gradient that follows "
                f"{'the FORWARD KL(ref||pi)' if target == 'forward' else target!r}, not the reverse KL(pi||ref) "
                f"(see `klgrpo verify-kl`); for the reverse KL use {_reverse_kl_fix(k.estimator, k.placement)}")
    if (k.coef > 0 or k.controller != "fixed") and k.placement in ("reward", "both") and t.num_iterations > 1:
        warnings.append(
            f"kl.placement={k.placement} with train.num_iterations={t.num_iterations}: the reward KL is the "
            f"estimator's value at the ROLLOUT policy, fixed for all {t.num_iterations} updates of a batch; from the "
            f"second update on the policy has moved, so the reward penalty's gradient is no longer that of "
            f"KL(pi||ref) (for k1 it is off by grad KL(pi||pi_old)), and kl metrics of later updates still read "
            f"the rollout's KL in the reward; use num_iterations=1 or kl.placement=loss for the exact gradient")
    if k.shaping == "clip" and k.estimator in ("k1", "k1_st"):
        warnings.append("kl.shaping=clip on a signed estimator clips only from above; negative k1 values pass")
    if r.max_staleness > 0 and (k.coef > 0 or k.controller != "fixed") and r.sampler_correction == "none" and \
            r.old_logprobs != "sampler":
        warnings.append(
            f"rollout.max_staleness {r.max_staleness} with rollout.sampler_correction none: the batches are the "
            f"policy's of up to {r.max_staleness} update(s) back, and nothing weights the KL term for it, so its "
            "gradient follows neither KL (`klgrpo verify-kl`, Stale samples); set rollout.sampler_correction "
            "sequence_mask (exact while its bounds do not bind) or token_mask")
    if r.truncation == "ignore" and (r.top_p < 1.0 or r.top_k > 0 or r.min_p > 0.0):
        warnings.append(
            f"rollout.truncation ignore with top_p={r.top_p}, top_k={r.top_k}, min_p={r.min_p}: the sampler draws "
            "from the truncated distribution while the trainer scores the whole softmax, so the policy ratio "
            "carries the kept mass and the logged KL and its gradient estimate neither the policy's KL nor the "
            "sampled one's (docs/algorithm.md, Truncated sampling); use rollout.truncation policy")
    return warnings


def active_trackers(cfg: GRPOConfig) -> list:
    """logging.report_to, without tensorboard when logging.tensorboard is false."""
    names = cfg.logging.report_to
    return trackers_of(names, cfg.logging.tensorboard) if isinstance(names, list) else names


def check_finite_and_ranges(cfg: GRPOConfig) -> None:
    """No NaN anywhere, no infinity where the field does not declare it (infinite_ok), the bounds declared on the
    fields (setting's low and high), and the typed entries of rewards.functions."""
    for path, value, spec in leaves(cfg):
        if isinstance(value, float) and not isinstance(value, bool):
            need(not math.isnan(value), f"{path} is NaN; give it a number")
            need(math.isfinite(value) or spec.metadata.get("infinite_ok", False),
                 f"{path} is {value}; give it a finite number")
    for path, value, spec in leaves(cfg):  # after the NaN check: a NaN fails every bound, say NaN first
        problem = bound_problem(path, spec, value)
        need(problem is None, problem)
    need(not (cfg.train.sharded_checkpoints and cfg.model.lora.r > 0),
         "train.sharded_checkpoints with LoRA: the adapter is small and saved whole; set train.sharded_checkpoints: "
         "false")
    seed = cfg.train.seed
    need(isinstance(seed, int) and 0 <= seed <= 2**32 - 1,
         f"train.seed must be an integer in [0, 4294967295] (numpy's seed range), got {seed!r}")
    # a step count is a 64-bit integer to torch (the scheduler's, the checkpoint's tensors): a larger one is a typo
    need(cfg.train.steps <= MAX_STEPS, f"train.steps must be at most {MAX_STEPS} (a 64-bit count), got "
                                       f"{cfg.train.steps}: give the number of optimizer steps to run")
    k = cfg.kl
    check_report_to(active_trackers(cfg))
    need(not (k.warn_above > 0 and k.warn_below >= k.warn_above),
         f"kl.warn_below ({k.warn_below:g}) must be below kl.warn_above ({k.warn_above:g}); "
         "set either to 0 to turn it off")
    need(k.beta_min <= k.beta_max, "kl.beta_min must be <= kl.beta_max")
    reward_specs(cfg.rewards.functions)


def policy_params_problems(loss) -> None:
    """loss.policy_params names only settings the chosen policy loss declared (POLICY_LOSSES' params), none that
    has a field of its own (loss.sapo_*, loss.vespo_*), each a number within its declared bounds."""
    declared = POLICY_LOSSES.params(loss.policy_loss)
    names = [f.name for f in dataclasses.fields(declared)] if declared is not None else []
    for key, value in loss.policy_params.items():
        need(key in names, f"loss.policy_params.{key}: loss.policy_loss {loss.policy_loss} has "
                           + (f"the settings {', '.join(names)}" if names else "no settings of its own"))
        own_field = f"{loss.policy_loss}_{key}"
        need(not hasattr(loss, own_field), f"loss.policy_params.{key}: set loss.{own_field} instead")
        need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
             f"loss.policy_params.{key} must be a finite number, got {value!r}")
    for spec in dataclasses.fields(declared) if declared is not None else ():
        path = f"loss.{loss.policy_loss}_{spec.name}"
        if not hasattr(loss, f"{loss.policy_loss}_{spec.name}"):
            path = f"loss.policy_params.{spec.name}"
        problem = bound_problem(path, spec, policy_settings(loss)[spec.name])
        need(problem is None, problem)


def policy_settings(loss) -> dict[str, Any]:
    """The chosen policy loss's own settings by name: its ``loss.<name>_<setting>`` field where the config has
    one, else loss.policy_params, else the declared default ({} for a loss without settings)."""
    declared = POLICY_LOSSES.params(loss.policy_loss)
    if declared is None:
        return {}
    settings = {}
    for spec in dataclasses.fields(declared):
        own_field = f"{loss.policy_loss}_{spec.name}"
        settings[spec.name] = getattr(loss, own_field, loss.policy_params.get(spec.name, spec.default))
    return settings
