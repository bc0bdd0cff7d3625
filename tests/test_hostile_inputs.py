"""Hostile and careless inputs, one case per defect a hostile-input run found, so none comes back. Every case is
a command as a new user would type it; each must end in exit 2 with ONE line on stderr that names the option,
field or file (no traceback), and leave every file of the case's folder byte for byte as it was.

- outputs: no command writes onto, into or over one of its inputs (also through a symbolic link), and an
  existing file is replaced only with --overwrite (klgrpo/apps/outputs.py);
- resume: a run folder's config.yaml is the run's record (missing, empty or hand-edited: refused), and a
  refused resume changes nothing; a second sweep into a live sweep's folder is refused before it writes;
- checkpoints: flipped bytes or removed checksum entries are refused wherever a checkpoint is read, and only a
  checkpoint that predates checksums passes unchecked;
- values: bounds declared on the fields, a dtype that does not exist, hostile reward-model weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from klgrpo.apps.cli import main as cli
from klgrpo.train.trainer import GRPOTrainer

from tests.conftest import write_jsonl
from tests.helpers.configs import make_config, quiet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, addition_file, tmp_path_factory) -> Path:
    """A 2-step run with checkpoints step_1 and step_2 and an eval set; group size 4."""
    root = tmp_path_factory.mktemp("hostile")
    sets = [{"name": "add", "source": str(addition_file), "limit": 4}]
    cfg = make_config(tiny_model_dir, addition_file, root / "run", eval={"sets": sets},
                      train={"steps": 2, "save_every": 1, "keep_checkpoints": 0})
    GRPOTrainer(cfg, log=quiet).train()
    return root / "run"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"<dir/link>")
            for p in sorted(folder.rglob("*"))}


def refused(args: list[str], capsys, folder: Path, *expected: str) -> str:
    """Run ``klgrpo ARGS``: exit 2, one line naming ``expected``, ``folder`` unchanged. Returns the line."""
    before = _snapshot(folder)
    capsys.readouterr()
    code = cli(args)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("klgrpo ")]
    assert code == 2, (args, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert _snapshot(folder) == before, "a file was created or changed"
    return lines[0]


def _copy_run(run: Path, root: Path) -> Path:
    return Path(shutil.copytree(run, root / "run", symlinks=True))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a bit inside the last tensor's bytes: the file still parses
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------------ outputs
def test_eval_json_onto_the_checkpoints_weights_is_refused(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    refused(["eval", str(ckpt), "--json", str(ckpt / "model.safetensors")], capsys, tmp_path,
            "--json", "model.safetensors is inside the model", "an input of this command")
    (tmp_path / "out.json").symlink_to(ckpt / "trainer_state.json")  # through a link: the same
    refused(["eval", str(ckpt), "--json", str(tmp_path / "out.json"), "--overwrite"], capsys, tmp_path,
            "is inside the model")


def test_eval_json_replaces_an_existing_file_only_with_overwrite(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt, mine = run / "checkpoints" / "step_2", tmp_path / "mine.json"
    mine.write_text("my notes")
    refused(["eval", str(ckpt), "--json", str(mine)], capsys, tmp_path, f"--json {mine} exists", "--overwrite")
    assert cli(["eval", str(ckpt), "--json", str(mine), "--overwrite"]) == 0
    assert set(json.loads(mine.read_text())["results"]) >= {"eval/add"}


def test_kl_json_onto_the_prompts_is_refused(tiny_model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "01+02="}])
    refused(["kl", str(tiny_model_dir), str(tiny_model_dir), "--prompts", str(prompts), "--json", str(prompts),
             "--overwrite"], capsys, tmp_path, "--json", "is --prompts", "an input of this command")


def test_export_out_through_a_link_into_the_checkpoint_is_refused(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    (tmp_path / "out").symlink_to(ckpt / "sub", target_is_directory=True)
    refused(["export", str(ckpt), str(tmp_path / "out")], capsys, tmp_path, "OUT", "is inside the checkpoint")


def test_explain_run_json_onto_its_log_and_plot_over_a_picture(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    refused(["explain", "--run", str(run), "--json", str(run / "metrics.jsonl"), "--overwrite"], capsys, tmp_path,
            "--json", "metrics.jsonl is inside", "an input of this command")
    picture = tmp_path / "p.png"
    picture.write_bytes(b"my picture")
    refused(["explain", "--run", str(run), "--plot", str(picture)], capsys, tmp_path,
            f"--plot {picture} exists", "--overwrite")


def test_report_never_draws_through_a_link_onto_its_inputs(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    shutil.rmtree(run / "plots", ignore_errors=True)
    (run / "plots").symlink_to(run / "checkpoints" / "step_2", target_is_directory=True)
    refused(["report", str(run)], capsys, tmp_path, "plots/reward.png", "is inside", "checkpoints", "--no-plots")


def test_sweep_never_writes_its_table_over_its_config(tmp_path, capsys):
    folder = tmp_path / "sweep"
    folder.mkdir()
    config = folder / "table.md"
    config.write_text("train:\n  steps: 1\n")
    refused(["sweep", "--grid", "kl.coef=0,0.1", "--config", str(config), "--output-dir", str(folder)], capsys,
            tmp_path, "--output-dir", "holds --config", "write over")


def test_sft_output_dir_inside_the_base_model_is_refused(tiny_model_dir, addition_file, tmp_path, capsys):
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(model), "device": "cpu"},
                                      "data": {"source": str(addition_file)}}))
    refused(["sft", "--config", str(config), "--output-dir", str(model / "sft"), "--steps", "1"], capsys, tmp_path,
            "--output-dir", "is inside model.name_or_path")


def test_train_overwrite_never_deletes_its_own_model(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_1"
    refused(["train", "--config", str(run / "config.yaml"), "--model.name_or_path", str(ckpt), "--output-dir",
             str(run), "--overwrite"], capsys, tmp_path, "--output-dir", "holds model.name_or_path")
    refused(["train", "--config", str(run / "config.yaml"), "--model.name_or_path", str(ckpt), "--output-dir",
             str(ckpt / "grpo")], capsys, tmp_path, "--output-dir", "is inside model.name_or_path")


# ------------------------------------------------------------------------------------------------------- resume
def _resume(run: Path, how: str = "auto", *extra: str) -> list[str]:
    return ["train", "--resume", how, "--output-dir", str(run), "--train.steps", "3", *extra]


@pytest.mark.parametrize("how", ["auto", "latest"])
@pytest.mark.parametrize("damage", ["empty", "deleted"])
def test_resume_refuses_a_run_without_its_config(finished_run, tmp_path, capsys, how, damage):
    run = _copy_run(finished_run, tmp_path)
    if damage == "empty":
        (run / "config.yaml").write_text("")
    else:
        (run / "config.yaml").unlink()
    refused(_resume(run, how), capsys, tmp_path, "config.yaml is missing or empty")


@pytest.mark.parametrize("how", ["auto", "latest"])
def test_resume_refuses_a_hand_edited_config_naming_the_field(finished_run, tmp_path, capsys, how):
    run = _copy_run(finished_run, tmp_path)
    text = (run / "config.yaml").read_text()
    assert "group_size: 4" in text
    (run / "config.yaml").write_text(text.replace("group_size: 4", "group_size: 2"))
    refused(_resume(run, how), capsys, tmp_path, "config.yaml was changed since checkpoint step_2",
            "rollout.group_size 4 -> 2", "not resume-safe")


def test_resume_accepts_an_edit_of_a_resume_safe_field(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["train"]["steps"] = 3  # how long: resume-safe
    (run / "config.yaml").write_text(yaml.safe_dump(data))
    assert cli(["train", "--resume", "latest", "--output-dir", str(run)]) == 0, capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3


def test_a_refused_resume_into_a_read_only_checkpoints_folder_changes_nothing(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    checkpoints = run / "checkpoints"
    if os.geteuid() != 0:
        checkpoints.chmod(0o555)
    elif subprocess.run(["mount", "--bind", "-o", "ro", str(checkpoints), str(checkpoints)],
                        capture_output=True).returncode != 0:
        pytest.skip("root here, and no read-only bind mount: every folder is writable")
    try:
        refused(_resume(run, "latest"), capsys, tmp_path, "cannot write in", "checkpoints")
    finally:
        if os.geteuid() != 0:
            checkpoints.chmod(0o755)
        else:
            subprocess.run(["umount", str(checkpoints)], check=True)


def test_a_second_sweep_into_a_live_sweeps_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "sweep"
    folder.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder / ".klgrpo.lock").write_text(json.dumps({"pid": live.pid, "host": os.uname().nodename}))
        refused(["sweep", "--grid", "kl.coef=0,0.1", "--output-dir", str(folder)], capsys, tmp_path,
                "being written by another klgrpo sweep", f"PID {live.pid}")
    finally:
        live.kill()
        live.wait()
