"""A slime launch script (``python3 train.py --advantage-estimator grpo --use-kl-loss ...``, the flags often kept
in bash arrays) in klgrpo's terms, by the rules of each slime release range (``slime.json``, read from
THUDM/slime at every tag).

slime's KL terms: ``--use-kl-loss`` adds ``--kl-loss-coef`` x ``--kl-loss-type``'s estimate (k1, k2, k3;
low_var_kl: k3 clamped at 10) to the loss without a weight, or, with ``--use-unbiased-kl`` (0.2.1 on), times
pi / pi_old in the graph; ``--kl-coef`` is the reward KL of REINFORCE++, and grpo, gspo and cispo never read it.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from klgrpo.apps.explain.frameworks import Release, releases, table
from klgrpo.apps.explain.truncation import Read
from klgrpo.errors import ConfigError

#: Flags without a value (store_true) that explain reads.
SWITCHES = ("use-kl-loss", "use-unbiased-kl", "calculate-per-token-loss", "normalize-advantages",
            "disable-grpo-std-normalization", "use-tis", "use-rollout-logprobs")
#: Flags that say a command is slime's train.py.
MARKERS = ("--advantage-estimator", "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type", "--kl-coef",
           "--rollout-batch-size", "--n-samples-per-prompt", "--rm-type", "--rollout-function-path")
READ = ("advantage-estimator", "use-kl-loss", "kl-loss-coef", "kl-coef", "kl-loss-type", "use-unbiased-kl",
        "n-samples-per-prompt", "rollout-batch-size", "global-batch-size", "num-steps-per-rollout",
        "calculate-per-token-loss", "eps-clip", "eps-clip-high", "rollout-top-p", "rollout-top-k",
        "disable-grpo-std-normalization")
#: Flags that change the objective and are not mapped: named when given.
NOT_MAPPED = ("normalize-advantages", "use-tis", "custom-advantage-function-path", "custom-loss-function-path",
              "loss-type", "entropy-coef", "gamma", "use-rollout-logprobs", "eps-clip-c")


@lru_cache(maxsize=None)
def _flag_releases() -> dict[str, Any]:
    """slime_flags.json (tools/slime_flags.py): each of slime's own flags -> the releases that declare it."""
    return json.loads((Path(__file__).with_name("slime_flags.json")).read_text(encoding="utf-8"))


def check_flags_at_releases(flags: list[str], clauses: list, origin: str) -> None:
    """With ``--version`` clauses for slime: refused in one line where no slime release they allow declares every
    slime flag the script passes (such a run stops at argparse's "unrecognized arguments"). Flags that are not
    slime's own (Megatron's, SGLang's) are not judged; releases the table does not know are not judged."""
    if not clauses:
        return
    from klgrpo.integrations.versions.clauses import specifier_set

    table = _flag_releases()
    allowed = [r for r in table["read"] if specifier_set(clauses).contains(r, prereleases=True)]
    if not allowed:
        return
    own = [name for name in dict.fromkeys(flags) if name in table["flags"]]
    for release in allowed:
        if all(release in table["flags"][name] for name in own):
            return
    release = allowed[-1]
    missing = next(name for name in own if release not in table["flags"][name])
    having = table["flags"][missing]
    span = having[0] if len(having) == 1 else f"{having[0]} to {having[-1]}"
    from klgrpo.integrations.versions import NotInRange

    raise NotInRange(f"{origin}: --{missing} is not a flag of slime {release} (slime {span} declare it): the run "
                     f"would stop at its first line; pass the release you run, e.g. --version slime=={having[-1]}")


def is_slime_command(arguments: list[str]) -> bool:
    return any(a.split("=", 1)[0] in MARKERS for a in arguments)


def parse_flags(arguments: list[str], origin: str) -> dict[str, Any]:
    """``--name value`` (several values: a list), ``--name=value`` or a switch -> {name: value (text), or True};
    the tokens before the first flag (python3 train.py) are the launcher's."""
    out: dict[str, Any] = {}
    name = None
    for token in arguments:
        if token.startswith("--"):
            key, eq, value = token[2:].partition("=")
            out[key] = value if eq else True
            name = None if eq or key in SWITCHES else key
        elif name is not None:
            held = out[name]
            out[name] = token if held is True else [*(held if isinstance(held, list) else [held]), token]
    return out


