"""Atomic checkpoints: a run can be killed at any moment and the newest complete checkpoint still loads.

    checkpoints/step_N/   model (save_pretrained, safetensors), tokenizer, trainer_state.safetensors +
                          trainer_state.json (optimizer, scheduler, RNG states, controller, data position,
                          pending batch, step; see state_io: nothing is pickled; the sha256 of every weights
                          file, checked by ``verify_checksums`` before a load), reference/ once synced

A checkpoint is written to a temporary sibling folder (.tmp_step_N_<pid>) and renamed into place, so step_N
either exists whole or not at all; a checkpoint written again at the same step (a rollback's) first moves the old
one aside (.replaced_step_N_<pid>), which a kill before the new one is in place leaves to be put back; pruning
renames a folder to .trash_step_N_<pid> before deleting it. ``clean_incomplete`` repairs or removes what a kill in
the middle of any of them leaves behind.

Each trainer_state.json records its lineage: how many rollbacks (kl.on_runaway rollback) the run's history holds
up to that state. A rollback writes its target step again with a lineage one higher, so the checkpoints of the
steps it undid, until they are deleted, are those of a later step with a smaller lineage than an earlier one:
``list_checkpoints`` leaves them out, and no resume takes them.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from klgrpo.errors import ConfigError, KLGRPOError, NonFiniteError, first_line
from klgrpo.store.state_io import (
    StateFileError,
    file_sha256,
    load_state,
    read_state_doc,
    read_state_metadata,
    save_state,
    state_files,
)

STATE_STEM = "trainer_state"
STATE_FILE = STATE_STEM + ".json"  # beside trainer_state.safetensors (tensors); see state_io
LEGACY_STATE_FILE = "trainer_state.pt"
WEIGHTS_SUMS = "weights_sha256"  # in trainer_state.json: {file inside the checkpoint: sha256}
#: A checkpoint's layout version, in trainer_state.json and in trainer_state.safetensors' header: 2 and above
#: record checksums (WEIGHTS_SUMS, and the sha256 of the tensors file), which a reader then requires.
VERSION_KEY = "checkpoint_version"
RUN_CONFIG = "run_config"  # in the trainer state (its JSON tree): the run's settings when the checkpoint was saved
CHECKPOINT_VERSION = 2
SHARDS_DIR = "sharded"  # train.sharded_checkpoints: every rank's shards of weights and AdamW moments
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp_step_(\d+)_(\d+)$")
_TRASH_DIR = re.compile(r"^\.trash_step_(\d+)_(\d+)$")
_REPLACED_DIR = re.compile(r"^\.replaced_step_(\d+)_(\d+)$")
#: in trainer_state.json: the rollbacks in the run's history up to this state (the module's docstring)
LINEAGE_KEY = "lineage"


class CheckpointLoadError(KLGRPOError):
    """A checkpoint's file cannot be read, or holds a state the run cannot use."""


#: The folder of a run that holds its checkpoints, one ``step_N`` folder each.
CHECKPOINTS_DIR = "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def check_finite_weights(model, step: int) -> None:
    """Raise NonFiniteError if any parameter of ``model`` (a module, or a gathered full state dict) holds a NaN
    or an infinity (one sync per tensor)."""
    named = model.items() if isinstance(model, dict) else model.named_parameters()
    bad = [name for name, p in named if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        raise NonFiniteError(f"the weights at step {step} hold NaN or infinite values ({bad[0]}"
                             f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); no checkpoint was written, "
                             f"the newest one in checkpoints/ holds the last finite weights")


def step_folder(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of step ``step`` lives (or will)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step}"


def is_sharded(checkpoint: Path) -> bool:
    """The checkpoint holds every rank's shards (train.sharded_checkpoints) instead of whole weights."""
    return (Path(checkpoint) / SHARDS_DIR).is_dir()


