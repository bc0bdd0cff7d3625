"""A verl, OpenRLHF, SkyRL or slime launch script, read as text (never run): the arguments of its ``python3 -m
verl.trainer.main_ppo`` (or another trainer module of a verl release: 0.8's ``main_ppo_sync``),
``openrlhf.cli.train_ppo_ray``, ``skyrl_train.entrypoints.main_base`` (or an example's own entry module, such as
``examples.train.algorithms.dapo.main_dapo``) or slime's ``train.py`` command.

What the reader follows: line continuations, comments, ``NAME=value`` and ``export NAME=value`` assignments with
literal values (substituted where the command uses ``$NAME`` / ``${NAME}``), bash arrays (``ARGS=( ... )`` used
as ``"${ARGS[@]}"``), ``ray job submit ... -- python3 -m ...``. A value that still holds a ``$`` after that (an
argument of the script, ``$HOME``, a command substitution) is kept as text: the caller names it when the setting
matters.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from klgrpo.apps.explain.reading import on_line, refuse
from klgrpo.errors import ConfigError
from klgrpo.integrations.versions import rl_profiles


def _spellings(module: str) -> tuple[str, ...]:
    """How a command names a trainer module: ``-m verl.trainer.main_ppo``, or its file."""
    return module, f"{module}.py", module.replace(".", "/") + ".py"


#: verl's trainer modules of every release (verl.json's entry_points: main_ppo, 0.8's main_ppo_sync); OpenRLHF's.
VERL_ENTRY_POINTS = tuple(dict.fromkeys(m for p in rl_profiles("verl") for m in p.entry_points))
#: SkyRL's trainers (skyrl_train.json's entry_points: skyrl-train's and the renamed skyrl package's main_base).
SKYRL_ENTRY_POINTS = ("skyrl_train.entrypoints.main_base", "skyrl.train.entrypoints.main_base")
LAUNCHERS = {"verl": tuple(s for module in VERL_ENTRY_POINTS for s in _spellings(module)),
             "openrlhf": ("openrlhf.cli.train_ppo_ray", "openrlhf/cli/train_ppo_ray.py"),
             "skyrl_train": tuple(s for module in SKYRL_ENTRY_POINTS for s in _spellings(module)),
             "slime": ("train.py", "train_async.py")}
#: SkyRL's examples run entry modules of their own (``-m examples.train.algorithms.dapo.main_dapo``): subclasses of
#: its BasePPOExp that read SkyRL's config. One counts as SkyRL's launcher where the script also sets SkyRL's keys.
SKYRL_EXAMPLE_ENTRY = re.compile(r"^(?:\w+\.)*examples(?:\.\w+)*\.main_\w+$")
SKYRL_MARKERS = ("trainer.algorithm.", "generator.n_samples_per_prompt", "trainer.policy.model.path")
#: A script runs slime's train.py when it also holds one of slime's own flags (train.py alone is anyone's).
SLIME_MARKERS = ("--advantage-estimator", "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type", "--kl-coef",
                 "--rollout-batch-size", "--n-samples-per-prompt", "--rm-type", "--rollout-function-path")
_NAMES = {"verl": "verl", "openrlhf": "OpenRLHF", "skyrl_train": "SkyRL", "slime": "slime"}
_ASSIGNMENT = re.compile(r"^(?:export\s+|local\s+|readonly\s+)?([A-Za-z_]\w*)=(.*)$")
_ARRAY = re.compile(r"^([A-Za-z_]\w*)=\($")
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")
#: What is left for the shell to expand: $1, $@, ${X:-y}, $(cmd), $((a * b)), $HOME.
_SHELL_EXPANSION = re.compile(r"\$(\(\(.*?\)\)|\(.*?\)|\{[^}]*\}|\w+|[@*#?])")
_ARRAY_USE = re.compile(r"^\$\{([A-Za-z_]\w*)\[[@*]\]\}$")


@dataclass
class LaunchCommand:
    """The arguments after the launcher's module, with where the command starts."""

    framework: str
    line: int
    arguments: list[str]
    unresolved: dict[str, str] = field(default_factory=dict)  # argument -> the variable it still holds
    module: str = ""  # the trainer module it runs (verl.trainer.main_ppo_sync)


def launchers_in(text: str, slime_flags: bool | None = None) -> set[str]:
    """The frameworks whose launcher module the text names (cheap: no tokenising); slime's train.py counts where
    ``slime_flags`` (default: the text itself holds one of slime's flags)."""
    found = {name for name, modules in LAUNCHERS.items() if any(module in text for module in modules)}
    if _example_entries(text) and any(marker in text for marker in SKYRL_MARKERS):
        found.add("skyrl_train")
    if slime_flags is None:
        slime_flags = any(marker in text for marker in SLIME_MARKERS)
    if not slime_flags:
        found.discard("slime")
    return found


