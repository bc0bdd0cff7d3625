"""Write klgrpo/apps/explain/slime_flags.json: which of slime's own command-line flags each slime release has, read
from the flags its argument files declare (every ``slime/**/arguments.py`` at the release tag, each ``"--name"``
literal), so ``klgrpo explain --version slime==X`` refuses a launch script that passes a flag release X does not
have (argparse stops such a run at once: "unrecognized arguments").

A flag counts as slime's own when slime/utils/arguments.py declares it at some release and Megatron-LM's
megatron/training/arguments.py does not at any of the tags given (slime hands the rest of its command line to
Megatron's parser: a Megatron flag slime later declared itself, such as --lr for its FSDP backend, was accepted
before that too). The flags slime adds from SGLang's ServerArgs at run time (``--sglang-*``) are never slime's own
here.

    python tools/slime_flags.py --slime SLIME_CLONE --megatron MEGATRON_CLONE
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "klgrpo" / "apps" / "explain" / "slime_flags.json"
RELEASES = ("v0.1.0", "v0.2.0", "v0.2.0.post1", "v0.2.1", "v0.2.2", "v0.2.3", "v0.2.4", "v0.3.0", "v0.3.1")
MEGATRON_TAGS = ("core_r0.8.0", "core_r0.10.0", "core_r0.12.0", "core_r0.13.0", "core_r0.14.0", "core_r0.15.0",
                 "HEAD")
FLAG = re.compile(r"""["'](--[a-z0-9][a-z0-9-]*)["']""")


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True, check=True).stdout


def _flags(clone: Path, tag: str, files: list[str]) -> set[str]:
    found: set[str] = set()
    for path in files:
        try:
            found |= set(FLAG.findall(_git(clone, "show", f"{tag}:{path}")))
        except subprocess.CalledProcessError:  # not at that tag
            continue
    return found


def build(slime: Path, megatron: Path) -> dict:
    megatron_flags = set().union(*(_flags(megatron, tag, ["megatron/training/arguments.py"])
                                   for tag in MEGATRON_TAGS))
    declared, own_source = {}, set()
    for tag in RELEASES:
        files = [p for p in _git(slime, "ls-tree", "-r", "--name-only", tag).splitlines()
                 if p.startswith("slime/") and p.endswith("arguments.py")]
        declared[tag] = _flags(slime, tag, files)
        own_source |= _flags(slime, tag, ["slime/utils/arguments.py"])
    own = sorted(f for f in own_source - megatron_flags if not f.startswith("--sglang-"))
    return {
        "note": ("slime's own flags (declared by slime/utils/arguments.py at some release, never by Megatron-LM's "
                 "megatron/training/arguments.py) -> the releases whose argument files declare them; written by "
                 "tools/slime_flags.py"),
        "read": {tag.removeprefix("v"): _git(slime, "rev-parse", f"{tag}^{{commit}}").strip()[:8]
                 for tag in RELEASES},
        "flags": {flag[2:]: [tag.removeprefix("v") for tag in RELEASES if flag in declared[tag]] for flag in own},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime", type=Path, required=True, help="a clone of THUDM/slime with its release tags")
    parser.add_argument("--megatron", type=Path, required=True, help="a clone of NVIDIA/Megatron-LM with its tags")
    args = parser.parse_args(argv)
    TARGET.write_text(json.dumps(build(args.slime, args.megatron), indent=1) + "\n")
    print(f"wrote {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
