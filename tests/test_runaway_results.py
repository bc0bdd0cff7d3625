"""The runaway sweep's committed results (docs/results/forgetting-runaway, written by tools/runaway_results.py) and
what docs/ablation.md and docs/quickstart.md quote from them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "forgetting-runaway"
SECTION = "## Acting on a KL runaway"


def _tool():
    spec = importlib.util.spec_from_file_location("runaway_results", ROOT / "tools" / "runaway_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _published() -> dict:
    return json.loads((ROOT / "docs" / "results" / "forgetting" / "table.json").read_text())


def _section() -> str:
    text = (ROOT / "docs" / "ablation.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return " ".join((text[start:] if end < 0 else text[start:end]).split())


def test_the_pairing_is_recomputed_from_the_two_tables():
    table = json.loads((RESULTS / "table.json").read_text())
    published = json.loads((ROOT / "docs" / "results" / "forgetting" / "table.json").read_text())
    assert json.loads((RESULTS / "paired.json").read_text()) == json.loads(json.dumps(_tool().paired(table,
                                                                                                      published)))


def test_every_run_record_is_its_tables_run():
    table = json.loads((RESULTS / "table.json").read_text())
    runs = {(c["setting"], r["seed"]): r["values"] for c in table["cells"] for r in c["runs"] if "values" in r}
    records = json.loads((RESULTS / "runs.json").read_text())
    assert {(r["setting"], r["seed"]) for r in records} == set(runs)
    for r in records:
        assert r["final_kl"] == runs[(r["setting"], r["seed"])]["final_kl"]
        if "on_runaway" in r["setting"]:
            assert r["runaway"]["rollbacks"] == sum(a["action"] == "rolled_back" for a in r["runaway"]["actions"])
        if "adaptive" in r["setting"]:  # kl.horizon auto: 20 steps of 32 sequences -> 12.8 (auto_horizon's floor)
            assert abs(r["kl_reach"]["horizon"] - 12.8) < 1e-9


def test_docs_quote_the_paired_sentences_and_every_run():
    docs = _section()
    paired = (RESULTS / "paired.md").read_text()
    sentences = [line for line in paired.splitlines() if line.startswith("- kl.")]
    assert sentences and all(" ".join(s.split()) in docs for s in sentences)
    rows = [line for line in paired.splitlines() if line.startswith("| kl.")]
    assert rows and all(row in docs for row in rows)
    table = json.loads((RESULTS / "table.json").read_text())
    values = {(c["setting"], r["seed"]): r["values"] for c in table["cells"] for r in c["runs"] if "values" in r}
    for r in json.loads((RESULTS / "runs.json").read_text()):
        v = values[(r["setting"], r["seed"])]
        rollbacks = r["runaway"]["rollbacks"] if r["runaway"] else "-"
        reached = ("yes" if r["kl_reach"]["reached"] else "no") if r["kl_reach"] else "-"
        row = (f"| {r['setting']} | {r['seed']} | {v['add/change']:+.1f} | {v['capitals/change']:+.1f} | "
               f"{v['opposites/change']:+.1f} | {r['final_kl']:.2f} | {r['final_beta']:.4g} | {rollbacks} | "
               f"{reached} |")
        assert row in docs, row


def test_the_reading_is_the_runs():
    """The numbers the section's prose quotes: the rollback run at seed 4 (its time, its runaway window's KL, its
    final beta), the published beta 0.01 runs' mean process time, and what plain KL lost at seed 4."""
    docs = _section()
    table = json.loads((RESULTS / "table.json").read_text())
    published = json.loads((ROOT / "docs" / "results" / "forgetting" / "table.json").read_text())
    runs = {(r["setting"], r["seed"]): r for r in json.loads((RESULTS / "runs.json").read_text())}
    rollback = runs[("kl.coef=0.01,kl.on_runaway=rollback", 4)]
    values = next(r["values"] for c in table["cells"] for r in c["runs"]
                  if c["setting"] == "kl.coef=0.01,kl.on_runaway=rollback" and r["seed"] == 4)
    assert f"that run took {values['process_seconds']:.0f} s" in docs
    actions = rollback["runaway"]["actions"]
    assert [a["to_step"] for a in actions] == [0, 0] and "went back to step 0 twice" in docs
    assert f"(mean KL {actions[0]['kl']:.2f})" in docs and f"beta {rollback['final_beta']:g}" in docs
    plain = next(c for c in published["cells"] if c["setting"] == "kl.coef=0.01")
    assert f"beta 0.01 runs took {plain['stats']['process_seconds']['mean']:.0f} s on average" in docs
    lost = [-r["values"]["capitals/change"] for c in published["cells"] if "replay" not in c["setting"]
            for r in c["runs"] if r["seed"] == 4]
    assert f"lost {min(lost):.0f}-{max(lost):.0f} points of capitals there" in docs


