"""``klgrpo explain --run FOLDER``: what a run's KL actually did, from its logs.

Four kinds of folder: a klgrpo run (``metrics.jsonl``, and the ``config.yaml`` it ran with; a prime-rl file
monitor's ``metrics.jsonl`` is told by its names), a TRL ``output_dir`` or ``checkpoint-N`` folder
(``trainer_state.json``'s ``log_history``; of an ``output_dir`` without one, the newest checkpoint's), and a
verl, OpenRLHF, NeMo-RL or prime-rl run's TensorBoard event files or W&B offline run
(klgrpo.apps.explain.tracker_logs), told apart by the metric names they log. TRL's ``training_args.bin`` is a
pickle: it is never read, so a TRL run's config comes only from ``--config``.

The KL's windows are judged as the trainer's KL watch judges them (klgrpo.run.kl_watch): consecutive windows of
``kl.warn_window`` logged steps; "drifting" when a window's mean is above ``kl.warn_above`` and above the previous
window's, "not learning" when it is below ``kl.warn_below`` from the second window on; only a KL to the reference
model is judged (prime-rl logs a KL to the sampler). Every value printed or written is the log's own number;
where a log is damaged or holds NaN / inf, the report says where and which.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from klgrpo.apps.explain import tracker_logs
from klgrpo.apps.explain.reading import MAX_BYTES
from klgrpo.config.schema import KLConfig
from klgrpo.errors import ConfigError
from klgrpo.run.kl_watch import WindowMeans, kl_signs
from klgrpo.train import metric_names as names

#: Logs larger than this are no run of a size explain can summarise in seconds.
MAX_LOG_BYTES = 256 * MAX_BYTES
#: (what, the metric names that hold it, first found wins) for each kind of run.
SERIES = {
    "klgrpo": {"kl": (names.RAW_KL,), "beta": (names.BETA,), "reward": (names.REWARD,),
               "clip_ratio": (names.CLIP_RATIO,), "entropy": (names.ENTROPY,)},
    "trl": {"kl": ("kl", names.RAW_KL), "beta": (names.BETA, "beta"), "reward": ("reward",),
            "clip_ratio": ("clip_ratio/region_mean", "clip_ratio"), "entropy": ("entropy",)},
    "verl": {"kl": ("actor/kl_loss", "actor/reward_kl_penalty", "critic/kl"),
             "beta": ("actor/kl_coef", "actor/reward_kl_penalty_coeff", "critic/kl_coeff"),
             "reward": ("critic/score/mean",), "clip_ratio": ("actor/pg_clipfrac",),
             "entropy": ("actor/entropy", "actor/entropy_loss")},
    "openrlhf": {"kl": ("train/kl",), "beta": (), "reward": ("train/reward",), "clip_ratio": ("train/ppo_clip_ratio",),
                 "entropy": ("train/entropy_loss",)},
    # NeMo-RL logs no clip fraction (train/probs_ratio_clamped is the mean clamped ratio) and no beta
    "nemo_rl": {"kl": ("train/kl_penalty",), "beta": (), "reward": ("train/reward",), "clip_ratio": (),
                "entropy": ("train/approx_entropy",)},
    # prime-rl's trainer: its only KL is to the sampler; the reward is in the orchestrator's log
    "prime_rl": {"kl": ("mismatch_kl/all/mean", "mismatch_kl/mean"), "beta": (), "reward": (),
                 "clip_ratio": ("is_masked/mean",), "entropy": ("entropy/all/mean", "entropy/mean")},
}
#: What each kind's KL metric is a KL to: the KL watch's bands judge a KL to the reference model only.
KL_TO = {"prime_rl": "sampler"}
#: The sampler-to-trainer panel of the runs that log one: (what, its metric names) per kind. klgrpo's names are
#: docs/metrics.md's; verl's are its rollout-correction metrics (algorithm.rollout_correction, off bypass mode).
SAMPLER_SERIES = {
    "klgrpo": {"kl": (names.SAMPLER_KL_K3,), "ess": (names.SAMPLER_ESS,), "chi2_token": (names.SAMPLER_CHI2_TOKEN,),
               "masked": (names.SAMPLER_MASKED_TOKEN_FRAC,)},
    "verl": {"kl": ("rollout_corr/kl",), "ess": ("rollout_corr/rollout_is_eff_sample_size",),
             "chi2_token": ("rollout_corr/chi2_token",), "masked": ("rollout_corr/rollout_rs_masked_fraction",)},
}
#: A metric that holds the KL only where its companion is logged beside it: verl's actor logs actor/kl_loss as 0.0
#: when use_kl_loss is off (from 0.7) and actor/kl_coef only when it is on.
NEEDS = {"actor/kl_loss": "actor/kl_coef"}
#: A metric that holds the KL only where some logged value is not 0: NeMo-RL's loss logs kl_penalty as 0 when
#: loss_fn.reference_policy_kl_penalty is 0 (no KL term; from 0.7.0 also with use_kl_in_reward).
ZERO_IS_NONE = ("train/kl_penalty",)
KIND_NAMES = {"klgrpo": "klgrpo run", "trl": "TRL run", "verl": "verl run", "openrlhf": "OpenRLHF run",
              "nemo_rl": "NeMo-RL run", "prime_rl": "prime-rl trainer run"}
#: The tracker-logged kinds, whose config is not in their logs.
TRACKER_KINDS = ("verl", "openrlhf", "nemo_rl", "prime_rl")
TRL_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class RunLog:
    folder: str
    kind: str  # a key of SERIES
    log_file: Path
    rows: list[dict]
    config_file: Path | None = None
    notes: list[str] = field(default_factory=list)
    #: Where a log file stops being whole (tracker_logs' damage entries): the rows are those read before it.
    damage: list[dict] = field(default_factory=list)


class Series(NamedTuple):
    metric: str
    points: list[tuple[int, float]]  # (step, value), the finite values
    non_finite: list[tuple[int, float]]  # (step, value), NaN or +-inf: never in the numbers, always named


def read_run(folder: str) -> RunLog:
    """The folder's log rows, or one ConfigError naming the folder and what --run reads."""
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"{folder} is not a folder; --run reads a klgrpo run folder (metrics.jsonl), a TRL "
                          f"output_dir / checkpoint-N folder ({TRL_STATE}), or a verl, OpenRLHF, NeMo-RL or prime-rl "
                          "run's TensorBoard folder or W&B offline run folder")
    if _present(path / "metrics.jsonl"):
        metrics = path / "metrics.jsonl"
        rows = _klgrpo_rows(metrics, folder)
        if _is_prime_rl_file(rows):
            log = RunLog(folder, "prime_rl", metrics, rows, damage=_cut_last_line(metrics, rows))
            log.notes.append("prime-rl's file monitor leaves NaN and infinite values out of metrics.jsonl: a step "
                             "without a value may have logged one")
            return _prime_rl_notes(log)
        log = RunLog(folder, "klgrpo", metrics, rows, damage=_cut_last_line(metrics, rows))
        if (path / "config.yaml").is_file():
            log.config_file = path / "config.yaml"
        return log
    state = _trl_state_file(path)
    if state is not None:
        return RunLog(folder, "trl", state, _trl_rows(state))
    found = tracker_logs.find_logs(path, MAX_LOG_BYTES)
    if found is None:
        raise ConfigError(f"{folder} holds neither metrics.jsonl (a klgrpo run), {TRL_STATE} (a TRL output_dir or "
                          f"checkpoint-N folder), TensorBoard event files ({tracker_logs.EVENT_PREFIX}*) nor a W&B "
                          "run (run-*.wandb) of verl, OpenRLHF, NeMo-RL or prime-rl; pass the run's folder")
    return _tracker_log(folder, *found)


