"""How a config field is declared (a default, a help text, its valid names, its lower bound, whether a resume may
change it) and how a value from YAML or the command line becomes the field's type; klgrpo/config/schema.py
declares the tree with these, and the checks (validation.py) and the resume (klgrpo/run/run_folder.py) read the
declarations."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any

from klgrpo.errors import ConfigError


class Names:
    """The valid values of a field, read from their sources (tuples or registries) each time they are checked,
    so a name registered after this module was imported (a new estimator, controller, shaping) is accepted."""

    def __init__(self, *sources: Any):
        self.sources = sources

    def __iter__(self):
        for source in self.sources:
            yield from source

    def __contains__(self, value: object) -> bool:
        return any(value in source for source in self.sources)


def setting(default: Any, help: str, choices: Any = None, *, low: float | None = None, above: bool = False,
            at_low: str = "", infinite_ok: bool = False, resume_safe: bool = False, high: float | None = None,
            words: tuple[str, ...] = ()) -> Any:
    """A config field: its default, its one-line help (`klgrpo train --help`), its valid values (None: any), and
    what the checks and a resume read from its declaration:

    low, above    the lowest value allowed: ``value >= low``, or ``value > low`` with above=True (None: no bound)
    at_low        what the field means at its bound ("0: off"), said in the refusal
    high          the highest value allowed: ``value <= high`` (None: no bound)
    words         the words a number field also takes as they are ("auto"), resolved where the field is read
    infinite_ok   a float that may be infinite ("no upper bound"); NaN is refused everywhere
    resume_safe   a resume may change it (with a warning): it does not change what the steps compute
    """
    meta = {"help": help, "choices": choices, "low": low, "above": above, "at_low": at_low,
            "infinite_ok": infinite_ok, "resume_safe": resume_safe, "high": high, "words": tuple(words)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def group(cls: type, *, resume_safe: bool = False) -> Any:
    """A group of fields (a dataclass of settings); ``resume_safe``: a resume may change any field in it."""
    return field(default_factory=cls, metadata={"resume_safe": resume_safe})


def bound_problem(path: str, spec: dataclasses.Field, value: Any) -> str | None:
    """The refusal of ``value`` outside the bounds declared on the field ``spec`` (None: it is in bounds; a word
    the field takes has no bound)."""
    if isinstance(value, str) and value in spec.metadata.get("words", ()):
        return None
    high = spec.metadata.get("high")
    if high is not None and not value <= high:
        return f"{path} must be <= {high:g}, got {value!r}"
    low = spec.metadata.get("low")
    if low is None:
        return None
    above = spec.metadata.get("above", False)
    if value > low if above else value >= low:
        return None
    meaning = spec.metadata.get("at_low", "")
    return f"{path} must be {'>' if above else '>='} {low}, got {value!r}" + (f" ({meaning})" if meaning else "")


def leaves(node: Any, prefix: str = ""):
    """(dotted path, value, Field) of every leaf field of a config dataclass instance, in declaration order."""
    for spec in dataclasses.fields(node):
        value = getattr(node, spec.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{spec.name}.")
        else:
            yield f"{prefix}{spec.name}", value, spec


def is_resume_safe(root: type, path: str) -> bool:
    """Whether a resume may change the field at ``path`` of the config class ``root``: declared resume_safe on
    the field or on a group that holds it (an unknown path is not)."""
    node = root
    for name in path.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return False
        spec = {f.name: f for f in dataclasses.fields(node)}.get(name)
        if spec is None:
            return False
        if spec.metadata.get("resume_safe"):
            return True
        node = typing.get_type_hints(node)[name]
    return False


def coerce(value: Any, typ: Any, path: str, origin: str) -> Any:
    origin_type = typing.get_origin(typ)
    if origin_type in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return None if value is None else coerce(value, args[0], path, origin)
    bad = ConfigError(f"{path} in {origin} must be {getattr(typ, '__name__', typ)}, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise bad
        return int(value)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string: accept scientific notation
            value = float_text(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if typ is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    if typ is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return value
    if typ is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad
        return value
    return value


def float_text(text: str) -> float | str:
    """``"1e-4"``, ``"5E-6"``, ``"+2.5e3"``, ``".inf"`` -> float; anything else stays text (and is refused)."""
    cleaned = text.strip().replace("_", "")
    if cleaned.lower() in (".inf", "+.inf", "-.inf", ".nan"):
        cleaned = cleaned.replace(".", "")
    try:
        return float(cleaned)
    except ValueError:
        return text
