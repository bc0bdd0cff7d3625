"""The release tables as typed rows (klgrpo.integrations.versions, klgrpo.apps.explain.frameworks): versions read
by packaging with the series rule pins are written in, each row checked once on load, a bad row refused in one
line naming the file and the row."""

from __future__ import annotations

import copy

import pytest
from packaging.version import Version

from klgrpo.apps.explain import frameworks
from klgrpo.integrations import versions
from klgrpo.integrations.versions import (
    Constraint,
    RewardKL,
    RLRange,
    TableError,
    TRLRange,
    constraints,
    satisfiable,
)


def _allows(spec: str, low: str, high: str | None) -> bool:
    return TRLRange("trl", Version(low), Version(high) if high else None).allows(constraints(spec))


@pytest.mark.parametrize(("spec", "low", "high", "expected"), [
    ("==0.18", "0.18.2", "0.19.0", True),  # ==0.18 is every 0.18.x
    ("==0.18", "0.19.0", None, False),
    ("==0.18.0", "0.18.0", "0.18.1", True),
    ("==0.18.1", "0.18.0", "0.18.1", False),  # [low, high): 0.18.1 is the next range's
    ("==0.6.0.post1", "0.6.0.post1", "0.7.1", True),
    ("==0.6.0.post1", "0.6.0", "0.6.0.post1", False),  # 0.6.0 alone, not its post releases
    ("==0.6", "0.6.0", "0.6.0.post1", True),
    ("==0.6", "0.6.0.post1", "0.7.1", True),  # the series holds the post releases
    ("~=0.15.0", "0.14.0", "0.16.0", True),
    ("~=0.15.0", "0.16.0", "0.17.0", False),  # ~=0.15.0 is >=0.15.0, ==0.15.*
    ("~=0.15", "0.16.0", "0.17.0", True),  # ~=0.15 is >=0.15, ==0.*
    ("~=1", "7.0", None, True),
    (">0.18", "0.18.0", "0.19.0", False),  # >0.18 leaves out every 0.18.x
    (">0.18", "0.19.0", None, True),
    ("<=0.18", "0.18.0", "0.19.0", True),  # <=0.18 holds every 0.18.x
    ("<=0.18", "0.19.0", None, False),
    ("<0.19", "0.18.0", "0.19.0", True),
    ("<0.19", "0.19.0", None, False),
    ("!=0.18", "0.18.0", "0.19.0", True),  # != is taken as allowing every range
    (">=0.16,<0.18", "0.14.0", "0.16.0", False),
    (">=0.16,<0.18", "0.17.0", "0.18.0", True),
])
def test_a_clause_allows_the_ranges_holding_a_release_it_names(spec, low, high, expected):
    assert _allows(spec, low, high) is expected


@pytest.mark.parametrize(("spec", "expected"), [
    ("==0.18,==0.19", False), (">=0.20,<0.19", False), ("==0.18,!=0.18", False), ("==0.18.0,!=0.18.0", False),
    ("==0.18,!=0.18.0", True),  # 0.18.1 is left
    (">=0.18.0,!=0.18.0", True), (">=0.18,!=0.18.*,!=0.19", True),  # 0.20: past both exclusions
    (">=0.18,<0.20,!=0.18,!=0.19", False), ("~=0.15.0,<0.15.0", False), ("<=0.18,>0.17", True),
])
def test_clauses_together_are_satisfiable_only_when_a_release_meets_them_all(spec, expected):
    assert satisfiable(constraints(spec)) is expected


def test_the_series_rule_as_packaging_specifiers():
    said = {spec: str(constraints(spec)[0].specifier) for spec in
            ("==0.18", "!=2025.9", "==0.18.0", "<=0.18", ">0.18.2", "~=1", "~=0.15.0", "==0.18.*", "<=0.6.0.post1")}
    assert said == {"==0.18": "==0.18.*", "!=2025.9": "!=2025.9.*", "==0.18.0": "==0.18.0", "<=0.18": "<0.19",
                    ">0.18.2": ">=0.18.3", "~=1": ">=1", "~=0.15.0": "~=0.15.0", "==0.18.*": "==0.18.*",
                    "<=0.6.0.post1": "<0.6.0.post2"}
    assert [str(c) for c in constraints("==v0.18 , >= 0.6.0.post1")] == ["==0.18", ">=0.6.0.post1"]


@pytest.mark.parametrize(("spec", "named"), [("0.18", "'0.18'"), ("===0.18", "'===0.18'"), ("==0.18.x", "'0.18.x'"),
                                             ("==0.18.0.*", "'==0.18.0.*'"), (">=abc", "'abc'")])
def test_a_bad_clause_is_one_config_error_naming_it(spec, named):
    with pytest.raises(versions.ConfigError) as err:
        constraints(spec)
    assert named in str(err.value) and "e.g." in str(err.value) and "\n" not in str(err.value)


