"""The package's rooms import in one direction along the data path, and no module imports itself in a circle.

    math  <-  backends  <-  core  <-  config  <-  store  <-  train  <-  run  <-  apps
    math  <-  verify (the proof imports the same objective the trainer runs)

Every import counts, also the ones inside functions; imports under ``if TYPE_CHECKING:`` (annotations only)
do not. klgrpo/errors.py and the package's __init__ may be imported from anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "klgrpo"

#: room -> rooms it may import from (itself included).
ALLOWED = {
    "math": {"math"},
    "backends": {"math", "backends"},
    "core": {"math", "backends", "core"},
    "config": {"math", "backends", "core", "config"},
    "store": {"math", "backends", "core", "config", "store"},
    "verify": {"math", "core", "verify"},
    "train": {"math", "backends", "core", "config", "store", "train"},
    "run": {"math", "backends", "core", "config", "store", "train", "run"},
    "integrations": {"math", "backends", "core", "config", "store", "train", "run", "verify", "integrations"},
    "apps": {"math", "backends", "core", "config", "store", "train", "run", "verify", "integrations", "apps"},
}
#: Importable from every room.
SHARED = {"klgrpo", "klgrpo.errors"}
#: Modules at the top of the package that belong to a room.
TOP_LEVEL_ROOMS = {"klgrpo.trl": "integrations", "klgrpo.custom": "integrations", "klgrpo.__main__": "apps"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str | None:
    if module in SHARED:
        return None
    if module in TOP_LEVEL_ROOMS:
        return TOP_LEVEL_ROOMS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Fully qualified klgrpo modules (or module attributes) that ``module`` imports at run time."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "klgrpo")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == "klgrpo":
                found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        modules[_module_name(path)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            # "klgrpo.math.kl.k3" -> the module "klgrpo.math.kl"; "klgrpo.verify.categorical" stays a module
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


GRAPH = _graph()


def test_every_module_has_a_room():
    homeless = [m for m in GRAPH if m not in SHARED and _room(m) not in ALLOWED]
    assert not homeless, f"modules outside the rooms {sorted(ALLOWED)}: {homeless}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_follow_the_data_path(module):
    room = _room(module)
    if room is None:
        return
    wrong = sorted(t for t in GRAPH[module] if _room(t) is not None and _room(t) not in ALLOWED[room])
    assert not wrong, f"{module} ({room}) imports against the direction: {wrong}"


def test_no_import_cycles():
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt in SHARED:
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_layout_test_sees_a_planted_violation(tmp_path):
    source = "def f():\n    from klgrpo.run.trainer import GRPOTrainer\n"
    imported = _imports(ast.parse(source), "klgrpo.math.kl", False)
    assert imported == {"klgrpo.run.trainer.GRPOTrainer"}
    assert _room("klgrpo.run.trainer") not in ALLOWED["math"]
