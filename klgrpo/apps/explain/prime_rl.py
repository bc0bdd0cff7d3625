"""A prime-rl RL config (its TOML: ``[trainer]``, ``[orchestrator]``, ``[inference]``, ...) in klgrpo's terms, by
the rules of each prime-rl release range (``prime_rl.json``, read from PrimeIntellect-ai/prime-rl at every tag).

prime-rl's RL loss has no KL to a reference model in any release read. ``trainer.loss.kl_tau`` weighs a term
toward the inference policy that sampled the batch: through the advantage (0.2 - 0.4: -kl_tau x log(pi /
pi_inference) per token, default 0) or in the loss (0.5 on: kl_tau x log(pi / pi_inference)^2, default 1e-3). It
keeps the policy near the sampler of the batch, not near its start: the verdict is zero, with a risk line.

A range's table row names the keys its configs cannot hold (``keys_not_here``: a later release's
``orchestrator.group_size`` or ``orchestrator.algo``, an earlier one's ``inference_gpu_ids``): a file holding one
runs on another range. Distillation (``distillation``: the key and the values that train on another model's
log-probs or rollouts, e.g. an ``algo.type`` opd at the orchestrator or per env) is refused.
"""

from __future__ import annotations

import math
from typing import Any

from klgrpo.apps.explain.frameworks import Release, releases, table
from klgrpo.apps.explain.truncation import Read
from klgrpo.errors import ConfigError
from klgrpo.integrations.versions import NotInRange

LOSS = "trainer.loss."
#: Values of an algorithm setting that train on another model's log-probs (on-policy distillation).
DISTILLATION = ("opd", "opsd")


def is_prime_rl(data: dict) -> bool:
    """prime-rl's RL config: its orchestrator group beside its trainer or inference group, every top-level key
    one of prime-rl's."""
    top = {str(key) for key in data}
    return "orchestrator" in top and bool(top & {"trainer", "inference"}) and top <= set(table("prime_rl")["groups"])


def _settings(values: dict[str, Any], prefix: str = ""):
    """(dotted key, value) of every setting, into TOML's arrays of tables ([[orchestrator.env]])."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _settings(value, f"{prefix}{key}.")
        elif isinstance(value, list) and all(isinstance(item, dict) for item in value):
            for item in value:
                yield from _settings(item, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def newest() -> Release:
    return releases("prime_rl")[-1]


def _refuse_other_ranges(settings: list[tuple[str, Any]], row: dict, label: str, origin: str) -> None:
    """A key the range's configs do not hold (pydantic forbids it there): the file runs on another range."""
    for key, _ in settings:
        held = next((name for name in row.get("keys_not_here", ()) if key == name or key.startswith(name + ".")),
                    None)
        if held is not None:
            raise NotInRange(f"{origin}: {key}: {held} is no key of {label} (klgrpo/apps/explain/prime_rl.json); "
                             "pass the release you run, e.g. --version prime_rl==0.8.0")


def _refuse_distillation(settings: list[tuple[str, Any]], row: dict, label: str, origin: str) -> None:
    """Distillation trains on another model's log-probs or rollouts: no verdict. The row names the key (its last
    dotted parts: ``algo.type`` at the orchestrator or under an env) and the values that do."""
    for key, value in settings:
        if key.rsplit(".", 1)[-1] == "algorithm" and str(value).lower() in DISTILLATION:
            raise ConfigError(f"{origin}: {key} {value!r}: on-policy distillation, whose per-token signal is the "
                              "reverse KL to the reference model (ref_kl_loss_fn); klgrpo has no such objective and "
                              "explain computes no verdict for it")
        for name, values in row.get("distillation", {}).items():
            if (key == name or key.endswith("." + name)) and str(value).lower() in values:
                what = ("supervised: cross-entropy on a teacher's (or its own hinted) rollouts" if value == "sft"
                        else "distillation: the per-token signal is another model's log-ratio to the policy")
                raise ConfigError(f"{origin}: {key} {value!r} in {label}: {what}; klgrpo has no such objective and "
                                  "explain computes no verdict for it")


def map_prime_rl(values: dict[str, Any], origin: str, release: Release | None = None) -> Read:
    """prime-rl's dotted keys -> klgrpo keys under ``release``'s rules (None: the newest)."""
    release = release or newest()
    row, label = release.release or {}, release.label
    settings = list(_settings(values))  # (key, value) pairs: one per env of an array of tables
    _refuse_other_ranges(settings, row, label, origin)
    _refuse_distillation(settings, row, label, origin)
    teacher = values.get(LOSS + "teacher_tau", 0.0)
    if teacher not in (0, 0.0) and row["teacher_tau"]:
        raise ConfigError(f"{origin}: {LOSS}teacher_tau {teacher!r}: a teacher's log-ratio in the advantage "
                          f"({label}); klgrpo has no such term and explain computes no verdict for it")
    tau = values.get(LOSS + "kl_tau", row["kl_tau_default"])
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ConfigError(f"{origin}: {LOSS}kl_tau must be a finite number >= 0, got {tau!r}")
    out = Read()
    for key in values:
        if key.startswith(LOSS) and key not in (LOSS + "kl_tau", LOSS + "teacher_tau"):
            out.unmapped[key] = "the policy term's: not mapped; the KL verdict does not depend on it"
        elif key not in (LOSS + "kl_tau", LOSS + "teacher_tau"):
            out.ignored.append(key)
    group = values.get("orchestrator.group_size", values.get("orchestrator.rollouts_per_example"))
    if isinstance(group, int) and not isinstance(group, bool) and group >= 1:
        out.config["rollout.group_size"] = group
    out.config.update({"kl.coef": 0.0, "kl.monitor": True})
    for key, value in settings:
        if (key == "orchestrator.algo.type" or key.endswith(".algo.type")) and value != "grpo":
            out.unmapped[key] = (f"{value}: its advantages are not GRPO's group-normalised rewards (not mapped); "
                                 "the rl loss is the same and the KL verdict does not depend on them")
    if tau > 0:
        # worded by the release the default came in, not the range's label: ranges with the same rule agree
        unset = "" if LOSS + "kl_tau" in values else f" (prime-rl's default from {row['kl_tau_since']})"
        out.source_risks = [("kl_tau",
            f"{LOSS}kl_tau {tau:g}{unset} is no KL to a reference: {row['kl_tau']}; it keeps each update "
            "near the policy that sampled the batch, not the policy near its start, and prime-rl's loss has no "
            "reference model; set kl.coef > 0 in klgrpo for a KL to the reference (its config below has none)")]
    return out