def test_every_table_loads_into_its_row_type():
    from klgrpo.math.kl import ESTIMATORS

    assert all(isinstance(p, TRLRange) and isinstance(p.low, Version) for p in versions.trl_profiles())
    assert all(isinstance(p.trl, TRLRange) and p.unweighted_kl for p in versions.unsloth_profiles())
    for framework in versions.RL_FRAMEWORKS:
        rows = versions.rl_profiles(framework)
        assert all(isinstance(r, RLRange) and isinstance(r.reward_kl, RewardKL) for r in rows)
        assert all(a.high == b.low for a, b in zip(rows, rows[1:])) and rows[-1].high is None
        for row in rows:
            for typed in row.estimators.values():
                assert typed.estimator in ESTIMATORS or (typed.estimator is None and typed.why)
    for framework in frameworks.FRAMEWORKS:
        assert all(isinstance(r.low, Version) for r in frameworks.releases(framework))
    # verl 0.2-0.3 put the KL in the reward unless the loss holds it; 0.4 on, with algorithm.use_kl_in_reward
    verl = {str(r.low): r for r in versions.rl_profiles("verl")}
    assert (verl["0.1"].reward_kl, verl["0.2"].reward_kl, verl["0.4.0"].reward_kl) == (
        RewardKL.ALWAYS, RewardKL.UNLESS_KL_LOSS, RewardKL.WITH_USE_KL_IN_REWARD)
    assert (verl["0.2"].estimators["low_var_kl"].estimator, verl["0.2"].estimators["low_var_kl"].cap) == ("k3", 10.0)
    assert verl["0.1"].estimators["full"].raises


def _planted(monkeypatch, name: str, edit) -> None:
    table = copy.deepcopy(versions._table(name))
    edit(table)
    monkeypatch.setattr(versions, "_table", lambda n, real=versions._table: table if n == name else real(n))
    for cached in (versions.trl_profiles, versions.unsloth_profiles, versions.rl_profiles):
        cached.cache_clear()


@pytest.fixture
def fresh_tables():
    yield
    for cached in (versions.trl_profiles, versions.unsloth_profiles, versions.rl_profiles, frameworks.releases):
        cached.cache_clear()


@pytest.mark.parametrize(("name", "edit", "said"), [
    ("verl", lambda t: t["ranges"][1].update(reward_kl="when it feels like it"),
     "verl.json ranges[1] (from 0.2): reward_kl 'when it feels like it' is none of"),
    ("openrlhf", lambda t: t["ranges"][-1].update(reward_kl="unless --use_kl_loss"),  # the range's flag is another
     "openrlhf.json ranges[7] (from 0.10.2): reward_kl 'unless --use_kl_loss' is none of"),
    ("verl", lambda t: t["ranges"][2].update({"from": "0.4.x"}), "verl.json ranges[2] (from 0.4.x): from '0.4.x'"),
    ("verl", lambda t: t["ranges"][2].update({"from": "0.5.0"}), "verl.json ranges[2] (from 0.5.0): from 0.5.0 is "
                                                                  "not the previous row's to"),
    ("verl", lambda t: t["ranges"][0]["estimators"].update(kl=["k1"]), "verl.json ranges[0] (from 0.1): estimators.kl"),
    ("verl", lambda t: t["ranges"][0].pop("defaults"), "verl.json ranges[0] (from 0.1): KeyError: 'defaults'"),
    ("openrlhf", lambda t: t["ranges"][0]["defaults"].update(init_coef=0.02),
     "openrlhf.json ranges[0] (from 0.0.1): defaults must map each KL setting to {flag, default}"),
    ("trl", lambda t: t["ranges"][0]["defaults"].pop("beta"), "trl.json ranges[0] (from 0.14.0): defaults must hold"),
    ("trl", lambda t: t["ranges"][1].update(absent="loss_type"), "trl.json ranges[1] (from 0.16.0): absent must be"),
    ("unsloth", lambda t: t["ranges"][0].update(trl="trl 0.14"), "unsloth.json ranges[0] (from 2025.2.4): "),
])
def test_a_bad_row_is_one_line_naming_the_file_and_the_row(monkeypatch, fresh_tables, name, edit, said):
    _planted(monkeypatch, name, edit)
    load = {"trl": versions.trl_profiles, "unsloth": versions.unsloth_profiles}.get(
        name, lambda: versions.rl_profiles(name))
    with pytest.raises(TableError) as err:
        load()
    assert said in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"klgrpo/integrations/versions/{name}.json ranges[")


def test_a_bad_row_of_explains_own_tables_names_its_file(monkeypatch, fresh_tables):
    table = copy.deepcopy(frameworks.table("roll"))
    table["ranges"][0]["to"] = table["ranges"][0]["from"]
    monkeypatch.setattr(frameworks, "table", lambda name: table)
    frameworks.releases.cache_clear()
    with pytest.raises(TableError, match=r"^klgrpo/apps/explain/roll\.json ranges\[0\] \(from [\d.]+\): to [\d.]+ "
                                         r"is not after from"):
        frameworks.releases("roll")


def test_the_tables_as_shipped_hold_no_row_the_checks_refuse(fresh_tables):
    # planted-bug guard for the tests above: with the real tables the same loaders return every row
    assert [len(versions.rl_profiles(f)) for f in versions.RL_FRAMEWORKS] == [
        len(versions._table(f)["ranges"]) for f in versions.RL_FRAMEWORKS]
    assert len(versions.trl_profiles()) == len(versions._table("trl")["ranges"])
    assert Constraint(">=", Version("0.18")).meets(Version("0.19"), None)
