"""Truncated sampling in a source config: the sampling filters it sets (top_p < 1, top_k > 0, min_p > 0) or its
release applies unset, the risk line each framework's trainer earns by scoring the full softmax of tokens drawn
from the truncated distribution, and the klgrpo keys that train the filters as drawn (``rollout.truncation
policy``, docs/algorithm.md, "Truncated sampling").

Per framework and release range the facts are data: ``truncation.json`` beside this module (read by hand from
each framework's sources at the tags it names).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from klgrpo.integrations.mapping import Mapped
from klgrpo.integrations.versions import ReleaseRange, parse_version

TABLE = Path(__file__).with_name("truncation.json")


@lru_cache(maxsize=None)
def table() -> dict[str, Any]:
    return json.loads(TABLE.read_text(encoding="utf-8"))


@dataclass
class Read(Mapped):
    """A mapped source config with risk lines of the source's own (its sampling filters; a framework's term that
    klgrpo's risks do not see, such as prime-rl's kl_tau): report.explain appends them."""

    source_risks: list[tuple[str, str]] = field(default_factory=list)  # (id, line), as report.risks


@dataclass(frozen=True)
class Filter:
    """One sampling filter that is on: the source's name for it, its value, klgrpo's key."""

    name: str
    value: float | int
    key: str


def filter_on(key: str, value: Any) -> bool:
    """Whether a filter's value truncates: top_p < 1, top_k > 0 (-1 and 0 are off), min_p > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    name = key.rsplit(".", 1)[-1]
    return value < 1 if name == "top_p" else value > 0


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _overlaps(profile: ReleaseRange | None, low: str, high: str | None) -> bool:
    """Whether the release range ``profile`` (None: the newest rules) meets [low, high)."""
    if profile is None:
        return high is None
    low_v, high_v = parse_version(low), parse_version(high) if high else None
    return (high_v is None or profile.low < high_v) and (profile.high is None or low_v < profile.high)


def _within(profile: ReleaseRange | None, low: str, high: str | None) -> bool:
    """Whether every release of ``profile`` lies in [low, high)."""
    if profile is None:
        return high is None
    return profile.low >= parse_version(low) and (
        high is None or profile.high is not None and profile.high <= parse_version(high))


def apply(framework: str, mapped: Mapped, settings: dict[str, Any], profile: ReleaseRange | None,
          sampling_params: dict[str, Any] | None = None, sampling_line: int | None = None) -> Read:
    """``mapped`` with the filters of ``settings`` (the source's values by its own names; ``sampling_params``:
    Unsloth's ``vllm_sampling_params``, which replace them) written into klgrpo's rollout keys, taken out of
    ``ignored``, and named in one risk line; a filter the release applies unset gets its own line."""
    rules = table()[framework]
    read = Read(**{f.name: getattr(mapped, f.name) for f in fields(Mapped)},
                source_risks=list(getattr(mapped, "source_risks", ())))
    values: dict[str, tuple[str, Any]] = {}  # klgrpo key -> (the source's name, value), the last setting wins
    prefix = rules.get("flag_prefix", "")
    for name, key in rules["fields"].items():
        if name in settings:
            values[key] = (name, settings[name])
    extra = settings.get(rules.get("also_in", "")) if rules.get("also_in") else None
    if isinstance(extra, dict):  # TRL's generation_kwargs override the fields
        for name, value in extra.items():
            if name in rules["fields"]:
                values[rules["fields"][name]] = (f"{rules['also_in']}.{name}", value)
    if sampling_params:
        for name, value in sampling_params.items():
            if name in rules["fields"]:
                values[rules["fields"][name]] = (f"{rules['sampling_params']} {name}", value)
    on: list[Filter] = []
    for key, (name, raw) in values.items():
        _unignore(read, name)
        value = _number(raw)
        if value is None:  # None (off), or a value the script computes when it runs
            if isinstance(raw, str) and "$" in raw:
                read.unmapped.setdefault(name, f"set when the script runs ({raw}): a value that truncates (top_p "
                                               "< 1, top_k > 0) samples a distribution the trainer does not "
                                               "score; the verdict takes it off")
            read.config[key] = _klgrpo_value(key, 1.0 if key == "rollout.top_p" else 0)
            continue
        replayed = rules.get("replayed", {}).get(name)
        if filter_on(key, value) and replayed and _within(profile, replayed["from"], None):
            read.unmapped.setdefault(prefix + name, f"{value:g}: {replayed['what']}")
        elif filter_on(key, value):
            on.append(Filter(prefix + name, value, key))
        read.config[key] = _klgrpo_value(key, value)
    unset = _unset_filter(read, rules, settings, profile, values)
    if on:
        read.config["rollout.truncation"] = "policy"
        read.source_risks.append(("truncated_sampling", _risk(rules, on, settings, profile, sampling_line)))
    if unset is not None:
        read.source_risks.append(("filter_default", unset))
    return read


