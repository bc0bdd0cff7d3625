"""What `klgrpo sft`, `export`, `sweep` and `train` write, and where they refuse to: an empty --output-dir, a file
as the output folder, a sweep into a train run's folder, numbers out of range. Each: exit 2, ONE line on stderr, no
traceback, every file as it was. A full disk (ENOSPC from the writer) leaves no half-written output folder."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import yaml

from klgrpo.apps.cli import main as cli
from tests.helpers.configs import make_config, quiet


@pytest.fixture(scope="module")
def sft_config(tiny_model_dir, addition_file, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft_cfg") / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_model_dir), "dtype": "float32",
                                              "device": "cpu"}, "data": {"source": str(addition_file), "limit": 8}}))
    return path


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, addition_file, tmp_path_factory) -> Path:
    from klgrpo.run.trainer import GRPOTrainer

    run = tmp_path_factory.mktemp("outputs") / "run"
    GRPOTrainer(make_config(tiny_model_dir, addition_file, run, train={"steps": 1}), log=quiet).train()
    return run


def _sft(config: Path, out, *extra) -> list[str]:
    return ["sft", "--config", str(config), "--output-dir", str(out), "--steps", "1", "--batch-size", "4", *extra]


def _a_file(root: Path) -> Path:
    (root / "notes.txt").write_text("mine")
    return root / "notes.txt"


def _a_run_copy(run: Path, root: Path) -> Path:
    return Path(shutil.copytree(run, root / "run"))


CASES = [
    ("sft_output_dir_empty", lambda c, r, run: _sft(c, ""), ["--output-dir is empty"]),
    ("sft_output_dir_is_a_file", lambda c, r, run: _sft(c, _a_file(r)), ["notes.txt is a file", "folder path"]),
    ("sft_output_dir_inside_a_file", lambda c, r, run: _sft(c, _a_file(r) / "m"), ["which is a file"]),
    ("sft_lr_nan", lambda c, r, run: _sft(c, r / "m", "--lr", "nan"), ["--lr must be a finite number > 0, got nan"]),
    ("sft_lr_negative", lambda c, r, run: _sft(c, r / "m", "--lr=-1e-3"), ["--lr must be a finite number > 0"]),
    ("sft_steps_negative", lambda c, r, run: _sft(c, r / "m", "--steps", "-5"), ["--steps must be >= 0", "-5"]),
    ("sft_epochs_inf", lambda c, r, run: _sft(c, r / "m", "--epochs", "inf"), ["--epochs must be a finite"]),
    ("train_output_dir_empty", lambda c, r, run: ["train", "--output-dir", ""], ["--output-dir is empty"]),
    ("train_output_dir_field_empty", lambda c, r, run: ["train", "--train.output_dir=", "--kl.coef", "0.1"],
     ["--train.output_dir is empty"]),
    ("sweep_output_dir_empty", lambda c, r, run: ["sweep", "--grid", "kl.coef=0,0.1", "--output-dir", ""],
     ["--output-dir is empty"]),
    ("sweep_into_a_train_run", lambda c, r, run: ["sweep", "--grid", "kl.coef=0,0.1", "--output-dir",
                                                  str(_a_run_copy(run, r))],
     ["holds a klgrpo train run", "another folder"]),
    ("export_out_empty", lambda c, r, run: ["export", str(_a_run_copy(run, r) / "checkpoints" / "step_1"), ""],
     ["OUT is empty"]),
]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line(case, sft_config, finished_run, tmp_path, capsys, monkeypatch):
    name, make_args, expected = case
    monkeypatch.chdir(tmp_path)  # an empty path must not turn into the current folder
    args = make_args(sft_config, tmp_path, finished_run)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    code = cli(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (name, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"klgrpo {args[0]}: error: "), lines[0]
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert _snapshot(tmp_path) == before, "a file was created or changed"


def _full_disk(monkeypatch, cls, method: str) -> None:
    """``cls.method`` writes part of a file into its folder, then fails as a full disk does."""
    def write_then_fail(self, folder, *args, **kwargs):
        os.makedirs(folder, exist_ok=True)
        Path(folder, "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cls, method, write_then_fail)


def test_sft_on_a_full_disk_leaves_no_folder(sft_config, tmp_path, capsys):
    pytest.importorskip("trl", reason="klgrpo sft runs TRL's SFTTrainer (pip install \"klgrpo[trl,data]\")")
    from trl import SFTTrainer

    with pytest.MonkeyPatch.context() as patch:
        _full_disk(patch, SFTTrainer, "save_model")
        assert cli(_sft(sft_config, tmp_path / "m")) == 2
    text = capsys.readouterr().err  # also the datasets library's progress bars
    err = [line for line in text.splitlines() if line.startswith("klgrpo sft")]
    assert "Traceback" not in text and len(err) == 1, text
    assert "No space left on device" in err[0] and "nothing was written there" in err[0], err
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling


def test_export_on_a_full_disk_leaves_no_folder(finished_run, tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedModel

    _full_disk(monkeypatch, PreTrainedModel, "save_pretrained")
    assert cli(["export", str(finished_run / "checkpoints" / "step_1"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "nothing was left there" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_after_sft_the_next_command_warns_about_the_default_lr(sft_config, tmp_path, capsys):
    pytest.importorskip("trl", reason="klgrpo sft runs TRL's SFTTrainer (pip install \"klgrpo[trl,data]\")")
    from klgrpo.config.schema import GRPOConfig

    assert cli(_sft(sft_config, tmp_path / "m")) == 0
    out = capsys.readouterr().out
    assert f"next: klgrpo train --config {sft_config}" in out
    assert f"optim.lr at klgrpo's default {GRPOConfig().optim.lr:g}" in out and "--optim.lr" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left beside it
    assert cli(_sft(sft_config, tmp_path / "m2", "--optim.lr", "1e-3")) == 0
    assert "note:" not in capsys.readouterr().out  # the config sets its own rate: nothing to warn about
