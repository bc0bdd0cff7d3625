"""The logs verl, OpenRLHF, NeMo-RL and prime-rl write through their trackers, read for ``klgrpo explain --run``.

TensorBoard event files (verl's ``Tracking`` with the tensorboard backend writes them under
``$TENSORBOARD_DIR``, default ``tensorboard_log/<project>/<experiment>``; OpenRLHF's ``--logger.tensorboard_dir``
under ``<dir>/<run_name>``; NeMo-RL's ``logger.tensorboard_enabled`` under ``<logger.log_dir>/exp_NNN/tensorboard``)
are read record by record, each record's CRC-32C checked, with TensorBoard's own
Event protobuf and scalar conversion (data_compat), so a file cut short or holding bad bytes is said with where it
stops. W&B offline runs
(``wandb/offline-run-*/run-*.wandb``) are read with the wandb package's own reader (``wandb leet inspect
--json``); without wandb an offline run is refused in one line that says what to install.

Which framework wrote a log is told by its metric names: the names are the frameworks' own (docs/explain.md
cites the files that log each one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

from klgrpo.errors import ConfigError

EVENT_PREFIX = "events.out.tfevents."
WANDB_SUFFIX = ".wandb"
#: How deep under the folder given to --run event files and W&B run files are looked for: verl's
#: tensorboard_log/<project>/<experiment>/, wandb/offline-run-*/ and NeMo-RL's
#: <logger.log_dir>/exp_NNN/wandb/wandb/offline-run-*/ (wandb.init(dir=...) adds its own wandb/) sit within it.
SEARCH_DEPTH = 4
#: Names only one framework logs: the first framework with one of them in a log wrote it.
FRAMEWORK_TAGS = {
    "verl": ("actor/kl_loss", "actor/kl_coef", "actor/reward_kl_penalty", "critic/kl", "actor/pg_clipfrac",
             "actor/pg_loss", "critic/score/mean"),
    "openrlhf": ("train/policy_loss", "train/ppo_clip_ratio", "train/ppo_kl", "train/actor_lr"),
    "nemo_rl": ("train/kl_penalty", "train/token_mult_prob_error", "train/gen_kl_error", "train/approx_entropy",
                "train/sampling_importance_ratio", "train/probs_ratio_clamped"),
    "prime_rl": ("mismatch_kl/all/mean", "mismatch_kl/mean", "masked_mismatch_kl/mean", "unmasked_mismatch_kl/mean",
                 "entropy/all/mean", "optim/zero_grad_ratio"),
}
#: The step of a W&B history row: OpenRLHF logs its own (wandb.define_metric("train/*",
#: step_metric="train/global_step")), prime-rl its own "step" (define_metric("*", step_metric="step"), several
#: wandb.log calls a step); verl and NeMo-RL pass their global step to wandb.log(step=...), W&B's _step.
WANDB_STEPS = ("train/global_step", "step", "_step")
WANDB_TIMEOUT_S = 300
#: Why an event file's records stop being whole (the "what" of its damage entry).
CUT_SHORT = "cut_short"  # the file ends inside a record: a crash or a copy mid-write
BAD_CHECKSUM = "bad_checksum"  # a record's bytes do not match its CRC-32C: flipped bits or bytes not TensorBoard's
NOT_AN_EVENT = "not_an_event"  # a whole record that is no Event protobuf
_RECORD_HEADER, _RECORD_FOOTER = 12, 4
#: A run's last values fit in this; a larger wandb-summary.json is not quoted.
SUMMARY_BYTES = 1 << 20


def find_logs(path: Path, limit_bytes: int) -> tuple[str, list[Path]] | None:
    """("tensorboard", [event files of one folder]) or ("wandb", [one run file]) under ``path``, or None."""
    event_dirs, run_files = {}, []
    for folder, dirs, files in os.walk(path):
        depth = len(Path(folder).relative_to(path).parts)
        if depth >= SEARCH_DEPTH:
            dirs[:] = []
        events = sorted(Path(folder) / f for f in files if f.startswith(EVENT_PREFIX))
        if events:
            event_dirs[Path(folder)] = events
        run_files += [Path(folder) / f for f in files if f.startswith("run-") and f.endswith(WANDB_SUFFIX)]
    for kind, found in (("tensorboard", list(event_dirs)), ("wandb", run_files)):
        if len(found) > 1:
            shown = ", ".join(str(p) for p in sorted(found)[:3])
            raise ConfigError(f"{path} holds {len(found)} {kind} runs ({shown}{', ...' if len(found) > 3 else ''}): "
                              "pass the folder of one")
        if found:
            files = event_dirs[found[0]] if kind == "tensorboard" else found
            for file in files:
                check_regular(file)
            _check_size(files, limit_bytes)
            return kind, files
    return None


def check_regular(file: Path) -> None:
    """Refuse, from its stat alone, a log that is no regular file: opening a FIFO for reading waits for a writer,
    and a device or socket is no log."""
    try:
        mode = os.stat(file).st_mode
    except OSError as err:
        raise ConfigError(f"{file} cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or
                stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise ConfigError(f"{file} is {what}, not a regular file: explain --run reads a run's log files as they "
                          "lie on disk; copy the log to a file and pass its folder")


def _check_size(files: list[Path], limit_bytes: int) -> None:
    size = sum(f.stat().st_size for f in files)
    if size > limit_bytes:
        raise ConfigError(f"{files[0].parent} holds {size} bytes of logs, more than the {limit_bytes} explain --run "
                          "reads")


def tensorboard_rows(files: list[Path]) -> tuple[list[dict], list[dict]]:
    """(rows, damage): one row per step, {"step": step, tag: value, ...} for every scalar of the folder's event
    files (a step logged twice keeps its later value), and one entry per file whose records stop being whole
    (see _read_event_file): its rows up to there are kept, the rest of that file is not read."""
    by_step: dict[int, dict] = {}
    damage = []
    for file in files:
        damaged = _read_event_file(file, by_step)
        if damaged is not None:
            damage.append(damaged)
    return [by_step[step] for step in sorted(by_step)], damage


def _read_event_file(file: Path, by_step: dict[int, dict]) -> dict | None:
    """Every scalar of one event file into ``by_step``; None, or where and why its records stop being whole.

    An event file is a sequence of TFRecords: an 8-byte length and its masked CRC-32C, the serialised Event and
    its masked CRC-32C. TensorBoard's own loader stops at the first record cut short or failing its checksum
    and says so only in a debug log; here the records are framed and checked one by one, so where a file ends
    (a crash mid-write) or holds bad bytes (a flipped bit, bytes appended) is said, with the last step read."""
    from google.protobuf.message import DecodeError
    from tensorboard import data_compat
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from tensorboard.util import tensor_util

    size = file.stat().st_size
    plugin_of: dict[str, str] = {}  # a tag's plugin: a writer puts the metadata on a tag's first value only
    offset, last_step = 0, None

    def stop(what: str) -> dict:
        return {"file": str(file), "what": what, "at_byte": offset, "file_bytes": size, "last_step": last_step}

    with open(file, "rb") as handle:
        while header := handle.read(_RECORD_HEADER):
            if len(header) < _RECORD_HEADER:
                return stop(CUT_SHORT)
            (length,), (header_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
            if masked_crc32c(header[:8]) != header_crc:
                return stop(BAD_CHECKSUM)
            if length > size - offset - _RECORD_HEADER - _RECORD_FOOTER:
                return stop(CUT_SHORT)
            data, footer = handle.read(length), handle.read(_RECORD_FOOTER)
            if len(data) < length or len(footer) < _RECORD_FOOTER:
                return stop(CUT_SHORT)
            if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
                return stop(BAD_CHECKSUM)
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError:
                return stop(NOT_AN_EVENT)
            for value in event.summary.value:
                value = data_compat.migrate_value(value)
                if value.HasField("metadata") and value.tag not in plugin_of:
                    plugin_of[value.tag] = value.metadata.plugin_data.plugin_name
                if plugin_of.get(value.tag) != "scalars" or not value.HasField("tensor"):
                    continue
                scalar = tensor_util.make_ndarray(value.tensor)
                if scalar.size == 1:
                    by_step.setdefault(event.step, {"step": event.step})[value.tag] = float(scalar.item())
                    last_step = event.step
            offset += _RECORD_HEADER + length + _RECORD_FOOTER
    return None


def wandb_rows(run_file: Path, kl_names: tuple[str, ...]) -> list[dict]:
    """The history rows of a W&B run file, each with its step, or one ConfigError saying what to install."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"{run_file} is a W&B offline run: reading it needs the wandb package (pip install "
                          f"'wandb>=0.31', whose `wandb leet inspect` reads it){_summary_hint(run_file, kl_names)}")
    try:
        done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                              capture_output=True, text=True, timeout=WANDB_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{run_file}: wandb did not read it in {WANDB_TIMEOUT_S} s") from None
    if done.returncode != 0:
        said = ((done.stderr.strip() or done.stdout.strip()).splitlines() or ["no message"])[-1]
        raise ConfigError(f"{run_file}: wandb could not read it ({said}); explain reads W&B runs with `wandb leet "
                          "inspect` (wandb >= 0.31)")
    return [row for line in done.stdout.splitlines() if (row := _history_row(line)) is not None]


