"""klgrpo eval: a checkpoint evaluated on its own gives exactly what training logged for it as eval/<name> (before
training, mid-run and at the end), with the run's config.yaml or an explicit --config; one-line errors."""

from __future__ import annotations

import json

import pytest

from klgrpo.apps.cli import main as cli
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet

# A score that depends on every character of the greedy completion, so any change of the weights shows.
SCORE_PY = "def spread(prompts, completions, **kw):\n    return [(sum(map(ord, c)) % 97) / 97 for c in completions]\n"


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, addition_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cmd")
    (root / "score.py").write_text(SCORE_PY)
    sets = [{"name": "add", "source": str(addition_file), "limit": 12, "reward": f"{root / 'score.py'}:spread"},
            {"name": "add_exact", "source": str(addition_file), "limit": 6}]
    cfg = make_config(tiny_model_dir, addition_file, root / "run", eval={"sets": sets, "every": 1},
                      train={"steps": 2, "save_every": 1, "keep_checkpoints": 0})
    GRPOTrainer(cfg, log=quiet).train()
    logged = {}
    for row in read_metrics(root / "run"):
        if "eval/add" in row:
            logged[row["step"]] = row
    return root / "run", logged


def test_a_checkpoint_gives_the_numbers_training_logged(trained_run, tiny_model_dir, tmp_path, capsys):
    run, logged = trained_run
    assert sorted(logged) == [0, 1, 2]
    assert len({logged[s]["eval/add"] for s in logged}) > 1  # the weights moved: the numbers differ by step
    for step in (1, 2):
        out = tmp_path / f"step{step}.json"
        assert cli(["eval", str(run / "checkpoints" / f"step_{step}"), "--json", str(out)]) == 0
        results = json.loads(out.read_text())["results"]
        names = ("eval/add", "eval/add_exact", "eval/add/entropy", "eval/add_exact/entropy")
        assert results == {k: logged[step][k] for k in names}
    text = capsys.readouterr().out
    assert f"eval.sets of {run / 'config.yaml'}" in text and "  add_exact        6  " in text
    # the model before training, with the run's config given explicitly: the step-0 numbers
    out = tmp_path / "base.json"
    assert cli(["eval", str(tiny_model_dir), "--config", str(run / "config.yaml"), "--set", "add",
                "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"] == {k: logged[0][k] for k in ("eval/add", "eval/add/entropy")}


def test_eval_errors_are_one_line(trained_run, tiny_model_dir, capsys):
    run, _ = trained_run
    assert cli(["eval", str(tiny_model_dir)]) == 2
    assert "no config for" in capsys.readouterr().err
    assert cli(["eval", str(run / "checkpoints" / "step_9")]) == 2  # a typo in the path: said as such
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "step_9': no such folder" in err
    assert cli(["eval", str(run / "checkpoints" / "step_1"), "--set", "mul"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--set mul: no such set" in err and "add, add_exact" in err
    assert cli(["eval", str(run / "nowhere")]) == 2
