"""Write tests/data/release_facts.json: the facts the release tables state, read again from the frameworks' own
source by the logic of tools/trl_versions.py and tools/rl_versions.py, each with where it was read (repository,
tag, the tag's commit, file, line), so a test can hold every table row to its sources without a download.

    python tools/release_facts.py --trl TRL_CLONE --verl VERL_CLONE --openrlhf OPENRLHF_CLONE \
        [--trl-wheels DIR] [--unsloth UNSLOTH_CLONE]

For every release tag the clones hold that a table row was read at (``read``), the fixture keeps:
TRL (each minor release from 0.14): the defaults of GRPOConfig's fields that decide the KL, beta among them (the
field's line in trl/trainer/grpo_config.py), the field whose value weights the KL by the importance ratio (the
line of trl/trainer/grpo_trainer.py that multiplies it) and, of the fields the row names as absent or removed,
those the release has; verl: the trainer config's KL defaults (each key's line of the yaml), when the KL enters
the reward, each estimator as running the release's kl_penalty names it (the function's line) and the trainer
modules; OpenRLHF: the KL flags' defaults (each add_argument's line), the reward rule and the estimators of
compute_approx_kl; Unsloth (hand-read: the commits unsloth.json names): the __version__ there, the GRPOConfig
defaults rl.py's replacements write, the TRL pyproject.toml allows. Tags no source here holds are listed as not
read.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "data" / "release_facts.json"
TABLES = ROOT / "klgrpo" / "integrations" / "versions"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trl_versions = _tool("trl_versions")
rl_versions = _tool("rl_versions")


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True, check=True).stdout


def _commit(clone: Path, tag: str) -> str:
    return _git(clone, "rev-list", "-n", "1", tag).strip()


def _tags_read(name: str) -> list[str]:
    """The tags each row of the table names in ``read`` (``... at tag vX``; TRL's wheels: ``(release vX)``), in the
    table's order."""
    table = json.loads((TABLES / f"{name}.json").read_text(encoding="utf-8"))
    return [m.group(1) for row in table["ranges"] for text in row["read"]
            for m in [re.search(r"(?: at tag |\(release )(v[\w.]+)\)?$", text)] if m]


def _line_of(source: str, pattern: str) -> int | None:
    return next((i for i, line in enumerate(source.splitlines(), 1) if re.search(pattern, line)), None)


def trl_sources(clone: Path, wheels: Path | None, tag: str) -> tuple[str, str, dict] | None:
    """TRL's two files at ``tag``: from the clone, else a release wheel in ``wheels``, else the installed TRL
    when it is that release (the wheel's files as pip unpacked them); None where none holds them."""
    paths = (trl_versions.CONFIG, trl_versions.TRAINER)
    if tag in _git(clone, "tag").split():
        return (*(_git(clone, "show", f"{tag}:{p}") for p in paths),
                {"repo": "huggingface/trl", "tag": tag, "commit": _commit(clone, tag)})
    version = tag.lstrip("v")
    wheel = next(iter(sorted(wheels.glob(f"trl-{version}-*.whl"))), None) if wheels else None
    if wheel is not None:
        import zipfile

        with zipfile.ZipFile(wheel) as archive:
            return (*(archive.read(p).decode() for p in paths), {"repo": "huggingface/trl", "tag": tag,
                                                                  "wheel": wheel.name})
    try:
        import trl
    except ImportError:
        return None
    if trl.__version__ != version:
        return None
    site = Path(trl.__file__).resolve().parents[1]
    return (*((site / p).read_text(encoding="utf-8") for p in paths),
            {"repo": "huggingface/trl", "tag": tag, "wheel": f"trl {version} as installed (site-packages)"})


def trl_tag(config: str, trainer: str, origin: dict, tag: str, named: set[str]) -> dict:
    rel = trl_versions.release(tag.lstrip("v"), config, trainer, "")
    cls = next(n for n in ast.parse(config).body if isinstance(n, ast.ClassDef) and n.name == "GRPOConfig")
    lines = {n.target.id: n.lineno for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    weight = _line_of(trainer, r"per_token_kl\s*=\s*per_token_kl\s*\*\s*coef_1")
    defaults = {name: _trl_default(value, lines.get(name)) for name, value in rel["defaults"].items()}
    return {**origin, "defaults": defaults,
            "kl_weight_field": {"value": rel["kl_weight_field"], "file": trl_versions.TRAINER, "line": weight},
            "has_of_named": sorted(named & set(rel["fields"]))}


def _trl_default(value: object, line: int | None) -> dict:
    if line is None:  # the field came later: trl_versions.release names the behaviour the release has
        return {"value": value, "file": trl_versions.TRAINER, "line": None,
                "why": "no such GRPOConfig field at the tag: the trainer's behaviour as tools/trl_versions.py names it"}
    return {"value": value, "file": trl_versions.CONFIG, "line": line}


def _yaml_lines(text: str) -> dict[str, int]:
    """Each dotted key of a yaml mapping -> its line (1-based)."""
    out: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                dotted = f"{prefix}{key.value}"
                out[dotted] = key.start_mark.line + 1
                walk(value, dotted + ".")

    walk(yaml.compose(text), "")
    return out


#: The line of ray_trainer.py that shows each reward rule (tools/rl_versions.py's _verl_reward reads the same).
_VERL_REWARD_LINES = {"with algorithm.use_kl_in_reward": r"use_kl_in_reward",
                      "whenever actor.use_kl_loss is false": r"if not self\.config\.actor_rollout_ref\.actor\.get\(",
                      "always": r"apply_kl_penalty\("}


#: The line of experience_maker.py that leaves the KL out of the reward (rl_versions.openrlhf_release's search).
_OPENRLHF_SKIPS = r"not (?:self\.strategy\.)?args\.(use_kl_loss|algo\.kl\.use_loss)"


def verl_tag(clone: Path, tag: str) -> dict:
    rel = rl_versions.verl_release(clone, tag)
    config_path = rel["read"].split(" ")[1].rstrip(",")
    lines = _yaml_lines(_git(clone, "show", f"{tag}:{config_path}"))
    algos = _git(clone, "show", f"{tag}:verl/trainer/ppo/core_algos.py")
    return {"repo": "volcengine/verl", "tag": tag, "commit": _commit(clone, tag),
            "defaults": {key: {"value": value, "file": config_path, "line": lines.get(key)}
                         for key, value in rel["defaults"].items()},
            "reward_kl": {"value": rel["reward_kl"], "file": "verl/trainer/ppo/ray_trainer.py",
                          "line": _line_of(_git(clone, "show", f"{tag}:verl/trainer/ppo/ray_trainer.py"),
                                           _VERL_REWARD_LINES[rel["reward_kl"]])},
            "estimators": {"value": rel["estimators"], "file": "verl/trainer/ppo/core_algos.py",
                           "line": _line_of(algos, r"^def kl_penalty\(")},
            "entry_points": rel["entry_points"]}


def openrlhf_tag(clone: Path, tag: str) -> dict:
    rel = rl_versions.openrlhf_release(clone, tag)
    maker = "openrlhf/trainer/ppo_utils/experience_maker.py"
    cli = rel["read"].split(" ")[1].rstrip(",")
    source = _git(clone, "show", f"{tag}:{cli}")
    lines = {node.args[0].value: node.lineno for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
             and isinstance(node.args[0], ast.Constant)}
    utils = _git(clone, "show", f"{tag}:openrlhf/models/utils.py")
    return {"repo": "OpenRLHF/OpenRLHF", "tag": tag, "commit": _commit(clone, tag),
            "defaults": {what: {**entry, "file": cli, "line": lines.get(entry["flag"])}
                         for what, entry in rel["defaults"].items()},
            "reward_kl": {"value": rel["reward_kl"], "file": maker, "line": _line_of(
                _git(clone, "show", f"{tag}:{maker}"), _OPENRLHF_SKIPS) if rel["reward_kl"] != "always" else None},
            "estimators": {"value": rel["estimators"], "file": "openrlhf/models/utils.py",
                           "line": _line_of(utils, r"^def compute_approx_kl\(")}}


def held(clone: Path) -> set[str]:
    return set(_git(clone, "tag").split())


#: unsloth.json names each commit it read as ``SHA (VERSION)`` (a short sha, the __version__ there).
_UNSLOTH_COMMIT = re.compile(r"\b([0-9a-f]{10})\b \((\d{4}\.\d+\.\d+)\)")
_UNSLOTH_FILES = {"unsloth/models/rl.py": "rl", "pyproject.toml": "pyproject"}


def unsloth_commits() -> list[tuple[str, str]]:
    """(short sha, the file read there) for each commit unsloth.json's rows name, in the table's order."""
    table = json.loads((TABLES / "unsloth.json").read_text(encoding="utf-8"))
    out = []
    for row in table["ranges"]:
        for text in row["read"]:
            path = next(p for p in _UNSLOTH_FILES if f" {p} " in text)
            out += [(sha, path) for sha, _ in _UNSLOTH_COMMIT.findall(text)]
    return list(dict.fromkeys(out))


def unsloth_commit(clone: Path, sha: str, path: str) -> dict:
    """At the commit: Unsloth's __version__ and, in rl.py, the GRPOConfig defaults its ``replacements`` write
    (beta, loss_type; absent: none written), or, in pyproject.toml, the TRL it allows."""
    utils = _git(clone, "show", f"{sha}:unsloth/models/_utils.py")
    version = re.search(r'^__version__ = "([^"]+)"', utils, re.M)
    source = _git(clone, "show", f"{sha}:{path}")
    out = {"repo": "unslothai/unsloth", "commit": _commit(clone, sha), "file": path,
           "version": {"value": version.group(1), "file": "unsloth/models/_utils.py",
                       "line": _line_of(utils, r'^__version__ = ')}}
    if path == "pyproject.toml":
        line = _line_of(source, r'^\s*"trl[>=<!~]')
        out["trl"] = {"value": re.search(r'"(trl[^"]*)"', source.splitlines()[line - 1]).group(1)[3:], "line": line}
        return out
    block = re.search(r"if trainer_file == \"grpo_trainer\":\n\s*replacements = \{([^}]*)\}", source)
    written = {}
    if block is not None:
        start = source[:block.start(1)].count("\n") + 1
        for offset, line in enumerate(block.group(1).splitlines()):
            found = re.search(r'"(\w+)"\s*:\s*([^,#]+?)\s*,', line)
            if found:
                written[found.group(1)] = {"value": ast.literal_eval(found.group(2)), "line": start + offset}
    out["replacements"] = written
    return out


def _named_trl_fields() -> set[str]:
    table = json.loads((TABLES / "trl.json").read_text(encoding="utf-8"))
    return {f for row in table["ranges"] for f in row["absent"] + row["removed_since"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl", type=Path, required=True)
    parser.add_argument("--verl", type=Path, required=True)
    parser.add_argument("--openrlhf", type=Path, required=True)
    parser.add_argument("--unsloth", type=Path, help="a clone of unslothai/unsloth (unsloth.json's commits)")
    parser.add_argument("--trl-wheels", type=Path, help="a folder of TRL release wheels, for the tags the clone lacks")
    args = parser.parse_args()
    named = _named_trl_fields()

    def read_trl(clone: Path, tag: str) -> dict | None:
        found = trl_sources(clone, args.trl_wheels, tag)
        return trl_tag(*found, tag, named) if found else None

    readers = {"trl": (args.trl, read_trl), "verl": (args.verl, lambda c, t: verl_tag(c, t) if t in held(c) else None),
               "openrlhf": (args.openrlhf, lambda c, t: openrlhf_tag(c, t) if t in held(c) else None)}
    facts: dict = {"generated_by": "tools/release_facts.py", "note": (
        "per release tag a table row was read at: the facts the row states, read again from the tag by "
        "tools/trl_versions.py's and tools/rl_versions.py's logic, with file and line; not_read: tags the clone "
        "lacks")}
    for name, (clone, read) in readers.items():
        found = {tag: read(clone, tag) for tag in _tags_read(name)}
        facts[name] = {"tags": {tag: one for tag, one in found.items() if one is not None},
                       "not_read": [tag for tag, one in found.items() if one is None]}
        print(f"{name}: {len(facts[name]['tags'])} tags read, {len(facts[name]['not_read'])} not read (no source here)")
    if args.unsloth:
        read = {sha: unsloth_commit(args.unsloth, sha, path) for sha, path in unsloth_commits()}
        facts["unsloth"] = {"commits": read}
        print(f"unsloth: {len(facts['unsloth']['commits'])} commits read")
    TARGET.write_text(json.dumps(facts, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {TARGET}")


if __name__ == "__main__":
    main()
