"""Write klgrpo/integrations/versions/trl.json: what decides the KL in each TRL release range, read from TRL's own
source at every minor release (a git clone's tags, and release wheels for the tags the clone lacks).

    python tools/trl_versions.py --git TRL_CLONE [--wheels DIR]     # rewrite the table
    python tools/trl_versions.py --git TRL_CLONE --commits-only     # only the pinned commits' rows

Launchers also pin TRL at a git commit (open-r1's setup.py: ``trl @ git+https://github.com/huggingface/trl.git@SHA``).
For each commit of PINNED_COMMITS the script reads the same two files at the commit and records the range whose
rules they equal (``commits``), so a file pinning the commit is read by that range.

For each release the script reads ``trl/trainer/grpo_config.py`` (GRPOConfig's own fields and the defaults of the
fields that decide the KL) and ``trl/trainer/grpo_trainer.py`` (whether the k3 value is multiplied by the
importance ratio ``coef_1``, and the loss's aggregation before ``loss_type`` existed). Consecutive releases whose
deciding defaults and formula agree form one range; each range records the files and tags it was read from.
Nothing is guessed: a field a release lacks is recorded as absent.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import zipfile
from pathlib import Path

from packaging.version import Version

TARGET = Path(__file__).resolve().parents[1] / "klgrpo" / "integrations" / "versions" / "trl.json"
CONFIG, TRAINER = "trl/trainer/grpo_config.py", "trl/trainer/grpo_trainer.py"
#: The GRPOConfig fields whose default decides the KL term, its weight or its aggregation.
DECIDING = ("beta", "loss_type", "scale_rewards", "use_bias_correction_kl", "num_iterations", "epsilon",
            "max_completion_length", "temperature", "num_generations")
#: Before loss_type existed, the trainer's one loss line, as the loss_type that later names it.
#: Modules a script imports that appeared in one release: an import of one bounds the release from below.
MODULES = ("trl.rewards", "trl.experimental", "trl.experimental.openenv", "trl.experimental.async_grpo")
LOSS_LINES = {"completion_mask.sum(dim=1)).mean()": "grpo", ".sum() / completion_mask.sum()": "bnpo"}
#: The TRL commits open-r1's setup.py pinned between January and May 2025 (its git history).
PINNED_COMMITS = ("6f99f42f724123409422f2fad42bf56fa91f366f", "013d360b8f2703d3546786fa124f3204d6cd8018",
                  "69ad852e5654a77f1695eb4c608906fe0c7e8624", "d625c5533a6b1c84d3565c8080857f6bb81c538a",
                  "c04e84c4545acfaecdf7e0631ad07a86ab0fb2f6", "1bca49515ecd5b85d16e68c42c76670e252e19f1",
                  "9ac614fb081e17805f7f62ab3f5f7036bdefe7b0")


def own_fields(source: str) -> dict[str, object]:
    """GRPOConfig's own annotated fields -> their literal default (None when not a literal)."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOConfig")
    out: dict[str, object] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = _default(node.value)
    return out


def _default(value: ast.expr | None) -> object:
    if isinstance(value, ast.Call):
        for keyword in value.keywords:
            if keyword.arg == "default":
                value = keyword.value
                break
        else:
            return None
    try:
        return ast.literal_eval(value) if value is not None else None
    except ValueError:
        return None


def trainer_facts(source: str) -> dict[str, object]:
    weighted = bool(re.search(r"per_token_kl\s*=\s*per_token_kl\s*\*\s*coef_1", source))
    # the loss assignment itself: the KL metric's line below it has the per-sequence form too
    assignments = [line for line in source.splitlines() if re.match(r"\s*loss = \(", line)]
    loss_line = next((name for line, name in LOSS_LINES.items() if any(line in a for a in assignments)), None)
    return {"kl_importance_weighted_by": "use_bias_correction_kl" if weighted else None,
            "implicit_loss_type": loss_line}


def release(version: str, config: str, trainer: str, where: str) -> dict[str, object]:
    fields = own_fields(config)
    facts = trainer_facts(trainer)
    defaults = {name: fields[name] for name in DECIDING if name in fields}
    if "loss_type" not in fields:
        defaults["loss_type"] = facts["implicit_loss_type"]
    if "use_bias_correction_kl" not in fields:
        defaults["use_bias_correction_kl"] = False  # no weight: the same as the field set false
    if "scale_rewards" not in fields:
        defaults["scale_rewards"] = True  # always divided by the group std before the field existed
    return {"version": version, "read": where, "fields": sorted(fields), "defaults": defaults,
            "kl_weight_field": facts["kl_importance_weighted_by"]}


def from_git(clone: Path) -> list[dict[str, object]]:
    tags = subprocess.run(["git", "-C", str(clone), "tag"], capture_output=True, text=True, check=True).stdout.split()
    minors = sorted({t for t in tags if re.fullmatch(r"v\d+\.\d+\.0", t)}, key=Version)
    out = []
    for tag in minors:
        if Version(tag) < Version("0.14.0"):
            continue  # GRPOTrainer arrived in 0.14
        show = [subprocess.run(["git", "-C", str(clone), "show", f"{tag}:{path}"], capture_output=True, text=True,
                               check=True).stdout for path in (CONFIG, TRAINER)]
        out.append(release(tag.lstrip("v"), *show, f"huggingface/trl {CONFIG}, {TRAINER} at tag {tag}"))
    return out