def test_quickstart_quotes_the_rollback_run():
    quickstart = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    table = json.loads((RESULTS / "table.json").read_text())
    v = next(r["values"] for c in table["cells"] for r in c["runs"]
             if c["setting"] == "kl.coef=0.01,kl.on_runaway=rollback" and r["seed"] == 4)
    run = next(r for r in json.loads((RESULTS / "runs.json").read_text()) if r["seed"] == 4 and r["runaway"])
    assert (f"rolled back twice, ended at beta {run['final_beta']:g} and a quarter of the learning rate, and changed "
            f"add / capitals / opposites by {v['add/change']:+.1f} / {v['capitals/change']:+.1f} / "
            f"{v['opposites/change']:+.1f} points") in quickstart
    assert run["runaway"]["rollbacks"] == 2 and run["runaway"]["lr_scale"] == 0.25


def test_a_run_the_folder_lacks_is_kept_from_the_committed_table_and_the_stats_recomputed():
    setting = "kl.coef=0.01,kl.on_runaway=rollback"

    def cell(runs, missing=()):
        return {"setting": setting, "seeds": [r["seed"] for r in runs if "values" in r], "missing": list(missing),
                "runs": runs, "stats": {}}

    earlier = {"cells": [cell([{"seed": 4, "status": "skipped", "values": {"final_kl": 0.4}}])]}
    new = {"header": ["# t"], "cells": [cell([{"seed": 3, "status": "finished", "values": {"final_kl": 0.2}},
                                              {"seed": 4, "status": "missing"}], missing=[4])]}
    merged = _tool().with_earlier_runs(new, earlier)["cells"][0]
    assert merged["missing"] == [] and sorted(merged["seeds"]) == [3, 4]
    assert [r["status"] for r in merged["runs"]] == ["finished", "earlier"]
    # mean of 0.2 and 0.4; sample std sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.1414...
    stats = merged["stats"]["final_kl"]
    assert abs(stats["mean"] - 0.3) < 1e-12 and abs(stats["std"] - 2 ** 0.5 / 10) < 1e-12 and stats["n"] == 2
    assert "seed 4" in new["header"][-1]


def test_the_readings_claims_are_the_runs():
    """What the reading says of the finished runs: the worst retention loss of a rollback run, the range of its
    task gains, and the auto horizon's loss of capitals at seed 4."""
    docs = _section()
    table = json.loads((RESULTS / "table.json").read_text())
    runs = {c["setting"]: {r["seed"]: r["values"] for r in c["runs"] if "values" in r} for c in table["cells"]}
    rollback = runs["kl.coef=0.01,kl.on_runaway=rollback"].values()
    worst = max(-min(v["capitals/change"], v["opposites/change"]) for v in rollback)
    assert f"no rollback run lost more than {worst:.1f} points of a retention set" in docs
    gains = [v["add/change"] for v in rollback]
    assert f"learned the sums ({min(gains):+.1f} to {max(gains):+.1f} points)" in docs
    adaptive = runs["kl.controller=adaptive,kl.coef=0.01,kl.horizon=auto"]
    worst_seed = min(adaptive, key=lambda seed: adaptive[seed]["capitals/change"])
    assert f"at seed {worst_seed} it lost {-adaptive[worst_seed]['capitals/change']:.1f} points of capitals" in docs
    assert f"at seed 4 {-adaptive[4]['capitals/change']:.1f}" in docs
    lost = [seed for seed, v in adaptive.items() if min(v["capitals/change"], v["opposites/change"]) < -10]
    words = ["no", "one", "two", "three", "four", "five"]
    assert f"{words[len(lost)]} of the {words[len(adaptive)]} runs lost more than 10 points" in docs
    plain = {r["seed"]: r["values"]["add/change"] for c in _published()["cells"] if c["setting"] == "kl.coef=0.01"
             for r in c["runs"]}
    assert f"plain beta 0.01 ended at {min(plain.values()):+.1f} to {max(plain.values()):+.1f}" in docs


