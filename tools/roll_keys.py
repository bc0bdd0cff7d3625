"""Write klgrpo/apps/explain/roll_keys.json: the config keys each ROLL release's RLVR pipeline has, read with ``ast``
(ROLL is not imported) from its config dataclasses at the release tag: RLVRConfig in
roll/pipeline/rlvr/rlvr_config.py, its bases (BaseConfig, and from 0.1.1 PPOConfig, in roll/configs/base_config.py)
and every dataclass a field holds (WorkerConfig and StrategyArguments in roll/configs/worker_config.py,
ModelArguments with LoraArguments, TrainingArguments, DataArguments and GeneratingArguments in roll/configs/*.py,
the filter and correction configs beside them), followed through inheritance, so a path such as
``actor_train.model_args.dtype`` is known per release.

How ROLL treats a key, read in examples/start_rlvr_pipeline.py and its vl / vlmath / rollout siblings at every tag:
Hydra composes the YAML (``hydra:`` and the ``defaults:`` list are Hydra's own and never judged; no structured
config is registered, so Hydra checks no key), then ``dacite.from_dict(data_class=RLVRConfig, data=...)`` builds the
config without a ``Config``. dacite's ``strict`` is False by default (every dacite release 1.0.0 - 1.9.2), so a key
the dataclasses lack is dropped without a word and the run goes on without it: ROLL's own examples carry such keys
at their own tag (``actor_train.data_args.dataset_dir``, ``interleave_probs``, ``model_args.flash_attn``,
``validation.eval_steps``). Such a key is never refused here. ``check_types`` is True there, so a mapping where the
release's field is a plain value (a str, number, bool, Literal or list) stops the run at once (WrongTypeError): the
one refusal the table supports. (examples/start_onpolicy_distill_pipeline.py, 0.2.1 on, turns the type check off:
its configs are not judged.)

The table records per release every dotted path (``keys``), the dataclass-typed ones whose contents are paths of
their own (``nested``), and the fields whose contents are free (``open``, never judged: a dict, Dict, Any or
mapping type, a Union holding one or holding a dataclass beside anything else, a type these files do not define,
and ``defaults`` / ``hydra``); every other key is a plain value.

    python tools/roll_keys.py --roll ROLL_CLONE
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "klgrpo" / "apps" / "explain" / "roll_keys.json"
RELEASES = ("v0.1.0", "v0.1.1", "v0.1.3", "v0.2.0", "v0.2.1", "v0.3.0")
ROOT_CLASS = "RLVRConfig"
FILES = ("roll/pipeline/rlvr/rlvr_config.py",)
CONFIGS = "roll/configs/"
HYDRA = ("defaults", "hydra")  # Hydra's own: composed away before dacite sees the config
#: Annotations that hold no mapping (dacite's type check refuses a mapping there).
PLAIN = {"str", "int", "float", "bool", "bytes", "None", "NoneType", "Literal", "List", "list", "Tuple", "tuple",
         "Set", "set", "Sequence", "FrozenSet", "frozenset"}
WRAPPERS = {"Optional", "Union"}


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True, check=True).stdout


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(_name(d.func if isinstance(d, ast.Call) else d) == "dataclass" for d in node.decorator_list)


def classes(clone: Path, tag: str) -> dict[str, ast.ClassDef]:
    """The dataclasses of the config files at ``tag`` by name (one definition each)."""
    paths = [p for p in _git(clone, "ls-tree", "-r", "--name-only", tag, CONFIGS).splitlines() if p.endswith(".py")]
    found: dict[str, ast.ClassDef] = {}
    for path in [*paths, *FILES]:
        for node in ast.parse(_git(clone, "show", f"{tag}:{path}")).body:
            if isinstance(node, ast.ClassDef) and _is_dataclass(node):
                if node.name in found:
                    raise SystemExit(f"{tag}: two dataclasses named {node.name}")
                found[node.name] = node
    return found


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and node.value is None:
        return "None"
    return ""


def kind(annotation: ast.expr, known: dict[str, ast.ClassDef]) -> str | None:
    """A field's annotation -> the dataclass it holds (its name), "plain" (no mapping fits) or None (open)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a forward reference
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):  # X | None
        members = [annotation.left, annotation.right]
    elif isinstance(annotation, ast.Subscript) and _name(annotation.value) in WRAPPERS:
        inner = annotation.slice
        members = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
    else:
        members = [annotation]
    if len(members) > 1 or members[0] is not annotation:
        kinds = {kind(m, known) for m in members if _name(m) != "None"}
        return kinds.pop() if len(kinds) == 1 else None  # a Union of a dataclass and anything else: open
    head = _name(annotation.value) if isinstance(annotation, ast.Subscript) else _name(annotation)
    if head in known and not isinstance(annotation, ast.Subscript):
        return head
    if head in PLAIN:
        return "plain"
    return None


def fields(name: str, known: dict[str, ast.ClassDef]) -> dict[str, ast.expr]:
    """A dataclass's fields with their annotations, its bases' first (dataclass order)."""
    node = known[name]
    out: dict[str, ast.expr] = {}
    for base in node.bases:
        if _name(base) in known:
            out.update(fields(_name(base), known))
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if _name(item.annotation) in ("ClassVar", "InitVar") or (
                    isinstance(item.annotation, ast.Subscript) and _name(item.annotation.value) in ("ClassVar",
                                                                                                    "InitVar")):
                continue
            out[item.target.id] = item.annotation
    return out


def walk(name: str, prefix: str, known: dict[str, ast.ClassDef], keys: set[str], nested: set[str],
         open_: set[str], seen: tuple[str, ...] = ()) -> None:
    for field, annotation in fields(name, known).items():
        path = f"{prefix}{field}"
        keys.add(path)
        held = kind(annotation, known)
        if held is None:
            open_.add(path)
        elif held != "plain":
            if held in seen:  # a dataclass holding itself: its contents left open
                open_.add(path)
                continue
            nested.add(path)
            walk(held, path + ".", known, keys, nested, open_, (*seen, held))


def read(clone: Path, tag: str) -> tuple[set[str], set[str], set[str]]:
    known = classes(clone, tag)
    keys: set[str] = set(HYDRA)
    nested: set[str] = set()
    open_: set[str] = set(HYDRA)
    walk(ROOT_CLASS, "", known, keys, nested, open_)
    return keys, nested, open_


def build(clone: Path) -> dict:
    found = {tag: read(clone, tag) for tag in RELEASES}
    release = {tag: tag.removeprefix("v") for tag in RELEASES}

    def column(index: int) -> dict[str, list[str]]:
        every = sorted(set().union(*(sets[index] for sets in found.values())))
        return {key: [release[tag] for tag in RELEASES if key in found[tag][index]] for key in every}

    return {
        "note": ("ROLL's RLVR pipeline config keys (RLVRConfig and the dataclasses it holds) -> the releases whose "
                 "dataclasses have them (dacite drops any other key); nested: the dataclass-typed ones; open: those "
                 "whose contents are free (dict / Any types, Hydra's defaults and hydra); written by "
                 "tools/roll_keys.py"),
        "read": {release[tag]: _git(clone, "rev-parse", f"{tag}^{{commit}}").strip()[:8] for tag in RELEASES},
        "keys": column(0),
        "nested": column(1),
        "open": column(2),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roll", type=Path, required=True, help="a clone of alibaba/ROLL with its release tags")
    args = parser.parse_args(argv)
    TARGET.write_text(json.dumps(build(args.roll), indent=1) + "\n")
    print(f"wrote {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
