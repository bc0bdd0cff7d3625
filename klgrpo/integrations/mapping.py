"""Another framework's config in klgrpo's vocabulary: the shared shape of the mapping tables
(klgrpo.integrations.trl_mapping, klgrpo.integrations.verl_mapping, klgrpo.integrations.openrlhf_mapping) and of
their result, and the one call of klgrpo's objective that the TRL bridge and the migration tests make with a mapped
config.

A table row names a source field, the klgrpo config keys it sets and the source's default; ``render_table``
writes the rows as the markdown tables of docs/trl.md and docs/explain.md (a test compares them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from klgrpo.config.schema import GRPOConfig
from klgrpo.config.terms import controller_fields, entropy_term, kl_term, policy_term, sampler_correction
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.kl_control import CONTROLLERS
from klgrpo.math.objective import ObjectiveInputs, ObjectiveOut, ObjectiveTerms, grpo_objective


@dataclass(frozen=True)
class FieldMapping:
    """One source field: the klgrpo keys it sets, the source's default, and the rule (one line)."""

    field: str
    keys: tuple[str, ...]
    default: Any
    rule: str


@dataclass
class Mapped:
    """A source config in klgrpo's terms.

    config      dotted klgrpo keys -> values (the rest: klgrpo's defaults)
    unmapped    source field -> why klgrpo has no counterpart (the objective differs there)
    ignored     source fields set by the user that change speed, memory or logging only
    extra_kl    KL terms the source adds beside ``config``'s that klgrpo's one KL term cannot hold:
                dicts with coef, estimator, placement, is_correction, reward_mode, shaping, clip_threshold
    off_policy  whether some updates use samples of an earlier policy (several iterations or mini-batches)
    source_runtime  the ``unmapped`` fields that the source's own trainer applies around the loss (the TRL
                bridge keeps them: it runs inside TRL's trainer)
    rewards     the source's reward functions as ``klgrpo explain`` lists them (dicts; a klgrpo config's
                rewards.functions)
    defaults    the release range's defaults the verdict took for objective fields the source leaves unset
                (TRL's use_bias_correction_kl, beta, ...): where they differ between ranges, explain says so
    kl_off      where a KL coefficient above 0 is set (or defaulted) and the source's own switches leave it unread:
                which, in a phrase (explain says so instead of "beta is 0")
    """

    config: dict[str, Any] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    extra_kl: list[dict[str, Any]] = field(default_factory=list)
    off_policy: bool = False
    source_runtime: set[str] = field(default_factory=set)
    rewards: list[dict[str, Any]] = field(default_factory=list)
    defaults: dict[str, Any] = field(default_factory=dict)
    kl_off: str = ""

    def nested(self) -> dict[str, dict[str, Any]]:
        """``config`` as the nested mapping a klgrpo YAML holds ({"kl": {"coef": ...}, ...})."""
        out: dict[str, Any] = {}
        for key, value in self.config.items():
            node = out
            *groups, name = key.split(".")
            for group in groups:
                node = node.setdefault(group, {})
            node[name] = value
        return out

    def klgrpo_config(self) -> GRPOConfig:
        return GRPOConfig.from_dict(self.nested(), origin="the mapped config")


#: The kl.* keys each shaping reads (its keywords are named apart from the fields: config/terms.py:kl_term maps them).
_SHAPING_KEYS = {"clip": ("kl.clip_threshold",), "sigmoid": ("kl.shaping_target",)}


def _controller_keys(name: str) -> set[str]:
    """The kl.* keys the controller registered as ``name`` reads: its constructor's keywords."""
    return {f"kl.{field_name}" for field_name in controller_fields(name)}


def drop_unread_kl_keys(config: dict[str, Any]) -> None:
    """Remove the kl.* settings that some controller or shaping reads but the configured ones do not (klgrpo's
    defaults stand in for them and nothing reads them); an unregistered controller keeps them all."""
    optional = set().union(*map(_controller_keys, CONTROLLERS), *_SHAPING_KEYS.values())
    controller = config.get("kl.controller", "fixed")
    keep = _controller_keys(controller) if controller in CONTROLLERS else optional
    keep |= set(_SHAPING_KEYS.get(config.get("kl.shaping", "none"), ()))
    for key in optional - keep:
        config.pop(key, None)


def render_table(rows: tuple[FieldMapping, ...], source: str) -> str:
    """The rows as a markdown table (the docs hold exactly this text)."""
    lines = [f"| {source} field | default | klgrpo key | rule |", "|---|---|---|---|"]
    for row in rows:
        keys = ", ".join(f"`{k}`" for k in row.keys) or "(none)"
        lines.append(f"| `{row.field}` | `{row.default!r}` | {keys} | {row.rule} |")
    return "\n".join(lines)


def mapped_objective(cfg: GRPOConfig, beta: float, inputs: ObjectiveInputs, normalizer: Normalizer, *,
                     entropy_coef: float | None = None, entropy_cut: Tensor | None = None) -> ObjectiveOut:
    """klgrpo's objective of one micro-batch (``inputs``) under the mapped ``cfg`` at beta ``beta``: the one place
    the TRL bridge and the exactness tests of ``klgrpo explain`` call it. ``entropy_coef`` is the bonus's applied
    coefficient (None: ``loss.entropy_coef``); ``entropy_cut`` as grpo_objective's; ``inputs.sampler_logp_BT``:
    the sampler's log-probs, weighted per ``rollout.sampler_correction``."""
    coef = cfg.loss.entropy_coef if entropy_coef is None else entropy_coef
    terms = ObjectiveTerms(kl=kl_term(cfg.kl, beta), aggregation=cfg.loss.aggregation, policy=policy_term(cfg.loss),
                           entropy=entropy_term(cfg.loss, coef), sampler_correction=sampler_correction(cfg.rollout))
    return grpo_objective(inputs, terms, normalizer, entropy_cut=entropy_cut)