def _history_row(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    item = record.get("history", {}).get("item") if record.get("type") == "history" else None
    if not isinstance(item, dict):
        return None
    step = next((int(item[name]) for name in WANDB_STEPS if isinstance(item.get(name), (int, float))
                 and not isinstance(item.get(name), bool) and float(item[name]).is_integer()), None)
    return None if step is None else {**item, "step": step}


def _summary_hint(run_file: Path, kl_names: tuple[str, ...]) -> str:
    """What the run's files/wandb-summary.json (the last values, where wandb wrote one) says of the KL."""
    summary_file = run_file.parent / "files" / "wandb-summary.json"
    try:
        info = os.stat(summary_file)
        if not stat.S_ISREG(info.st_mode) or info.st_size > SUMMARY_BYTES:  # a FIFO would wait for a writer
            return ""
        summary = json.loads(summary_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return ""
    names = [n for n in kl_names if isinstance(summary, dict) and isinstance(summary.get(n), (int, float))]
    return f"; its files/wandb-summary.json holds only the last values ({names[0]} {summary[names[0]]})" if names \
        else ""


def framework(rows: list[dict], where: Path, damage_said: str = "") -> str:
    """"verl", "openrlhf", "nemo_rl" or "prime_rl", from the metric names the log holds; one ConfigError naming
    what was looked for (and ``damage_said``: where the log stopped being read, if it did)."""
    tags = set().union(*rows) if rows else set()
    for name, marks in FRAMEWORK_TAGS.items():
        if tags & set(marks):
            return name
    looked = "; ".join(f"{name}: {', '.join(marks)}" for name, marks in FRAMEWORK_TAGS.items())
    raise ConfigError(f"{where} logs none of the metric names explain reads ({looked}): is it a verl, OpenRLHF, "
                      f"NeMo-RL or prime-rl run's log?{damage_said}")