def _tracker_log(folder: str, source: str, files: list[Path]) -> RunLog:
    damage: list[dict] = []
    if source == "tensorboard":
        rows, damage = tracker_logs.tensorboard_rows(files)
    else:
        rows = tracker_logs.wandb_rows(files[0], tuple(dict.fromkeys(n for k in TRACKER_KINDS
                                                                     for n in SERIES[k]["kl"])))
    kind = tracker_logs.framework(rows, files[0].parent, _damage_clause(damage))
    log = RunLog(folder, kind, files[0] if source == "wandb" else files[0].parent, rows, damage=damage)
    if kind == "verl" and any(NEEDS["actor/kl_loss"] in row for row in rows):
        log.notes.append("verl's FSDP actor from 0.7 sums actor/kl_loss over the step's PPO epochs and "
                         "mini-batches: with several, the logged value is that many times their mean KL")
    if kind == "openrlhf":
        log.notes.append("beta is not logged: OpenRLHF's beta is --algo.kl.init_coef (adaptive with "
                         "--algo.kl.target)")
    if kind == "nemo_rl":
        log.notes.append("beta is not logged: NeMo-RL's is loss_fn.reference_policy_kl_penalty; train/kl_penalty "
                         "is the loss's KL term divided by it (reference_policy_kl_type's estimate, to the "
                         "reference), summed over the step's global batches (train_global_batch_size): with "
                         "several, the logged value is that many times their mean KL")
        if any("train/gen_kl_error" in row for row in rows):
            log.notes.append("train/gen_kl_error, train/policy_kl_error and train/js_divergence_error compare the "
                             "sampler's log-probs with the trainer's (the generation mismatch), not the policy "
                             "with the reference")
    if kind == "prime_rl":
        _prime_rl_notes(log)
    return log


