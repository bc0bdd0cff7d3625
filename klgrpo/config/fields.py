"""How a config field is declared (a default, a help text, its valid names, its bounds, whether a resume may
change it) and how a value from YAML or the command line becomes the field's type; klgrpo/config/schema.py
declares the tree with these, and the checks (validation.py) and the resume (klgrpo/store/run_folder.py) read the
declarations."""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from dataclasses import field
from typing import Any

from klgrpo.errors import ConfigError


class Settings:
    """A group of config fields: settable while the config is being put together, read-only once it is validated
    (``freeze``), so what a run checked is what it runs; a changed copy comes from ``dataclasses.replace`` or
    GRPOConfig.override."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {name}: the config is read-only once validated; make a changed copy "
                f"(dataclasses.replace, or GRPOConfig.override)")
        object.__setattr__(self, name, value)


def freeze(node: Any) -> None:
    """Make ``node`` and every group inside it read-only (Settings)."""
    object.__setattr__(node, "_frozen", True)
    for spec in dataclasses.fields(node):
        value = getattr(node, spec.name)
        if dataclasses.is_dataclass(value):
            freeze(value)


class Names:
    """The valid values of a field, read from their sources (tuples or registries) each time they are checked,
    so a name registered after this module was imported (a new estimator, controller, shaping) is accepted. A
    source written "module:NAME" is imported when first read: declaring the config loads no torch."""

    def __init__(self, *sources: Any):
        self.sources = sources

    def _resolved(self):
        for source in self.sources:
            if isinstance(source, str):
                module, _, name = source.partition(":")
                source = getattr(importlib.import_module(module), name)
            yield source

    def __iter__(self):
        for source in self._resolved():
            yield from source

    def __contains__(self, value: object) -> bool:
        return any(value in source for source in self._resolved())


def setting(default: Any, help: str, choices: Any = None, *, low: float | None = None, above: bool = False,
            high: float | None = None, below: bool = False, at_low: str = "", infinite_ok: bool = False,
            resume_safe: bool = False, words: tuple[str, ...] = ()) -> Any:
    """A config field: its default, its one-line help (`klgrpo train --help`), its valid values (None: any), and
    what the checks and a resume read from its declaration:

    low, above    the lowest value allowed: ``value >= low``, or ``value > low`` with above=True (None: no bound)
    high, below   the highest: ``value <= high``, or ``value < high`` with below=True (None: no bound)
    at_low        what the field means at its bound ("0: off"), or why the bound is there, said in the refusal
    infinite_ok   a float that may be infinite ("no upper bound"); NaN is refused everywhere
    resume_safe   a resume may change it (with a warning): it does not change what the steps compute
    words         the words a number field also takes as they are ("auto"), resolved where the field is read
    """
    meta = {"help": help, "choices": choices, "low": low, "above": above, "high": high, "below": below,
            "at_low": at_low, "infinite_ok": infinite_ok, "resume_safe": resume_safe, "words": tuple(words)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def declared_setting(params: type, name: str) -> Any:
    """A config field declared from the field ``name`` of a registered entry's settings dataclass (its default,
    help and bounds: klgrpo.math.registry.param), so the two never disagree."""
    spec = {f.name: f for f in dataclasses.fields(params)}[name]
    bounds = {k: spec.metadata[k] for k in ("low", "above", "high", "below", "at_low")}
    return setting(spec.default, spec.metadata["help"], **bounds)


def group(cls: type, *, resume_safe: bool = False) -> Any:
    """A group of fields (a dataclass of settings); ``resume_safe``: a resume may change any field in it."""
    return field(default_factory=cls, metadata={"resume_safe": resume_safe})


def bound_problem(path: str, spec: dataclasses.Field, value: Any) -> str | None:
    """The refusal of ``value`` outside the bounds declared on the field ``spec`` (None: it is in bounds; a word
    the field takes has no bound)."""
    meta = spec.metadata
    if isinstance(value, str) and value in meta.get("words", ()):
        return None
    low, high = meta.get("low"), meta.get("high")
    above, below = meta.get("above", False), meta.get("below", False)
    if (low is None or (value > low if above else value >= low)) and (
            high is None or (value < high if below else value <= high)):
        return None
    if high is None:
        wanted = f"{'>' if above else '>='} {low}"
    elif low is None:
        wanted = f"{'<' if below else '<='} {high}"
    else:
        wanted = f"in {'(' if above else '['}{low}, {high}{')' if below else ']'}"
    meaning = meta.get("at_low", "")
    return f"{path} must be {wanted}, got {value!r}" + (f" ({meaning})" if meaning else "")


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
