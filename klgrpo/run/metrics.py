"""The metrics' sinks: metrics.jsonl, TensorBoard (tb/), and a progress bar.

The names and their glossary live in klgrpo/train/metric_names.py (``GLOSSARY``, re-exported here);
docs/metrics.md is the same list for users. ``MetricsLogger`` writes one row per ``log`` call:

    run_dir/metrics.jsonl   {"step": N, "wall_time": seconds since the run started, "<name>": value, ...}
    run_dir/tb/             TensorBoard scalars under the same names
    the terminal            a tqdm bar whose postfix is a one-line summary (reward, kl, beta, len, s/step)

Non-finite values are never dropped: strict JSON has no NaN, so metrics.jsonl holds them as the strings
"NaN", "Infinity" and "-Infinity" (``float()`` of each gives the value back; ``read_metrics`` does it for
you), TensorBoard gets the float itself, and the first non-finite value of each name prints a warning line.

Resuming (``start_step > 0``) keeps the rows with step <= start_step, drops the later ones (written after the
checkpoint the run resumes from) by rewriting the file atomically, and appends; TensorBoard is told to
purge its events from step start_step + 1 on. A resumed run's files then read like an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from tqdm.auto import tqdm

from klgrpo.config.trackers import active_trackers
from klgrpo.errors import KLGRPOError
from klgrpo.store.run_folder import METRICS_FILE
from klgrpo.train import metric_names as names
from klgrpo.train.metric_names import GLOSSARY

#: Progress-bar labels for the summary keys; other keys show their last path component.
SHORT_LABELS = {
    names.REWARD: "reward",
    names.RAW_KL: "kl",
    names.BETA: "beta",
    names.MEAN_LENGTH: "len",
    names.TIME_STEP: "s/step",
}

DEFAULT_SUMMARY_KEYS = tuple(SHORT_LABELS)

_RESERVED = ("step", "wall_time")
_NONFINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsFileError(KLGRPOError):
    """metrics.jsonl has a line that is not a JSON object (beyond a truncated last line)."""


def describe(name: str) -> str | None:
    """The glossary line for ``name``, matching the <...> patterns; None if the name is not documented."""
    if name in GLOSSARY:
        return GLOSSARY[name]
    patterns = [(key[: key.index("<")], key[key.index(">") + 1:], text) for key, text in GLOSSARY.items()
                if "<" in key]
    # the most specific pattern first: eval/<name>/entropy before eval/<name>
    for prefix, suffix, text in sorted(patterns, key=lambda p: -len(p[0] + p[1])):
        if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix):
            return text
    return None


def undocumented(names: Iterable[str]) -> list[str]:
    """The names that no GLOSSARY entry describes (a test of the trainer can assert this is empty)."""
    return [n for n in names if describe(n) is None]


def _json_value(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _format(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl, TensorBoard and a progress bar (module docstring).

    ``log(step, metrics)`` writes one row; call it once per step with all that step's names (a second call
    with the same step, e.g. for eval metrics, writes a second row with that step). Steps must not go
    backwards. ``message(text)`` prints a line without breaking the bar. Use as a context manager or call
    ``close()``.

    start_step: the last step already completed (the checkpoint resumed from); 0 for a fresh run, which
    starts metrics.jsonl empty. wall_time continues from the last kept row on resume, so it counts training
    time and not the time the run was stopped.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        total_steps: int,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        start_step: int = 0,
        summary_keys: Iterable[str] = DEFAULT_SUMMARY_KEYS,
        report_to: Iterable[str] | None = None,
        project: str = "klgrpo",
        config: dict | None = None,
    ):
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.summary_keys = tuple(summary_keys)
        self._last_step = start_step
        self._warned_nonfinite: set[str] = set()
        self._latest: dict[str, float] = {}
        self._closed = False

        kept = _keep_rows_up_to(self.path, start_step)
        self._time_offset = max((float(r["wall_time"]) for r in kept if _is_number(r.get("wall_time"))), default=0.0)
        self._t0 = time.monotonic()
        self._file = self.path.open("a", encoding="utf-8")

        # The trackers (accelerate's): report_to, or TensorBoard alone; logging.tensorboard false drops TensorBoard.
        wanted = active_trackers(None if report_to is None else list(report_to), tensorboard)
        self._trackers = None
        if wanted:
            from klgrpo.run.trackers import RunTrackers

            self._trackers = RunTrackers(wanted, self.run_dir, project, config, start_step)

        self._bar = None
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    # -- writing ------------------------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write one row: {"step", "wall_time", **metrics}. Values are anything ``float()`` accepts."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        step = int(step)
        if step < self._last_step:
            raise ValueError(f"metrics step went backwards: {step} after {self._last_step}")
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if name in _RESERVED:
                raise ValueError(f"metric name {name!r} is reserved for the row's own field; rename it")
            try:
                values[name] = float(value)
            except (TypeError, ValueError) as err:
                raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}: {err}") from None

        wall_time = round(self._time_offset + time.monotonic() - self._t0, 3)
        row = {"step": step, "wall_time": wall_time, **{k: _json_value(v) for k, v in values.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

        if self._trackers is not None:
            self._trackers.log(values, step)

        for name, value in values.items():
            if not math.isfinite(value) and name not in self._warned_nonfinite:
                self._warned_nonfinite.add(name)
                self.message(f"warning: step {step}: {name} is {value} (kept in {self.path.name} as "
                             f"{_json_value(value)!r}; further non-finite values of it are not announced)")

        self._latest.update(values)
        self._last_step = step
        if self._bar is not None:
            self._bar.set_postfix_str(self.summary(), refresh=False)
            self._bar.update(max(0, step - self._bar.n))

    def summary(self) -> str:
        """The one-line step summary of the latest values of ``summary_keys`` (the bar's postfix)."""
        parts = [f"{SHORT_LABELS.get(k, k.rsplit('/', 1)[-1])} {_format(self._latest[k])}"
                 for k in self.summary_keys if k in self._latest]
        return " | ".join(parts)

    def rewind(self, step: int) -> None:
        """Forget the rows after ``step`` (a rollback undid those steps, kl.on_runaway): metrics.jsonl keeps the
        rows up to it (the evaluation at step 0 too), as a resume from that step would; the trackers keep what
        they were sent (they cannot take it back)."""
        self._file.close()
        kept = [r for r in _read_rows(self.path) if _is_number(r["step"]) and r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._last_step = step
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def message(self, text: str) -> None:
        """Print a line above the progress bar (also when the bar is off)."""
        tqdm.write(str(text))

    def text(self, name: str, text: str, step: int) -> None:
        """A text entry at ``step`` for the trackers (TensorBoard's Text tab), e.g. a warning sign."""
        if self._trackers is not None:
            self._trackers.text(name, str(text), int(step))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._trackers is not None:
            self._trackers.finish()
        self._file.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- reading --------------------------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _decode(row: dict) -> dict:
    return {k: _NONFINITE_TEXT.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


def _read_rows(path: Path) -> list[dict]:
    """Raw rows (non-finite values still as strings); a truncated last line is skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise MetricsFileError(f"{path}, line {line}: not UTF-8 text (a binary or damaged file); it is not the "
                               f"metrics.jsonl a klgrpo run writes: restore it, or fix or delete that line") from None
    lines = text.split("\n")
    # A crash mid-write leaves a last line without its newline; text ending in "\n" leaves "" last.
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines):  # the unterminated last line: a write the crash cut short
                break
            raise MetricsFileError(f"{path}, line {i}: not valid JSON ({err.msg}); fix or delete that line") from None
        if not isinstance(row, dict) or "step" not in row:
            raise MetricsFileError(f"{path}, line {i}: expected a JSON object with a \"step\" field; "
                                   f"fix or delete that line")
        rows.append(row)
    return rows


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of run_dir/metrics.jsonl (``run_dir`` may also be the file itself), in file order.

    "NaN"/"Infinity"/"-Infinity" strings come back as floats. A truncated last line (a crash mid-write) is
    skipped; any other unreadable line raises ``MetricsFileError`` naming the file and line.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a run folder written by `klgrpo train` holds {METRICS_FILE}")
    return [_decode(r) for r in _read_rows(path)]


def _keep_rows_up_to(path: Path, start_step: int) -> list[dict]:
    """Rewrite ``path`` atomically with only the rows of step <= start_step (none for a fresh run)."""
    if not path.exists():
        return []
    kept = []
    if start_step > 0:
        kept = [r for r in _read_rows(path) if _is_number(r["step"]) and r["step"] <= start_step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kept


__all__ = ["SHORT_LABELS", "DEFAULT_SUMMARY_KEYS", "MetricsLogger", "MetricsFileError",
           "read_metrics", "describe", "undocumented"]
