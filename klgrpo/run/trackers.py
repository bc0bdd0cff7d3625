"""The experiment trackers a run reports to (``logging.report_to``), through accelerate's own tracker classes
(``accelerate.tracking``): TensorBoard, Trackio, Weights & Biases, MLflow, Aim, Comet, ClearML, DVCLive, SwanLab.

Every tracker gets the same metric names and steps as metrics.jsonl. Where each one writes:

    tensorboard  <run>/tb (as before)
    trackio      the Trackio project ``logging.project``, run named after the run folder; local store in
                 $TRACKIO_DIR (default ~/.cache/huggingface/trackio), ``trackio show`` opens it
    wandb        the W&B project ``logging.project``, files under <run>/wandb; WANDB_MODE=offline writes there
                 only (``wandb sync`` uploads later)
    mlflow       the MLflow experiment ``logging.project`` at $MLFLOW_TRACKING_URI; with no URI set, a local
                 database in the run folder (<run>/mlflow.db, artifacts in <run>/mlartifacts), not in the
                 folder the run was started from
    others       their own defaults (their environment variables), project / run named as above

A resumed run continues the same tracker run (the ids are kept in <run>/trackers.json) and logs each step once:
TensorBoard drops what an interrupted session wrote after the checkpoint (purge_step), and the other trackers,
which cannot drop logged points, are not sent a step again that an interrupted session already sent them (they
keep that session's value for it; metrics.jsonl and TensorBoard hold the resumed run's).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from klgrpo.config.trackers import check_report_to
from klgrpo.errors import ConfigError, first_line

STATE_FILE = "trackers.json"
TB_DIR = "tb"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
_OWN_MLFLOW_URI: str | None = None  # the <run>/mlflow.db URI klgrpo set (no URI was set), until the run finishes
#: what to do when a tracker cannot start, said after its own first line
REMEDIES = {"mlflow": "set MLFLOW_TRACKING_URI to a database (sqlite:///mlflow.db) or a server (http://...), or "
                      "unset it for <run>/mlflow.db"}


def flat_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    """The resolved config as dotted keys with scalar values (lists and dicts as JSON text): trackers' params."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key not in ("columns", "kwargs"):
            out.update(flat_config(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float, str)) or value is None:
            out[f"{prefix}{key}"] = value
        else:
            out[f"{prefix}{key}"] = json.dumps(value, default=str)
    return out


