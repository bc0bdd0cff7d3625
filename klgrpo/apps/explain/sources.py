"""Read an input of ``klgrpo explain``: detect its format and map it onto klgrpo's config.

    trl        a YAML/JSON mapping of what ``trl grpo --config`` reads (GRPOConfig, ModelConfig, the script and
               dataset arguments), or a Python script's ``GRPOConfig(...)`` call (read with ``ast``, never run)
    unsloth    a script (or notebook) importing Unsloth: TRL's fields with Unsloth's patched defaults and its own
               loss's KL (k3 without the importance ratio), per Unsloth release (klgrpo.integrations.versions)
    adaptive_kl  TRL's fields with the adaptive-KL fields (kl_adaptation_method, kl_target, ...) of
               ``klgrpo.trl.GRPOConfig`` and the Unsloth fork it mirrors
    verl       verl's Hydra YAML (actor_rollout_ref:, algorithm:, ...), key=value overrides one per line, or a
               launch script running ``python3 -m verl.trainer.main_ppo key=value ...``; per verl release
               (klgrpo.integrations.versions)
    openrlhf   an OpenRLHF command line (``--algo.kl.init_coef 0.01 --algo.kl.use_loss ...``) in a text file or
               a launch script; per OpenRLHF release
    roll       a ROLL RLVR pipeline config (flat keys beside actor_train:, actor_infer:, ...), per ROLL release
               (roll.py, roll.json)
    prime_rl   a prime-rl RL config (TOML: [trainer], [orchestrator], ...), per prime-rl release (prime_rl.py,
               prime_rl.json)
    nemo_rl    a NeMo-RL GRPO config (grpo:, loss_fn:, policy:, ...; a recipe with defaults:), per NeMo-RL release
               (nemo_rl.py, nemo_rl.json)
    klgrpo     a klgrpo config (model:, kl:, loss:, ...)
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

from klgrpo.apps.explain import (
    frameworks,
    nemo_rl,
    prime_rl,
    python_script,
    roll,
    shell_script,
    skyrl_train,
    slime,
    truncation,
)
from klgrpo.apps.explain.reading import WHAT_EXPLAIN_READS, load_toml, load_yaml, suffix
from klgrpo.apps.explain.rewards import reward_entries
from klgrpo.apps.explain.trl_config import map_trl_config
from klgrpo.config.schema import GRPOConfig, all_field_paths
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import Mapped
from klgrpo.integrations.openrlhf_mapping import OPENRLHF_DEFAULTS, canonical, map_openrlhf, parse_flags
from klgrpo.integrations.trl_mapping import ADAPTIVE_KL_DEFAULTS
from klgrpo.integrations.verl_mapping import ROOTS as VERL_ROOTS
from klgrpo.integrations.verl_mapping import VERL_DEFAULTS, map_verl
from klgrpo.integrations.versions import (
    Constraint,
    NotInRange,
    ReleaseRange,
    RLRange,
    TRLRange,
    newest,
    outside_every_range,
    profiles,
    release_label,
    trl_profiles,
    unsloth_config_fields,
)

FORMATS = ("trl", "verl", "openrlhf", "unsloth", "adaptive_kl", "nemo_rl", "roll", "skyrl_train", "prime_rl", "slime",
           "klgrpo")
#: The formats read through TRL's fields, per release range (klgrpo.integrations.versions).
TRL_KINDS = ("trl", "unsloth", "adaptive_kl")
_UNSLOTH_IMPORT = re.compile(r"^\s*(from\s+unsloth(_zoo)?\b|import\s+unsloth\b)|\b(PatchFastRL|UnslothGRPO\w*)\b", re.M)
KLGRPO_GROUPS = tuple(f.name for f in GRPOConfig.__dataclass_fields__.values())
_OVERRIDE = re.compile(r"^\+{0,2}[A-Za-z_][\w.]*=")
#: What a launch script passes on from its own command line.
_SCRIPT_ARGUMENTS = ("$@", "$*", "${@}", "${*}")
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_SHELL = re.compile(r"^#!.*\b(ba|z|da)?sh\b")


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _override_value(text: str, origin: str) -> Any:
    """A Hydra override's value as YAML (``True``, ``1e-6``, ``['a', 'b']``); text that is no YAML stays text."""
    if not text.strip():
        return None
    try:
        value = load_yaml(text, origin)
    except ConfigError:
        return text
    if isinstance(value, str) and _NUMBER.match(value):  # Hydra reads 1e-6 as a number, YAML 1.1 as text
        return float(value)
    return value


