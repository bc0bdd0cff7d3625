"""logging.report_to through accelerate's trackers, offline: every tracker gets the metrics.jsonl names and steps,
and a resumed run (after an interrupted session that logged past its checkpoint) has each step once in each.
TensorBoard always runs; Trackio (local store), W&B (offline mode) and MLflow (file store) when installed."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter

import pytest

from klgrpo.errors import ConfigError
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet

METRIC = "train/loss"


def _interrupted_then_resumed(tiny_model_dir, addition_file, run, **logging):
    """Steps 1-3 with a checkpoint after each, then step 3's checkpoint is lost (a crash after logging step 3,
    before saving it), then a resume from step 2 to step 4: steps 3 and 4 are trained again / anew."""
    logging = {"progress": False, "plots": False, **logging}
    cfg = make_config(tiny_model_dir, addition_file, run, train={"steps": 3, "save_every": 1, "keep_checkpoints": 0},
                      logging=logging)
    GRPOTrainer(cfg, log=quiet).train()
    shutil.rmtree(run / "checkpoints" / "step_3")
    cfg = make_config(tiny_model_dir, addition_file, run, train={"steps": 4, "save_every": 1, "keep_checkpoints": 0},
                      logging=logging)
    GRPOTrainer(cfg, log=quiet).train(resume="latest")
    rows = [r for r in read_metrics(run) if METRIC in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # metrics.jsonl: the resumed session's steps 3 and 4
    return rows


def _names(rows) -> set[str]:
    return {k for r in rows for k in r if k not in ("step", "wall_time")}


def test_unknown_or_missing_tracker_is_one_line():
    from klgrpo.run.trackers import check_report_to

    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'; choose from tensorboard, trackio"):
        check_report_to(["tensorbord"])
    with pytest.raises(ConfigError, match="must be a list"):
        check_report_to("wandb")
    missing = next((n for n in ("swanlab", "dvclive", "aim") if __import__("importlib").util.find_spec(n) is None),
                   None)
    if missing:
        with pytest.raises(ConfigError, match=f"names {missing} but its package is not installed: pip install"):
            check_report_to([missing])


def test_tensorboard_gets_the_jsonl_names_and_each_step_once_after_a_resume(tiny_model_dir, addition_file,
                                                                            tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    rows = _interrupted_then_resumed(tiny_model_dir, addition_file, run, tensorboard=True,
                                     report_to=["tensorboard"])
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0}).Reload()
    assert set(events.Tags()["scalars"]) == _names(rows)
    points = events.Scalars(METRIC)
    assert [p.step for p in points] == [1, 2, 3, 4]
    assert [p.value for p in points] == pytest.approx([r[METRIC] for r in rows], rel=1e-6)


def test_report_to_empty_writes_metrics_jsonl_only(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 1},
                      logging={"tensorboard": True, "report_to": []})
    GRPOTrainer(cfg, log=quiet).train()
    assert not (tmp_path / "run" / "tb").exists() and read_metrics(tmp_path / "run")


def _check_one_per_step(points: dict[int, list[float]], rows, steps_from_first_session=(3,)):
    """steps 1..4 once each; step 3 keeps the interrupted session's value, the others equal metrics.jsonl."""
    assert sorted(points) == [1, 2, 3, 4] and all(len(v) == 1 for v in points.values()), points
    jsonl = {r["step"]: r[METRIC] for r in rows}
    for step in (1, 2, 4):
        assert points[step][0] == pytest.approx(jsonl[step], rel=1e-6)


def test_mlflow_local_store(tiny_model_dir, addition_file, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow tracker needs the mlflow package: "
                                                  "pip install 'klgrpo[mlflow]'")
    # A local database store: MLflow's file store keeps a metric as a file, so it cannot hold both clip_ratio
    # and clip_ratio/low (docs/metrics.md)
    pytest.importorskip("sqlalchemy")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = tmp_path / "run"
    rows = _interrupted_then_resumed(tiny_model_dir, addition_file, run, tensorboard=False, report_to=["mlflow"],
                                     project="klgrpo-test")
    client = mlflow.tracking.MlflowClient()
    runs = mlflow.search_runs(experiment_names=["klgrpo-test"], output_format="list")
    assert len(runs) == 1  # the resumed session continued the same MLflow run
    history = client.get_metric_history(runs[0].info.run_id, METRIC)
    points: dict[int, list[float]] = {}
    for m in history:
        points.setdefault(m.step, []).append(m.value)
    _check_one_per_step(points, rows)
    assert set(runs[0].data.metrics) == _names(rows)
    assert runs[0].data.params["kl.coef"] == "0.1"