class RunTrackers:
    """The run's trackers. ``log(values, step)`` and ``text(name, text, step)`` go to each of them."""

    def __init__(self, names: list[str], run_dir: Path, project: str, config: dict | None, start_step: int):
        check_report_to(list(names))
        from accelerate import PartialState

        PartialState()  # accelerate's trackers log through its logging, which needs the state (a no-op once set)
        self.run_dir = Path(run_dir)
        self.state_path = self.run_dir / STATE_FILE
        state = self._read_state() if start_step > 0 else {}
        self.sent: dict[str, int] = {}   # the highest step each tracker got (kept in trackers.json)
        self.floor: dict[str, int] = {}  # steps up to this one are not sent again (earlier sessions had them)
        self.ids: dict[str, str] = {}
        self.trackers = []
        for name in dict.fromkeys(names):  # each once, in the order given
            run_id = state.get(name, {}).get("id") or uuid.uuid4().hex[:16]
            tracker = _started(name, self.run_dir, project, run_id, start_step)
            # The config as the run's params (TensorBoard: config.yaml sits beside tb/). MLflow refuses a changed
            # param, so a resume (which may change train.steps) keeps the first session's there.
            if config and name != "tensorboard" and not (name == "mlflow" and start_step > 0):
                tracker.store_init_configuration(flat_config(config))
            self.trackers.append((name, tracker))
            self.ids[name] = run_id
            # A fresh run sends everything (step 0 too: the evaluation before training). A resumed one sends the
            # steps after its checkpoint; TensorBoard purges the interrupted session's, the others skip them.
            floor = start_step if start_step > 0 else -1
            if name != "tensorboard":
                floor = max(floor, int(state.get(name, {}).get("sent", -1)))
            self.floor[name], self.sent[name] = floor, floor
        self._write_state()

    def log(self, values: dict[str, float], step: int) -> None:
        for name, tracker in self.trackers:
            if step > self.floor[name]:
                # W&B holds a step's row until the next step or the run's end; commit it now, so a crash keeps it
                tracker.log(dict(values), step=step, **({"commit": True} if name == "wandb" else {}))
                self.sent[name] = max(self.sent[name], step)
        self._write_state()

    def text(self, name: str, text: str, step: int) -> None:
        for tracker_name, tracker in self.trackers:
            if step <= self.floor[tracker_name]:
                continue
            if tracker_name == "mlflow":  # MLflow's metrics are numbers only: the text is an artifact of the run
                import mlflow

                mlflow.log_text(text, f"{name}/step_{step}.txt")
            else:
                tracker.log({name: text}, step=step)

    def finish(self) -> None:
        for _, tracker in self.trackers:
            tracker.finish()
        if any(name == "mlflow" for name, _ in self.trackers):
            _forget_own_mlflow_uri()
        self.trackers = []

    def _read_state(self) -> dict:
        try:
            data = json.loads(self.state_path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_state(self) -> None:
        state = {name: {"id": self.ids[name], "sent": self.sent[name]} for name, _ in self.trackers}
        tmp = self.state_path.with_name(STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)


def _started(name: str, run_dir: Path, project: str, run_id: str, start_step: int):
    """The tracker, started; a tracker that cannot start (its store, URI or credentials) is one line naming it."""
    try:
        tracker = _make(name, run_dir, project, run_id, start_step)
        tracker.main_process_only = False  # only rank 0 builds trackers
        tracker.start()
    except (ImportError, KeyboardInterrupt, ConfigError):
        raise
    except Exception as err:  # a library's own error type (MlflowException, wandb.Error, ...): quoted in one line
        remedy = REMEDIES.get(name, f"check its settings, or drop {name} from logging.report_to")
        raise ConfigError(f"logging.report_to: {name} did not start ({type(err).__name__}: "
                          f"{_first_sentence(err)}); {remedy}") from None
    return tracker


def _first_sentence(err: BaseException) -> str:
    text = first_line(err, limit=None)
    return text.split(". ")[0].rstrip(".")[:200]


def _make(name: str, run_dir: Path, project: str, run_id: str, start_step: int):
    from accelerate import tracking

    run_name = run_dir.name
    if name == "tensorboard":
        # purge_step: TensorBoard drops what an interrupted session wrote at steps >= purge_step
        return tracking.TensorBoardTracker(TB_DIR, str(run_dir), **({"purge_step": start_step + 1} if start_step
                                                                      else {}))
    if name == "wandb":
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        return tracking.WandBTracker(project, name=run_name, id=run_id, resume="allow", dir=str(run_dir))
    if name == "trackio":
        return tracking.TrackioTracker(project, name=f"{run_name}-{run_id[:8]}", resume="allow")
    if name == "mlflow":
        artifacts = _mlflow_default_store(run_dir)
        return tracking.MLflowTracker(experiment_name=project, run_name=run_name, logging_dir=artifacts,
                                      run_id=_mlflow_run_id(project, run_name, run_id, artifacts))
    cls = tracking.LOGGER_TYPE_TO_CLASS[name]
    return cls(project)


def _mlflow_default_store(run_dir: Path) -> str | None:
    """With no tracking URI set (environment or mlflow.set_tracking_uri), MLflow would write ./mlflow.db wherever
    the run was started: point it at <run>/mlflow.db instead. Returns the artifact location for a new experiment
    there (None: the URI's own default). A file-store URI is refused in one line: MLflow 3 refuses it itself,
    and it keeps a metric as a file, so it cannot hold both clip_ratio and clip_ratio/low."""
    from urllib.parse import urlparse

    import mlflow

    global _OWN_MLFLOW_URI
    is_set = getattr(mlflow.tracking._tracking_service.utils, "is_tracking_uri_set", lambda: True)
    uri = mlflow.get_tracking_uri() if is_set() else None
    if uri and uri != _OWN_MLFLOW_URI:
        if urlparse(uri).scheme in ("", "file"):
            raise ConfigError(f"MLFLOW_TRACKING_URI={uri} is MLflow's file store, which cannot hold klgrpo's "
                              f"metrics (it keeps clip_ratio as a file, so no clip_ratio/low beside it); "
                              f"{REMEDIES['mlflow']}")
        return None
    run_dir = Path(run_dir).resolve()
    _OWN_MLFLOW_URI = f"sqlite:///{run_dir / MLFLOW_DB}"
    mlflow.set_tracking_uri(_OWN_MLFLOW_URI)
    return (run_dir / MLFLOW_ARTIFACTS).as_uri()


def _forget_own_mlflow_uri() -> None:
    """The run is over: the next run (in this process) gets its own folder's store, and the user's code none."""
    global _OWN_MLFLOW_URI
    import mlflow

    if _OWN_MLFLOW_URI is not None and mlflow.get_tracking_uri() == _OWN_MLFLOW_URI:
        mlflow.set_tracking_uri(None)
    _OWN_MLFLOW_URI = None


def _mlflow_run_id(project: str, run_name: str, key: str, artifacts: str | None = None) -> str:
    """The MLflow run of this run folder (tagged with its key): the one an earlier session started, else a new one
    (in a new experiment, its artifacts at ``artifacts``)."""
    import mlflow

    found = mlflow.search_runs(experiment_names=[project], filter_string=f"tags.klgrpo_run = '{key}'",
                               output_format="list") if mlflow.get_experiment_by_name(project) else []
    if found:
        return found[0].info.run_id
    if artifacts is not None and mlflow.get_experiment_by_name(project) is None:
        mlflow.create_experiment(project, artifact_location=artifacts)
    mlflow.set_experiment(project)
    run = mlflow.start_run(run_name=run_name, tags={"klgrpo_run": key})
    mlflow.end_run()
    return run.info.run_id