def _overrides(text: str, origin: str) -> dict[str, Any] | None:
    """key=value lines (comments and blank lines skipped) -> {key: YAML value}, or None if not that format."""
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines or not all(_OVERRIDE.match(line) for line in lines):
        return None
    out = {}
    for line in lines:
        key, value = line.lstrip("+").split("=", 1)
        out[key.strip()] = _override_value(value, origin)
    return out


def _shape(text: str, origin: str) -> str:
    """"python", "script" (a verl or OpenRLHF launch script), "overrides", "flags" or "mapping"."""
    first = text.lstrip().split("\n", 1)[0]
    if suffix(origin) == ".toml":
        return "mapping"
    if suffix(origin) == ".py" or first.startswith("#!") and "python" in first:
        return "python"
    if suffix(origin) in (".sh", ".bash") or _SHELL.match(first) or shell_script.launchers_in(text):
        return "script"
    if _overrides(text, origin) is not None:
        return "overrides"
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if lines and lines[0].startswith("--"):
        return "flags"
    return "python" if _is_python(text, origin) else "mapping"


def _is_python(text: str, origin: str) -> bool:
    """A script without the .py suffix: it imports something and parses as Python with an import, a definition
    or a GRPOConfig call (a YAML line such as ``beta: 0.1`` also parses as Python)."""
    if not re.search(r"^\s*(from|import)\s+[\w.]+", text, re.M):
        return False
    try:
        return python_script.looks_like_python(python_script.parse(text, origin))
    except ConfigError:
        return False


def _parse(text: str, origin: str) -> tuple[str, Any]:
    """(shape, parsed) by the text's shape."""
    shape = _shape(text, origin)
    if shape == "overrides":
        return shape, _overrides(text, origin)
    if shape == "flags":
        return shape, shell_script.flag_tokens(text, origin)
    if shape in ("python", "script"):
        return shape, text
    data = load_toml(text, origin) if suffix(origin) == ".toml" else load_yaml(text, origin)
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{origin} is none of the formats klgrpo explain reads ({WHAT_EXPLAIN_READS})")
    return "mapping", data


def _candidates(shape: str, data: Any) -> list[str]:
    if shape == "flags":
        return ["openrlhf"]
    if shape == "overrides":
        return ["skyrl_train"] if skyrl_train.is_skyrl_overrides(data) else ["verl"]
    top = set(data)
    nested = all(isinstance(value, dict) for value in data.values())
    found = []
    if nested and top <= set(KLGRPO_GROUPS):
        found.append("klgrpo")
    if top & set(VERL_ROOTS) and {str(key).split(".")[0] for key in top} <= set(VERL_ROOTS):
        found.append("verl")
    if nemo_rl.is_nemo_rl(data):
        found.append("nemo_rl")
    if roll.is_roll(data):
        found.append("roll")
    if skyrl_train.is_skyrl(data):
        found.append("skyrl_train")
    if prime_rl.is_prime_rl(data):
        found = [name for name in found if name != "klgrpo"] + ["prime_rl"]  # its [model] is no klgrpo group
    # a Hydra config's defaults: list is no TRL field
    if not nested and not {"verl", "nemo_rl", "roll", "skyrl_train", "prime_rl"} & set(found):
        found.append("adaptive_kl" if top & set(ADAPTIVE_KL_DEFAULTS) else "trl")
    return found


def load_source(text: str, origin: str, source: str | None = None, call: int | None = None) -> tuple[str, Mapped]:
    """(format, mapped config) of the text by TRL 1.16's rules; ``source`` forces the format, ``call`` picks the
    GRPOConfig call or launcher command that starts on that line."""
    found, variants = load_variants(text, origin, source, call)
    return found, variants[0][1]


Variant = tuple[ReleaseRange | None, Mapped]