def _is_prime_rl_file(rows: list[dict]) -> bool:
    """A metrics.jsonl of prime-rl's file monitor ({"step", "time", **metrics}), told by prime-rl's names, holding
    none of klgrpo's KL names."""
    names = set().union(*rows) if rows else set()
    return not names & set(SERIES["klgrpo"]["kl"]) and bool(names & set(tracker_logs.FRAMEWORK_TAGS["prime_rl"]))


def _prime_rl_notes(log: RunLog) -> RunLog:
    log.notes += ["prime-rl's loss has no KL to a reference model: mismatch_kl is the KL between the inference "
                  "policy that sampled the batch and the trainer's (k3 of log(pi_trainer / pi_inference) per "
                  "token), a measure of the sampler's mismatch; no band is judged on it",
                  "beta is not logged: trainer.loss.kl_tau weighs prime-rl's log-ratio term to the sampler",
                  "the reward is in the orchestrator's log (its own run), not the trainer's"]
    return log


def _present(file: Path) -> bool:
    """Whether the log file is there; one that is there but no regular file (a FIFO) is refused unopened."""
    if not file.exists():
        return False
    tracker_logs.check_regular(file)
    return True


def _check_size(file: Path) -> None:
    if file.stat().st_size > MAX_LOG_BYTES:
        raise ConfigError(f"{file} is {file.stat().st_size} bytes, more than the {MAX_LOG_BYTES} explain --run reads")


def _klgrpo_rows(file: Path, folder: str) -> list[dict]:
    from klgrpo.run.metrics import read_metrics

    _check_size(file)
    try:
        return read_metrics(file)
    except UnicodeDecodeError:
        raise ConfigError(f"{file} is not UTF-8 text; a klgrpo run's metrics.jsonl is JSON lines") from None
    except RecursionError:
        raise ConfigError(f"{file}: a row nests too deeply to be a metrics row (a row is one flat JSON object); "
                          "remove it") from None


def _cut_last_line(file: Path, rows: list[dict]) -> list[dict]:
    """A metrics.jsonl whose last line has no newline and is no JSON (a crash mid-write): read_metrics skips that
    line; it is said as the log's damage, with the last step read."""
    data = file.read_bytes()
    start = data.rfind(b"\n") + 1
    if not data[start:].strip():
        return []
    try:
        json.loads(data[start:])
        return []
    except ValueError:  # a JSON error, or bytes that are no UTF-8
        return [{"file": str(file), "what": tracker_logs.CUT_SHORT, "at_byte": start, "file_bytes": len(data),
                 "last_step": rows[-1]["step"] if rows else None}]


def _trl_state_file(path: Path) -> Path | None:
    if _present(path / TRL_STATE):
        return path / TRL_STATE
    checkpoints = sorted((int(m.group(1)), child) for child in path.iterdir()
                         if (m := _CHECKPOINT.match(child.name)) and _present(child / TRL_STATE))
    return checkpoints[-1][1] / TRL_STATE if checkpoints else None


def _trl_rows(file: Path) -> list[dict]:
    _check_size(file)
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"{file} is not valid JSON ({type(err).__name__}); TRL writes it as JSON") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ConfigError(f"{file} has no log_history list; is it TRL's {TRL_STATE}?")
    return [row for row in history if isinstance(row, dict) and isinstance(row.get("step"), int)]


