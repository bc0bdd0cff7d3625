"""Run-folder safety: a folder that holds a run is never overwritten unless asked, one run writes it at a time,
a resume continues the run it names, and what killed saves leave behind is cleaned at start.

    resolve_auto_resume(run_dir, cfg)                   --resume auto: "latest", a restart of an unsaved start, or fresh
    check_run_folder(run_dir, cfg, resume, overwrite)   read-only checks (the CLI runs them before building a model)
    open_run_folder(run_dir, cfg, resume, overwrite)    the checks, then --overwrite's clearing, the lock,
                                                        the clean-up and config.yaml; returns the RunLock

A folder "holds a run" when it has a checkpoint, a metrics row or a summary.json. A fresh run into such a
folder is refused with a line naming --resume, --output-dir and --overwrite. What klgrpo owns in a run folder
is listed in its marker file ``.klgrpo_owned.json`` (written when a fresh run opens the folder): --overwrite
deletes only the names listed there (a folder without the marker, or a name of RUN_FILES that exists but is not
listed -- the user's own config.yaml or plots/ -- is refused, never deleted or written over). config.yaml is
written atomically and never through a symbolic link.

The lock is ``<run>/.klgrpo.lock`` (created with O_EXCL, holding the PID and host). A lock whose process is
gone (same host) is stale and taken over; a live one refuses the second run. Within one process the folders
whose lock a trainer holds are also kept in memory, so a second trainer of the same process (a thread, a
notebook cell) is refused too, while a lock left by an earlier trainer of this process that never released it
is taken over.

Resuming compares the run's config.yaml with the new config: a change of a field declared ``resume_safe`` (on
itself or its group, in klgrpo/config/schema.py: how long, how often to save or evaluate, logging, device) is
applied with a warning and config.yaml is updated (said so); any other change (group_size, prompts_per_step,
seed, lr, data, ...) would not continue the same run and is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Callable

import yaml

from klgrpo.config.fields import is_resume_safe
from klgrpo.config.schema import GRPOConfig, safe_load_bounded
from klgrpo.errors import ConfigError, warn
from klgrpo.store.checkpoint import (
    CHECKPOINTS_DIR,
    clean_incomplete,
    list_checkpoints,
    pid_alive,
    recorded_config,
    resume_candidates,
)

#: One JSON object per step (run/metrics.py writes it) and the run's summary (run/loop.py).
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".klgrpo.lock"
OWNED_FILE = ".klgrpo_owned.json"
#: The lock files this process holds (resolved paths): a second trainer in this process is refused.
_HELD_HERE: set[str] = set()
_HELD_HERE_GUARD = threading.Lock()
CONFIG_FILE = "config.yaml"
#: What klgrpo writes into a run folder: --overwrite deletes these and nothing else.
RUN_FILES = ("config.yaml", METRICS_FILE, METRICS_FILE + ".tmp", SUMMARY_FILE, "checkpoints", "tb", "plots",
             "kl_dumps", "merged", "replay_cache.safetensors", "replay_cache.json", "replay_cache.pt")


# ---------------------------------------------------------------------------------------------- checks
def check_output_dir(run_dir: Path) -> None:
    """The run folder is a folder (or can be created) and is writable."""
    run_dir = Path(run_dir)
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # exists() is False for a link to nothing, or to itself through others
            raise ConfigError(f"train.output_dir {run_dir}: {existing} is a symbolic link to a missing folder (or "
                              f"a loop of links); fix the link or pass --output-dir a folder path")
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == run_dir else f"is inside {existing}, which is a file"
        raise ConfigError(f"train.output_dir {run_dir} {what}; pass --output-dir a folder path")
    probe = existing / f".klgrpo_write_test_{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"train.output_dir {run_dir}: cannot write in {existing} ({exc.strerror or exc}); "
                          f"pass --output-dir a writable folder") from None


def timestamped_run_dir(prefix: str = "") -> Path:
    """runs/<prefix><date-time>, with -2, -3, ... appended when a run started in the same second already has it."""
    from datetime import datetime

    base = Path("runs") / f"{prefix}{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def holds_run(run_dir: Path) -> bool:
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir()):
        return True
    if (run_dir / SUMMARY_FILE).exists():
        return True
    metrics = run_dir / METRICS_FILE
    try:
        return metrics.is_file() and bool(metrics.read_text(encoding="utf-8", errors="replace").strip())
    except OSError:
        return True


def resolve_auto_resume(run_dir: Path, cfg) -> tuple[str | None, bool]:
    """``--resume auto`` as (resume, overwrite): ("latest", False) when the folder has a complete checkpoint;
    (None, True) when it holds the beginning of this same run (its config.yaml agrees) killed before its first
    checkpoint, which starts again from step 0; (None, False) for a folder without a run. A launcher that
    restarts failed workers (``torchrun --max-restarts``) can pass it every time."""
    run_dir = Path(run_dir)
    if list_checkpoints(run_dir):
        return "latest", False
    if not holds_run(run_dir):
        return None, False
    saved = saved_config(run_dir)
    if saved is None:
        raise ConfigError(f"--resume auto: {run_dir} holds a run without a checkpoint or a {CONFIG_FILE}; start a "
                          f"new run with another --output-dir, or replace it with --overwrite")
    compare_configs(saved, cfg.to_dict(), run_dir)  # another run's beginning is refused, not restarted
    return None, True


def check_run_folder(run_dir: Path, cfg, resume: str | None, overwrite: bool = False) -> list[str]:
    """Refuse a fresh run into a run folder (without overwrite), a folder locked by a live run, or a resume
    whose config breaks the run's exactness. Returns the warnings of a resume's harmless changes."""
    run_dir = Path(run_dir)
    check_output_dir(run_dir)
    _check_lock(run_dir)
    if resume == "auto":
        if overwrite:
            raise ConfigError("--resume auto continues a run and --overwrite deletes it: pass only one of them")
        resume, overwrite = resolve_auto_resume(run_dir, cfg)
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite deletes it: pass only one of them")
    if resume == "latest":
        _check_run_record(run_dir)
    if not resume:
        if holds_run(run_dir) and not overwrite:
            if not list_checkpoints(run_dir):  # nothing to resume: name only the remedies that work
                raise ConfigError(f"{run_dir} holds a run that stopped before its first checkpoint (nothing to "
                                  f"resume); replace it with --overwrite or start a new one with another --output-dir")
            raise ConfigError(f"{run_dir} already holds a run; continue it with --resume latest, start a new one "
                              f"with another --output-dir, or replace it with --overwrite")
        _check_nothing_foreign(run_dir)
        return []
    warnings = compare_configs(saved_config(_config_home(run_dir, resume)), cfg.to_dict(), run_dir)
    if resume == "latest" and (done := list_checkpoints(run_dir)):
        # Resuming a finished run would rewrite its summary.json with an empty history and its config.yaml.
        reached = int(done[-1].name.removeprefix("step_"))
        if reached >= cfg.train.steps:
            raise ConfigError(f"the run in {run_dir} already reached step {reached} (train.steps {cfg.train.steps}): "
                              f"nothing to continue; pass --train.steps above {reached} to train further")
    return warnings


def _check_run_record(run_dir: Path) -> None:
    """What --resume latest continues is the run's record: its config.yaml (present, not empty, and agreeing
    with the settings its newest checkpoint was trained with, but for resume-safe fields) and a folder the
    resume can write its checkpoints into; checked before anything in the folder changes."""
    if list_checkpoints(run_dir) and run_config_file(run_dir) is None:
        raise ConfigError(f"--resume: {run_dir / CONFIG_FILE} is missing or empty, and it is the record of the run's "
                          f"settings that a resume continues; restore it, or start a new run with another "
                          f"--output-dir")
    done = list_checkpoints(run_dir)
    recorded = recorded_config(done[-1]) if done else None
    saved = saved_config(run_dir)
    if recorded is not None and saved is not None and (unsafe := _unsafe_changes(recorded, saved)):
        raise ConfigError(f"--resume: {run_dir / CONFIG_FILE} was changed since checkpoint {done[-1].name} was "
                          f"saved: {_shown(unsafe)}; these fields are not resume-safe: restore "
                          f"{CONFIG_FILE}, or start a new run with another --output-dir")
    for folder in (run_dir, run_dir / CHECKPOINTS_DIR):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"--resume: cannot write in {folder} (permission denied), where the resumed run saves "
                              f"its checkpoints; make it writable, or copy the run to a writable --output-dir")


def owned_files(run_dir: Path) -> set[str] | None:
    """The names klgrpo's marker lists as its own in ``run_dir`` (None: no marker, or an unreadable one)."""
    try:
        data = json.loads((Path(run_dir) / OWNED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    names = data.get("files") if isinstance(data, dict) else None
    return {n for n in names if n in RUN_FILES} if isinstance(names, list) else None


def _check_nothing_foreign(run_dir: Path) -> None:
    """A fresh run writes only names that are absent or klgrpo's own (the marker lists them)."""
    owned = owned_files(run_dir) or set()
    # The replay cache is written before the folder is opened and checks its own content when it is read.
    names = [n for n in RUN_FILES if not n.startswith("replay_cache")]
    foreign = [n for n in names if (Path(run_dir) / n).exists() or (Path(run_dir) / n).is_symlink()]
    foreign = [n for n in foreign if n not in owned or (Path(run_dir) / n).is_symlink()]
    if foreign:
        raise ConfigError(f"{run_dir} already has {', '.join(foreign)}, not written by a klgrpo run there (no "
                          f"{OWNED_FILE} lists it); klgrpo writes files of those names: pick another --output-dir, "
                          f"or move them away")


def _config_home(run_dir: Path, resume: str) -> Path:
    """The folder whose config.yaml a resume continues: the run folder, or the run of a checkpoint path."""
    if resume != "latest":
        home = Path(resume).resolve().parent.parent
        if run_config_file(home) is not None:
            return home
    return run_dir


def run_config_file(run_dir: Path) -> Path | None:
    """The run's config.yaml, or None when it is missing or empty: an empty file (or one holding only comments
    or ``null``) names no settings, and reading it as the defaults would continue a run under another config."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        empty = safe_load_bounded(path.read_text(encoding="utf-8"), str(path)) is None
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return path  # not empty: whoever reads it names what is wrong
    return None if empty else path


def saved_config(run_dir: Path) -> dict | None:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = safe_load_bounded(path.read_text(encoding="utf-8"), str(path))
    except (yaml.YAMLError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not valid YAML; restore it or pass the run's config with --config") from None
    return data if isinstance(data, dict) else None


def compare_configs(saved: dict | None, new: dict, run_dir: Path) -> list[str]:
    """Warnings for harmless changes; ConfigError for a change that would not continue the same run."""
    if saved is None:
        return []
    old, now = _flatten(saved), _flatten(new)
    changed = [k for k in sorted(set(old) & set(now)) if old[k] != now[k]]
    if unsafe := _unsafe_changes(saved, new):
        raise ConfigError(f"--resume with a changed config would not continue the run in {run_dir}: "
                          f"{_shown(unsafe)}; drop those overrides (--resume without --config uses the run's "
                          f"{CONFIG_FILE}) or start a new run with another --output-dir")
    warnings = [f"resuming with {k} {old[k]!r} -> {now[k]!r}" for k in changed if k != "train.output_dir"]
    if "train.steps" in changed and now.get("optim.schedule") in ("linear", "cosine"):
        warnings.append(f"optim.schedule={now['optim.schedule']} was laid out for {old['train.steps']} steps; with "
                        f"train.steps {now['train.steps']} the learning rate follows the new schedule from the "
                        f"resumed step on (a finished run's rate rises again)")
    return warnings


def _unsafe_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(field, old value, new value) of every field both configs hold that differs and is not resume-safe."""
    before, after = _flatten(old), _flatten(new)
    return [(k, before[k], after[k]) for k in sorted(set(before) & set(after))
            if before[k] != after[k] and not _resume_safe(k)]


def _shown(changes: list[tuple[str, object, object]]) -> str:
    shown = "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes[:3])
    return shown + (f" (and {len(changes) - 3} more)" if len(changes) > 3 else "")


def _resume_safe(key: str) -> bool:
    return is_resume_safe(GRPOConfig, key)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k not in ("columns", "kwargs"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ------------------------------------------------------------------------------------------------ open
def open_run_folder(run_dir: Path, cfg, resume: str | None, overwrite: bool = False,
                    log: Callable[[str], None] = print) -> "RunLock":
    """Checks, then: --overwrite clears the old run, the lock is taken, orphans are removed, config.yaml is
    written (fresh run) or updated with a resume's harmless changes (said so)."""
    run_dir = Path(run_dir)
    warnings = check_run_folder(run_dir, cfg, resume, overwrite)
    if resume == "auto":
        resume, overwrite = resolve_auto_resume(run_dir, cfg)
    if resume:
        resume_candidates(resume, run_dir)  # nothing to resume: refuse before writing anything
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir).acquire()
    if not resume and overwrite and holds_run(run_dir):
        clear_run(run_dir)
        log(f"--overwrite: deleted the earlier run in {run_dir}")
    removed = clean_incomplete(run_dir)
    if removed:
        log(f"removed {len(removed)} incomplete checkpoint folder(s) left by an interrupted save or prune: "
            f"{', '.join(p.name for p in removed)}")
    for w in warnings:
        warn(w)
    config = run_dir / CONFIG_FILE
    text = cfg.to_yaml()
    try:
        if not resume:
            _write_atomic(run_dir / OWNED_FILE, json.dumps({"files": list(RUN_FILES)}))
        if not resume or not config.exists():
            _write_atomic(config, text)
        elif warnings and config.read_text() != text:
            lock.resumed_config = text  # written by ``config_after_resume`` once the checkpoint has loaded
    except OSError as exc:
        lock.release()
        raise ConfigError(f"cannot write {config} ({exc.strerror or exc}); free disk space or pass --output-dir a "
                          f"writable folder") from None
    return lock


def _write_atomic(path: Path, text: str) -> None:
    """Write a sibling temporary file and rename it over ``path``: a full disk leaves the old file whole, and a
    symbolic link at ``path`` is replaced, never written through."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def clear_run(run_dir: Path) -> None:
    """Delete what the marker lists as klgrpo's (nothing without a marker)."""
    for name in sorted(owned_files(run_dir) or ()):
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def discard_unstarted_run(run_dir: Path) -> None:
    """After a fresh run failed before its first step: remove what it wrote, so no half-written run stays."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or holds_run(run_dir) or list_checkpoints(run_dir):
        return
    lock = run_dir / LOCK_FILE
    owner = _read_lock(lock)
    if owner and owner.get("pid") != os.getpid():
        return
    clear_run(run_dir)
    (run_dir / OWNED_FILE).unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    try:
        run_dir.rmdir()
    except OSError:  # other files of the user's stay
        pass


# ------------------------------------------------------------------------------------------------ lock
class RunLock:
    """``<run>/.klgrpo.lock``: one writer per run folder; stale locks of dead processes are taken over."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False
        self.resumed_config: str | None = None  # a resume's harmless changes, for config.yaml

    def config_after_resume(self, log: Callable[[str], None] = print) -> None:
        """After a resume loaded: write config.yaml with its harmless changes (a resume that fails leaves the
        run's config.yaml as it was)."""
        if self.resumed_config is not None:
            config = self.path.parent / CONFIG_FILE
            _write_atomic(config, self.resumed_config)
            self.resumed_config = None
            log(f"{config} updated with the changes above")

    def check_free(self, what: str = "run") -> None:
        """Refuse (one line) while a live process holds the lock; ``what`` names the holder ("run", "sweep")."""
        owner = _read_lock(self.path)
        if owner and _owner_alive(owner):
            raise ConfigError(f"{self.path.parent} is being written by another klgrpo {what} (PID "
                              f"{owner.get('pid')} on {owner.get('host')}); wait for it to finish or pick another "
                              f"--output-dir (if that process is gone, delete {self.path})")

    def acquire(self) -> "RunLock":
        with _HELD_HERE_GUARD:  # two threads of this process: one wins, the other sees it in _HELD_HERE
            self._acquire_file()  # _check_lock refuses a folder this process holds
            _HELD_HERE.add(str(self.path.resolve()))
        return self

    def _acquire_file(self) -> "RunLock":
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                _check_lock(self.path.parent)  # raises while the owner lives
                self._take_over_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
            self.held = True
            return self
        raise ConfigError(f"cannot take the lock {self.path}; another klgrpo run keeps taking it: pick another "
                          f"--output-dir")

    def _take_over_stale(self) -> None:
        """Move the stale lock aside atomically (only one contender wins the rename), and put it back if what
        was moved is not the stale lock we judged (a live run took the lock in between)."""
        seen = _read_lock(self.path)
        aside = self.path.with_name(f"{LOCK_FILE}.stale.{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        moved = _read_lock(aside)
        if moved != seen and moved and _owner_alive(moved):
            os.replace(aside, self.path)
            raise ConfigError(f"{self.path.parent} is being written by another klgrpo run (PID {moved.get('pid')}); "
                              f"wait for it to finish or pick another --output-dir")
        aside.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            owner = _read_lock(self.path)
            if owner and owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False
            with _HELD_HERE_GUARD:
                _HELD_HERE.discard(str(self.path.resolve()))


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as stale


def _owner_alive(owner: dict) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False  # this process: an earlier trainer of it that did not release
    if owner.get("host") not in (None, socket.gethostname()):
        return True  # another machine's process: cannot be checked, assume it runs
    return pid_alive(pid)


def _check_lock(run_dir: Path) -> None:
    if str((Path(run_dir) / LOCK_FILE).resolve()) in _HELD_HERE:
        raise ConfigError(f"{run_dir} is being written by another trainer in this process; let it finish (or pick "
                          f"another --output-dir)")
    owner = _read_lock(Path(run_dir) / LOCK_FILE)
    if owner and _owner_alive(owner):
        raise ConfigError(f"{run_dir} is being written by another klgrpo run (PID {owner.get('pid')} on "
                          f"{owner.get('host')}); wait for it to finish or pick another --output-dir "
                          f"(if that process is gone, delete {Path(run_dir) / LOCK_FILE})")


__all__ = ["timestamped_run_dir", "resolve_auto_resume", "check_run_folder", "open_run_folder", "check_output_dir",
           "holds_run", "clear_run", "discard_unstarted_run", "RunLock", "RUN_FILES", "LOCK_FILE"]
