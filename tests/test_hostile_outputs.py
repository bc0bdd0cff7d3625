"""Hostile folders and files on report, verify-kl --from-run / --json, sweep --dry-run and --config: each is one
line (exit 2) that names the path, opens no FIFO (it would wait for a writer) and writes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from klgrpo.apps.cli import main as cli
from klgrpo.core.kl_dump import save_dump


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<other>"
            for p in sorted(folder.rglob("*"))}


def _one_line(args: list[str], capsys, folder: Path) -> str:
    """``klgrpo ARGS``: exit 2, one line on stderr, ``folder`` byte for byte as it was."""
    before = _files(folder)
    capsys.readouterr()
    code = cli(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert _files(folder) == before, "a file was written or changed"
    return lines[0]


def _run_folder(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "adaptive_kl/raw_kl": 0.01})
                                       + "\n")
    return run


def _dump(run: Path) -> Path:
    path = run / "kl_dumps" / "step_000001.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    ref = torch.tensor([[-1.0, -2.0]])
    save_dump(path, 1, ref + 0.1, ref, torch.tensor([[True, True]]))
    return path


def test_report_refuses_a_plots_link_that_leads_out_of_the_run(tmp_path, capsys):
    run = _run_folder(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "reward.png").write_bytes(b"someone else's picture")
    (run / "plots").symlink_to(elsewhere, target_is_directory=True)
    line = _one_line(["report", str(run)], capsys, tmp_path)
    assert f"{run / 'plots'} is a symbolic link" in line and "outside the run folder" in line, line
    assert "--no-plots" in line


def test_report_draws_through_a_plots_link_inside_the_run(tmp_path, capsys):
    run = _run_folder(tmp_path)
    (run / "drawn").mkdir()
    (run / "plots").symlink_to(run / "drawn", target_is_directory=True)
    assert cli(["report", str(run)]) == 0
    assert (run / "drawn" / "kl.png").is_file()


def test_report_names_a_metrics_fifo_as_such(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    line = _one_line(["report", "--no-plots", str(run)], capsys, tmp_path)
    assert "metrics.jsonl is not a regular file" in line, line


def test_verify_kl_from_run_never_opens_a_fifo_dump(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "kl_dumps").mkdir(parents=True)
    os.mkfifo(run / "kl_dumps" / "step_000001.safetensors")
    line = _one_line(["verify-kl", "--from-run", str(run)], capsys, tmp_path)  # returns: no read of the FIFO
    assert "step_000001.safetensors is not a regular file" in line, line


def test_verify_kl_json_never_lands_on_the_dumps(tmp_path, capsys):
    dump = _dump(tmp_path / "run")
    line = _one_line(["verify-kl", "--from-run", str(tmp_path / "run"), "--json", str(dump)], capsys, tmp_path)
    assert line.startswith(f"klgrpo verify-kl: --json {dump} is inside --from-run"), line


def test_verify_kl_json_replaces_a_file_only_with_overwrite(tmp_path, capsys):
    _dump(tmp_path / "run")
    out = tmp_path / "stats.json"
    out.write_text("kept\n")
    line = _one_line(["verify-kl", "--from-run", str(tmp_path / "run"), "--json", str(out)], capsys, tmp_path)
    assert f"--json {out} exists" in line and "--overwrite" in line, line
    assert cli(["verify-kl", "--from-run", str(tmp_path / "run"), "--json", str(out), "--overwrite"]) == 0
    stats = {s["estimator"]: s for s in json.loads(out.read_text())["dumps"]}
    assert stats["k1"]["mean"] == pytest.approx(0.1, abs=1e-6)  # log pi - log ref = 0.1 at both tokens


def test_verify_kl_json_into_a_new_folder_still_works(tmp_path):
    _dump(tmp_path / "run")
    out = tmp_path / "new" / "stats.json"
    assert cli(["verify-kl", "--from-run", str(tmp_path / "run"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["run_dir"] == str(tmp_path / "run")


def test_sweep_dry_run_refuses_a_run_it_would_refuse(tmp_path, capsys):
    line = _one_line(["sweep", "--grid", "kl.coef=-1,0.1", "--dry-run", "--output-dir", str(tmp_path / "s")],
                     capsys, tmp_path)
    assert "kl.coef=-1 seed=0" in line and "kl.coef must be >= 0" in line and "nothing was run" in line, line
    assert not (tmp_path / "s").exists()


def test_a_config_fifo_is_named_as_such(tmp_path, capsys):
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    line = _one_line(["train", "--config", str(fifo), "--print-config"], capsys, tmp_path)
    assert f"config file {fifo} is not a regular file" in line, line
    line = _one_line(["sweep", "--grid", "kl.coef=0,1", "--config", str(fifo), "--dry-run"], capsys, tmp_path)
    assert f"--config {fifo}: not a regular file" in line, line