def _example_entries(text: str) -> list[str]:
    """The ``-m examples....main_*`` modules the text runs."""
    words = text.split()
    return [module for flag, module in zip(words, words[1:]) if flag == "-m" and SKYRL_EXAMPLE_ENTRY.match(module)]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash continuations and quotes spanning lines (a JSON string) joined,
    and whole-line comments dropped."""
    out, pending, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not pending and line.lstrip().startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if _open_quote(pending + line):
            pending += line + "\n"
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _open_quote(line: str) -> bool:
    """Whether the line leaves a quote open (its string goes on on the next line)."""
    try:
        shlex.split(line, comments=True)
    except ValueError as err:
        return "No closing quotation" in str(err)
    return False


def _tokens(line: str, origin: str, number: int) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError as err:
        raise ConfigError(f"{origin}: line {number}: {err} (an unclosed quote?)") from None


def _substitute(token: str, variables: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return _VARIABLE.sub(value, token)


def _read_array(lines: list[tuple[int, str]], index: int, origin: str) -> tuple[list[str], int]:
    """Tokens of a multi-line ``NAME=(`` ... ``)`` array starting after line ``index``; returns the next index."""
    tokens: list[str] = []
    for position in range(index + 1, len(lines)):
        number, line = lines[position]
        if line.strip() == ")":
            return tokens, position + 1
        tokens += _tokens(line, origin, number)
    raise ConfigError(f"{origin}: line {lines[index][0]}: the array is not closed with ')'")


def commands(text: str, origin: str) -> list[LaunchCommand]:
    """Every launcher command of the script, its variables and arrays substituted where they are literal."""
    variables: dict[str, str] = {}
    arrays: dict[str, list[str]] = {}
    found: list[LaunchCommand] = []
    lines = _logical_lines(text)
    slime_flags = any(marker in text for marker in SLIME_MARKERS)
    index = 0
    while index < len(lines):
        number, line = lines[index]
        stripped = line.strip()
        array = _ARRAY.match(stripped)
        if array:
            arrays[array.group(1)], index = _read_array(lines, index, origin)
            continue
        index += 1
        assignment = _ASSIGNMENT.match(stripped)
        if assignment and not launchers_in(stripped, slime_flags):
            tokens = _tokens(assignment.group(2), origin, number) or [""]
            if assignment.group(2).startswith("(") and stripped.endswith(")"):
                arrays[assignment.group(1)] = _tokens(assignment.group(2)[1:-1], origin, number)
            elif len(tokens) == 1:
                variables[assignment.group(1)] = _substitute(tokens[0], variables)
            continue
        framework = next((name for name in LAUNCHERS if launchers_in(stripped, slime_flags) == {name}), None)
        command = None if framework is None else _command(framework, number, _tokens(line, origin, number),
                                                          variables, arrays)
        if command is not None:
            found.append(command)
    return found


def _command(framework: str, number: int, tokens: list[str], variables: dict, arrays: dict) -> LaunchCommand | None:
    modules = LAUNCHERS[framework]
    starts = [i for i, token in enumerate(tokens) if any(token.endswith(m) for m in modules)]
    if framework == "skyrl_train" and not starts:  # an example's own entry module
        starts = [i for i, token in enumerate(tokens[1:], 1)
                  if tokens[i - 1] == "-m" and SKYRL_EXAMPLE_ENTRY.match(token)]
        modules = tuple(tokens[i] for i in starts[:1])
    if not starts:  # the module named inside another word (an echo, a JSON argument): no launch
        return None
    named = max((m for m in modules if tokens[starts[0]].endswith(m)), key=len)  # main_ppo_sync, not main_ppo
    module = named.removesuffix(".py").replace("/", ".")
    command = LaunchCommand(framework, number, [], module=module)
    for token in tokens[starts[0] + 1:]:
        used = _ARRAY_USE.match(token)
        expanded = arrays.get(used.group(1), [token]) if used else [token]
        for item in expanded:
            item = _substitute(item, variables)
            command.arguments.append(item)
            left = _SHELL_EXPANSION.search(item)
            if left:
                command.unresolved[item] = left.group(0)
    return command


def launch_command(text: str, origin: str, line: int | None = None) -> LaunchCommand:
    """The script's one launcher command (or the one starting at ``line``); a script with none, with several, or
    with both frameworks' launchers is refused in one line."""
    found = commands(text, origin)
    if line is not None:
        return on_line(found, line, origin, "launcher command starts at line", "the commands start at lines")
    if not found:
        raise refuse(origin, f"runs none of verl's trainers ({', '.join(VERL_ENTRY_POINTS)}), "
                             f"openrlhf.cli.train_ppo_ray, SkyRL's ({', '.join(SKYRL_ENTRY_POINTS)}) nor slime's "
                             "train.py")
    if len({c.framework for c in found}) > 1:
        named = [_NAMES[name] for name in LAUNCHERS if name in {c.framework for c in found}]
        raise ConfigError(f"{origin} launches {'both ' if len(named) == 2 else ''}{' and '.join(named)} (lines "
                          f"{', '.join(str(c.line) for c in found)}); pass --call LINE to pick one")
    if len(found) > 1:
        raise ConfigError(f"{origin} launches {len(found)} runs (lines {', '.join(str(c.line) for c in found)}); "
                          "pass --call LINE to pick one")
    return found[0]


def flag_tokens(text: str, origin: str) -> list[str]:
    """The tokens of a bare command line (``--flag value`` lines, continuations and comments allowed)."""
    return [token for number, line in _logical_lines(text) for token in _tokens(line, origin, number)]