def test_quickstart_quotes_the_readings_claims():
    quickstart = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    docs = _section()
    adaptive = [r["values"] for c in json.loads((RESULTS / "table.json").read_text())["cells"]
                if c["setting"] == "kl.controller=adaptive,kl.coef=0.01,kl.horizon=auto" for r in c["runs"]]
    assert f"one lost {-min(v['capitals/change'] for v in adaptive):.1f} points of capitals" in quickstart
    lost = sum(min(v["capitals/change"], v["opposites/change"]) < -10 for v in adaptive)
    assert f"({['no', 'one', 'two', 'three', 'four', 'five'][lost]} of five runs lost more than 10 points" in quickstart
    table = json.loads((RESULTS / "table.json").read_text())
    rollback = [r["values"] for c in table["cells"] if c["setting"] == "kl.coef=0.01,kl.on_runaway=rollback"
                for r in c["runs"] if "values" in r]
    worst = max(-min(v["capitals/change"], v["opposites/change"]) for v in rollback)
    assert f"no run lost more than {worst:.1f} points of a retention set" in quickstart
    assert len(rollback) == 5 and "on the same regime (5 seeds)" in quickstart
    published = json.loads((ROOT / "docs" / "results" / "forgetting" / "table.json").read_text())
    plain = next(c for c in published["cells"] if c["setting"] == "kl.coef=0.01")
    seeds = {r["seed"] for c in table["cells"] if "on_runaway" in c["setting"] for r in c["runs"] if "values" in r}
    plain_worst = max(-min(r["values"]["capitals/change"], r["values"]["opposites/change"])
                      for r in plain["runs"] if r["seed"] in seeds)
    assert f"plain beta 0.01 at the same seeds lost up to {plain_worst:.1f} points" in quickstart
    assert f"lost 10.9 to {plain_worst:.1f} points at two of the same seeds" in docs


def test_the_anchored_reading_is_the_runs():
    """Beside the anchor: the worst loss of either set; with rollback the sums per seed against the anchor alone's
    at the same seeds, and the paired task change; with the auto horizon the sums per seed and its beta range."""
    docs = _section()
    table = json.loads((RESULTS / "table.json").read_text())
    runs = {c["setting"]: {r["seed"]: r["values"] for r in c["runs"] if "values" in r} for c in table["cells"]}
    rollback = runs["kl.coef=0.01,kl.on_runaway=rollback,kl.replay.coef=1"]
    auto = runs["kl.controller=adaptive,kl.coef=0.01,kl.horizon=auto,kl.replay.coef=1"]
    seeds = sorted(rollback)
    assert seeds == sorted(auto) == [0, 1, 2, 3, 4] and f"seeds {seeds[0]} to {seeds[-1]}:" in docs
    worst = max(-min(v["capitals/change"], v["opposites/change"]) for v in [*rollback.values(), *auto.values()])
    assert f"no run lost more than {worst:.1f} points of either set" in docs
    alone = {r["seed"]: r["values"]["add/change"] for c in _published()["cells"]
             if c["setting"] == "kl.coef=0.01,kl.replay.coef=1" for r in c["runs"]}

    def listed(values):  # "a, b, c, d and e" in seed order
        shown = [f"{values[s]:+.1f}" for s in seeds]
        return ", ".join(shown[:-1]) + " and " + shown[-1]

    assert f"learned the sums at every seed (seeds 0 to 4: {listed({s: rollback[s]['add/change'] for s in seeds})}"\
        in docs and all(v["add/change"] > 0 for v in rollback.values())
    assert f"the anchor alone ended at {listed(alone)}:" in docs
    rises = sum(auto[s]["add/change"] > 0 for s in seeds)
    assert rises == 2 and f"rose at two seeds only ({listed({s: auto[s]['add/change'] for s in seeds})}" in docs
    betas = [r["final_beta"] for r in json.loads((RESULTS / "runs.json").read_text())
             if r["setting"] == "kl.controller=adaptive,kl.coef=0.01,kl.horizon=auto,kl.replay.coef=1"]
    assert f"beta ending at {min(betas):.2f} to {max(betas):.2f}" in docs
    paired = json.loads((RESULTS / "paired.json").read_text())["kl.coef=0.01,kl.replay.coef=1"]["rows"]
    task = {row["setting"]: row["add/change"] for row in paired}
    guarded = task["kl.coef=0.01,kl.on_runaway=rollback,kl.replay.coef=1"]
    assert guarded["higher"] == 5 and (f"{guarded['mean']:+.1f} points of the task against the anchor alone (95% "
                                       f"interval {guarded['low']:+.1f}..{guarded['high']:+.1f}), higher at 5 of 5"
                                       ) in docs
    horizon = task["kl.controller=adaptive,kl.coef=0.01,kl.horizon=auto,kl.replay.coef=1"]
    assert f"{horizon['mean']:+.1f} points ({horizon['low']:+.1f}..{horizon['high']:+.1f})" in docs


