"""Write klgrpo/integrations/versions/{verl,openrlhf}.json: what decides the KL in each verl and OpenRLHF release
range, read from their own source at every release tag of a git clone.

    python tools/rl_versions.py --verl VERL_CLONE --openrlhf OPENRLHF_CLONE     # rewrite both tables

verl: the KL defaults of the trainer config (``verl/trainer/config/ppo_trainer.yaml``, from v0.5.0 the composed
``_generated_ppo_trainer.yaml``: ``actor_rollout_ref.actor.use_kl_loss / kl_loss_coef / kl_loss_type``,
``algorithm.use_kl_in_reward / kl_penalty / kl_ctrl.*``), the trainer modules a launch script runs
(``verl.trainer.main_ppo``, 0.8's ``main_ppo_sync``), when ``verl/trainer/ppo/ray_trainer.py`` puts the KL in
the reward, and the estimators of ``verl/trainer/ppo/core_algos.py``'s ``kl_penalty``. OpenRLHF: the KL flags'
defaults of ``train_ppo_ray.py`` (``examples/`` before v0.3.6, then ``openrlhf/cli/``), and the estimators of
``openrlhf/models/utils.py``'s ``compute_approx_kl``.

The estimators are not read as text: each release's own function is run (its definition alone, with torch) on
log-ratios l = log pi - log ref from -30 to 30, and its values and gradient are matched against k1 = l,
k2 = l^2 / 2, k3 = exp(-l) - 1 + l and |l|, with the cap its values show. Consecutive releases with the same
facts form one range; each range names the files and tags it was read from.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
from pathlib import Path

import torch
import yaml
from packaging.version import Version

TARGET = Path(__file__).resolve().parents[1] / "klgrpo" / "integrations" / "versions"
PROBE = (-30.0, -2.0, -0.5, 0.0, 0.5, 2.0, 30.0)
FORMULAS = {"k1": ("l", lambda l: l), "k2": ("l^2 / 2", lambda l: l * l / 2),
            "k3": ("exp(-l) - 1 + l", lambda l: torch.exp(-l) - 1 + l), "abs": ("|l|", torch.abs)}
VERL_KEYS = ("actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef",
             "actor_rollout_ref.actor.kl_loss_type", "algorithm.use_kl_in_reward", "algorithm.kl_penalty",
             "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.target_kl",
             "algorithm.kl_ctrl.horizon")
#: OpenRLHF's KL flags, by what they hold: the flat names, then the grouped names of v0.10.2 on.
OPENRLHF_FLAGS = {"init_coef": ("--init_kl_coef", "--algo.kl.init_coef"),
                  "use_loss": ("--use_kl_loss", "--algo.kl.use_loss"),
                  "estimator": ("--kl_estimator", "--algo.kl.estimator", "--use_kl_estimator_k3"),
                  "target": ("--kl_target", "--algo.kl.target"), "horizon": ("--kl_horizon", "--algo.kl.horizon")}


def git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True, check=True).stdout


def release_tags(clone: Path) -> list[str]:
    tags = [t for t in git(clone, "tag").split() if re.fullmatch(r"v\d+(\.\d+)*(\.post\d+)?", t)]
    return sorted(tags, key=Version)


def functions(source: str, names: tuple[str, ...]) -> dict:
    """The module's functions of these names, defined alone (decorators dropped) with torch."""
    tree = ast.parse(source)
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    for node in found:
        node.decorator_list = []
    space: dict = {"torch": torch}
    exec(compile(ast.Module(body=found, type_ignores=[]), "<release>", "exec"), space)  # noqa: S102 - a release's own function
    return {name: space[name] for name in names if name in space}


