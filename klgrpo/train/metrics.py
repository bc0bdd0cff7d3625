"""Metric names and their sinks: metrics.jsonl, TensorBoard (tb/), and a progress bar.

``GLOSSARY`` is the one list of every name the trainer logs, each with its formula; docs/metrics.md is the
same list for users. ``MetricsLogger`` writes one row per ``log`` call:

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

from klgrpo.errors import KLGRPOError
from klgrpo.train.trackers import TB_DIR

METRICS_FILE = "metrics.jsonl"
#: The run summary the trainer writes at the end (read by `klgrpo report`, the demo and the sweep).
SUMMARY_FILE = "summary.json"

#: Every metric name the trainer logs -> its formula or meaning, in one line. "Per token" means over the
#: step's completion tokens (the completion mask, EOS included), pooled over all B*G completions.
#: l = log pi(y_t) - log pi_ref(y_t) is the per-token log-ratio of the sampled token (docs/kl_math.md).
#: Names with <...> are patterns: one metric per reward function or evaluation set.
GLOSSARY: dict[str, str] = {
    # train
    "train/loss": "the GRPO loss of the step: policy loss + beta * KL loss term, aggregated per loss.aggregation "
                  "with the global normaliser (summed over micro-batches it equals the full-batch loss); the replay "
                  "anchor's term is logged apart as train/replay_penalty",
    "train/policy_loss": "clipped surrogate -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), "
                         "rho_t = pi(y_t) / pi_old(y_t), aggregated as the loss",
    "train/kl_penalty": "beta times the KL that entered the objective: the shaped, importance-corrected loss "
                        "term aggregated as the loss, plus (KL in the reward) beta * mean over completions of "
                        "the summed per-token KL",
    "train/reward": "mean over the step's B*G completions of the total reward (weighted sum of the reward functions)",
    "train/reward_std": "mean over the B prompts of the std of the G total rewards within each group "
                        "(ddof as the advantages); 0 means no group had a learning signal",
    "rewards/<function>": "mean over the step's completions of one reward function's unweighted value",
    "train/advantage_abs": "mean over completions of |A_i|, the group-normalised advantage "
                           "(before any KL-in-reward term)",
    "train/replay_penalty": "replay coefficient times the replay KL term that entered the loss "
                            "(KL to the reference on replay prompts, the retention guard); absent when off",
    # adaptive_kl
    "adaptive_kl/raw_kl": "mean per token of the configured estimator's KL value, before shaping",
    "adaptive_kl/adapted_kl": "mean per token of the KL value after shaping (none/clip/sigmoid/length_normalized)",
    "adaptive_kl/current_beta": "the beta that multiplied the KL in this step; the controller updates it "
                                "after the step, so the next row shows the new value",
    # kl diagnostics
    "kl/k1": "mean per token of k1 = l (unbiased for KL(pi||ref), either sign)",
    "kl/k2": "mean per token of k2 = l^2 / 2 (biased, >= 0), on the same tokens as kl/k1",
    "kl/k3": "mean per token of k3 = exp(-l) + l - 1 (unbiased, >= 0), on the same tokens as kl/k1",
    "kl/max": "max over the step's completion tokens of k3, with |l| clamped at the k3 guard (default 20): "
              "the spikes of the heavy-tailed estimator",
    "kl/min": "min over the step's loss-mask tokens of the configured estimator's per-token KL value (the one "
              "adaptive_kl/raw_kl averages): negative for k1 (a token the policy makes less likely than the "
              "reference); for k2, k3, k3_st and full a negative value means a bug",
    "logp/policy_mean": "mean per loss-mask token of log pi(y_t), the policy's log-prob of the sampled token "
                        "(at the sampling temperature, with the weights of the update)",
    "logp/reference_mean": "mean per loss-mask token of log pi_ref(y_t) on the same tokens: "
                           "logp/policy_mean - logp/reference_mean = kl/k1",
    "kl/clamp_frac": "fraction of completion tokens whose |l| exceeded the k3 guard (clamped; no KL gradient there)",
    "kl/shaping_clip_frac": "fraction of completion tokens whose KL exceeded kl_clip_threshold under the clip "
                            "shaping (zero KL gradient there); 0 for other shapings",
    "kl/sequence_sum": "mean over completions of sum_t l_t (summed k1): the sequence KL estimate, "
                       "Ziegler's controller input",
    "kl/log_ratio_p50": "median over the step's loss-mask tokens of l (linear interpolation, as torch.quantile); "
                        "kl/log_ratio_p90 and kl/log_ratio_p99 the 90th and 99th percentiles",
    "kl/log_ratio_p90": "90th percentile over the step's loss-mask tokens of l",
    "kl/log_ratio_p99": "99th percentile over the step's loss-mask tokens of l: where a few tokens run off",
    "kl/k3_p50": "median over the step's loss-mask tokens of k3 = exp(-l) + l - 1 (|l| clamped at the k3 guard)",
    "kl/k3_p90": "90th percentile over the step's loss-mask tokens of k3",
    "kl/k3_p99": "99th percentile over the step's loss-mask tokens of k3: with kl/max, the heavy tail of the KL",
    "kl/loss_share": "|beta * KL loss term| / (P + |beta * KL loss term|), in [0, 1], P = the per-token |policy "
                     "loss| aggregated as the loss: how much of the loss's magnitude the KL is; logged when the KL "
                     "is in the loss with beta > 0",
    "train/replay_share": "|train/replay_penalty| / (|train/loss| + |train/replay_penalty|), in [0, 1] (0 when "
                          "both are 0): the anchor's share of the objective's magnitude",
    "kl/replay": "mean per token of the configured estimator's KL value on the replay prompts' completions",
    # completions
    "completions/mean_length": "mean over the step's completions of the completion length in tokens (EOS included)",
    "completions/max_length": "longest completion of the step, in tokens",
    "completions/clipped_ratio": "fraction of completions cut at max_new_tokens without an EOS",
    # clipping
    "clip_ratio": "fraction of completion tokens where the PPO clip was active: clip_ratio/low + clip_ratio/high",
    "clip_ratio/low": "fraction of completion tokens with A < 0 and rho_t < 1 - eps_low",
    "clip_ratio/high": "fraction of completion tokens with A > 0 and rho_t > 1 + eps_high",
    # optimisation
    "entropy": "mean per token of the policy's next-token entropy -sum_v pi(v) log pi(v) (nats, at the "
               "sampling temperature)",
    "grad_norm": "global L2 norm of the gradient over the trainable parameters, before clipping",
    "lr": "learning rate of this optimizer step",
    "train/skipped_steps": "steps skipped so far because the loss or the gradient norm was NaN or infinite (the "
                           "optimizer, scheduler and KL controller did not move on them); the run stops after "
                           "train.max_skipped_steps in a row",
    # timing
    "time/generate": "wall seconds spent sampling the step's completions",
    "time/reward": "wall seconds spent in the reward functions",
    "time/reference": "wall seconds spent computing the reference log-probs",
    "time/replay": "wall seconds of the replay anchor's forward/backward",
    "time/update": "wall seconds of the policy forward/backward passes and optimizer step(s)",
    "time/step": "wall seconds of the whole step, from sampling to logging",
    # eval
    "eval/<name>": "greedy accuracy (fraction correct, 0..1) on the named evaluation or retention set, "
                   "logged at evaluation steps only",
}

#: Progress-bar labels for the summary keys; other keys show their last path component.
SHORT_LABELS = {
    "train/reward": "reward",
    "adaptive_kl/raw_kl": "kl",
    "adaptive_kl/current_beta": "beta",
    "completions/mean_length": "len",
    "time/step": "s/step",
}

DEFAULT_SUMMARY_KEYS = ("train/reward", "adaptive_kl/raw_kl", "adaptive_kl/current_beta",
                        "completions/mean_length", "time/step")

_RESERVED = ("step", "wall_time")
_NONFINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsFileError(KLGRPOError):
    """metrics.jsonl has a line that is not a JSON object (beyond a truncated last line)."""


def describe(name: str) -> str | None:
    """The glossary line for ``name``, matching the <...> patterns; None if the name is not documented."""
    if name in GLOSSARY:
        return GLOSSARY[name]
    for key, text in GLOSSARY.items():
        if "<" in key and name.startswith(key[: key.index("<")]) and len(name) > key.index("<"):
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
        names = [n for n in (report_to if report_to is not None else ["tensorboard"])
                 if n != "tensorboard" or tensorboard]
        self._trackers = None
        if names:
            from klgrpo.train.trackers import RunTrackers

            self._trackers = RunTrackers(names, self.run_dir, project, config, start_step)

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

    def message(self, text: str) -> None:
        """Print a line above the progress bar (also when the bar is off)."""
        tqdm.write(str(text))

    def text(self, name: str, text: str, step: int) -> None:
        """A text entry at ``step`` (TensorBoard's Text tab), e.g. a warning sign."""
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
    text = path.read_text(encoding="utf-8")
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


__all__ = ["GLOSSARY", "SHORT_LABELS", "DEFAULT_SUMMARY_KEYS", "MetricsLogger", "MetricsFileError",
           "read_metrics", "describe", "undocumented", "METRICS_FILE", "SUMMARY_FILE", "TB_DIR"]
