"""The explanation of a mapped config: the gradient verdicts (verify-kl's exact oracles on the mapped KL terms,
klgrpo.verify.verdict), the value verdict, beta's rule, the aggregation, the risks, and the printed lines."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import yaml

from klgrpo.apps.explain.rewards import format_entry
from klgrpo.config.schema import GRPOConfig
from klgrpo.config.terms import kl_term, run_controller_params
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import Mapped
from klgrpo.math.objective import KLTerm

FORMAT_NAMES = {"trl": "TRL GRPOConfig", "unsloth": "Unsloth's GRPO (TRL's GRPOConfig, Unsloth's defaults and loss)",
                "adaptive_kl": "TRL GRPOConfig with the adaptive-KL fields (klgrpo.trl, the Unsloth fork's)",
                "verl": "verl PPO trainer config", "openrlhf": "OpenRLHF command line",
                "nemo_rl": "NeMo-RL GRPO config", "roll": "ROLL RLVR pipeline config",
                "skyrl_train": "SkyRL trainer config", "prime_rl": "prime-rl RL config",
                "slime": "slime train.py command line",
                "klgrpo": "klgrpo config"}
AGGREGATION_WEIGHTING = {
    "token_mean": "every token weighs the same (a long completion's KL counts in proportion to its length)",
    "seq_mean_token_mean": "each completion weighs the same: a token's KL is divided by its completion's length",
    "seq_mean_token_sum": "each completion's summed KL weighs the same (the sequence KL's own weighting)",
    "constant": "every token weighs 1 / (completions x max length), whatever the lengths",
}


def kl_parts(kl, extra: list[dict[str, Any]]) -> list[KLTerm]:
    """The KL terms of the mapped config: its ``kl`` group as the trainer builds it, plus the source's extra
    terms."""
    return [kl_term(kl, kl.coef), *(KLTerm(**part) for part in extra)]


def explain(source: str, mapped: Mapped) -> dict[str, Any]:
    """The explanation as data: the --json document."""
    from klgrpo.verify.report import torch_threads
    from klgrpo.verify.verdict import gradient_verdict, value_verdict

    cfg = GRPOConfig.from_dict(mapped.nested(), origin="the mapped config")
    unmapped = dict(mapped.unmapped)
    klgrpo_rules = []
    try:
        cfg.validate()
    except ConfigError as err:  # klgrpo's own rule (e.g. group_size >= 2), not a field of the source
        klgrpo_rules.append(str(err))
    parts = kl_parts(cfg.kl, mapped.extra_kl)
    aggregation = cfg.loss.aggregation
    with torch_threads(1):
        verdicts = {"token_on_policy": gradient_verdict(parts, "token", "first_epoch", aggregation),
                    "sequence_on_policy": gradient_verdict(parts, "sequence", "first_epoch", aggregation)}
        if mapped.off_policy:
            verdicts["token_off_policy"] = gradient_verdict(parts, "token", "off_policy", aggregation)
        values = [value_verdict(part.estimator) for part in parts if part.coef > 0 or part is parts[0]]
    report = {
        "source": source,
        "config": mapped.nested(),
        "gradient": {name: v.target for name, v in verdicts.items()},
        "gradient_detail": {name: asdict(v) for name, v in verdicts.items()},
        "value": values[0] if len(values) == 1 else values,
        "controller": controller_rule(cfg),
        "aggregation": {"name": aggregation, "weighting": AGGREGATION_WEIGHTING[aggregation]},
        "unmapped": unmapped,
        "ignored": list(mapped.ignored),
        "off_policy": mapped.off_policy,
        "klgrpo_rules": klgrpo_rules,
        "kl_live": any(part.coef > 0 for part in parts),
    }
    if mapped.rewards:
        report["rewards"] = list(mapped.rewards)
    source = list(getattr(mapped, "source_risks", ()))
    found = risks(cfg, parts, report, mapped.off_policy, mapped.kl_off) + source
    if any(risk_id in SAYS_NO_KL for risk_id, _ in source):  # the source's line says why, beta 0 would not
        found = [(risk_id, line) for risk_id, line in found if risk_id != "beta_zero"]
    report["risks"] = [line for _, line in found]
    report["risk_ids"] = [risk_id for risk_id, _ in found]  # what a program reads: the lines are for people
    return report


def controller_rule(cfg: GRPOConfig) -> str:
    kl = cfg.kl
    params = run_controller_params(cfg)
    rules = {
        "fixed": f"fixed at {kl.coef:g}",
        "adaptive": f"beta <- beta (1 + clip(KL / {params.get('target', 0):g} - 1, -0.2, 0.2) n / "
                    f"{params.get('horizon', 0):g}) after each step, from {kl.coef:g} (Ziegler et al.)",
        "step": f"beta x 1.5 when KL > 1.5 x {params.get('target', 0):g}, x 0.75 when KL < 0.5 x target",
        "dual": f"log beta += {params.get('lr', 0):g} (KL - {params.get('target', 0):g}) / target, beta in "
                f"[{params.get('beta_min', 0):g}, {params.get('beta_max', 0):g}]",
        "dynamic": f"beta x {params.get('decay', 0):g} after each step whose mean reward > "
                   f"{params.get('reward_threshold', 0):g}; beta = {params.get('beta_min', 0):g} after "
                   f"{params.get('schedule_steps', 0)} steps (0: never)",
    }
    rule = rules.get(kl.controller, kl.controller)
    return rule if kl.controller == "fixed" else f"{rule}; KL measured as {kl.kl_measure}"


#: the sources' own risk ids that say why a set KL coefficient adds nothing (explain then says no "beta is 0")
SAYS_NO_KL = ("kl_coef_ignored",)


def risks(cfg: GRPOConfig, parts, report: dict, off_policy: bool, kl_off: str = "") -> list[tuple[str, str]]:
    """(id, line) per risk, each line naming the change that fixes it; the ids are what a program reads in
    explain's JSON (``risk_ids``), the lines what a person reads."""
    loss, out = cfg.loss, []
    gradient = report["gradient"]
    live = [p for p in parts if p.coef > 0]

    def add(risk_id: str, line: str) -> None:
        out.append((risk_id, line))

    if not live and kl_off:
        add("kl_off", f"no KL term: {kl_off}; nothing keeps the policy near its start: turn the source's KL on "
                      "(klgrpo: kl.coef > 0)")
    elif not live:
        add("beta_zero", "beta is 0: no KL term and no reference model, nothing keeps the policy near its start; "
                         "set kl.coef > 0 (TRL: beta, e.g. 0.001-0.04)")
    if gradient["token_on_policy"] == "forward":
        add("forward_kl", "the KL gradient follows the forward KL(ref||pi): k3 without the in-graph importance "
                          "weight; set kl.is_correction in_graph (TRL: use_bias_correction_kl true) or kl.estimator "
                          "k3_st")
    elif live and gradient["token_on_policy"] in ("neither", "zero"):
        add(f"{gradient['token_on_policy']}_kl", f"the KL gradient follows {gradient['token_on_policy']} KL at the "
                                                 f"token level; {_estimator_advice(live)}")
    if off_policy and any(p.placement in ("reward", "both") for p in live):
        add("reward_kl_off_policy", "KL in the reward with several updates per batch: it is read at the rollout "
                                    f"policy, so later updates follow {gradient.get('token_off_policy', 'neither')} "
                                    "KL; set train.num_iterations 1 with one update per batch, or put the KL in the "
                                    "loss (kl.placement loss, k3 in_graph)")
    elif off_policy and gradient.get("token_off_policy") not in (None, "reverse") and live:
        add("off_policy", f"off-policy updates follow {gradient['token_off_policy']} KL: set kl.is_correction "
                          "in_graph (k3) or detached (k3_st)")
    for p in live:
        if p.shaping == "clip":
            add("kl_clipped", f"the KL is clipped at {p.clip_threshold:g} per token: tokens above it get zero KL "
                              "gradient (count them in kl/shaping_clip_frac); raise kl.clip_threshold or set "
                              "kl.shaping none")
        if p.shaping == "length_normalized":
            add("length_normalized", "kl.shaping length_normalized divides each token's KL by its completion's "
                                     "length: long completions are barely regularised; set kl.shaping none")
        if p.shaping == "sigmoid":
            add("sigmoid_shaping", f"kl.shaping sigmoid gates the KL by sigmoid(KL - {p.shaping_target:g}): its "
                                   "gradient follows neither KL; set kl.shaping none")
    if live and loss.aggregation == "seq_mean_token_mean":
        add("seq_mean_token_mean", "loss.aggregation seq_mean_token_mean divides each completion's KL by its length, "
                                   f"so the sequence-level gradient follows {gradient['sequence_on_policy']} KL; use "
                                   "token_mean or seq_mean_token_sum (TRL: loss_type dapo)")
    if loss.advantage_scale != "none" and loss.std_eps < 1e-4:
        add("advantage_epsilon", f"advantage epsilon {loss.std_eps:g}: a group whose rewards differ by float noise "
                                 "gets advantages of order 1 ((r - mean) / (std + eps)); set loss.std_eps 1e-4 or "
                                 "more")
    return out


