"""Every data file klgrpo reads at run time ships in the wheel: each JSON file under klgrpo/ matches a glob of
pyproject.toml's [tool.setuptools.package-data] (a table missing there would be absent from an installed
klgrpo, while an editable install and these tests still find it)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_json_table_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["klgrpo"]
    package = ROOT / "klgrpo"
    shipped = {p for g in globs for p in package.glob(g)}
    tables = set(package.rglob("*.json"))
    assert tables, "no JSON tables found: the test would check nothing"
    assert tables <= shipped, sorted(str(p.relative_to(ROOT)) for p in tables - shipped)