def _klgrpo_value(key: str, value: float | int) -> float | int:
    if key == "rollout.top_k":
        return int(value) if value > 0 else 0
    if key == "rollout.min_p":
        return float(value) if value > 0 else 0.0
    return float(value) if 0 < value <= 1 else 1.0


def _unignore(read: Read, name: str) -> None:
    """A sampling filter changes the distribution sampled: never listed as speed, memory or logging, nor as a
    field the mapping does not read."""
    read.ignored[:] = [item for item in read.ignored if item != name]
    if read.unmapped.get(name, "").startswith("not read by the mapping"):
        del read.unmapped[name]


def _unset_filter(read: Read, rules: dict, settings: dict, profile: ReleaseRange | None, values: dict) -> str | None:
    """The risk line of the filters the release applies where the file leaves their fields unset (TRL 0.14 -
    0.17's top_k 50; ROLL's generating_args block: top_p 0.7, top_k 50); where every release of ``profile``
    applies one, klgrpo's key takes its value."""
    rows = []
    for row in rules.get("unset", ()):
        key = rules["fields"][row["field"]]
        if key in values or not _overlaps(profile, row["from"], row["to"]):
            continue
        if row["unless"] and settings.get(row["unless"]) is True:
            continue
        if row.get("requires") and not any(str(name).startswith(row["requires"]) for name in settings):
            continue
        rows.append(row)
    if not rows:
        return None
    written = []
    for row in rows:
        key = rules["fields"][row["field"]]
        if _within(profile, row["from"], row["to"]):
            read.config[key] = row["value"]
            read.config["rollout.truncation"] = "policy"
            written.append(f"{key} {row['value']}")
    first = rows[0]
    releases = (f"{rules['name']} {first['from']} or later" if first["to"] is None
                else f"{rules['name']} >= {first['from']}, < {first['to']}")
    names = " and ".join(row["field"] for row in rows)
    kept = " and ".join(f"{row['field'].rsplit('.', 1)[-1]} {row['value']}" for row in rows)
    fixes = "; ".join(dict.fromkeys(row["fix"] for row in rows))
    whys = "; ".join(dict.fromkeys(row["why"] for row in rows))
    return (f"{names} unset: on {releases} the sampler truncates each position's distribution at {kept} ({whys}) "
            "while "
            f"{_trainer(rules)}, so the old-policy/sampler ratios carry the kept mass and the KL it logs and trains "
            f"estimates neither KL(pi||ref) nor the KL of the distribution sampled; {fixes}, or train the truncated "
            "distribution exactly with klgrpo's rollout.truncation policy"
            + (f" ({', '.join(written)} below)" if written else ""))


def _risk(rules: dict, on: list[Filter], settings: dict, profile: ReleaseRange | None, line: int | None) -> str:
    named = ", ".join(f"{f.name} {f.value:g}" for f in on)
    where = f" (line {line})" if line is not None and any(" " in f.name for f in on) else ""
    text = (f"sampling filter {named}{where}: the sampler draws each token from the truncated, renormalised "
            f"distribution while {_trainer(rules)}, so the old-policy/sampler "
            "ratios carry the kept mass and the KL it logs and trains estimates neither KL(pi||ref) nor the KL of "
            "the distribution sampled")
    logprobs = rules.get("sampler_logprobs")
    if logprobs and _overlaps(profile, logprobs["from"], None) and all(
            settings.get(name, name == "vllm_importance_sampling_correction") is True for name in logprobs["when"]):
        since = "" if _within(profile, logprobs["from"], None) else f"from {rules['name']} {logprobs['from']}, "
        text += f"; {since}{logprobs['what']}"
    keys = ", ".join(f"{f.key} {_klgrpo_value(f.key, f.value):g}" for f in on)
    return text + f"; klgrpo's rollout.truncation policy trains the truncated distribution exactly ({keys} below)"


def _trainer(rules: dict) -> str:
    """The table's line on how the trainer scores, without its evidence in parentheses."""
    return rules["trainer"].split(" (")[0]
