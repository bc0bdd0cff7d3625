"""No public function of klgrpo/math or klgrpo/train takes more than MAX_PARAMETERS parameters: a longer list is a
sign that its arguments want a dataclass (the objective takes ObjectiveInputs and ObjectiveTerms, a policy loss
its registered settings as one ``params``, the step's builder the caller's GivenParts)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("klgrpo/math", "klgrpo/train")
MAX_PARAMETERS = 8


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every parameter (positional-only, ordinary, keyword-only, *args, **kwargs), self or cls not counted."""
    a = node.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return count - bool(a.args and a.args[0].arg in ("self", "cls"))


def long_signatures(source: str, limit: int = MAX_PARAMETERS) -> list[tuple[str, int]]:
    """(name, count) of the public functions and methods in ``source`` with more than ``limit`` parameters."""
    return [(n.name, parameter_count(n)) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")
            and parameter_count(n) > limit]


def test_the_counter_counts_every_kind_of_parameter():
    planted = ("def nine(a, b, /, c, d=1, *args, e, f=2, g, **kw): ...\n"
               "class C:\n    def method(self, a, b, c, d, e, f, g, h): ...\n    @classmethod\n"
               "    def build(cls, a, b, c, d, e, f, g, h, i): ...\n"
               "def _private(a, b, c, d, e, f, g, h, i): ...\n")
    assert long_signatures(planted) == [("nine", 9), ("build", 9)]  # method: 8 (self not counted)


def test_no_public_function_of_math_or_train_takes_more_than_eight_parameters():
    found = {f"{path.relative_to(ROOT)}:{name}": count for room in ROOMS for path in sorted((ROOT / room).rglob("*.py"))
             for name, count in long_signatures(path.read_text())}
    assert found == {}
