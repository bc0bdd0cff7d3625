"""What the end of a run names: only outputs it wrote (plots, TensorBoard, a merged LoRA model), nothing of an
evaluation that did not run (the demo with eval.sets []), a kl.on_runaway stop's checkpoint without its whole
sentence again, and a LoRA run's adapter (at the start and in the summary)."""

from __future__ import annotations

import pytest
import yaml
from helpers.configs import make_config

from klgrpo.apps import demo_run
from klgrpo.apps.cli import main as cli
from klgrpo.apps.demo import assets as demo_assets
from klgrpo.apps.summary import lora_line, print_run_summary, stopped_line, where_lines
from tests.conftest import write_jsonl

SUMMARY = {
    "steps": 2,
    "wall_seconds": 1.0,
    "seconds_per_step": 0.5,
    "eval_before": {},
    "eval_after": {},
    "final_kl": 0.01,
    "final_beta": 0.04,
    "final_reward": 0.5,
    "stopped_early": None,
}


def _labels(lines: list[str]) -> list[str]:
    """The first word of each where-line: run, plots, TensorBoard, merged."""
    return [line.split()[0] for line in lines]


# ------------------------------------------------------------------------------------------ where things are
def test_an_empty_run_folder_names_only_itself(tmp_path):
    assert where_lines(tmp_path) == [f"  run folder   {tmp_path}"]


def test_each_output_is_named_once_it_is_written(tmp_path):
    (tmp_path / "metrics.jsonl").touch()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "plots").mkdir()  # a folder without a plot in it is not a plot
    assert _labels(where_lines(tmp_path)) == ["run"]
    assert where_lines(tmp_path)[0] == f"  run folder   {tmp_path}  (metrics.jsonl, checkpoints/)"
    (tmp_path / "plots" / "reward.png").touch()
    assert _labels(where_lines(tmp_path)) == ["run", "plots"]
    (tmp_path / "tb").mkdir()
    assert _labels(where_lines(tmp_path)) == ["run", "plots", "TensorBoard"]
    (tmp_path / "merged").mkdir()
    lines = where_lines(tmp_path)
    assert _labels(lines) == ["run", "plots", "TensorBoard", "merged"]
    assert lines[2] == f"  TensorBoard  tensorboard --logdir {tmp_path / 'tb'}"


