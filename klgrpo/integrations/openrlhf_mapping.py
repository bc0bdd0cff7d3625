"""OpenRLHF's PPO/GRPO command line in klgrpo's vocabulary (``klgrpo explain``).

Names and defaults are those of ``openrlhf/cli/train_ppo_ray.py`` at OpenRLHF 0.11.0 (dotted flags such as
``--algo.kl.init_coef``); the flat names of earlier releases (``--init_kl_coef``, ``--use_kl_loss``,
``--kl_estimator``, ``--kl_target``, ...) are read as the same fields. docs/explain.md derives each formula.

The KL flags' names and defaults, when the KL goes into the reward and each estimator's value (and cap) come
from klgrpo/integrations/versions/openrlhf.json, the row of the release range the command line is mapped under
(the newest row without one): a KL flag is read under the name that range gives it, and one of another range
only rules the range out.

The KL: ``compute_approx_kl`` clamps every estimator's value to [-10, 10]; with ``--algo.kl.use_loss`` it is
added to the actor loss (``init_coef * agg(k(l))``, the policy loss's token mean, no importance weight), else
``-init_coef * k(l_old)`` is added to each token's reward after the group normalisation and summed from each
token to the end (gamma 1): klgrpo's ``kl.placement reward`` with ``kl.reward_mode reward_to_go``.
"""

from __future__ import annotations

from typing import Any

from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import FieldMapping, Mapped, drop_unread_kl_keys
from klgrpo.integrations.versions import NotInRange, RewardKL, RLRange, newest, rl_profiles

OPENRLHF_VERSION = "0.11.0"
#: klgrpo's clip_threshold where no estimator is capped (the key is dropped then).
KL_VALUE_CAP = 10.0
#: What each KL flag holds (openrlhf.json's keys) -> its name in the newest range, the name this module reads.
_NEWEST = newest("openrlhf").defaults
KL_NAMES = {what: entry["flag"][2:] for what, entry in _NEWEST.items()}
#: Every range's KL flags (as written, without --) -> what they hold.
RANGE_KL_FLAGS = {entry["flag"][2:]: what for p in rl_profiles("openrlhf") for what, entry in p.defaults.items()}

OPENRLHF_FIELDS = (
    FieldMapping(KL_NAMES["init_coef"], ("kl.coef",), _NEWEST["init_coef"]["default"], "beta"),
    FieldMapping(KL_NAMES["use_loss"], ("kl.placement", "kl.reward_mode"), _NEWEST["use_loss"]["default"],
                 "true: loss; false: reward, reward_to_go"),
    FieldMapping(KL_NAMES["estimator"], ("kl.estimator", "kl.shaping", "kl.clip_threshold"),
                 _NEWEST["estimator"]["default"], "same name; k2 and k3 in the loss: kl.shaping clip at 10"),
    FieldMapping(KL_NAMES["target"], ("kl.controller", "kl.target"), _NEWEST["target"]["default"],
                 "set: adaptive with this target"),
    FieldMapping(KL_NAMES["horizon"], ("kl.horizon",), _NEWEST["horizon"]["default"], "same value"),
    FieldMapping("algo.advantage.estimator", ("loss.advantage_scale",), "gae",
                 "group_norm: group (std_eps 1e-9, ddof 1); dr_grpo: none; the others: none"),
    FieldMapping("actor.eps_clip", ("loss.eps_low", "loss.eps_high"), 0.2, "both, unless eps_clip_low_high"),
    FieldMapping("actor.eps_clip_low_high", ("loss.eps_low", "loss.eps_high"), None, "two values: low, high"),
    FieldMapping("actor.dual_clip", ("loss.dual_clip",), None, "unset: 0 (off)"),
    FieldMapping("actor.policy_loss_type", ("loss.policy_loss", "loss.aggregation"), "ppo",
                 "ppo: ppo_clip, token_mean; gspo: gspo, seq_mean_token_mean"),
    FieldMapping("train.max_epochs", ("train.num_iterations",), 1, "same value"),
    FieldMapping("rollout.n_samples_per_prompt", ("rollout.group_size",), 1, "same value"),
    FieldMapping("rollout.batch_size", ("rollout.prompts_per_step",), 1024, "same value"),
    FieldMapping("train.batch_size", (), 128, "fewer samples than rollout.batch_size x n: several updates per "
                                              "batch, the later ones off-policy"),
    FieldMapping("rollout.temperature", ("rollout.temperature",), 1.0, "same value"),
    FieldMapping("rollout.max_new_tokens", ("rollout.max_new_tokens",), None, "unset: klgrpo's default"),
    FieldMapping("actor.entropy_coef", ("loss.entropy_coef",), None,
                 "same value (unset: 0): the token mean of the entropy over the step's action tokens; OpenRLHF's "
                 "entropy is of the untempered logits (unmapped at another rollout.temperature)"),
)
OPENRLHF_DEFAULTS = {row.field: row.default for row in OPENRLHF_FIELDS}
#: The flat names of OpenRLHF releases before 0.10.2 of the flags outside the KL term -> the newest name (the KL
#: flags' names per range: openrlhf.json).
FLAT_NAMES = {
    "advantage_estimator": "algo.advantage.estimator",
    "eps_clip": "actor.eps_clip", "eps_clip_low_high": "actor.eps_clip_low_high", "dual_clip": "actor.dual_clip",
    "policy_loss_type": "actor.policy_loss_type", "max_epochs": "train.max_epochs",
    "n_samples_per_prompt": "rollout.n_samples_per_prompt", "rollout_batch_size": "rollout.batch_size",
    "train_batch_size": "train.batch_size", "temperature": "rollout.temperature",
    "generate_max_len": "rollout.max_new_tokens", "entropy_loss_coef": "actor.entropy_coef",
}
#: Flags without a value (store_true): the KL flags whose default is a bool in some range.
SWITCHES = tuple(entry["flag"][2:] for p in rl_profiles("openrlhf") for entry in p.defaults.values()
                 if isinstance(entry["default"], bool))