#: How JSON writers spell the values JSON has no literal for (klgrpo's metrics.jsonl, W&B's history).
_NON_FINITE_SPELLINGS = {"NaN": math.nan, "nan": math.nan, "Infinity": math.inf, "inf": math.inf,
                         "-Infinity": -math.inf, "-inf": -math.inf}


def _logged_number(value: Any) -> float | None:
    if isinstance(value, str):
        return _NON_FINITE_SPELLINGS.get(value)
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else value


def series(log: RunLog, what: str, table: dict = SERIES) -> Series | None:
    """The first of ``what``'s names (in ``table``, SERIES or SAMPLER_SERIES) that the log holds a number of: its
    finite values, and apart from them its NaN and infinite ones (a run that diverges logs them; they are named,
    never averaged nor dropped unsaid)."""
    for name in table.get(log.kind, {}).get(what, ()):
        if name in NEEDS and not any(NEEDS[name] in row for row in log.rows):
            continue
        logged = [(row["step"], number) for row in log.rows if (number := _logged_number(row.get(name))) is not None]
        if name in ZERO_IS_NONE and all(value == 0 for _, value in logged):
            continue
        if logged:
            return Series(name, [p for p in logged if math.isfinite(p[1])],
                          [p for p in logged if not math.isfinite(p[1])])
    return None


def _spell(value: float) -> str:
    return "NaN" if math.isnan(value) else "inf" if value > 0 else "-inf"