def load_variants(text: str, origin: str, source: str | None = None, call: int | None = None,
                  versions: dict[str, list[Constraint]] | None = None) -> tuple[str, list[Variant]]:
    """(format, [(release range, mapped config)]): with ``versions`` (the clauses of --version or of the file,
    possibly none), a TRL, Unsloth, verl or OpenRLHF file is mapped under each release range they allow that has
    every field the file sets; without, by the newest rules alone (range None)."""
    if suffix(origin) == ".ipynb" or text.lstrip().startswith("{") and '"cells"' in text[:4096]:
        # a notebook is Python: never read as YAML (JSON is YAML) when a cell does not parse
        return _from_python(notebook_code(text, origin), origin, source, call, versions)
    shape, data = _parse(text, origin)
    if shape == "python":
        return _from_python(text, origin, source, call, versions)
    if shape == "script":
        return _from_script(text, origin, source, call, versions)
    if source is None:
        found = _candidates(shape, data)
        if not found:
            raise ConfigError(f"{origin} is none of the formats klgrpo explain reads ({WHAT_EXPLAIN_READS}); its "
                              f"top-level keys: {', '.join(sorted(map(str, data)))[:80]}")
        if len(found) != 1:
            keys = ", ".join(sorted(map(str, data)))[:80] if shape == "mapping" else shape
            raise ConfigError(f"{origin} could be {' or '.join(found) or 'none of the formats'} (top-level keys: "
                              f"{keys}); pass --from {'|'.join(found or FORMATS)}")
        source = found[0]
    if source == "openrlhf":
        if shape != "flags":
            raise ConfigError(f"{origin} holds no --flags; an OpenRLHF config is its command line")
        flags = parse_flags(data, origin)
        return source, rl_variants("openrlhf", origin, versions, lambda p: truncation.apply(
            "openrlhf", map_openrlhf(flags, origin, p), flags, p))
    if shape == "flags":
        raise ConfigError(f"{origin} is a command line; only --from openrlhf reads one")
    if source == "skyrl_train":
        values = data if shape == "overrides" else _flatten(data)
        return source, table_variants("skyrl_train", origin, versions, lambda r: _skyrl(values, origin, r))
    if source == "verl":
        values = data if shape == "overrides" else _flatten(data)
        return source, rl_variants("verl", origin, versions, lambda p: truncation.apply(
            "verl", map_verl(values, origin, p), values, p))
    if shape == "overrides":
        raise ConfigError(f"{origin} holds key=value lines; only --from verl or skyrl_train reads them")
    if source == "nemo_rl":
        if shape != "mapping":
            raise ConfigError(f"{origin}: a NeMo-RL config is a YAML mapping (grpo:, loss_fn:, policy:, ...)")
        values = nemo_rl.flatten(data)
        return source, table_variants("nemo_rl", origin, versions, lambda r: nemo_rl.map_nemo_rl(values, origin, r))
    if source == "prime_rl":
        if shape != "mapping":
            raise ConfigError(f"{origin}: a prime-rl config is a TOML mapping ([trainer], [orchestrator], ...)")
        flat = _flatten(data)
        return source, table_variants("prime_rl", origin, versions, lambda r: prime_rl.map_prime_rl(flat, origin, r))
    if source == "roll":
        if shape != "mapping":
            raise ConfigError(f"{origin}: a ROLL config is a YAML mapping (actor_train:, actor_infer:, ...)")
        flat = roll.flatten(data)
        roll.check_keys_at_releases(list(flat), (versions or {}).get("roll", []), origin)
        return source, table_variants("roll", origin, versions, lambda r: truncation.apply(
            "roll", roll.map_roll(flat, origin, r), flat, r or roll.newest()))
    if source == "klgrpo":
        return source, [(None, _klgrpo(data, origin))]
    return source, trl_variants(data, origin, source, versions)