#: Unknown flags under these prefixes could change the KL term or its aggregation: refused (a typo, or a flag of a
#: later OpenRLHF whose effect on the verdict is unknown). Other unknown flags go to ``unmapped`` with a reason.
KL_PREFIXES = ("algo.kl.", "actor.policy_loss")
#: Flags of OpenRLHF 0.11 outside the table, with why they leave the KL term as it is.
NOT_THE_KL_TERM = {
    "algo.advantage.gamma": "the return's discount (the KL in the reward is summed with gamma 1: read below)",
    "algo.advantage.lambd": "GAE's lambda: the advantages, not the KL term",
    "algo.advantage.no_std_norm": "the advantages' normalisation, not the KL term",
    "algo.advantage.is_correction_enable": "vLLM's importance-sampling correction weighs the policy term, not the "
                                           "KL term",
    "algo.advantage.is_correction_threshold": "the vLLM importance-sampling correction's bounds (policy term)",
    "algo.advantage.is_correction_type": "the vLLM importance-sampling correction's kind (policy term)",
    "algo.dynamic_filtering_enable": "drops prompts whose group rewards are all equal: which samples train, not "
                                     "the KL term",
    "algo.dynamic_filtering_range": "the rewards range of the dynamic filtering (which samples train)",
    "actor.aux_loss_coef": "a mixture-of-experts load-balancing loss beside the objective",
}
_GROUP_REASONS = {"reward.": "changes the rewards, not the KL term",
                  "algo.advantage.": "changes the advantages, not the KL term",
                  "algo.": "not in klgrpo's OpenRLHF 0.11 table: the verdict assumes it leaves the KL term as it is",
                  "actor.eps": "changes the policy term's clip, not the KL term",
                  "actor.dual": "changes the policy term's clip, not the KL term"}
ADVANTAGES = {"group_norm": ("group", 1e-9), "dr_grpo": ("none", 1e-9)}
POLICY_LOSSES = {"ppo": ("ppo_clip", "token_mean"), "gspo": ("gspo", "seq_mean_token_mean")}
_TYPES = {"algo.kl.use_loss": bool, "algo.kl.estimator": str, "algo.advantage.estimator": str,
          "actor.policy_loss_type": str, "actor.eps_clip_low_high": list}
_INTS = ("algo.kl.horizon", "train.max_epochs", "rollout.n_samples_per_prompt", "rollout.batch_size",
         "train.batch_size", "rollout.max_new_tokens")


def parse_flags(tokens: list[str], origin: str) -> dict[str, Any]:
    """``--name value`` tokens -> {name: value}: the KL flags as written (their range's name, openrlhf.json), the
    others under their 0.11 name; values stay text until :func:`map_openrlhf` types them."""
    args_of: dict[str, list[str]] = {}
    args = None  # None before the first flag: the launcher and the script (python -m ..., deepspeed ...)
    for token in tokens:
        if token.startswith("--"):
            args = []
            name = token[2:]
            args_of[name if name in RANGE_KL_FLAGS else FLAT_NAMES.get(name, name)] = args
        elif args is not None:
            args.append(token)
    return {name: True if name in SWITCHES else (values if len(values) != 1 else values[0])
            for name, values in args_of.items()}


def _is_true(value: Any) -> bool:
    """A switch's value: True as parse_flags gives it, or "true" / "1" written out."""
    return value is True or str(value).lower() in ("true", "1")