def _step_ranges(steps: list[int]) -> list[str]:
    """[1, 2, 3, 7] -> ["1-3", "7"]: runs of consecutive logged steps."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return [f"{a}-{b}" if a != b else f"{a}" for a, b in runs]


def non_finite_entry(what: str, found: Series) -> dict[str, Any]:
    steps = [step for step, _ in found.non_finite]
    return {"what": what, "metric": found.metric, "values": sorted({_spell(v) for _, v in found.non_finite}),
            "first_step": steps[0], "steps": len(steps), "of_steps": len(steps) + len(found.points),
            "step_ranges": _step_ranges(steps)}


def trajectory(points: list[tuple[int, float]]) -> dict[str, Any]:
    values = [value for _, value in points]
    peak = max(points, key=lambda point: point[1])
    return {"points": len(points), "first": {"step": points[0][0], "value": points[0][1]},
            "median": statistics.median(values), "last": {"step": points[-1][0], "value": points[-1][1]},
            "max": {"step": peak[0], "value": peak[1]}, "min": min(values)}


def band_windows(points: list[tuple[int, float]], warn_above: float, warn_below: float,
                 window: int) -> list[dict[str, Any]]:
    """Every complete window of ``window`` logged KL values that lies in a band, judged by the trainer's own
    window collector and rule (klgrpo.run.kl_watch: WindowMeans, kl_signs)."""
    out, windows = [], WindowMeans(window)
    for step, value in points:
        done = windows.observe(step, value)
        if done is not None:
            out += [{"band": band, "first_step": done.first_step, "last_step": done.last_step, "mean": done.mean}
                    for band in kl_signs(done, warn_above, warn_below)]
    return out


def summarise(log: RunLog, kl_settings: KLConfig, overrides: dict[str, float | None]) -> dict[str, Any]:
    """The --run part of the --json document."""
    bands = {"warn_above": kl_settings.warn_above, "warn_below": kl_settings.warn_below,
             "window": kl_settings.warn_window}
    bands.update({k: v for k, v in overrides.items() if v is not None})
    out: dict[str, Any] = {"folder": log.folder, "kind": log.kind, "log": str(log.log_file), "notes": list(log.notes)}
    out["damaged"] = [dict(entry) for entry in log.damage]
    out["non_finite"] = []
    for what in SERIES[log.kind]:
        found = series(log, what)
        out[what] = None if found is None or not found.points else {"metric": found.metric,
                                                                     **trajectory(found.points)}
        if what == "beta" and out[what] is not None:
            out[what]["changes"] = sum(1 for a, b in zip(found.points, found.points[1:]) if a[1] != b[1])
        if found is not None and found.non_finite:
            out["non_finite"].append(non_finite_entry(what, found))
    kl = series(log, "kl")
    if kl is None:
        looked = " or ".join(f"{n} (with {NEEDS[n]})" if n in NEEDS else f"{n} (not 0 throughout)"
                             if n in ZERO_IS_NONE else n for n in SERIES[log.kind]["kl"])
        raise ConfigError(f"{log.log_file} logs no KL ({looked}): the run had no reference model, or logged "
                          f"nothing yet{_damage_clause(log.damage)}")
    if not kl.points:
        raise ConfigError(f"{log.log_file}: {_non_finite_text(non_finite_entry('kl', kl))}: no finite KL to "
                          f"judge (the run diverged from its first logged step){_damage_clause(log.damage)}")
    out["kl"]["to"] = KL_TO.get(log.kind, "reference")
    judged = out["kl"]["to"] == "reference"
    out["bands"] = {**bands, "judged": judged, "windows": band_windows(
        kl.points, bands["warn_above"], bands["warn_below"], int(bands["window"])) if judged else []}
    out["sampler"] = sampler_panel(log, out["non_finite"])
    if out["beta"] is None and log.kind in ("klgrpo", "trl", "verl"):
        out["notes"].append("beta is not logged: TRL's beta is fixed at GRPOConfig.beta" if log.kind == "trl"
                            else "beta is not logged")
    return out


def sampler_panel(log: RunLog, non_finite: list[dict]) -> dict[str, Any] | None:
    """The sampler panel's trajectories and the steps beyond klgrpo's warning bands (rollout.warn_ess_below,
    rollout.warn_chi2_above at their defaults); None where the log has none."""
    from klgrpo.config.schema import RolloutConfig

    defaults = RolloutConfig()
    out: dict[str, Any] = {}
    for what in SAMPLER_SERIES.get(log.kind, {}):
        found = series(log, what, SAMPLER_SERIES)
        if found is None:
            continue
        if found.non_finite:
            non_finite.append(non_finite_entry(f"sampler {what}", found))
        if found.points:
            out[what] = {"metric": found.metric, **trajectory(found.points)}
            if what == "ess":
                out[what]["below_band"] = [s for s, v in found.points if v < defaults.warn_ess_below]
            if what == "chi2_token":
                out[what]["above_band"] = [s for s, v in found.points if v > defaults.warn_chi2_above]
    if not out:
        return None
    out["bands"] = {"warn_ess_below": defaults.warn_ess_below, "warn_chi2_above": defaults.warn_chi2_above}
    return out


def _sampler_lines(panel: dict[str, Any] | None) -> list[str]:
    if panel is None:
        return []
    parts = []
    if "kl" in panel:
        kl = panel["kl"]
        parts.append(f"KL(sampler || trainer) ({kl['metric']}) median {_number(kl['median'])}, max "
                     f"{_number(kl['max']['value'])} at step {kl['max']['step']}")
    if "ess" in panel:
        ess, band = panel["ess"], panel["bands"]["warn_ess_below"]
        below = ess["below_band"]
        parts.append(f"ESS ({ess['metric']}) min {_number(ess['min'])}, last {_number(ess['last']['value'])}; "
                     + (f"below {band:g} at {len(below)} of {ess['points']} steps (from step {below[0]})" if below
                        else f"never below {band:g}"))
    if "chi2_token" in panel:
        chi2, band = panel["chi2_token"], panel["bands"]["warn_chi2_above"]
        above = chi2["above_band"]
        parts.append(f"chi-square per token ({chi2['metric']}) max {_number(chi2['max']['value'])}; "
                     + (f"above {band:g} at {len(above)} steps (from step {above[0]})" if above
                        else f"never above {band:g}"))
    if "masked" in panel:
        masked = panel["masked"]
        parts.append(f"masked or truncated ({masked['metric']}) max {_number(masked['max']['value'])}")
    drifted = bool(panel.get("ess", {}).get("below_band")) or bool(panel.get("chi2_token", {}).get("above_band"))
    verdict = ("the sampler drifted from the trainer: see rollout.sampler_correction and rollout.divergence_mask "
               "(docs/kl_guide.md)" if drifted else "the sampler stayed with the trainer")
    return [f"  sampler: {'; '.join(parts)}: {verdict}"]


def _number(value: float) -> str:
    return f"{value:.4g}"


_DAMAGE_TEXT = {tracker_logs.CUT_SHORT: "is cut short (its last record is incomplete)",
                tracker_logs.BAD_CHECKSUM: "holds bytes that fail their record's checksum",
                tracker_logs.NOT_AN_EVENT: "holds a record that is no TensorBoard event"}


def damage_text(entry: dict[str, Any]) -> str:
    read = f"read to step {entry['last_step']}" if entry["last_step"] is not None else "no step read before it"
    return (f"{entry['file']} {_DAMAGE_TEXT[entry['what']]} at byte {entry['at_byte']} of {entry['file_bytes']}: "
            f"{read}, the rest ({entry['file_bytes'] - entry['at_byte']} bytes) not read")


def _damage_clause(damage: list[dict]) -> str:
    return "".join(f"; {damage_text(entry)}" for entry in damage)


def _non_finite_text(entry: dict[str, Any]) -> str:
    ranges = entry["step_ranges"]
    shown = ", ".join(ranges[:4]) + (f" and {len(ranges) - 4} more runs of steps" if len(ranges) > 4 else "")
    return (f"{entry['metric']} is {' / '.join(entry['values'])} from step {entry['first_step']}, "
            f"{entry['steps']} of {entry['of_steps']} logged steps (steps {shown})")


def format_run(summary: dict[str, Any]) -> str:
    kind = KIND_NAMES[summary["kind"]]
    kl = summary["kl"]
    lines = [f"{summary['folder']}: {kind} ({summary['log']}, {kl['points']} steps with a KL)",
             *(f"  damaged: {damage_text(entry)}" for entry in summary["damaged"]),
             *(f"  not finite: {_non_finite_text(entry)}; left out of the numbers below"
               for entry in summary["non_finite"]),
             f"  {'KL' if kl['to'] == 'reference' else 'KL to the ' + kl['to'] + ', not to a reference'} "
             f"({kl['metric']}): first {_number(kl['first']['value'])} at step {kl['first']['step']}, median "
             f"{_number(kl['median'])}, last {_number(kl['last']['value'])} at step {kl['last']['step']}, max "
             f"{_number(kl['max']['value'])} at step {kl['max']['step']}"]
    bands = summary["bands"]
    short = kl["points"] < int(bands["window"])
    crossed = "; ".join(f"steps {w['first_step']}-{w['last_step']} {w['band'].replace('_', ' ')} (mean "
                        f"{_number(w['mean'])})" for w in bands["windows"]) or (
        f"the run is shorter than one warning window ({kl['points']} logged KL values, a window is "
        f"{bands['window']}): no band judged" if short else "no window in either band")
    if not bands["judged"]:
        crossed = f"none judged: the bands judge a KL to the reference model, this log's is to the {kl['to']}"
    lines.append(f"  bands (warn_above {bands['warn_above']:g}, warn_below {bands['warn_below']:g}, windows of "
                 f"{bands['window']} steps): {crossed}")
    beta = summary["beta"]
    if beta is not None:
        moved = (f"{_number(beta['first']['value'])} throughout" if beta["changes"] == 0 else
                 f"from {_number(beta['first']['value'])} to {_number(beta['last']['value'])} (min "
                 f"{_number(beta['min'])}, max {_number(beta['max']['value'])}, changed at {beta['changes']} steps)")
        lines.append(f"  beta ({beta['metric']}): {moved}")
    for what in ("reward", "clip_ratio", "entropy"):
        part = summary[what]
        if part is not None:
            lines.append(f"  {what.replace('_', ' ')} ({part['metric']}): first {_number(part['first']['value'])}, "
                         f"last {_number(part['last']['value'])}, max {_number(part['max']['value'])} at step "
                         f"{part['max']['step']}")
    lines += _sampler_lines(summary.get("sampler"))
    lines += [f"  note: {note}" for note in summary["notes"]]
    return "\n".join(lines)


def plot(log: RunLog, out: Path) -> None:
    """KL, beta and reward against the step, one panel each (those the log holds), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = [(what, series(log, what)) for what in ("kl", "beta", "reward")]
    found = [(what, s) for what, s in found if s is not None and s.points]
    figure, axes = plt.subplots(len(found), 1, figsize=(7, 2.4 * len(found)), sharex=True, squeeze=False)
    for axis, (what, (name, points, _)) in zip(axes[:, 0], found):
        axis.plot([s for s, _ in points], [v for _, v in points], lw=1.2)
        axis.set_ylabel(what)
        axis.set_title(name, fontsize=9)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(log.folder, fontsize=10)
    figure.tight_layout()
    try:
        figure.savefig(out, format="png", dpi=100)
    finally:
        plt.close(figure)