def trl_variants(data: dict, origin: str, kind: str, versions: dict[str, list[Constraint]] | None,
                 computed: dict[str, str] | None = None,
                 call: python_script.ConfigCall | None = None) -> list[Variant]:
    """The file's fields mapped under each release range that ``versions`` allows and that has them all; the
    adaptive-KL fields exist in klgrpo.trl only (TRL 1.16's rules). ``call``: the script's GRPOConfig call, whose
    vllm_sampling_params (Unsloth's) may hold a SamplingParams(...) read from the script."""
    adaptive = kind == "adaptive_kl"
    if versions is None or adaptive:
        candidates: list[TRLRange | None] = [None]
    else:
        framework = "unsloth" if kind == "unsloth" else "trl"
        if versions.get("trl") and not profiles("trl", versions):  # a TRL release no range of the table holds
            first = release_label(trl_profiles()[0].low)
            raise ConfigError(f"{origin}: --version trl{','.join(map(str, versions['trl']))} is outside every TRL "
                              f"release range klgrpo knows ({first} and later, klgrpo/integrations/versions/"
                              f"trl.json); pass --version trl==X with a release from {first} on")
        # the newest first; Unsloth clauses that contradict the TRL ones: every range
        candidates = list(reversed(profiles(framework, versions) or profiles(framework, {})))
    out: list[Variant] = []
    missing: list[NotInRange] = []
    for profile in candidates:
        try:
            mapped = map_trl_config(dict(data), origin, adaptive, profile, unsloth=kind == "unsloth")
        except NotInRange as err:
            missing.append(err)
            continue
        for keyword, why in (computed or {}).items():
            own = unsloth_config_fields().get(keyword) if kind == "unsloth" else None
            if own is not None and own[1] is None:
                mapped.ignored.append(keyword)  # whatever it holds: speed and memory only
                continue
            if call is not None and call.sampling is not None and keyword == python_script.SAMPLING_KEYWORD:
                mapped.unmapped.setdefault(keyword, (
                    f"Unsloth's GRPOConfig field: the SamplingParams(...) of line {call.sampling_line}, read: its "
                    "top_p, top_k and min_p replace the config's (the sampling risk and rollout keys below); its "
                    "other settings (temperature, stop, seed) are not mapped"))
            mapped.unmapped.setdefault(keyword, f"Unsloth's GRPOConfig field, {why}: {own[1]}" if own else why)
        framework = "unsloth" if kind == "unsloth" else "trl"
        mapped = truncation.apply(framework, mapped, data, profile, call.sampling if call else None,
                                  call.sampling_line if call else None)
        out.append((profile, mapped))
    if not out:
        raise missing[-1]
    return out


def rl_variants(framework: str, origin: str, versions: dict[str, list[Constraint]] | None,
                mapper: Callable[[RLRange | None], Mapped]) -> list[Variant]:
    """verl's or OpenRLHF's config mapped under each release range ``versions`` allows (the newest first) that
    has every KL key it sets; a version no range holds is one line."""
    if versions is None:
        return [(None, mapper(None))]
    allowed = profiles(framework, versions)
    if not allowed:
        raise ConfigError(f"{origin}: {outside_every_range(framework, versions.get(framework, []))}")
    out: list[Variant] = []
    missing: list[NotInRange] = []
    for profile in reversed(allowed):
        try:
            out.append((profile, mapper(profile)))
        except NotInRange as err:
            missing.append(err)
    if not out:  # the newest range's reason: the release a user most likely runs
        raise missing[0]
    return out


def table_variants(framework: str, origin: str, versions: dict[str, list[Constraint]] | None,
                   mapper: Callable[[frameworks.Release | None], Mapped]) -> list[Variant]:
    """A framework of explain's own tables (frameworks.py) mapped under each release range ``versions`` allows
    (the newest first) that has every KL key it sets; a version no range holds is one line."""
    if versions is None:
        return [(None, mapper(None))]
    allowed = frameworks.allowed(framework, versions)
    if not allowed:
        raise ConfigError(f"{origin}: {frameworks.outside(framework, versions.get(framework, []))}")
    out: list[Variant] = []
    missing: list[NotInRange] = []
    for release in reversed(allowed):
        try:
            out.append((release, mapper(release)))
        except NotInRange as err:
            missing.append(err)
    if not out:
        raise missing[0]
    return out


#: Cell magics whose body is not Python (the shell, another language): the body is kept out of the script.
_FOREIGN_CELL_MAGICS = ("%%bash", "%%sh", "%%shell", "%%script", "%%writefile", "%%html", "%%javascript", "%%js",
                        "%%latex", "%%markdown", "%%perl", "%%ruby", "%%svg", "%%sql")