def _typed(name: str, value: Any, origin: str) -> Any:
    kind = _TYPES.get(name, int if name in _INTS else float)
    if kind is bool:
        return _is_true(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{origin}: --{name} takes one name, got {value!r}")
        return value
    if kind is list:
        items = value if isinstance(value, list) else [value]
        if len(items) != 2:
            raise ConfigError(f"{origin}: --{name} takes two numbers (low high), got {items!r}")
        return [_typed("eps", item, origin) for item in items]
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: --{name} must be {'an integer' if kind is int else 'a number'}, "
                          f"got {value!r}") from None


def canonical(name: str) -> str:
    """A KL flag of any range (as written, without --) -> its 0.11 name; another flag as it is."""
    return KL_NAMES[RANGE_KL_FLAGS[name]] if name in RANGE_KL_FLAGS else name


def _value(row: RLRange, what: str, value: Any, origin: str) -> Any:
    """A KL flag's value in the newest terms; a switch for the estimator (--use_kl_estimator_k3) picks the second
    of the range's two estimators."""
    if what == "estimator" and isinstance(row.defaults[what]["default"], bool):
        names = list(row.estimators)
        return names[1] if _is_true(value) else names[0]
    return value


def _newest_with(flag: str) -> RLRange:
    """The newest range's row that has the KL flag (as written)."""
    return next(p for p in reversed(rl_profiles("openrlhf"))
                if any(entry["flag"][2:] == flag for entry in p.defaults.values()))


