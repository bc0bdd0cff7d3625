"""What decides the KL in each release range of TRL, Unsloth, verl and OpenRLHF, as data (trl.json, written by
tools/trl_versions.py from TRL's source at every minor release; unsloth.json, read by hand from Unsloth's and
unsloth_zoo's source, each row naming the file and commit read; verl.json and openrlhf.json, written by
tools/rl_versions.py from every release tag), and the version constraints a file states.

Each table is read and checked once, into the row types of :mod:`.rows`: a ``TRLRange`` is one TRL or Unsloth
range in the terms of klgrpo.integrations.trl_mapping (TRL's defaults there, the GRPOConfig fields it lacks or
still has, and (Unsloth) the defaults Unsloth writes and its own loss's KL); an ``RLRange`` is one verl or
OpenRLHF range, read by klgrpo.integrations.verl_mapping and openrlhf_mapping, its estimators typed as
``TableEstimator`` and its reward rule as ``RewardKL``. Versions and clauses: :mod:`.clauses`.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from packaging.version import Version

from klgrpo.errors import ConfigError
from klgrpo.integrations.versions.clauses import (
    Constraint,
    constraints,
    parse_version,
    release_label,
    satisfiable,
    specifier_set,
)
from klgrpo.integrations.versions.rows import (
    NAMES,
    ReleaseRange,
    RewardKL,
    RLRange,
    TableError,
    TableEstimator,
    TRLRange,
    checked_ranges,
    estimators_of,
    reward_rule,
    row_names,
    row_place,
    row_version,
    table_estimator,
    table_path,
)

__all__ = ["NAMES", "RL_FRAMEWORKS", "Constraint", "NotInRange", "ReleaseRange", "RewardKL", "RLRange",
           "TableError", "TableEstimator", "TRLRange", "checked_ranges", "constraints", "git_pins_in", "imports_in",
           "newest", "outside_every_range", "parse_option", "parse_version", "pins_in", "profiles", "release_label",
           "rl_profiles", "satisfiable", "specifier_set", "spans", "stated_in", "table_estimator", "table_path",
           "trl_profiles", "unsloth_config_fields", "unsloth_profiles"]

HERE = Path(__file__).resolve().parent
#: Those whose tables tools/rl_versions.py writes (one row per range, read by their mappings).
RL_FRAMEWORKS = ("verl", "openrlhf")
_CLAUSE = r"(?:==|~=|>=|<=|!=|>|<)\s*v?\d+(?:\.\d+){0,2}(?:\.post\d+)?"
_PIN = r"(?<![\w-]){name}(?:\[[\w,\s-]*\])?\s*(" + _CLAUSE + r"(?:\s*,\s*" + _CLAUSE + r")*)"
#: ``trl @ git+https://github.com/huggingface/trl.git@REF`` (open-r1's setup.py): a release tag or a commit.
_GIT_PIN = r"(?<![\w-])trl(?:\[[\w,\s-]*\])?\s*@\s*git\+https?://github\.com/huggingface/trl(?:\.git)?@([\w.]+)"


class NotInRange(ConfigError):
    """A field the release range being tried lacks: that range cannot run the file."""


def pins_in(text: str, package: str) -> list[Constraint]:
    """The version clauses a file states for ``package``: pins, requirements lines, ``pip install pkg==X``."""
    found = []
    for match in re.finditer(_PIN.replace("{name}", re.escape(package)), text, re.I):
        found.extend(constraints(re.sub(r"\s+|v(?=\d)", "", match.group(1))))
    return found


@lru_cache(maxsize=None)
def _table(name: str) -> dict[str, Any]:
    return json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def trl_profiles() -> tuple[TRLRange, ...]:
    def make(index: int, row: dict, low: Version, high: Version | None) -> TRLRange:
        path, defaults = table_path("trl"), row["defaults"]
        if not isinstance(defaults, dict) or not isinstance(defaults.get("beta"), (int, float)):
            raise TableError(f"{row_place(path, index, row)}: defaults must hold TRL's beta, got {defaults!r}")
        return TRLRange("trl", low, high, dict(defaults), frozenset(row_names(path, index, row, "absent")),
                        frozenset(row_names(path, index, row, "removed_since")), row_names(path, index, row, "read"))

    return checked_ranges(table_path("trl"), _table("trl")["ranges"], make)


@lru_cache(maxsize=None)
def unsloth_config_fields() -> dict[str, tuple[Version, str | None]]:
    """The fields Unsloth's patched GRPOConfig adds to TRL's (unsloth.json's config_fields): name -> (the first
    Unsloth release that has it, what it changes; None: speed or memory only). TRL's own GRPOConfig refuses
    them, so a file that sets one runs on Unsloth."""
    fields = _table("unsloth")["config_fields"]["fields"]
    return {name: (parse_version(row["from"]), row["does"]) for name, row in fields.items()}


@lru_cache(maxsize=None)
def unsloth_profiles() -> tuple[TRLRange, ...]:
    """Each Unsloth range paired with each TRL range its pins allow."""
    table = _table("unsloth")
    rewrites = {k: v for k, v in table["rewrites"].items() if k in ("dapo", "dr_grpo")}
    loss_read = tuple(table["loss"]["read"])

    def make(index: int, row: dict, low: Version, high: Version | None) -> list[TRLRange]:
        pins = constraints(row["trl"])
        own = {k: v for k, v in row["defaults"].items() if v is not None}
        return [TRLRange("unsloth", low, high, {**trl.defaults, **own}, trl.absent, trl.removed_since,
                         row_names(table_path("unsloth"), index, row, "read") + loss_read, True, rewrites, trl)
                for trl in trl_profiles() if trl.allows(pins)]

    pairs = checked_ranges(table_path("unsloth"), table["ranges"], make)
    return tuple(profile for paired in pairs for profile in paired)


@lru_cache(maxsize=None)
def rl_profiles(framework: str) -> tuple[RLRange, ...]:
    """verl's or OpenRLHF's ranges, typed and checked."""
    def make(index: int, row: dict, low: Version, high: Version | None) -> RLRange:
        path, defaults = table_path(framework), row["defaults"]
        where = row_place(path, index, row)
        if not isinstance(defaults, dict) or framework == "openrlhf" and not all(
                isinstance(e, dict) and set(e) == {"flag", "default"} and str(e["flag"]).startswith("--")
                for e in defaults.values()):
            raise TableError(f"{where}: defaults must map "
                             + ("each KL setting to {flag, default}" if framework == "openrlhf" else "keys to values"))
        return RLRange(framework, low, high, row_version(path, index, row, "last_read"), dict(defaults),
                       reward_rule(framework, where, row), estimators_of(where, row),
                       row_names(path, index, row, "entry_points") if "entry_points" in row else (),
                       row_names(path, index, row, "read"))

    return checked_ranges(table_path(framework), _table(framework)["ranges"], make)


def newest(framework: str) -> RLRange:
    """The newest range of verl's or OpenRLHF's table: the rules a config is mapped by without a range."""
    return rl_profiles(framework)[-1]


def profiles(framework: str, clauses: dict[str, list[Constraint]]) -> list[TRLRange] | list[RLRange]:
    """The ranges of ``framework`` that the clauses allow (TRL's clauses also bound Unsloth's TRL)."""
    if framework in RL_FRAMEWORKS:
        return [p for p in rl_profiles(framework) if p.allows(clauses.get(framework, []))]
    if framework == "trl":
        return [p for p in trl_profiles() if p.allows(clauses.get("trl", []))]
    return [p for p in unsloth_profiles()
            if p.allows(clauses.get("unsloth", [])) and p.trl is not None and p.trl.allows(clauses.get("trl", []))]


def spans(found: list[ReleaseRange]) -> list[str]:
    """The ranges as few labels as possible: neighbouring TRL ranges (under the same Unsloth range) joined."""
    merged: list[ReleaseRange] = []
    for p in sorted(found, key=lambda p: (p.low, p.trl.low) if getattr(p, "trl", None) else (p.low,)):
        last = merged[-1] if merged else None
        trl, last_trl = getattr(p, "trl", None), getattr(last, "trl", None)
        if last is not None and p.framework == last.framework != "unsloth" and last.high == p.low:
            merged[-1] = ReleaseRange(p.framework, last.low, p.high)
        elif (last is not None and trl and last_trl and (last.low, last.high) == (p.low, p.high)
              and last_trl.high == trl.low):
            merged[-1] = replace(p, trl=replace(trl, low=last_trl.low))
        else:
            merged.append(p)
    return [p.label for p in merged]


def parse_option(text: str) -> dict[str, list[Constraint]]:
    """``--version trl==0.18`` (several joined by spaces or ';': ``unsloth==2025.3.1;trl==0.15``; also
    ``verl==0.3``, ``openrlhf==0.5.9.post1``)."""
    out: dict[str, list[Constraint]] = {}
    for item in filter(None, re.split(r"[;\s]+", text)):
        match = re.match(r"^(trl|unsloth|verl|openrlhf)\s*(.+)$", item, re.I)
        if not match:
            raise ConfigError(f"--version {item!r}: write trl==X, unsloth==X, verl==X or openrlhf==X (e.g. "
                              "--version trl==0.18)")
        out.setdefault(match.group(1).lower(), []).extend(constraints(match.group(2)))
    return out


def imports_in(text: str) -> list[Constraint]:
    """``>=`` the first release of each TRL module the file imports that not every release has."""
    first = _table("trl")["modules_first"]
    found = []
    for module, release in first.items():
        if re.search(rf"^\s*(from\s+{re.escape(module)}(\s|\.)|import\s+{re.escape(module)}\b)", text, re.M):
            found.append(Constraint(">=", parse_version(release)))
    return found


def git_pins_in(text: str) -> list[Constraint]:
    """TRL installed from git: a release tag -> ``==`` it; a commit that trl.json's ``commits`` holds -> the range
    whose rules were read at it; another commit or a branch states no release."""
    out = []
    table = _table("trl")
    for match in re.finditer(_GIT_PIN, text, re.I):
        ref = match.group(1).lower()
        if re.fullmatch(r"v?\d+\.\d+\.\d+", ref):
            out.append(Constraint("==", parse_version(ref)))
            continue
        known = [row for sha, row in table.get("commits", {}).items() if len(ref) >= 7 and sha.startswith(ref)]
        span = next((r for r in trl_profiles() if known and r.low == parse_version(known[0]["range_from"])), None)
        if span is not None:
            out.append(Constraint(">=", span.low))
            out += [Constraint("<", span.high)] if span.high else []
    return out


def stated_in(text: str) -> dict[str, list[Constraint]]:
    """The clauses a file states for TRL, Unsloth, verl and OpenRLHF: pins (also a git install of TRL), and for
    TRL the modules it imports."""
    out = {name: found for name in NAMES if (found := pins_in(text, name))}
    if git := git_pins_in(text):
        out["trl"] = out.get("trl", []) + git
    if imported := imports_in(text):
        out["trl"] = out.get("trl", []) + imported
    return out


def outside_every_range(framework: str, clauses: list[Constraint]) -> str:
    """The one line for clauses that no range of verl's or OpenRLHF's table allows."""
    first = release_label(rl_profiles(framework)[0].low)
    return (f"{NAMES[framework]}{','.join(map(str, clauses))} is outside every {NAMES[framework]} release range "
            f"klgrpo knows ({first} and later, klgrpo/integrations/versions/{framework}.json); pass "
            f"--version {framework}==X with a release from {first} on")