def notebook_code(text: str, origin: str) -> str:
    """A Jupyter notebook's code cells as one Python script. A shell (``!pip ...``) or magic (``%env``) line is
    a statement where it stands, so it becomes ``pass`` at its indentation (Colab puts ``!pip install`` as the
    only body of an ``if``) with the line kept beside it as a comment; a cell of shell or another language
    (``%%bash``) becomes comments. A script that still does not parse is refused naming the cell and its line."""
    import json

    try:
        cells = json.loads(text).get("cells", [])
    except (ValueError, AttributeError, RecursionError):
        raise ConfigError(f"{origin} is not a valid notebook (JSON with cells)") from None
    lines: list[str] = []
    where: list[tuple[int, int]] = []  # script line -> (code cell, line in the cell), both from 1
    code_cells = [cell for cell in cells if isinstance(cell, dict) and cell.get("cell_type") == "code"] if (
        isinstance(cells, list)) else []
    for number, cell in enumerate(code_cells, 1):
        source = _cell_source(cell.get("source", ""), origin, number)
        foreign = source.lstrip().startswith(_FOREIGN_CELL_MAGICS)
        shell = False  # inside a shell line continued with a backslash (IPython joins them)
        for line_number, line in enumerate(source.splitlines(), 1):
            body = line.lstrip()
            if foreign or shell:
                lines.append(f"# {line}")
            elif body.startswith(("!", "%")):
                lines.append(f"{line[:len(line) - len(body)]}pass  # {body}")
            else:
                lines.append(line)
            shell = (shell or body.startswith(("!", "%"))) and line.endswith("\\") and not foreign
            where.append((number, line_number))
    script = "\n".join(lines) + "\n"
    try:
        compile(script, origin, "exec", flags=ast.PyCF_ONLY_AST)
    except SyntaxError as err:
        cell, line = where[min(max((err.lineno or 1) - 1, 0), len(where) - 1)] if where else (0, 0)
        raise ConfigError(f"{origin}: code cell {cell}, line {line}: not valid Python ({err.msg}); explain reads "
                          "a notebook's code cells as one script: fix that cell or copy the GRPOConfig(...) cell "
                          "into a .py file") from None
    except (RecursionError, MemoryError, ValueError):
        raise ConfigError(f"{origin}: its code cells nest too deeply to be parsed as Python") from None
    return script


def _cell_source(source: Any, origin: str, number: int) -> str:
    """A cell's source as nbformat writes it: one string, or a list of strings (its lines)."""
    if isinstance(source, str):
        return source
    if isinstance(source, list) and all(isinstance(part, str) for part in source):
        return "".join(source)
    raise ConfigError(f"{origin}: code cell {number}: its source is {type(source).__name__} "
                      f"{_short_json(source)}, not text (a string or a list of strings, as nbformat writes it); "
                      "re-save the notebook with Jupyter")