#: (estimator, importance weight) of a loss KL whose gradient follows the reverse KL: advised only where missing.
REVERSE_IN_LOSS = {("k3", "in_graph"), ("k3_st", "detached")}


def _estimator_advice(live: list[KLTerm]) -> str:
    """What to change so the token-level gradient follows the reverse KL, leaving out what the config already
    has: k3 in_graph or k3_st detached in the loss, k1 in the reward; else the shaping is the cause."""
    advice = []
    if any(p.in_loss and (p.estimator, p.is_correction) not in REVERSE_IN_LOSS for p in live):
        advice.append("use k3 with kl.is_correction in_graph, or k3_st with detached")
    if any(p.placement == "reward" and p.estimator != "k1" for p in live):
        advice.append("in the reward use kl.estimator k1 (its REINFORCE gradient follows the reverse KL)")
    if advice:
        return "; ".join(advice)
    shaped = sorted({p.shaping for p in live if p.shaping != "none"})
    if shaped:
        return (f"the estimator and its weight already follow the reverse KL: kl.shaping {', '.join(shaped)} "
                "changes the gradient (see below)")
    return "the estimator and its weight already follow the reverse KL"


def format_report(origin: str, report: dict) -> str:
    g = report["gradient"]
    off = f", token off-policy {g['token_off_policy']}" if "token_off_policy" in g else ""
    values = report["value"] if isinstance(report["value"], list) else [report["value"]]
    value = "; ".join(f"{v['estimator']}: {'unbiased' if v['unbiased'] else 'biased'} estimate of "
                      f"{v['estimates']}" for v in values)
    releases = report.get("releases")
    lines = [f"{origin}: {FORMAT_NAMES[report['source']]}" + (f", on {' and on '.join(releases)}" if releases else ""),
             f"  KL gradient: token {g['token_on_policy']}, sequence {g['sequence_on_policy']} (first update "
             f"on a batch){off}",
             *([f"  KL value: {value}"] if report.get("kl_live", True) else []),
             f"  beta: {report['controller']}",
             f"  aggregation: {report['aggregation']['name']}: {report['aggregation']['weighting']}"]
    lines += [f"  reward: {format_entry(entry)}" for entry in report.get("rewards", ())]
    for name, why in report["unmapped"].items():
        lines.append(f"  no counterpart: {name}: {why}")
    if report["ignored"]:
        lines.append(f"  ignored (speed, memory, logging): {', '.join(report['ignored'])}")
    lines += [f"  note: {note}" for note in report.get("notes", ())]
    lines += [f"  klgrpo rule (for the config below, not the source's): {rule}"
              for rule in report.get("klgrpo_rules", ())]
    lines += [f"  risk: {risk}" for risk in report["risks"]]
    lines.append("  klgrpo config (--write FILE saves it; every other key at klgrpo's default):")
    config = yaml.safe_dump(report["config"], sort_keys=False, default_flow_style=None, width=110)
    lines += [f"    {line}" for line in config.splitlines()]
    return "\n".join(lines)