def commit_rows(clone: Path, rows: list[dict[str, object]], shas=PINNED_COMMITS) -> dict[str, dict[str, object]]:
    """Each pinned commit -> its version string and the range (``from``) whose rules it has, or None."""
    out = {}
    for sha in shas:
        config, trainer, init = (_show(clone, sha, path) for path in (CONFIG, TRAINER, "trl/__init__.py"))
        version = re.search(r'__version__ = "([^"]+)"', init).group(1)
        rel = release(version, config, trainer, f"huggingface/trl {CONFIG}, {TRAINER} at commit {sha}")
        same = [r["from"] for r in rows if (r["defaults"], r["kl_weight_field"]) ==
                (rel["defaults"], rel["kl_weight_field"])]
        out[sha] = {"version": version, "range_from": same[-1] if same else None, "read": rel["read"]}
    return out


def _show(clone: Path, ref: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(clone), "show", f"{ref}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def modules_first(clone: Path) -> dict[str, str]:
    """Each of MODULES -> the first minor release whose tree has it (a package folder or a module file)."""
    tags = subprocess.run(["git", "-C", str(clone), "tag"], capture_output=True, text=True, check=True).stdout.split()
    minors = sorted((t for t in tags if re.fullmatch(r"v\d+\.\d+\.0", t)), key=Version)
    out = {}
    for module in MODULES:
        path = module.replace(".", "/")
        for tag in minors:
            found = [subprocess.run(["git", "-C", str(clone), "cat-file", "-e", f"{tag}:{p}"], capture_output=True)
                     .returncode == 0 for p in (path, path + ".py")]
            if any(found):
                out[module] = tag.lstrip("v")
                break
    return out


def from_wheels(folder: Path) -> list[dict[str, object]]:
    out = []
    for wheel in sorted(folder.glob("trl-*.whl"), key=lambda p: Version(p.name.split("-")[1])):
        version = wheel.name.split("-")[1]
        with zipfile.ZipFile(wheel) as archive:
            show = [archive.read(path).decode() for path in (CONFIG, TRAINER)]
        out.append(release(version, *show, f"{wheel.name} {CONFIG}, {TRAINER} (release v{version})"))
    return out


def ranges(releases: list[dict[str, object]]) -> list[dict[str, object]]:
    """Consecutive releases with the same deciding defaults and KL formula -> one range."""
    out: list[dict[str, object]] = []
    for rel in releases:
        decided = (rel["defaults"], rel["kl_weight_field"])
        if out and (out[-1]["defaults"], out[-1]["kl_weight_field"]) == decided:
            last = out[-1]
            last["last_read"] = rel["version"]
            last["read"].append(rel["read"])
            last["fields_any"] = sorted(set(last["fields_any"]) | set(rel["fields"]))
            last["fields_last"] = rel["fields"]
            continue
        out.append({"from": rel["version"], "last_read": rel["version"], "defaults": rel["defaults"],
                    "kl_weight_field": rel["kl_weight_field"], "read": [rel["read"]],
                    "fields_any": rel["fields"], "fields_last": rel["fields"]})
    for i, row in enumerate(out):
        row["to"] = out[i + 1]["from"] if i + 1 < len(out) else None
    return out


def field_changes(table: list[dict[str, object]], trainer_fields: set[str]) -> None:
    """Each range's fields as changes against the newest release: ``absent`` (GRPO fields of the newest release
    that no release of the range has; TrainingArguments' own fields excluded, every release inherits them) and
    ``removed_since`` (fields of the range that the newest release no longer has)."""
    newest = set(table[-1]["fields_last"])
    for row in table:
        seen = set(row.pop("fields_any"))
        row.pop("fields_last")
        row["absent"] = sorted(newest - seen - trainer_fields)
        row["removed_since"] = sorted(seen - newest - trainer_fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", type=Path, required=True)
    parser.add_argument("--wheels", type=Path)
    parser.add_argument("--commits-only", action="store_true", help="only rewrite the table's pinned commits")
    args = parser.parse_args()
    if args.commits_only:
        table = json.loads(TARGET.read_text(encoding="utf-8"))
        table["commits"] = commit_rows(args.git, table["ranges"])
        TARGET.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {TARGET}: {len(table['commits'])} commits")
        return
    releases = from_git(args.git)
    if args.wheels:
        seen = {r["version"] for r in releases}
        releases += [r for r in from_wheels(args.wheels) if r["version"] not in seen]
    import dataclasses

    from transformers import TrainingArguments

    rows = ranges(releases)
    field_changes(rows, {f.name for f in dataclasses.fields(TrainingArguments)})
    table = {"framework": "trl", "generated_by": "tools/trl_versions.py",
             "note": "from: first release of the range; to: first release of the next range (null: open); "
                     "last_read: the newest release read for the range; absent: GRPOConfig fields of the newest "
                     "release that the range lacks; removed_since: fields of the range the newest lacks",
             "modules_first": modules_first(args.git), "ranges": rows}
    table["commits"] = commit_rows(args.git, rows)
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {TARGET}: {len(table['ranges'])} ranges")


if __name__ == "__main__":
    main()
