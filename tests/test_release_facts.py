"""Every row of the TRL, verl, OpenRLHF and Unsloth release tables against the facts tools/release_facts.py read
again from the frameworks' own source at each tag or commit the row names (tests/data/release_facts.json:
repository, tag, commit or wheel, file and line of each fact), so a row that states another default, estimator,
reward rule, field or TRL pairing than its releases have fails here; nothing is downloaded."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from packaging.version import Version

from klgrpo.integrations.versions import TRLRange, _table, constraints, trl_profiles

FACTS = json.loads((Path(__file__).parent / "data" / "release_facts.json").read_text(encoding="utf-8"))


def _in_row(row: dict, tag: str) -> bool:
    version = Version(tag)
    return Version(row["from"]) <= version and (row["to"] is None or version < Version(row["to"]))


def _values(defaults: dict) -> dict:
    return {name: fact["value"] for name, fact in defaults.items()}


def _trl_mismatches(row: dict, tag: str, fact: dict) -> list[str]:
    out = []
    if row["defaults"] != _values(fact["defaults"]):
        out.append(f"defaults {row['defaults']} != {_values(fact['defaults'])}")
    if row["kl_weight_field"] != fact["kl_weight_field"]["value"]:
        out.append(f"kl_weight_field {row['kl_weight_field']!r} != {fact['kl_weight_field']['value']!r}")
    if held := sorted(set(row["absent"]) & set(fact["has_of_named"])):
        out.append(f"absent names fields the release has: {held}")
    return out


def _rl_mismatches(row: dict, tag: str, fact: dict) -> list[str]:
    defaults = fact["defaults"]
    stated = ({what: {"flag": f["flag"], "default": f["default"]} for what, f in defaults.items()}
              if "flag" in next(iter(defaults.values()), {}) else _values(defaults))
    out = [] if row["defaults"] == stated else [f"defaults {row['defaults']} != {stated}"]
    for key in ("reward_kl", "estimators"):
        if row[key] != fact[key]["value"]:
            out.append(f"{key} {row[key]!r} != {fact[key]['value']!r}")
    if "entry_points" in fact and row["entry_points"] != fact["entry_points"]:
        out.append(f"entry_points {row['entry_points']} != {fact['entry_points']}")
    return out


CHECKS = {"trl": _trl_mismatches, "verl": _rl_mismatches, "openrlhf": _rl_mismatches}


def mismatches(name: str, rows: list[dict]) -> tuple[list[str], int]:
    """(each disagreement as 'table row (from X) at tag: what', the number of (row, tag) pairs compared)."""
    out, compared = [], 0
    for tag, fact in FACTS[name]["tags"].items():
        row = next((r for r in rows if _in_row(r, tag)), None)
        if row is None:
            out.append(f"{name}.json: no row holds {tag}, which a row names as read")
            continue
        compared += 1
        out += [f"{name}.json row from {row['from']} at {tag}: {what}" for what in CHECKS[name](row, tag, fact)]
    return out, compared


@pytest.mark.parametrize("name", ["trl", "verl", "openrlhf"])
def test_every_table_row_states_what_its_releases_source_has(name):
    found, compared = mismatches(name, _table(name)["ranges"])
    assert found == []
    # every tag the rows name is compared, or listed as not read (no clone, wheel or installed package held it)
    named = [text for row in _table(name)["ranges"] for text in row["read"]]
    assert compared + len(FACTS[name]["not_read"]) == len(named)
    assert compared >= {"trl": 28, "verl": 12, "openrlhf": 110}[name]


def test_the_trl_rows_fields_against_every_release_read():
    facts = FACTS["trl"]["tags"]
    newest = set(facts["v1.16.0"]["has_of_named"])  # absent: fields of the newest release the range lacks
    for row in _table("trl")["ranges"]:
        assert set(row["absent"]) <= newest
        read = [fact for tag, fact in facts.items() if _in_row(row, tag)]
        if len(read) == len(row["read"]):  # every release of the range read: what it had is known
            assert set(row["removed_since"]) <= set().union(*(set(f["has_of_named"]) for f in read))
            assert not set(row["removed_since"]) & newest


def test_each_fact_names_where_it_was_read():
    for name in ("trl", "verl", "openrlhf"):
        for tag, fact in FACTS[name]["tags"].items():
            assert fact["tag"] == tag and fact["repo"] in ("huggingface/trl", "volcengine/verl", "OpenRLHF/OpenRLHF")
            assert len(fact.get("commit", "")) == 40 or fact.get("wheel", "").startswith("trl")
            for default in fact["defaults"].values():
                assert default["file"] and (isinstance(default["line"], int) or default.get("why"))
    # a spot check by hand: TRL 0.18.0's beta default, 0.04, on its line of grpo_config.py
    beta = FACTS["trl"]["tags"]["v0.18.0"]["defaults"]["beta"]
    assert (beta["value"], beta["line"], FACTS["trl"]["tags"]["v0.18.0"]["commit"][:7]) == (0.04, 390, "ef4b0b2")


#: A field TRL 1.13.0 has that some row names as absent or removed (the fixture keeps only those fields).
_HAD_AT_1_13 = FACTS["trl"]["tags"]["v1.13.0"]["has_of_named"][0]


@pytest.mark.parametrize(("name", "index", "plant", "said"), [
    ("trl", 2, lambda r: r["defaults"].update(beta=0.0), "trl.json row from 0.18.0 at v0.18.0: defaults"),
    ("trl", 6, lambda r: r["absent"].append(_HAD_AT_1_13), f"absent names fields the release has: ['{_HAD_AT_1_13}']"),
    ("trl", 6, lambda r: r.update(kl_weight_field=None), "row from 1.10.0 at v1.13.0: kl_weight_field None"),
    ("verl", 2, lambda r: r["defaults"].update({"actor_rollout_ref.actor.kl_loss_coef": 0.002}),
     "verl.json row from 0.4.0 at v0.4.0: defaults"),
    ("verl", 1, lambda r: r["estimators"].update(low_var_kl="k3 = exp(-l) - 1 + l"), "at v0.2: estimators"),
    ("verl", 0, lambda r: r.update(reward_kl="with algorithm.use_kl_in_reward"), "at v0.1: reward_kl"),
    ("verl", 3, lambda r: r["entry_points"].append("verl.trainer.main_ppo_sync"), "at v0.6.0: entry_points"),
    ("openrlhf", 7, lambda r: r["defaults"]["estimator"].update(default="k3"), "row from 0.10.2 at v0.10.2: defaults"),
    ("openrlhf", 0, lambda r: r.update({"to": "0.3.0"}), "openrlhf.json: no row holds v0.3.0"),
])
def test_a_planted_wrong_row_is_named(name, index, plant, said):
    rows = copy.deepcopy(_table(name)["ranges"])
    plant(rows[index])
    found, _ = mismatches(name, rows)
    assert any(said in line for line in found), found


def unsloth_mismatches(rows: list[dict]) -> tuple[list[str], int]:
    """Each Unsloth row against the commits it names: the __version__ there lies in the row's range; rl.py's
    replacements write the row's beta and loss_type (null: none written); the TRL pyproject.toml allows holds
    every TRL range the row pairs with."""
    out, compared = [], 0
    for row in rows:
        named = [sha for text in row["read"] for sha in FACTS["unsloth"]["commits"] if sha in text]
        paired = [p for p in trl_profiles() if p.allows(constraints(row["trl"]))]
        for sha in named:
            fact, compared = FACTS["unsloth"]["commits"][sha], compared + 1
            where = f"unsloth.json row from {row['from']} at {sha}"
            if not _in_row(row, fact["version"]["value"]):
                out.append(f"{where}: __version__ {fact['version']['value']} is outside the row")
            if "replacements" in fact:
                written = {name: fact["replacements"].get(name, {}).get("value") for name in row["defaults"]}
                if written != row["defaults"]:
                    out.append(f"{where}: defaults {row['defaults']} != the replacements {written}")
            if "trl" in fact:
                pin = constraints(fact["trl"]["value"])
                refused = [p.label for p in paired if not TRLRange("trl", p.low, p.high).allows(pin)]
                if refused:
                    out.append(f"{where}: pairs with {refused}, which trl{fact['trl']['value']} rules out")
    return out, compared


def test_every_unsloth_row_states_what_the_commits_it_names_have():
    found, compared = unsloth_mismatches(_table("unsloth")["ranges"])
    assert found == []
    assert compared == len(FACTS["unsloth"]["commits"]) == 9


@pytest.mark.parametrize(("index", "plant", "said"), [
    (1, lambda r: r["defaults"].update(beta=0.01), "row from 2025.6.5 at d7b0653a2a: defaults"),
    (0, lambda r: r["defaults"].update(loss_type="bnpo"), "row from 2025.2.4 at 623060ba29: defaults"),
    (0, lambda r: r.update(trl=">=0.14,<0.20"), "row from 2025.2.4 at f331d5e537: pairs with ['TRL >= 0.16.0"),
    (2, lambda r: r.update({"from": "2025.10.1"}), "at 721eee6a80: __version__ 2025.9.1 is outside the row"),
])
def test_a_planted_wrong_unsloth_row_is_named(index, plant, said):
    rows = copy.deepcopy(_table("unsloth")["ranges"])
    plant(rows[index])
    found, _ = unsloth_mismatches(rows)
    assert any(said in line for line in found), found