def test_the_anchored_reading_quotes_retention_and_rollbacks():
    """The anchored bullet's retention against the anchor alone (with the sweep's formatting: +0.0, never -0.0)
    and the rollbacks per run."""
    from klgrpo.apps.sweep.paired import points

    docs = _section()
    paired = json.loads((RESULTS / "paired.json").read_text())["kl.coef=0.01,kl.replay.coef=1"]["rows"]
    kept = {row["setting"]: row["retention"] for row in paired}
    rollback = kept["kl.coef=0.01,kl.on_runaway=rollback,kl.replay.coef=1"]
    horizon = kept["kl.controller=adaptive,kl.coef=0.01,kl.horizon=auto,kl.replay.coef=1"]
    assert (f"retention {points(rollback['mean'])} points for rollback, 95% interval {points(rollback['low'])}.."
            f"{points(rollback['high'])}, and {points(horizon['mean'])} for the auto horizon, "
            f"{points(horizon['low'])}..{points(horizon['high'])}, against the anchor alone") in docs
    rollbacks = {r["seed"]: r["runaway"]["rollbacks"] for r in json.loads((RESULTS / "runs.json").read_text())
                 if r["setting"] == "kl.coef=0.01,kl.on_runaway=rollback,kl.replay.coef=1"}
    assert rollbacks == {0: 1, 1: 1, 2: 1, 3: 2, 4: 1} and "one rollback each but two at seed 3" in docs


def test_quickstart_quotes_the_anchored_rollback():
    quickstart = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    table = json.loads((RESULTS / "table.json").read_text())
    anchored = [r["values"] for c in table["cells"] if c["setting"] == "kl.coef=0.01,kl.on_runaway=rollback,"
                "kl.replay.coef=1" for r in c["runs"] if "values" in r]
    worst = max(-min(v["capitals/change"], v["opposites/change"]) for v in anchored)
    rows = json.loads((RESULTS / "paired.json").read_text())["kl.coef=0.01,kl.replay.coef=1"]["rows"]
    task = next(r["add/change"] for r in rows if r["setting"] == "kl.coef=0.01,kl.on_runaway=rollback,kl.replay.coef=1")
    assert len(anchored) == 5 and all(v["add/change"] > 0 for v in anchored)
    assert worst <= 0 and all(v["capitals/change"] >= 0 and v["opposites/change"] >= 0 for v in anchored)
    assert (f"rollback kept both sets (no run lost a point of either) and learned the sums at "
            f"all 5 seeds: {task['mean']:+.1f} points of the task against the anchor alone (95% interval "
            f"{task['low']:+.1f}..{task['high']:+.1f})") in quickstart