def formula(run) -> str:
    """What ``run(l)`` computes on the probe log-ratios, in words: a known estimator, its cap, its gradient."""
    l = torch.tensor(PROBE, dtype=torch.float64, requires_grad=True)
    try:
        value = run(l)
    except NotImplementedError:
        return "raises NotImplementedError"
    (grad,) = torch.autograd.grad(value.sum(), l)
    value, grad = value.detach().double(), grad.double()  # OpenRLHF computes in float32
    for name, (text, exact) in FORMULAS.items():
        raw = exact(l.detach())
        cap = float(value.max())
        is_capped = cap < float(raw.max()) * (1 - 1e-4)  # float32's exp(30) is no cap
        capped = raw.clamp(-cap, cap) if is_capped else raw
        if torch.allclose(value, capped, rtol=1e-5, atol=1e-6):
            said = f"{name} = {text}" + (f", clamped to [-{cap:g}, {cap:g}]" if is_capped else "")
            gradient = _gradient_name(grad, l.detach(), raw != capped)
            return said if gradient == name else f"{said}; gradient of {gradient}"
    return "none of k1, k2, k3, |l|"


def _gradient_name(grad: torch.Tensor, l: torch.Tensor, capped: torch.Tensor) -> str:
    free = ~capped
    grads = {"k1": torch.ones_like(l), "k2": l, "k3": 1 - torch.exp(-l), "abs": torch.sign(l)}
    return next((name for name, g in grads.items() if torch.allclose(grad[free], g[free], rtol=1e-5, atol=1e-6)),
                "another")


def verl_release(clone: Path, tag: str) -> dict:
    files = git(clone, "ls-tree", "-r", "--name-only", tag).split()
    config_path = next(p for p in ("verl/trainer/config/_generated_ppo_trainer.yaml",
                                   "verl/trainer/config/ppo_trainer.yaml") if p in files)
    config = yaml.safe_load(git(clone, "show", f"{tag}:{config_path}"))
    defaults = {key: value for key in VERL_KEYS if (value := _dig(config, key)) is not _MISSING}
    trainer = git(clone, "show", f"{tag}:verl/trainer/ppo/ray_trainer.py")
    algos = git(clone, "show", f"{tag}:verl/trainer/ppo/core_algos.py")
    run = functions(algos, ("kl_penalty", "kl_penalty_forward"))["kl_penalty"]
    names = compared_with(algos, "kl_penalty")  # "full" too: the release's function says what it does with it
    if re.search(r"kl_penalty\.endswith\(['\"]\+['\"]\)", algos):
        names += [f"{n}+" for n in names if n != "full"]
    estimators = {n: formula(lambda l, n=n: run(l, torch.zeros_like(l), n)) for n in names}
    return {"version": tag.lstrip("v"), "read": f"volcengine/verl {config_path}, verl/trainer/ppo/ray_trainer.py, "
            f"verl/trainer/ppo/core_algos.py, verl/trainer/main_ppo*.py at tag {tag}", "defaults": defaults,
            "reward_kl": _verl_reward(trainer), "estimators": estimators, "entry_points": _verl_entry_points(clone, tag,
                                                                                                          files)}


def _verl_entry_points(clone: Path, tag: str, files: list[str]) -> list[str]:
    """The trainer modules a launch script may run at the tag: verl/trainer/main_ppo*.py with a Hydra main
    (``main_ppo_sync`` in 0.8; ``main_ppo_v0`` in 0.9 is imported by ``main_ppo``, not run)."""
    found = [path for path in files if re.fullmatch(r"verl/trainer/main_ppo\w*\.py", path)
             and "@hydra.main" in git(clone, "show", f"{tag}:{path}")]
    return sorted(path[:-3].replace("/", ".") for path in found)