def _in_range(values: dict[str, Any], row: RLRange, label: str, origin: str,
              release: RLRange | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the flags with the KL flags under their 0.11 names, the range's KL defaults under those names);
    NotInRange for a KL flag of another range only (without a range, each name is read as the newest range that
    has it reads it)."""
    own = {entry["flag"][2:]: what for what, entry in row.defaults.items()}
    out = {}
    for name, value in values.items():
        if name in own:
            out[KL_NAMES[own[name]]] = _value(row, own[name], value, origin)
        elif name in RANGE_KL_FLAGS and release is None:
            out[canonical(name)] = _value(_newest_with(name), RANGE_KL_FLAGS[name], value, origin)
        elif name in RANGE_KL_FLAGS:
            raise NotInRange(f"{origin}: --{name} is not a flag of {label} (its KL flags: "
                             f"{', '.join(sorted(own))}; klgrpo/integrations/versions/openrlhf.json)")
        else:
            out[name] = value
    defaults = {KL_NAMES[what]: _value(row, what, entry["default"], origin) for what, entry in row.defaults.items()}
    return out, defaults


def map_openrlhf(values: dict[str, Any], origin: str = "command line", release: RLRange | None = None) -> Mapped:
    """OpenRLHF flags (as :func:`parse_flags` gives them) -> klgrpo keys under ``release``'s rules (a range of
    openrlhf.json; None: the newest); absent flags take that range's defaults."""
    import difflib

    row = release or newest("openrlhf")
    label = row.label
    values, range_defaults = _in_range(values, row, label, origin, release)
    out = Mapped()
    typed = {}
    for name, value in values.items():
        if name in OPENRLHF_DEFAULTS:
            typed[name] = _typed(name, value, origin)
        elif name.startswith(KL_PREFIXES):
            close = difflib.get_close_matches(name[:100], sorted(OPENRLHF_DEFAULTS), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise ConfigError(f"{origin}: unknown OpenRLHF flag --{name[:100]}{hint} (a flag there could change the "
                              "KL term)")
        elif name in NOT_THE_KL_TERM:
            out.unmapped[name] = NOT_THE_KL_TERM[name]
        elif name.startswith(tuple(_GROUP_REASONS)):
            out.unmapped[name] = next(why for prefix, why in _GROUP_REASONS.items() if name.startswith(prefix))
        else:
            out.ignored.append(name)
    gamma = values.get("algo.advantage.gamma", 1.0)
    if not typed.get("algo.kl.use_loss") and _typed("algo.advantage.gamma", gamma, origin) != 1.0:
        raise ConfigError(f"{origin}: --algo.advantage.gamma {gamma} discounts the KL in the reward, which klgrpo "
                          "sums with gamma 1; the verdict would not hold (use gamma 1.0, or --algo.kl.use_loss)")
    v = {**OPENRLHF_DEFAULTS, **range_defaults, **typed}
    _map_policy(v, out)
    _map_kl(v, out, row, label)
    updates = v["rollout.batch_size"] * v["rollout.n_samples_per_prompt"] / v["train.batch_size"]
    out.off_policy = v["train.max_epochs"] > 1 or updates > 1
    if updates > 1:
        out.unmapped["train.batch_size"] = (
            f"{updates:g} updates per rollout batch on different samples; klgrpo updates once per batch per "
            "iteration (train.num_iterations): the off-policy verdict holds for OpenRLHF's later updates")
    drop_unread_kl_keys(out.config)
    return out


def _map_policy(v: dict, out: Mapped) -> None:
    policy_type = v["actor.policy_loss_type"]
    if policy_type not in POLICY_LOSSES:
        out.unmapped["actor.policy_loss_type"] = f"{policy_type!r} is not one of: {', '.join(POLICY_LOSSES)}"
    policy, aggregation = POLICY_LOSSES.get(policy_type, POLICY_LOSSES["ppo"])
    low, high = v["actor.eps_clip_low_high"] or (v["actor.eps_clip"], v["actor.eps_clip"])
    estimator = v["algo.advantage.estimator"]
    scale, std_eps = ADVANTAGES.get(estimator, ("none", 1e-9))
    if estimator not in ADVANTAGES:
        out.unmapped["algo.advantage.estimator"] = (
            f"{estimator!r}: klgrpo's advantages are group-normalised rewards (OpenRLHF's group_norm) or centred "
            "rewards (dr_grpo); the config below uses centred rewards")
    out.config.update({
        "loss.policy_loss": policy, "loss.aggregation": aggregation, "loss.eps_low": float(low),
        "loss.eps_high": float(high), "loss.dual_clip": float(v["actor.dual_clip"] or 0.0),
        "loss.advantage_scale": scale, "loss.std_eps": std_eps, "loss.std_ddof": 1,
        "train.num_iterations": v["train.max_epochs"], "rollout.group_size": v["rollout.n_samples_per_prompt"],
        "rollout.prompts_per_step": v["rollout.batch_size"], "rollout.temperature": v["rollout.temperature"],
    })
    if v["rollout.max_new_tokens"] is not None:
        out.config["rollout.max_new_tokens"] = v["rollout.max_new_tokens"]
    _map_entropy(v, out)


def _map_entropy(v: dict, out: Mapped) -> None:
    """OpenRLHF subtracts entropy_coef * (the step's token mean of H), H of the logits before the temperature
    (its log-probs take the temperature); klgrpo's bonus (TRL's) is that token mean per micro-batch, weighted by
    the micro-batch's share of the sequences: the same with one micro-batch (train.micro_batch_size 0)."""
    coef = v["actor.entropy_coef"]
    if coef:
        out.config["loss.entropy_coef"] = float(coef)
    if coef and v["rollout.temperature"] != 1.0:
        out.unmapped["actor.entropy_coef"] = (
            f"OpenRLHF's entropy is of the logits before the temperature, klgrpo's at rollout.temperature "
            f"{v['rollout.temperature']:g} (its log-probs' temperature): equal at temperature 1 only")


def _reward_rule(row: RLRange) -> bool:
    """Whether --use_kl_loss (the range's name) can take the KL out of the reward: openrlhf.json's reward_kl."""
    return row.reward_kl is RewardKL.UNLESS_KL_LOSS


def _map_kl(v: dict, out: Mapped, row: RLRange, label: str) -> None:
    estimator, in_loss = v["algo.kl.estimator"], _reward_rule(row) and v["algo.kl.use_loss"]
    if estimator not in row.estimators:
        out.unmapped["algo.kl.estimator"] = (f"{estimator!r} is not an estimator of {label}: "
                                             f"{', '.join(row.estimators)}")
        estimator = next(iter(row.estimators))
    found = row.estimators[estimator]
    cap = found.cap
    # k2, k3 >= 0: the value cap is klgrpo's clip shaping (loss term); k1 and the reward value are not capped
    shaping = "clip" if cap is not None and in_loss and found.estimator != "k1" else "none"
    if cap is not None and (found.estimator == "k1" or not in_loss):
        out.unmapped["algo.kl.estimator"] = out.unmapped.get("algo.kl.estimator", (
            f"OpenRLHF clamps the KL value to [-{cap:g}, {cap:g}]; klgrpo has no such clamp here (equal while "
            f"|value| <= {cap:g})"))
    target = v["algo.kl.target"]
    out.config.update({
        "kl.coef": float(v["algo.kl.init_coef"]), "kl.monitor": v["algo.kl.init_coef"] > 0,
        "kl.estimator": found.estimator, "kl.placement": "loss" if in_loss else "reward",
        "kl.reward_mode": "reward_to_go", "kl.is_correction": "none", "kl.shaping": shaping,
        "kl.clip_threshold": cap or KL_VALUE_CAP,
        "kl.controller": "fixed" if target is None else "adaptive", "kl.horizon": float(v["algo.kl.horizon"]),
    })
    if target is not None:
        out.config["kl.target"] = float(target)
        out.unmapped["algo.kl.target"] = (
            "OpenRLHF's adaptive controller reads the mean over sequences of each sequence's mean KL; klgrpo's "
            "reads the mean per-token KL (kl.kl_measure token_mean; equal when all lengths are equal)")
