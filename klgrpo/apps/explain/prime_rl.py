"""A prime-rl RL config (its TOML: ``[trainer]``, ``[orchestrator]``, ``[inference]``, ...) in klgrpo's terms, by
the rules of each prime-rl release range (``prime_rl.json``, read from PrimeIntellect-ai/prime-rl at every tag).

prime-rl's RL loss has no KL to a reference model in any release read. ``trainer.loss.kl_tau`` weighs a term
toward the inference policy that sampled the batch: through the advantage (0.2 - 0.4: -kl_tau x log(pi /
pi_inference) per token, default 0) or in the loss (0.5 on: kl_tau x log(pi / pi_inference)^2, default 1e-3). It
keeps the policy near the sampler of the batch, not near its start: the verdict is zero, with a risk line.
"""

from __future__ import annotations

import math
from typing import Any

from klgrpo.apps.explain.frameworks import Release, releases, table
from klgrpo.apps.explain.truncation import Read
from klgrpo.errors import ConfigError

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


def map_prime_rl(values: dict[str, Any], origin: str, release: Release | None = None) -> Read:
    """prime-rl's dotted keys -> klgrpo keys under ``release``'s rules (None: the newest)."""
    release = release or newest()
    row, label = release.release or {}, release.label
    for key, value in _settings(values):
        if key.rsplit(".", 1)[-1] == "algorithm" and str(value).lower() in DISTILLATION:
            raise ConfigError(f"{origin}: {key} {value!r}: on-policy distillation, whose per-token signal is the "
                              "reverse KL to the reference model (ref_kl_loss_fn); klgrpo has no such objective and "
                              "explain computes no verdict for it")
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
    if tau > 0:
        unset = "" if LOSS + "kl_tau" in values else f" (the default of {label})"
        out.source_risks = [
            f"{LOSS}kl_tau {tau:g}{unset} is no KL to a reference: {label} {row['kl_tau']}; it keeps each update "
            "near the policy that sampled the batch, not the policy near its start, and prime-rl's loss has no "
            "reference model; set kl.coef > 0 in klgrpo for a KL to the reference (its config below has none)"]
    return out