def _wandb_records(path):
    """The records of a W&B offline .wandb file: LevelDB's log format (32 KiB blocks; each chunk has a 7-byte
    header: crc32c, little-endian length, type 1 full / 2 first / 3 middle / 4 last), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline(tiny_model_dir, addition_file, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb tracker needs the wandb package: pip install 'klgrpo[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    rows = _interrupted_then_resumed(tiny_model_dir, addition_file, run, tensorboard=False, report_to=["wandb"])
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per session, the same run id
    run_id = json.loads((run / "trackers.json").read_text())["wandb"]["id"]
    assert all(f.name == f"run-{run_id}.wandb" for f in files)
    for _ in range(100):  # W&B's service process writes the files: wait (at most ~20 s) until both are complete
        points: dict[int, list[float]] = {}
        names: set[str] = set()
        for path in files:
            for record in _wandb_records(path):
                if record.WhichOneof("record_type") != "history":
                    continue
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                names |= {k for k in items if not k.startswith("_")}
                if METRIC in items:
                    points.setdefault(int(items["_step"]), []).append(items[METRIC])
        if 4 in points:
            break
        time.sleep(0.2)
    _check_one_per_step(points, rows)
    assert names == _names(rows)


def test_trackio_local_store(tiny_model_dir, addition_file, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("trackio") is None:
        pytest.skip("the trackio tracker needs the trackio package: pip install 'klgrpo[trackio]'")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    import trackio.utils

    if trackio.utils.TRACKIO_DIR != tmp_path / "trackio":  # imported earlier with another directory
        monkeypatch.setattr(trackio.utils, "TRACKIO_DIR", tmp_path / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    run = tmp_path / "run"
    rows = _interrupted_then_resumed(tiny_model_dir, addition_file, run, tensorboard=False, report_to=["trackio"],
                                     project="klgrpo-test")
    (name,) = SQLiteStorage.get_runs("klgrpo-test")
    logs = SQLiteStorage.get_logs("klgrpo-test", name)
    points = dict(Counter())
    for entry in logs:
        if METRIC in entry:
            points.setdefault(int(entry["step"]), []).append(entry[METRIC])
    _check_one_per_step(points, rows)
    assert {k for e in logs for k in e if k not in ("step", "timestamp")} >= _names(rows)


def test_a_tracker_that_cannot_start_is_one_line_naming_it(tiny_model_dir, addition_file, tmp_path, monkeypatch):
    from klgrpo.run import trackers

    class Refusing:
        def start(self):
            raise RuntimeError("store unreachable. Details follow\n  line two\n  line three")

    monkeypatch.setattr(trackers, "_make", lambda *a: Refusing())
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 1},
                      logging={"tensorboard": True, "report_to": ["tensorboard"]})
    with pytest.raises(ConfigError) as raised:
        GRPOTrainer(cfg, log=quiet).train()
    assert str(raised.value) == ("logging.report_to: tensorboard did not start (RuntimeError: store unreachable); "
                                 "check its settings, or drop tensorboard from logging.report_to")


def test_mlflow_file_store_uri_is_one_line(tiny_model_dir, addition_file, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow", reason="the mlflow tracker needs the mlflow package: pip install 'klgrpo[mlflow]'")
    from klgrpo.apps.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:./mlruns")
    code = main(["train", "--model.name_or_path", str(tiny_model_dir), "--data.source", str(addition_file),
                 "--output-dir", str(tmp_path / "run"), "--rollout.group_size", "4", "--rollout.prompts_per_step",
                 "4", "--rollout.max_new_tokens", "4", "--train.steps", "1", "--logging.progress", "false",
                 "--logging.plots", "false", "--logging.report_to", "[mlflow]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("klgrpo train: error: MLFLOW_TRACKING_URI=file:./mlruns is MLflow's file store")
    assert "sqlite:///mlflow.db" in err[0] and not (tmp_path / "mlruns").exists()


def test_mlflow_without_a_uri_writes_into_the_run_folder(tiny_model_dir, addition_file, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow tracker needs the mlflow package: "
                                                  "pip install 'klgrpo[mlflow]'")
    pytest.importorskip("sqlalchemy", reason="MLflow's local database needs sqlalchemy (installed with mlflow)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):  # two runs in one process: each in its own folder's database
        cfg = make_config(tiny_model_dir, addition_file, tmp_path / name, train={"steps": 1},
                          logging={"tensorboard": False, "report_to": ["mlflow"], "project": "p"})
        GRPOTrainer(cfg, log=quiet).train()
        client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("p").experiment_id])
        assert run.info.run_name == name and METRIC in run.data.metrics
        assert client.get_experiment_by_name("p").artifact_location == (tmp_path / name / "mlartifacts").as_uri()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # nothing where the runs were started
    assert not mlflow.tracking._tracking_service.utils.is_tracking_uri_set()  # the user's process as it was