@contextmanager
def checkpoint_writer(run_dir: Path, step: int, *, owner: bool = True, pid: int | None = None, keep: int = 0,
                      ready: Callable[[], None] | None = None, protect: tuple = ()) -> Iterator[Path]:
    """The atomic folder of checkpoints/step_<step>: yields the temporary folder to write into (process ``pid``'s,
    rank 0's; created by the ``owner``), then renames it into place and prunes to the newest ``keep`` (0: keep
    all) but the folders in ``protect``. Every process of a run enters it (``ready()``: a barrier once the folder
    exists, so every rank can write its shards into it); only the owner creates, renames and prunes.

    A full disk or a read-only folder raises a one-line KLGRPOError and leaves the earlier checkpoints as they
    were; whatever is raised inside removes the temporary folder."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = step_folder(run_dir, step)
    tmp = shard_folder(run_dir, step, pid).parent
    if owner:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            raise _save_error(exc, final, run_dir) from None
    if ready is not None:
        ready()
    if not owner:
        yield tmp
        return
    try:
        yield tmp
        aside = final.with_name(f".replaced_{final.name}_{os.getpid()}")
        if final.exists():  # moved aside, not deleted, until the new one is in place (clean_incomplete)
            os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    except Exception as exc:  # an OSError, or safetensors' own SafetensorError wrapping one (a full disk)
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
            raise
        raise _save_error(exc, final, run_dir) from None
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            if old not in {Path(p) for p in protect}:  # the states kl.on_runaway keeps
                _remove(old)


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoints/step_<N> folder."""
    return int(_STEP_DIR.match(Path(folder).name).group(1))


def checkpoints_after(run_dir: Path, step: int) -> list[Path]:
    """The complete checkpoints of steps after ``step``, undone ones included, oldest first."""
    return [p for p in _complete_folders(run_dir) if checkpoint_step(p) > step]


def remove_checkpoints_after(run_dir: Path, step: int) -> list[Path]:
    """Delete the checkpoints of steps after ``step`` (a rollback undid those steps, and wrote ``step`` again
    with a higher lineage first, so a resume already skips them); returns the folders removed."""
    later = checkpoints_after(run_dir, step)
    for folder in later:
        _remove(folder)
    return later