def _short_json(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _from_python(text: str, origin: str, source: str | None, line: int | None,
                 versions: dict[str, list[Constraint]] | None) -> tuple[str, list[Variant]]:
    if source not in (None, *TRL_KINDS):
        raise ConfigError(f"{origin} is a Python script; explain reads a GRPOConfig(...) call there (--from trl, "
                          "unsloth or adaptive_kl)")
    call = python_script.config_call(text, origin, line)
    where = f"{origin}: line {call.line}"
    adaptive = source == "adaptive_kl" or source is None and (
        bool(set(call.keywords) & set(ADAPTIVE_KL_DEFAULTS)) or call.imported_from.startswith("klgrpo"))
    # Unsloth's own GRPOConfig fields (vllm_sampling_params, ...): TRL's GRPOConfig refuses them, so the call runs
    # on Unsloth's patched class even where the cell importing Unsloth is not in the file
    own = set(unsloth_config_fields()) & {*call.keywords, *call.computed}
    unsloth = not adaptive and (source == "unsloth" or source is None and (bool(_UNSLOTH_IMPORT.search(text))
                                                                           or bool(own)))
    kind = "adaptive_kl" if adaptive else "unsloth" if unsloth else "trl"
    return kind, trl_variants(call.keywords, where, kind, versions, call.computed, call)


def _from_script(text: str, origin: str, source: str | None, line: int | None,
                 versions: dict[str, list[Constraint]] | None) -> tuple[str, list[Variant]]:
    command = shell_script.launch_command(text, origin, line)
    if source not in (None, command.framework):
        raise ConfigError(f"{origin}: line {command.line} launches {command.framework}, not {source}")
    where = f"{origin}: line {command.line}"
    if command.framework == "skyrl_train":
        overridden = [a.split("=", 1)[0] for a in command.arguments if "=" in a and not a.startswith(("+", "~", "-"))]
        skyrl_train.check_keys_at_releases(overridden, (versions or {}).get("skyrl_train", []), where)
        return command.framework, table_variants("skyrl_train", where, versions,
                                                 lambda release: _skyrl_from_script(command, where, release))
    if command.framework == "slime":
        slime.check_flags_at_releases([a[2:].split("=", 1)[0] for a in command.arguments if a.startswith("--")],
                                      (versions or {}).get("slime", []), where)
        return command.framework, table_variants("slime", where, versions,
                                                 lambda release: _slime_from_script(command, where, release))
    mapper = _verl_from_script if command.framework == "verl" else _openrlhf_from_script
    return command.framework, rl_variants(command.framework, where, versions,
                                          lambda profile: mapper(command, where, profile))


def _slime_from_script(command: shell_script.LaunchCommand, where: str,
                       release: frameworks.Release | None) -> Mapped:
    """A slime launch script's train.py flags; a setting the script takes from its own arguments or environment
    is named with the default the verdict used."""
    row = (release or slime.newest()).release or {}
    arguments = [a for a in command.arguments if a not in _SCRIPT_ARGUMENTS]
    flags = slime.flags_of(arguments, where)
    notes = {}
    for name, value in list(flags.items()):
        words = value if isinstance(value, list) else [value]
        held = [command.unresolved[w] for w in words if isinstance(w, str) and w in command.unresolved]
        if held:
            if name in slime.READ:
                notes[name] = _unresolved_note(held[0], row["defaults"].get(name), "slime")
            del flags[name]
    mapped = truncation.apply("slime", slime.map_slime(flags, where, release), flags, release or slime.newest())
    for name, why in notes.items():
        mapped.unmapped.setdefault(name, why)
    unread = [a for a in command.arguments if a in command.unresolved and a.startswith("${") and a.endswith("[@]}")]
    for array in unread:
        mapped.unmapped.setdefault(array, "an array the script does not define (sourced from another file): its "
                                          "flags are not seen here")
    if len(arguments) < len(command.arguments):
        mapped.unmapped["$@"] = "arguments given to the script when it runs: not seen here"
    return mapped


def _skyrl(values: dict[str, Any], origin: str, release: frameworks.Release | None) -> Mapped:
    return truncation.apply("skyrl_train", skyrl_train.map_skyrl(values, origin, release), values,
                            release or skyrl_train.newest())


def _skyrl_from_script(command: shell_script.LaunchCommand, where: str,
                       release: frameworks.Release | None) -> Mapped:
    """A SkyRL launch script's key=value arguments (Hydra overrides, as verl's); a setting the script takes from
    its own arguments or environment is named with the default the verdict used."""
    row = (release or skyrl_train.newest()).release or {}
    values: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for argument in command.arguments:
        if argument in _SCRIPT_ARGUMENTS:
            notes[argument] = "arguments given to the script when it runs: not seen here"
            continue
        if argument.startswith("-") or "=" not in argument:
            continue
        key, value = argument.lstrip("+~").split("=", 1)
        if argument in command.unresolved:
            if key in skyrl_train.READ:
                notes[key] = _unresolved_note(command.unresolved[argument], row["defaults"].get(key), "SkyRL")
            continue
        values[key] = _override_value(value, where)
    mapped = _skyrl(values, where, release)
    for key, why in notes.items():
        mapped.unmapped.setdefault(key, why)
    if command.module not in shell_script.SKYRL_ENTRY_POINTS:
        _skyrl_example_entry(command.module, where, mapped)
    return mapped


def _skyrl_example_entry(module: str, where: str, mapped: Mapped) -> None:
    """An example's own entry module: a subclass of SkyRL's BasePPOExp on SkyRL's config, so the keys read as
    SkyRL's; what its code changes is named, and one that does not train RL against a reference is refused."""
    name = module.rsplit(".", 1)[-1]
    if "sft" in name or "distill" in name:
        raise ConfigError(f"{where} runs {module}, SkyRL's example of {'distillation' if 'distill' in name else 'SFT'}"
                          f", not RL against a reference model: klgrpo explain reads SkyRL's RL trainers")
    mapped.unmapped[f"-m {module}"] = ("the example's own entry module (a subclass of SkyRL's BasePPOExp): the keys "
                                       "read as SkyRL's; what its code changes in the trainer (an extra penalty, a "
                                       "custom loss or advantage) is not read")
    if "async" in name:
        mapped.off_policy = True
        mapped.unmapped["trainer.fully_async.max_staleness_steps"] = (
            "an asynchronous trainer: batches drawn by a policy up to that many updates old (older ones are kept, "
            "with a warning), and SkyRL's KL loss is not weighted for it; klgrpo's rollout.max_staleness with "
            "rollout.sampler_correction weights the KL term by pi / mu")


def _unresolved_note(variable: str, default: Any, framework: str) -> str:
    return (f"set by {variable} when the script runs (not a literal in the script): the verdict uses "
            f"{framework}'s default, {default!r}")


def _range_default(profile: RLRange | None, name: str, newest: dict[str, Any]) -> Any:
    """The default of ``name`` (the newest name) in the range; where the table has no entry, the newest."""
    entry = (profile.defaults if profile is not None else {}).get(name, newest.get(name))
    return entry["default"] if isinstance(entry, dict) else entry


def _verl_from_script(command: shell_script.LaunchCommand, where: str, profile: RLRange | None) -> Mapped:
    row = profile or newest("verl")
    if command.module not in row.entry_points:
        raise NotInRange(f"{where}: {command.module} is no trainer of {row.label} (it has: "
                         f"{', '.join(row.entry_points)}); pass the release you run, e.g. --version verl==0.8")
    values: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for argument in command.arguments:
        if argument in _SCRIPT_ARGUMENTS:
            notes[argument] = "arguments given to the script when it runs: not seen here"
            continue
        if argument.startswith("-") or "=" not in argument:  # Hydra's own flags (--config-name=...)
            continue
        key, value = argument.lstrip("+~").split("=", 1)
        if argument in command.unresolved and key in VERL_DEFAULTS:
            notes[key] = _unresolved_note(command.unresolved[argument], _range_default(profile, key, VERL_DEFAULTS),
                                          "verl")
            continue
        values[key] = value if argument in command.unresolved else _override_value(value, where)
    mapped = truncation.apply("verl", map_verl(values, where, profile), values, profile)
    for key, why in notes.items():
        mapped.unmapped.setdefault(key, why)
    return mapped


def _openrlhf_from_script(command: shell_script.LaunchCommand, where: str, profile: RLRange | None) -> Mapped:
    arguments = [a for a in command.arguments if a not in _SCRIPT_ARGUMENTS]
    flags = parse_flags(arguments, where)
    notes = {}
    for name, value in list(flags.items()):
        words = value if isinstance(value, list) else [value]
        held = [command.unresolved[w] for w in words if isinstance(w, str) and w in command.unresolved]
        if held and canonical(name) in OPENRLHF_DEFAULTS:
            default = OPENRLHF_DEFAULTS[canonical(name)]
            if profile is not None:  # the range's flag holding the same (openrlhf.json)
                default = next((e["default"] for e in profile.defaults.values() if e["flag"] == f"--{name}"), default)
            notes[name] = _unresolved_note(held[0], default, "OpenRLHF")
            del flags[name]
    mapped = truncation.apply("openrlhf", map_openrlhf(flags, where, profile), flags, profile)
    for name, why in notes.items():
        mapped.unmapped.setdefault(name, why)
    if len(arguments) < len(command.arguments):
        mapped.unmapped["$@"] = "arguments given to the script when it runs: not seen here"
    return mapped


def _klgrpo(data: dict, origin: str) -> Mapped:
    cfg = GRPOConfig.from_dict(data, origin=origin)  # unknown keys and wrong types: one line each
    values = dict(_flatten(cfg.to_dict()))
    keys = [path for path, _ in all_field_paths() if path.startswith(("kl.", "loss.", "train.num_iterations"))]
    return Mapped(config={key: values[key] for key in keys}, off_policy=cfg.train.num_iterations > 1,
                  rewards=reward_entries(cfg.rewards.functions, cfg.data.as_chat))