def compared_with(source: str, variable: str) -> list[str]:
    """The strings ``variable`` is compared with (``== "k1"``, ``in ("kl", "k1")``), in the order written."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == variable:
            for right in node.comparators:
                items = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
                out += [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
    return list(dict.fromkeys(out))


_MISSING = object()


def _dig(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _verl_reward(trainer: str) -> str:
    if "use_kl_in_reward" in trainer:
        return "with algorithm.use_kl_in_reward"
    if re.search(r"if not self\.config\.actor_rollout_ref\.actor\.get\(['\"]use_kl_loss", trainer):
        return "whenever actor.use_kl_loss is false"
    return "always"


def openrlhf_release(clone: Path, tag: str) -> dict:
    files = git(clone, "ls-tree", "-r", "--name-only", tag).split()
    cli = next(p for p in ("openrlhf/cli/train_ppo_ray.py", "examples/train_ppo_ray.py") if p in files)
    flags = _argparse_defaults(git(clone, "show", f"{tag}:{cli}"))
    defaults = {what: {"flag": flag, "default": flags[flag]} for what, names in OPENRLHF_FLAGS.items()
                for flag in names if flag in flags}
    utils = git(clone, "show", f"{tag}:openrlhf/models/utils.py")
    run = functions(utils, ("compute_approx_kl",))["compute_approx_kl"]
    if "use_kl_estimator_k3" in run.__code__.co_varnames:
        options = {"k1": {"use_kl_estimator_k3": False}, "k3": {"use_kl_estimator_k3": True}}
    elif "kl_estimator" in run.__code__.co_varnames:
        options = {n: {"kl_estimator": n} for n in compared_with(utils, "kl_estimator")}
    else:
        options = {"k1": {}}  # no choice: the one formula the function has
    mask = "action_mask" in run.__code__.co_varnames[:run.__code__.co_argcount]
    estimators = {n: formula(lambda l, kw=kw: run(l, torch.zeros_like(l), **kw,
                                                  **({"action_mask": torch.ones_like(l)} if mask else {})))
                  for n, kw in options.items()}
    maker = "openrlhf/trainer/ppo_utils/experience_maker.py"
    skips = re.search(r"not (?:self\.strategy\.)?args\.(use_kl_loss|algo\.kl\.use_loss)",
                      git(clone, "show", f"{tag}:{maker}") if maker in files else "")
    return {"version": tag.lstrip("v"), "read": f"OpenRLHF/OpenRLHF {cli}, openrlhf/models/utils.py, {maker} at "
            f"tag {tag}", "defaults": defaults, "estimators": estimators,
            "reward_kl": f"unless --{skips.group(1)}" if skips else "always"}


def _argparse_defaults(source: str) -> dict[str, object]:
    """--flag -> its default (store_true: False) for every add_argument call with a literal default."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant)):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        action = keywords.get("action")
        if isinstance(action, ast.Constant) and action.value == "store_true":
            out[node.args[0].value] = False
        elif "default" in keywords:
            try:
                out[node.args[0].value] = ast.literal_eval(keywords["default"])
            except ValueError:
                out[node.args[0].value] = ast.unparse(keywords["default"])
        else:
            out[node.args[0].value] = None
    return out


def ranges(releases: list[dict], facts: tuple[str, ...]) -> list[dict]:
    """Consecutive releases with the same facts -> one range (from, to, last_read, read, the facts)."""
    out: list[dict] = []
    for rel in releases:
        if out and all(out[-1][f] == rel[f] for f in facts):
            out[-1]["last_read"] = rel["version"]
            out[-1]["read"].append(rel["read"])
            continue
        out.append({"from": rel["version"], "last_read": rel["version"], "read": [rel["read"]],
                    **{f: rel[f] for f in facts}})
    for i, row in enumerate(out):
        row["to"] = out[i + 1]["from"] if i + 1 < len(out) else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", type=Path, required=True)
    parser.add_argument("--openrlhf", type=Path, required=True)
    args = parser.parse_args()
    note = ("from: first release of the range; to: first release of the next range (null: open); last_read: the "
            "newest release read for the range; estimators: l = log pi - log ref, each name's value and (where it "
            "differs) gradient, found by running the release's own function")
    tables = {
        "verl": ranges([verl_release(args.verl, t) for t in release_tags(args.verl)],
                       ("defaults", "reward_kl", "estimators", "entry_points")),
        "openrlhf": ranges([openrlhf_release(args.openrlhf, t) for t in release_tags(args.openrlhf)],
                           ("defaults", "reward_kl", "estimators")),
    }
    for name, rows in tables.items():
        table = {"framework": name, "generated_by": "tools/rl_versions.py", "note": note, "ranges": rows}
        (TARGET / f"{name}.json").write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {TARGET / f'{name}.json'}: {len(rows)} ranges")


if __name__ == "__main__":
    main()