def _off(value: Any) -> bool:
    """A flag's value that turns its setting off: false, or a number equal to 0."""
    if value is False:
        return True
    try:
        return float(value) == 0
    except (TypeError, ValueError):
        return False


def newest() -> Release:
    return releases("slime")[-1]


def _number(flags: dict, name: str, origin: str) -> float:
    value = flags.get(name)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: --{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{origin}: --{name} must be a finite number, got {value!r}")
    return number


def map_slime(flags: dict[str, Any], origin: str, release: Release | None = None) -> Read:
    """slime's flags (names without ``--``) -> klgrpo keys under ``release``'s rules (None: the newest); absent
    flags take arguments.py's defaults of that release."""
    release = release or newest()
    row, label = release.release or {}, release.label
    if "use-unbiased-kl" in flags and not row["unbiased_kl"]:
        from klgrpo.integrations.versions import NotInRange

        raise NotInRange(f"{origin}: --use-unbiased-kl is not a flag of {label} (0.2.1 on); pass the release you "
                         "run, e.g. --version slime==0.3.1")
    v = {**row["defaults"], **flags}
    estimator = str(v["advantage-estimator"])
    if estimator not in row["advantage_estimators"]:
        from klgrpo.integrations.versions import NotInRange

        raise NotInRange(f"{origin}: --advantage-estimator {estimator} is none of {label}'s "
                         f"({', '.join(row['advantage_estimators'])}); pass the release you run")
    if estimator in ("reinforce_plus_plus_baseline", "ppo", "on_policy_distillation"):
        raise ConfigError(f"{origin}: --advantage-estimator {estimator}: "
                          + {"reinforce_plus_plus_baseline": "slime subtracts --kl-coef x each token's KL from that "
                                                             "token's advantage (no sum over the later tokens)",
                             "ppo": "a critic's advantages (GAE)",
                             "on_policy_distillation": "the teacher's log-ratio as the advantage"}[estimator]
                          + "; klgrpo has no such objective and explain computes no verdict for it")
    out = Read()
    for name, value in flags.items():
        if name in READ:
            continue
        if name in NOT_MAPPED and not _off(value):
            out.unmapped[name] = "not read by the mapping: check that it does not change the objective"
        else:
            out.ignored.append(name)
    group = int(_number(v, "n-samples-per-prompt", origin))
    out.config["rollout.group_size"] = group
    if "rollout-batch-size" in v:
        prompts = int(_number(v, "rollout-batch-size", origin))
        out.config["rollout.prompts_per_step"] = prompts
        steps = None
        if v.get("num-steps-per-rollout") is not None:
            steps = _number(v, "num-steps-per-rollout", origin)
        elif v.get("global-batch-size") is not None:
            steps = prompts * group / _number(v, "global-batch-size", origin)
        if steps is not None and steps > 1:
            out.off_policy = True
            out.unmapped["global-batch-size"] = (
                f"{steps:g} optimizer steps per rollout on different samples; klgrpo updates once per batch per "
                "iteration (train.num_iterations): the off-policy verdict holds for slime's later steps")
    eps = _number(v, "eps-clip", origin)
    out.config.update({
        # gspo's ratio is the sequence's exp(mean_t (log pi - log pi_old)) (policy_loss_function): klgrpo's gspo
        "loss.policy_loss": "gspo" if estimator == "gspo" else "ppo_clip", "loss.eps_low": eps,
        "loss.eps_high": _number(v, "eps-clip-high", origin) if "eps-clip-high" in v else eps,
        "loss.aggregation": "token_mean" if v.get("calculate-per-token-loss") is True else "seq_mean_token_mean",
        "loss.advantage_scale": "none" if v.get("disable-grpo-std-normalization") is True else "group"})
    if estimator == "cispo":
        out.unmapped["advantage-estimator"] = ("cispo: slime's compute_cispo_loss is not mapped (the config below "
                                               "has ppo_clip); the KL verdict does not depend on it")
    _map_kl(v, flags, row, label, estimator, origin, out)
    return out


def _map_kl(v: dict, flags: dict, row: dict, label: str, adv: str, origin: str, out: Read) -> None:
    kind = str(v["kl-loss-type"])
    if kind not in row["estimators"]:
        raise ConfigError(f"{origin}: --kl-loss-type {kind} is none of {label}'s ({', '.join(row['estimators'])}): "
                          "argparse refuses it")
    estimator = "k1" if kind == "kl" else "k3" if kind == "low_var_kl" else kind
    loss_on = v.get("use-kl-loss") is True
    loss_coef = _number(v, "kl-loss-coef", origin)
    reward_coef = _number(v, "kl-coef", origin)
    reward_on = reward_coef > 0 and adv == "reinforce_plus_plus"
    if reward_coef > 0 and adv in ("grpo", "gspo", "cispo"):
        out.source_risks.append(("kl_coef_ignored",
            f"--kl-coef {reward_coef:g} is silently ignored: {label}'s {adv} advantages (get_grpo_returns) broadcast "
            "each sample's reward alone and never read the KL that --kl-coef weighs (only reinforce_plus_plus and "
            "ppo do); for a KL to the reference use --use-kl-loss with --kl-loss-coef (klgrpo: kl.coef)"))
    unbiased = v.get("use-unbiased-kl") is True and row["unbiased_kl"]
    if not loss_on and not reward_on and loss_coef > 0:
        out.kl_off = f"--kl-loss-coef {loss_coef:g} without --use-kl-loss is never read"
    if loss_on:
        out.config.update({"kl.coef": loss_coef, "kl.estimator": estimator, "kl.placement": "loss",
                           "kl.is_correction": "in_graph" if unbiased else "none",
                           "kl.shaping": "clip" if kind == "low_var_kl" else "none"})
        if kind == "low_var_kl":
            out.config["kl.clip_threshold"] = 10.0
        if reward_on:
            out.extra_kl.append({"coef": reward_coef, "estimator": estimator, "placement": "reward",
                                 "is_correction": "none", "reward_mode": "reward_to_go", "shaping": "none"})
            out.unmapped["kl-coef"] = (f"klgrpo has one KL term: slime's reward KL ({kind}, {reward_coef:g}) beside "
                                       "its loss KL is left out of the config below; the verdict includes both")
    elif reward_on:
        out.config.update({"kl.coef": reward_coef, "kl.estimator": estimator, "kl.placement": "reward",
                           "kl.reward_mode": "reward_to_go", "kl.is_correction": "none", "kl.shaping": "none"})
    else:
        out.config.update({"kl.coef": 0.0, "kl.estimator": estimator})
        if loss_coef > 0:
            out.unmapped["kl-loss-coef"] = f"{loss_coef:g} without --use-kl-loss: no KL term"
    if reward_on or loss_on and kind in ("kl", "k1", "k2", "k3"):
        out.config["kl.log_ratio_clamp"] = 20.0
        if estimator == "k3" and kind == "k3":
            out.unmapped.setdefault("kl-loss-type", "k3: slime clamps nothing; klgrpo's log-ratio guard (20) "
                                                    "differs only where |log pi - log ref| > 20")
    if reward_on:
        out.unmapped.setdefault("advantage-estimator", (
            "reinforce_plus_plus: the reward enters at the last token, -kl_coef x KL at each, summed to the end; "
            "slime's rewards are not group-normalised there (klgrpo's are: the config below)"))


def flags_of(arguments: list[str], origin: str) -> dict[str, Any]:
    """The launch command's flags, refused in one line when they are no slime command's."""
    if not is_slime_command(arguments):
        raise ConfigError(f"{origin}: runs {'/'.join(table('slime')['entry_points'])} without slime's flags "
                          f"({', '.join(MARKERS[:4])}, ...); explain reads slime's train.py commands")
    return parse_flags(arguments, origin)