def write_checkpoint_files(folder: Path, *, model, tokenizer, trainer_state: dict[str, Any], reference=None,
                           model_state: dict | None = None, reference_state: dict | None = None,
                           sharded: bool = False) -> None:
    """Write a checkpoint's files into ``folder``: the model (``save_pretrained``; only its architecture when
    ``sharded``: the shards are in folder/sharded already), the tokenizer, the reference, then the trainer state
    with the sha256 of every weights file. ``model_state`` (``reference_state``): the full state dict of a sharded
    model (reference), gathered by the engine, saved instead of the module's own. Refuses (NonFiniteError) weights
    that hold a NaN or an infinity, before writing anything."""
    if not sharded:
        check_finite_weights(model if model_state is None else model_state, int(trainer_state["step"]))
    if sharded:
        model.config.save_pretrained(folder)  # the architecture, for `klgrpo export`
    elif hasattr(model, "peft_config"):  # the trainable adapter only; the reference adapter is saved separately
        model.save_pretrained(folder, safe_serialization=True, selected_adapters=["default"], state_dict=model_state)
    else:
        model.save_pretrained(folder, safe_serialization=True, state_dict=model_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if reference is not None:
        reference.save(folder, **({"state_dict": reference_state} if reference_state is not None else {}))
    save_state(folder, STATE_STEM, trainer_state,
               extra={WEIGHTS_SUMS: weights_checksums(folder), VERSION_KEY: CHECKPOINT_VERSION,
                      LINEAGE_KEY: int(trainer_state.get(LINEAGE_KEY, 0))},
               metadata={VERSION_KEY: str(CHECKPOINT_VERSION)})


def _weights_files(folder: Path) -> list[Path]:
    """The files holding a checkpoint's weights: the model's (or adapter's), the reference's, every shard."""
    folder = Path(folder)
    found = [p for pattern in ("*.safetensors", "reference/*.safetensors", f"{SHARDS_DIR}/*")
             for p in folder.glob(pattern) if p.is_file()]
    return sorted(p for p in found if p.name != f"{STATE_STEM}.safetensors")


def weights_checksums(folder: Path) -> dict[str, str]:
    """{path inside the checkpoint: sha256} of every weights file in ``folder``."""
    return {p.relative_to(folder).as_posix(): file_sha256(p) for p in _weights_files(folder)}


def verify_checksums(checkpoint: Path) -> None:
    """The weights files of ``checkpoint`` are byte for byte those it was saved with (the sha256 recorded in
    its trainer_state.json), and no weights file was added. Raises StateFileError naming the first file that is
    missing, changed or unlisted, or the checkpoint whose checksum entries were removed. Only a checkpoint that
    predates checksums passes unchecked: its trainer_state.json has neither checksum entry nor a
    ``checkpoint_version``, and its trainer_state.safetensors header no ``checkpoint_version`` either (every
    checkpoint written since records all of them)."""
    checkpoint = Path(checkpoint)
    doc = read_state_doc(checkpoint, STATE_STEM)
    sums = doc.get(WEIGHTS_SUMS)
    if not isinstance(sums, dict):
        if _records_checksums(checkpoint, doc):
            raise StateFileError(f"{checkpoint / STATE_FILE} has no {WEIGHTS_SUMS} entries, which a checkpoint "
                                 f"of this layout (checkpoint_version {CHECKPOINT_VERSION}) records; its weights "
                                 f"cannot be checked (an edited or cut trainer state)")
        return
    for name, digest in sorted(sums.items()):
        path = checkpoint / name
        if not path.is_file():
            raise StateFileError(f"{path} is missing (it is listed in {STATE_FILE})")
        if file_sha256(path) != digest:
            raise StateFileError(f"{path} cannot be read as saved: its sha256 checksum differs from the one in "
                                 f"{STATE_FILE} (a disk error, a cut copy or an edit)")
    unlisted = [p for p in _weights_files(checkpoint) if p.relative_to(checkpoint).as_posix() not in sums]
    if unlisted:
        raise StateFileError(f"{unlisted[0]} is not listed in {STATE_FILE} (it was not saved with the checkpoint)")


def _records_checksums(checkpoint: Path, doc: dict) -> bool:
    """Whether the checkpoint was written by a klgrpo that records checksums (see ``verify_checksums``)."""
    meta = read_state_metadata(checkpoint, STATE_STEM)
    return VERSION_KEY in doc or "sha256" in doc or VERSION_KEY in meta


def recorded_config(checkpoint: Path) -> dict | None:
    """The run's settings recorded with ``checkpoint`` (None: an older checkpoint, or an unreadable state)."""
    try:
        tree = read_state_doc(Path(checkpoint), STATE_STEM).get("tree")
    except StateFileError:
        return None
    config = tree.get(RUN_CONFIG) if isinstance(tree, dict) else None  # plain JSON: no tensor or tag inside
    return config if isinstance(config, dict) else None


def check_checkpoint(path, field: str) -> None:
    """Before a model folder ``path`` is read (as ``field``: model.name_or_path, kl.reference, CHECKPOINT, ...):
    a klgrpo checkpoint (a folder with trainer_state.json) must pass ``verify_checksums``; anything else (a
    transformers folder, a hub name) is left to its loader. One ConfigError line otherwise."""
    folder = Path(str(path))
    if not str(path) or not (folder / STATE_FILE).is_file():
        return
    try:
        verify_checksums(folder)
    except StateFileError as exc:
        raise ConfigError(f"{field} {path}: {exc}; pass an intact checkpoint (an older one of the run: "
                          f"checkpoints/step_N)") from None


_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")


def shard_folder(run_dir: Path, step: int, pid: int | None = None) -> Path:
    """Where every rank writes its shards of step ``step`` (inside the temporary folder of process ``pid``,
    rank 0's, renamed into place once the checkpoint is whole)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f".tmp_step_{step}_{pid or os.getpid()}" / SHARDS_DIR


def _save_error(exc: Exception, final: Path, run_dir: Path) -> KLGRPOError:
    done = list_checkpoints(run_dir)
    kept = f"the newest complete checkpoint is {done[-1]}" if done else "no earlier checkpoint exists"
    code = getattr(exc, "errno", None)
    if code is None and (m := _OS_ERROR_CODE.search(str(exc))):  # SafetensorError: "... (os error 28)"
        code = int(m.group(1))
    if code in (errno.ENOSPC, errno.EDQUOT):
        return KLGRPOError(f"no space left on the device while saving {final}: free disk space (or lower "
                           f"train.keep_checkpoints) and continue with --resume latest; {kept}")
    reason = getattr(exc, "strerror", None) or first_line(exc)
    return KLGRPOError(f"cannot write {final} ({reason}); check that train.output_dir is a writable folder; {kept}")


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder so that a kill midway leaves a .trash_ folder, never a half step_N."""
    trash = folder.with_name(f".trash_{folder.name}_{os.getpid()}")
    try:
        os.replace(folder, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def is_complete(folder: Path) -> bool:
    """A checkpoint folder holds the trainer state (both files) and the model's weights."""
    folder = Path(folder)
    weights = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
    shards = folder / SHARDS_DIR
    return (all(p.is_file() for p in state_files(folder, STATE_STEM))
            and (any((folder / w).is_file() for w in weights)
                 or (shards.is_dir() and any(shards.glob("*.safetensors")))))


def _put_back_replaced(root: Path) -> None:
    """A checkpoint moved aside by a dead process's save of the same step, whose new one never took its place
    (a kill between the two renames), is put back as step_N: the state the run was in before that save."""
    for p in sorted(root.iterdir()):
        if (m := _REPLACED_DIR.match(p.name)) and not pid_alive(int(m.group(2))):
            final = root / f"step_{m.group(1)}"
            if not final.exists() and is_complete(p):
                os.replace(p, final)


def _complete_folders(run_dir: Path) -> list[Path]:
    """Every complete step_N folder, undone ones included, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    _put_back_replaced(root)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def lineage(folder: Path) -> int:
    """A checkpoint's lineage (the module's docstring); 0 where its trainer_state.json has none or is unreadable
    (its load then fails and names the file)."""
    try:
        value = read_state_doc(Path(folder), STATE_STEM).get(LINEAGE_KEY, 0)
    except StateFileError:
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _undone(folders: list[Path]) -> set[Path]:
    """The folders (oldest first) that a rollback undid: a later step with a smaller lineage than an earlier one."""
    undone, highest = set(), -1
    for folder in folders:
        mark = lineage(folder)
        if mark < highest:
            undone.add(folder)
        highest = max(highest, mark)
    return undone


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints a run can resume from, oldest first (those a rollback undid left out)."""
    found = _complete_folders(run_dir)
    undone = _undone(found)
    return [p for p in found if p not in undone]


def clean_incomplete(run_dir: Path) -> list[Path]:
    """Remove what killed saves, rollbacks and prunes leave behind (a checkpoint moved aside by a save that never
    finished is put back first: ``_put_back_replaced``): .tmp_step_* and .replaced_step_* of dead processes,
    .trash_step_*, the checkpoints a rollback undid, and step_N folders that are incomplete and older than the
    newest complete checkpoint. Returns the removed."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = _complete_folders(run_dir)
    undone = _undone(found)
    live = [p for p in found if p not in undone]
    newest = checkpoint_step(live[-1]) if live else -1
    removed = []
    for p in root.iterdir():
        tmp = _TMP_DIR.match(p.name) or _REPLACED_DIR.match(p.name)
        step = _STEP_DIR.match(p.name)
        orphan = ((tmp and not pid_alive(int(tmp.group(2)))) or _TRASH_DIR.match(p.name) or p in undone
                  or (step and int(step.group(1)) < newest and not is_complete(p)))
        if orphan and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def resume_candidates(resume: str, run_dir: Path) -> list[Path]:
    """``latest`` -> the run's complete checkpoints, newest first; otherwise the one checkpoint folder named."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            _refuse_pickled(Path(run_dir) / CHECKPOINTS_DIR)
            raise ConfigError(f"--resume latest: no checkpoint in {Path(run_dir) / 'checkpoints'}; "
                              f"pass --output-dir of the run to resume or a checkpoint folder")
        return found[::-1]
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        _refuse_pickled(path.parent)
        raise ConfigError(f"--resume {resume}: not a checkpoint folder (no {STATE_FILE}); "
                          f"pass a checkpoints/step_N folder or 'latest'")
    return [path]


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint, read from safetensors + JSON (nothing is unpickled)."""
    state = load_state(Path(checkpoint), STATE_STEM)
    if not isinstance(state, dict) or "step" not in state:
        raise StateFileError(f"{Path(checkpoint) / STATE_FILE} holds no trainer state")
    return state


def _refuse_pickled(folder: Path) -> None:
    """Checkpoints of older klgrpo versions pickled their trainer state; klgrpo does not unpickle files."""
    if folder.is_dir() and any(folder.glob(f"*/{LEGACY_STATE_FILE}")) or (folder / LEGACY_STATE_FILE).exists():
        raise ConfigError(f"the checkpoints in {folder} hold {LEGACY_STATE_FILE} (pickle, written by an older "
                          f"klgrpo), which klgrpo does not load because unpickling can run code; start a new run")
