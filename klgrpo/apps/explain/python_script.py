"""A Python training script, parsed with ``ast`` and never run or imported: its ``GRPOConfig(...)`` call and the
keyword arguments written as literals.

A call counts when its callee is ``GRPOConfig`` (imported from TRL, from ``klgrpo.trl``, from Unsloth, or used
without an import, as documentation snippets do), a name it was imported as (``from trl import GRPOConfig as
C``), an attribute ending in ``GRPOConfig`` (``trl.GRPOConfig``) or Unsloth's ``UnslothGRPOConfig``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from klgrpo.apps.explain.reading import check_plain, on_line, refuse
from klgrpo.errors import ConfigError

CONFIG_CLASSES = ("GRPOConfig", "UnslothGRPOConfig")
COMPUTED = "computed when the script runs: the verdict uses TRL's default"


@dataclass
class ConfigCall:
    """One GRPOConfig call: its line, its literal keywords, and the keywords computed at run time."""

    line: int
    keywords: dict[str, Any] = field(default_factory=dict)
    computed: dict[str, str] = field(default_factory=dict)  # keyword -> why it is not read
    imported_from: str = ""
    sampling: dict[str, Any] | None = None  # Unsloth's vllm_sampling_params: its SamplingParams(...) literals
    sampling_line: int | None = None


def parse(text: str, origin: str) -> ast.Module:
    try:
        return ast.parse(text, filename=origin)
    except SyntaxError as err:
        raise refuse(origin, f"is not valid Python (line {err.lineno}: {err.msg})") from None
    except (RecursionError, MemoryError, ValueError):
        raise refuse(origin, "nests too deeply to be parsed as Python") from None


def looks_like_python(tree: ast.Module) -> bool:
    """An import, a function or class, or a GRPOConfig call: a YAML line such as ``beta: 0.1`` also parses as
    Python (an annotation), so parsing alone does not tell."""
    return any(isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
               for node in tree.body) or bool(config_calls(tree, "<text>"))


def _config_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> the module it was imported from, for each imported GRPOConfig class."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in CONFIG_CLASSES:
                    names[alias.asname or alias.name] = node.module or ""
    return names


def _callee(node: ast.Call, imported: dict[str, str]) -> str | None:
    """The module the called GRPOConfig comes from ("" when not imported), or None if it is another call."""
    func = node.func
    if isinstance(func, ast.Name):
        if func.id in imported:
            return imported[func.id]
        return "" if func.id in CONFIG_CLASSES else None
    if isinstance(func, ast.Attribute) and func.attr in CONFIG_CLASSES:
        return ast.unparse(func.value)
    return None


def config_calls(tree: ast.Module, origin: str) -> list[ConfigCall]:
    imported = _config_names(tree)
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            module = _callee(node, imported)
            if module is not None:
                calls.append(_read_call(node, module, origin))
                _read_sampling_params(tree, node, calls[-1], origin)
    return sorted(calls, key=lambda call: call.line)


SAMPLING_KEYWORD = "vllm_sampling_params"


def _is_sampling_params(node: ast.Call) -> bool:
    return (isinstance(node.func, ast.Name) and node.func.id == "SamplingParams"
            or isinstance(node.func, ast.Attribute) and node.func.attr == "SamplingParams")


def _read_sampling_params(tree: ast.Module, node: ast.Call, call: ConfigCall, origin: str) -> None:
    """Unsloth's ``vllm_sampling_params=``: a ``SamplingParams(...)`` call written there, or a name assigned one
    at the top level before the GRPOConfig call (the last such assignment): its literal keywords."""
    value = next((k.value for k in node.keywords if k.arg == SAMPLING_KEYWORD), None)
    if isinstance(value, ast.Name):
        assigned = [stmt.value for stmt in tree.body if isinstance(stmt, ast.Assign) and stmt.lineno < node.lineno
                    and any(isinstance(t, ast.Name) and t.id == value.id for t in stmt.targets)]
        value = assigned[-1] if assigned else None
    if not isinstance(value, ast.Call) or not _is_sampling_params(value):
        return
    sampling = _read_call(value, "", origin)
    call.sampling, call.sampling_line = sampling.keywords, value.lineno


def _read_call(node: ast.Call, module: str, origin: str) -> ConfigCall:
    call = ConfigCall(node.lineno, imported_from=module)
    for keyword in node.keywords:
        if keyword.arg is None:
            call.computed[f"**{_source(keyword.value)}"] = (
                "keywords computed when the script runs: the verdict uses TRL's defaults for them")
            continue
        try:
            value = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            call.computed[keyword.arg] = f"{COMPUTED} ({_source(keyword.value)})"
            continue
        value = list(value) if isinstance(value, tuple) else value
        try:
            check_plain(value, f"{origin}: line {node.lineno}: {keyword.arg}")
        except ConfigError:
            call.computed[keyword.arg] = f"{COMPUTED} (not a plain value)"
            continue
        call.keywords[keyword.arg] = value
    return call


def _source(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except (RecursionError, ValueError):
        return "an expression"
    return text if len(text) <= 40 else text[:37] + "..."


def config_call(text: str, origin: str, line: int | None = None) -> ConfigCall:
    """The script's one GRPOConfig call (or the one on ``line``); none or several are refused in one line."""
    calls = config_calls(parse(text, origin), origin)
    if line is not None:
        return on_line(calls, line, origin, "GRPOConfig call on line", "the calls are on lines")
    if not calls:
        raise refuse(origin, "is a Python script without a GRPOConfig(...) call")
    if len(calls) > 1:
        raise ConfigError(f"{origin} has {len(calls)} GRPOConfig calls (lines "
                          f"{', '.join(str(c.line) for c in calls)}); pass --call LINE to pick one")
    return calls[0]