def test_a_run_with_plots_on_and_tensorboard_off_names_the_plots_only(tiny_model_dir, addition_file, tmp_path, capsys):
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        make_config(
            tiny_model_dir,
            addition_file,
            out,
            train={"steps": 1},
            logging={"plots": True, "tensorboard": False, "progress": False},
        ).to_yaml()
    )
    assert cli(["train", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert [line for line in text.splitlines() if line.startswith("  plots ")] == [
        f"  plots        {out / 'plots'}  (redraw: klgrpo report {out})"
    ]
    assert "TensorBoard" not in text and not (out / "tb").exists()


# ------------------------------------------------------------------------------------ an evaluation not run
@pytest.fixture
def tiny_demo(monkeypatch, tmp_path, tiny_model_dir, addition_file):
    replay = write_jsonl(tmp_path / "replay.jsonl", [{"prompt": f"{a:02d}-01="} for a in range(10, 30)])
    fake = demo_assets.DemoAssets(
        model_dir=tiny_model_dir,
        train_file=addition_file,
        eval_files={demo_run.TRAINED: addition_file, demo_run.HELD_OUT: addition_file},
        replay_file=replay,
        sft_stats={},
        from_cache=True,
    )
    monkeypatch.setattr(demo_assets, "prepare_demo_assets", lambda **_: fake)
    monkeypatch.setattr(demo_assets, "planned_demo_assets", lambda **_: fake)
    return fake


TINY = [
    "--train.steps",
    "1",
    "--logging.progress",
    "false",
    "--logging.tensorboard",
    "false",
    "--logging.plots",
    "false",
    "--rollout.prompts_per_step",
    "2",
    "--kl.replay.num_prompts",
    "2",
]


@pytest.mark.parametrize("sets", ["[]", None], ids=["no-eval-sets", "demo-sets"])
def test_the_demo_says_nothing_of_an_evaluation_it_did_not_run(tiny_demo, tmp_path, capsys, sets):
    limits = (
        ["--eval.sets", "[]"]
        if sets == "[]"
        else [
            "--eval.sets",
            yaml.safe_dump(
                [{"name": name, "source": str(path), "limit": 4} for name, path in tiny_demo.eval_files.items()],
                default_flow_style=True,
            ).strip(),
        ]
    )
    assert cli(["train", "--output-dir", str(tmp_path / "run"), *TINY, *limits]) == 0
    lines = capsys.readouterr().out.splitlines()
    evaluated = sets is None
    assert sum("3/3 greedy evaluation" in line for line in lines) == int(evaluated)
    assert sum(line.startswith("  evaluation ") for line in lines) == int(evaluated)  # the table's header
    assert sum(" points" in line and "addition" in line for line in lines) == int(evaluated)
    assert not any("n/a" in line for line in lines)
    replay = [line for line in lines if line.startswith("  with the replay anchor")]
    assert len(replay) == 1 and replay[0].endswith(" points" if evaluated else ")")


# ------------------------------------------------------------------------------------------ a runaway stop
RUNAWAY_SENTENCE = (
    "KL runaway at step 4: the KL is 0.5354 per token (mean of steps 3-4), above kl.runaway_above "
    "0.5 and rising (previous window 0.05022); kl.on_runaway stop: the last healthy window started "
    "at the checkpoint runs/x/checkpoints/step_0 (step 0): train on from its weights "
    "(model.name_or_path runs/x/checkpoints/step_0, kl.reference the original model) with a larger "
    "kl.coef or a smaller optim.lr"
)
STOPPED = {
    **SUMMARY,
    "stopped_early": RUNAWAY_SENTENCE,
    "runaway": {
        "on_runaway": "stop",
        "actions": [
            {
                "action": "stopped",
                "step": 4,
                "kl": 0.5354214,
                "checkpoint": "runs/x/checkpoints/step_0",
                "target_step": 0,
            }
        ],
    },
}


def test_a_runaway_stop_names_its_checkpoint_not_the_whole_sentence_again():
    line = stopped_line(STOPPED)
    assert line.startswith("stopped early: kl.on_runaway stop at step 4 (KL 0.5354 per token); ")
    assert (
        "checkpoint runs/x/checkpoints/step_0 (step 0): train on from its weights (model.name_or_path "
        "runs/x/checkpoints/step_0, kl.reference the original model)" in line
    )
    assert "previous window" not in line and len(line) < len(RUNAWAY_SENTENCE)
    lines = []
    print_run_summary(STOPPED, "runs/x", out=lines.append)
    assert sum(line.startswith("  stopped early:") for line in lines) == 1
    assert not any("previous window" in line for line in lines)


def test_other_early_stops_keep_their_reason():
    reason = "train.max_wall_seconds=5 reached"
    assert stopped_line({**SUMMARY, "stopped_early": reason}) == f"stopped early: {reason}"
    rolled = {
        **STOPPED,
        "stopped_early": reason,
        "runaway": {"actions": [{"action": "rolled_back", "step": 4, "to_step": 0}]},
    }
    assert stopped_line(rolled) == f"stopped early: {reason}"
    assert stopped_line(SUMMARY) is None


# ----------------------------------------------------------------------------------------------------- LoRA
def test_lora_line_names_rank_alpha_targets_and_the_reference(tiny_model_dir, addition_file, tmp_path):
    full = make_config(tiny_model_dir, addition_file, tmp_path / "a")
    assert lora_line(full) is None
    lora = {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}
    line = lora_line(make_config(tiny_model_dir, addition_file, tmp_path / "b", model=lora))
    assert (
        line == "LoRA rank 8, alpha 16, dropout 0, targets q_proj, v_proj; reference the base model with the "
        "adapter off"
    )
    own_reference = make_config(
        tiny_model_dir, addition_file, tmp_path / "c", model=lora, kl={"reference": str(tiny_model_dir)}
    )
    assert lora_line(own_reference).endswith(f"; reference kl.reference {tiny_model_dir}")
    synced = make_config(tiny_model_dir, addition_file, tmp_path / "d", model=lora, kl={"sync_every": 50})
    assert lora_line(synced).endswith(
        "; reference the base model with a frozen copy of the adapter, synced every 50 steps"
    )


def test_a_lora_run_says_so_at_the_start_and_in_the_summary(tiny_model_dir, addition_file, tmp_path, capsys):
    pytest.importorskip("peft")
    config = tmp_path / "run.yaml"
    config.write_text(
        make_config(
            tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 1}, model={"lora": {"r": 2, "alpha": 4}}
        ).to_yaml()
    )
    assert cli(["train", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = [i for i, line in enumerate(lines) if line.strip().startswith("LoRA rank 2, alpha 4, ")]
    loading = next(i for i, line in enumerate(lines) if line.startswith("loading "))
    assert len(said) == 2 and said[0] < loading < said[1]  # the banner before the model loads, then the summary
    assert cli(["train", "--config", str(config), "--model.lora.r", "0", "--overwrite"]) == 0
    assert "LoRA" not in capsys.readouterr().out


def test_the_demo_says_lora_is_on(tiny_demo, tmp_path, capsys):
    """A LoRA demo names the adapter at the start and in the summary, once each."""
    assert cli(["train", "--output-dir", str(tmp_path / "run"), *TINY, "--eval.sets", "[]", "--model.lora.r", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = [line.strip() for line in lines if line.strip().startswith("LoRA rank 4,")]
    assert len(said) == 2, lines
    assert said[0].endswith("reference the base model with the adapter off")
