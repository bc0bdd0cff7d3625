"""Resolve a reward function's name: a built-in, "module.path:function" or "path/to/file.py:function"."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

from klgrpo.core.rewards.builtins import BUILTIN_REWARDS
from klgrpo.errors import KLGRPOError, RewardError

_FILE_MODULES: dict[Path, ModuleType] = {}


def load_reward_function(name: str) -> Callable:
    """The reward function called ``name``.

    name: a built-in (``BUILTIN_REWARDS``), ``"package.module:function"`` (importable; a module in the working
        directory is found even when klgrpo runs as a console script) or ``"path/to/file.py:function"``
        (relative to the working directory; the file's folder is importable while the file loads).
    """
    if not isinstance(name, str) or not name.strip():
        raise RewardError(f"a reward function name must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[name]
        package, extra = getattr(fn, "requires_package", (None, None))
        if package and importlib.util.find_spec(package) is None:
            raise RewardError(f"the built-in reward {name!r} needs the {package.replace('_', '-')} package: "
                              f"pip install \"{extra}\"")
        return fn
    usage = (f"use a built-in ({', '.join(BUILTIN_REWARDS.names())}), 'module.path:function' or "
             f"'path/to/file.py:function'")
    fn = load_user_function(name, "reward function", RewardError, usage)
    _check_signature(fn, name)
    return fn


def load_user_function(name: str, what: str, error: type[KLGRPOError] = RewardError, usage: str = "") -> Callable:
    """The function ``"module.path:function"`` or ``"path/to/file.py:function"`` (see
    :func:`load_reward_function`); failures raise ``error`` with a message that starts with ``what``."""
    usage = usage or "use 'module.path:function' or 'path/to/file.py:function'"
    target, _, fn_name = name.strip().rpartition(":")
    if not target or not fn_name:
        raise error(f"unknown {what} {name!r}; {usage}")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    label = f"{what} {name!r}"
    module = _import_file(target, label, error) if is_file else _import_module(target, label, error)
    fn = getattr(module, fn_name, None)
    if fn is None:
        defined = [n for n, v in vars(module).items()
                   if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]
        listing = ", ".join(defined) if defined else "none"
        raise error(f"{label}: {target} has no attribute {fn_name!r} (its functions: {listing}); fix the name "
                    f"after the colon")
    if not callable(fn):
        raise error(f"{label}: {fn_name!r} in {target} is of type {type(fn).__name__}, not a function")
    return fn


def display_name(name: str) -> str:
    """Short name for metrics: a built-in's name, else the function's name after the colon."""
    return name.strip().rpartition(":")[2]


def _check_signature(fn: Callable, name: str) -> None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature: trust them
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise RewardError(f"reward function {name!r} must accept (prompts, completions, **columns), but its "
                          f"signature is {inspect.signature(fn)}")


def _import_module(module_name: str, label: str, error: type[KLGRPOError] = RewardError) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        cwd = Path.cwd()
        # A console script's sys.path lacks the working directory, where users keep their reward modules.
        if (e.name in (top, module_name) and str(cwd) not in sys.path and "" not in sys.path
                and ((cwd / f"{top}.py").exists() or (cwd / top).is_dir())):
            sys.path.append(str(cwd))
            return _import_module(module_name, label, error)
        if e.name is not None and module_name.startswith(e.name):
            raise error(f"{label}: no module named {e.name!r} can be imported; check the name, put the module's "
                        f"folder on PYTHONPATH or use 'path/to/file.py:function'") from None
        raise error(f"{label}: importing {module_name} raised {_describe(e)}") from e
    except Exception as e:
        raise error(f"{label}: importing {module_name} raised {_describe(e)}") from e


def _import_file(file_name: str, label: str, error: type[KLGRPOError] = RewardError) -> ModuleType:
    path = Path(file_name).expanduser()
    if not path.is_file():
        raise error(f"{label}: file {file_name} not found (relative paths start at "
                          f"{Path.cwd()}); check the path before the colon")
    path = path.resolve()
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    # A unique, importable module name, so that pickling and dataclasses in the file work.
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"klgrpo_user_file_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise error(f"{label}: {file_name} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.parent))  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise error(f"{label}: importing {file_name} raised {_describe(e)}") from e
    finally:
        if str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    _FILE_MODULES[path] = module
    return module


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
