"""Write klgrpo/apps/explain/skyrl_train_keys.json: the config keys each skyrl-train release has, read from its Hydra
config (skyrl-train/skyrl_train/config/ppo_base_config.yaml at the release tag), so ``klgrpo explain --version
skyrl_train==X`` refuses a launch script that overrides a key release X does not have. Hydra's config is in struct
mode: ``key=value`` on a key the config lacks stops the run ("Could not override ... not in struct"); ``+key=value``
adds one and is never judged.

What is left open (never judged): the subtrees the config's ``defaults:`` list fills from other files
(``megatron_config@trainer.policy.megatron_config``, the ``skyrl_gym_config`` package ``environment.skyrl_gym``,
DeepSpeed's), and every mapping the file leaves empty or null (free-form arguments such as
``generator.engine_init_kwargs``).

    python tools/skyrl_keys.py --skyrl SKYRL_CLONE
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "klgrpo" / "apps" / "explain" / "skyrl_train_keys.json"
RELEASES = ("skyrl_train-v0.1.0", "skyrl_train-v0.2.0", "skyrl_train-v0.3.0", "skyrl_train-v0.4.0")
CONFIG = "skyrl-train/skyrl_train/config/ppo_base_config.yaml"
GYM_PACKAGE = "environment.skyrl_gym"  # skyrl_gym_config/default.yaml's ``# @package``


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True, check=True).stdout


def walk(node, prefix: str, keys: set[str], open_: set[str]) -> None:
    """Every dotted path of ``node`` into ``keys``; empty or null mappings, whose contents are free, into ``open_``."""
    for name, value in node.items():
        path = f"{prefix}{name}"
        keys.add(path)
        if isinstance(value, dict) and value:
            walk(value, path + ".", keys, open_)
        elif isinstance(value, dict) or value is None:
            open_.add(path)


def read(clone: Path, tag: str) -> tuple[set[str], set[str]]:
    config = yaml.safe_load(_git(clone, "show", f"{tag}:{CONFIG}"))
    keys: set[str] = set()
    open_: set[str] = {GYM_PACKAGE}
    for entry in config.pop("defaults", []):
        if isinstance(entry, dict):
            for group in entry:
                if "@" in group:
                    open_.add(group.split("@", 1)[1])
    walk(config, "", keys, open_)
    return keys | open_, open_


def build(clone: Path) -> dict:
    found = {tag: read(clone, tag) for tag in RELEASES}
    every = sorted(set().union(*(keys for keys, _ in found.values())))
    release = {tag: tag.rsplit("-v", 1)[1] for tag in RELEASES}
    return {
        "note": ("skyrl-train's Hydra config keys -> the releases whose ppo_base_config.yaml has them; open: the "
                 "subtrees whose contents are free there (defaults-list targets, empty mappings); written by "
                 "tools/skyrl_keys.py"),
        "read": {release[tag]: _git(clone, "rev-parse", f"{tag}^{{commit}}").strip()[:8] for tag in RELEASES},
        "keys": {key: [release[tag] for tag in RELEASES if key in found[tag][0]] for key in every},
        "open": {key: [release[tag] for tag in RELEASES if key in found[tag][1]]
                 for key in sorted(set().union(*(o for _, o in found.values())))},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skyrl", type=Path, required=True, help="a clone of NovaSky-AI/SkyRL with its release tags")
    args = parser.parse_args(argv)
    TARGET.write_text(json.dumps(build(args.skyrl), indent=1) + "\n")
    print(f"wrote {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
