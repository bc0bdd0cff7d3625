"""A run folder's plots and summary table (the trainer draws them at the end; ``klgrpo report`` redraws).

    plots/reward.png   train/reward (raw and smoothed), rewards/<function> when there are several, eval/<name>
    plots/kl.png       adaptive_kl/raw_kl and adaptive_kl/adapted_kl; below them kl/k1, kl/k2, kl/k3 when logged
    plots/beta.png     adaptive_kl/current_beta
    plots/length.png   completions/mean_length (and max_length), completions/clipped_ratio

A plot whose metrics are absent is skipped. Non-finite values leave gaps and are counted in the legend.
The table gives first, last, min, max and the mean of the last 10% of the logged values of each key metric,
then summary.json when the trainer has written it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from klgrpo.math.kl_control import CONTROLLERS, init_keywords
from klgrpo.run.metrics import read_metrics
from klgrpo.store.run_folder import SUMMARY_FILE
from klgrpo.train import metric_names as m

PLOTS_DIR = "plots"

#: The rows of the summary table, in order (eval/<name> keys follow them); absent keys are left out.
TABLE_KEYS = (
    m.REWARD, m.REWARD_STD, m.LOSS, m.POLICY_LOSS, m.KL_PENALTY,
    m.RAW_KL, m.ADAPTED_KL, m.BETA,
    m.KL_K1, m.KL_K2, m.KL_K3, m.KL_MAX, m.KL_CLAMP_FRAC, m.KL_SEQUENCE_SUM, m.KL_REPLAY,
    m.MEAN_LENGTH, m.TRUNCATED_RATIO, m.CLIP_RATIO, m.ENTROPY, m.GRAD_NORM,
    m.TIME_STEP,
)

Series = tuple[list[int], list[float]]


def _series(rows: list[dict], key: str) -> Series:
    """(steps, values) of one key over the rows that carry it, as floats (NaN for anything unreadable)."""
    steps, values = [], []
    for row in rows:
        if key in row:
            steps.append(row["step"])
            try:
                values.append(float(row[key]))
            except (TypeError, ValueError):
                values.append(math.nan)
    return steps, values


def _keys(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return [k for k in seen if k not in ("step", "wall_time")]


def _last_fraction(values: list[float], fraction: float = 0.1) -> list[float]:
    """The last ceil(fraction * n) values (at least one)."""
    return values[-max(1, math.ceil(fraction * len(values))):]


# -- plots ------------------------------------------------------------------------------------------------------


def _smooth(values: list[float]) -> list[float]:
    """Trailing mean over a window of ~n/20 points (NaNs ignored), so the trend reads at a glance."""
    window = max(1, len(values) // 20)
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _plot_line(ax, series: Series, label: str, *, smooth: bool = False, **style) -> None:
    steps, values = series
    bad = sum(not math.isfinite(v) for v in values)
    if bad:
        label += f" ({bad} non-finite)"
    shown = [v if math.isfinite(v) else math.nan for v in values]
    many = len(values) >= 40
    if smooth and many:
        raw_style = {k: v for k, v in style.items() if k not in ("linewidth", "alpha", "zorder")}
        line, = ax.plot(steps, shown, alpha=0.3, linewidth=1, **raw_style)
        ax.plot(steps, _smooth(shown), **{"linewidth": 2, **style, "color": line.get_color()},
                label=f"{label} (smoothed)")
    else:
        ax.plot(steps, shown, marker="o" if len(values) <= 30 else None, markersize=3, label=label, **style)


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


@dataclass(frozen=True)
class PlotContext:
    """What the plots read from the run's config beside its metrics: the controller's per-token KL target (None:
    no controller steers to one) and the sampler's warning bands (rollout.warn_ess_below, warn_chi2_above)."""

    kl_target: float | None = None
    sampler_bands: dict = field(default_factory=dict)


def _new_figure(nrows: int = 1):
    from matplotlib.figure import Figure  # no pyplot: no display, no global figure state

    fig = Figure(figsize=(8, 3.6 * nrows), layout="constrained")
    axes = [fig.add_subplot(nrows, 1, i + 1) for i in range(nrows)]
    for ax in axes[1:]:
        ax.sharex(axes[0])
    return fig, axes


def _reward_plot(rows, keys, run: PlotContext):
    evals = sorted(k for k in keys if m.is_eval_accuracy(k))  # accuracies share a 0..1 axis; entropies do not
    per_function = sorted(k for k in keys if k.startswith(m.REWARD_PREFIX))
    if m.REWARD not in keys and not evals:
        return None
    panels = (m.REWARD in keys) + bool(evals)
    fig, axes = _new_figure(panels)
    if m.REWARD in keys:
        ax = axes[0]
        _plot_line(ax, _series(rows, m.REWARD), m.REWARD, smooth=True)
        if len(per_function) > 1:
            for k in per_function:
                _plot_line(ax, _series(rows, k), k, smooth=True, linestyle="--")
        _finish(ax, "Training reward (mean over the step's completions)", "reward")
    if evals:
        ax = axes[-1]
        for k in evals:
            _plot_line(ax, _series(rows, k), k)
        _finish(ax, "Evaluation: greedy accuracy per set", "accuracy")
    return fig


#: How each KL curve is drawn. The curves often coincide (raw = adapted without shaping, raw = k3 for k3 and
#: k3_st), so no curve may hide another: raw is a wide translucent band, adapted a thin dashed line on it, and
#: the monitors get a panel of their own with a line style each.
_KL_STYLES = {
    m.RAW_KL: {"linewidth": 6, "alpha": 0.35, "zorder": 2},
    m.ADAPTED_KL: {"linewidth": 1.5, "linestyle": "--", "zorder": 3},
    m.KL_K1: {"linewidth": 5, "alpha": 0.35, "zorder": 2},
    m.KL_K2: {"linewidth": 2, "linestyle": "--", "zorder": 3},
    m.KL_K3: {"linewidth": 1.5, "linestyle": ":", "zorder": 4},
}


def _kl_plot(rows, keys, run: PlotContext):
    panels = [[k for k in (m.RAW_KL, m.ADAPTED_KL) if k in keys],
              [k for k in (m.KL_K1, m.KL_K2, m.KL_K3) if k in keys]]
    panels = [p for p in panels if p]
    if not panels:
        return None
    fig, axes = _new_figure(len(panels))
    for ax, names in zip(axes, panels):
        for k in names:
            _plot_line(ax, _series(rows, k), k, smooth=True, **_KL_STYLES[k])
        ax.axhline(0.0, color="grey", linewidth=0.8)
        monitors = names[0] in (m.KL_K1, m.KL_K2, m.KL_K3)
        if run.kl_target is not None and not monitors:  # the controller steers adaptive_kl/raw_kl
            ax.axhline(run.kl_target, color="black", linestyle="--", linewidth=1.0,
                       label=f"controller target {run.kl_target:g}")
        _finish(ax, "KL monitors k1, k2, k3 of the same log-ratio" if monitors else
                "KL in the objective: configured estimator, raw and after shaping", "KL (nats per token)")
    return fig


def _beta_plot(rows, keys, run: PlotContext):
    if m.BETA not in keys:
        return None
    fig, (ax,) = _new_figure()
    _plot_line(ax, _series(rows, m.BETA), m.BETA)
    _finish(ax, "KL coefficient beta", "beta")
    return fig


def _length_plot(rows, keys, run: PlotContext):
    has_len = m.MEAN_LENGTH in keys
    has_clip = m.TRUNCATED_RATIO in keys
    if not (has_len or has_clip):
        return None
    fig, axes = _new_figure(has_len + has_clip)
    if has_len:
        _plot_line(axes[0], _series(rows, m.MEAN_LENGTH), m.MEAN_LENGTH, smooth=True)
        if m.MAX_LENGTH in keys:
            _plot_line(axes[0], _series(rows, m.MAX_LENGTH), m.MAX_LENGTH, linestyle="--")
        _finish(axes[0], "Completion length", "tokens")
    if has_clip:
        _plot_line(axes[-1], _series(rows, m.TRUNCATED_RATIO), m.TRUNCATED_RATIO, smooth=True)
        axes[-1].set_ylim(-0.02, 1.02)
        _finish(axes[-1], "Completions cut at max_new_tokens", "fraction")
    return fig


def _sampler_plot(rows, keys, run: PlotContext):
    """The sampler-to-trainer panel: its KL, the chi-squares (with q1's and q4's by completion length) and the
    ESS with the masked fractions, each against its warning band (rollout.warn_*) when the run set one."""
    if m.SAMPLER_KL_K3 not in keys:
        return None
    bands = run.sampler_bands
    fig, axes = _new_figure(3)
    for k in (m.SAMPLER_KL_K1, m.SAMPLER_KL_K3):
        if k in keys:
            _plot_line(axes[0], _series(rows, k), k)
    axes[0].axhline(0.0, color="grey", linewidth=0.8)
    _finish(axes[0], "Sampler to trainer: KL(mu || pi_old) per token", "KL (nats per token)")
    for k, style in ((m.SAMPLER_CHI2_TOKEN, {}), (m.SAMPLER_CHI2_SEQ, {"linestyle": "--"}),
                     (m.sampler_quartile(1, "chi2_token"), {"linestyle": ":", "linewidth": 1.0}),
                     (m.sampler_quartile(4, "chi2_token"), {"linestyle": "-.", "linewidth": 1.0})):
        if k in keys:
            _plot_line(axes[1], _series(rows, k), k, **style)
    if bands.get("warn_chi2_above"):
        axes[1].axhline(bands["warn_chi2_above"], color="black", linestyle="--", linewidth=1.0,
                        label=f"rollout.warn_chi2_above {bands['warn_chi2_above']:g}")
    _finish(axes[1], "Chi-square of the importance weights (0: matched)", "chi-square")
    for k, style in ((m.SAMPLER_ESS, {}), (m.SAMPLER_MASKED_TOKEN_FRAC, {"linestyle": "--"}),
                     (m.SAMPLER_MASKED_SEQ_FRAC, {"linestyle": ":"})):
        if k in keys:
            _plot_line(axes[2], _series(rows, k), k, **style)
    if bands.get("warn_ess_below"):
        axes[2].axhline(bands["warn_ess_below"], color="black", linestyle="--", linewidth=1.0,
                        label=f"rollout.warn_ess_below {bands['warn_ess_below']:g}")
    axes[2].set_ylim(-0.02, 1.02)
    _finish(axes[2], "Effective sample size (1: matched) and the share corrected away", "fraction")
    return fig


_PLOTS = {"reward.png": _reward_plot, "kl.png": _kl_plot, "beta.png": _beta_plot, "length.png": _length_plot,
          "sampler.png": _sampler_plot}
#: The files make_plots draws in a run's plots/ (`klgrpo report` checks where they land first).
PLOT_FILES = tuple(_PLOTS)


def _run_config(run_dir: Path) -> dict:
    """The run's config.yaml as a dict ({} when it is missing or unreadable: the plots draw without it)."""
    try:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def _sampler_bands(run_dir: Path) -> dict:
    rollout = _run_config(run_dir).get("rollout", {})
    rollout = rollout if isinstance(rollout, dict) else {}
    return {k: float(v) for k in ("warn_ess_below", "warn_chi2_above")
            if isinstance(v := rollout.get(k), (int, float)) and not isinstance(v, bool)}


def _controller_target(run_dir: Path) -> float | None:
    """The per-token KL target of a controller that steers toward one (from the run's config.yaml), else None."""
    kl = _run_config(run_dir).get("kl", {})
    if not isinstance(kl, dict):
        return None
    steers = kl.get("controller") in CONTROLLERS and "target" in init_keywords(CONTROLLERS[kl["controller"]])
    if steers and kl.get("kl_measure", "token_mean") == "token_mean":
        return float(kl.get("target"))
    return None


def make_plots(run_dir: str | os.PathLike) -> list[Path]:
    """Draw run_dir/plots/{reward,kl,beta,length,sampler}.png from metrics.jsonl; returns the files written."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    keys = set(_keys(rows))
    out_dir = run_dir / PLOTS_DIR
    written = []
    context = PlotContext(kl_target=_controller_target(run_dir), sampler_bands=_sampler_bands(run_dir))
    for filename, draw in _PLOTS.items():
        fig = draw(rows, keys, context)
        if fig is None:
            continue
        out_dir.mkdir(exist_ok=True)
        path = out_dir / filename
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


# -- table ------------------------------------------------------------------------------------------------------


def _num(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def summary_table(run_dir: str | os.PathLike) -> str:
    """A plain-text table of the key metrics, then summary.json's contents when present.

    Columns: n (rows carrying the key), first, last, min and max (over the finite values), and last10%: the
    mean of the finite values among the last ceil(n / 10) logged ones. Non-finite values are listed below.
    """
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    keys = _keys(rows)
    chosen = [k for k in TABLE_KEYS if k in keys] + sorted(k for k in keys if k.startswith(m.EVAL_PREFIX))
    header = ("metric", "n", "first", "last", "min", "max", "last10%")
    table = [header]
    notes = []
    for key in chosen:
        steps, values = _series(rows, key)
        finite = [v for v in values if math.isfinite(v)]
        tail = [v for v in _last_fraction(values) if math.isfinite(v)]
        table.append((
            key, str(len(values)), _num(values[0]), _num(values[-1]),
            _num(min(finite)) if finite else "-", _num(max(finite)) if finite else "-",
            _num(sum(tail) / len(tail)) if tail else "-",
        ))
        bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
        if bad:
            notes.append(f"  {key}: {len(bad)} non-finite value(s), first at step {bad[0]}")
    last_step = rows[-1]["step"] if rows else 0
    lines = [f"{run_dir}: {len(rows)} rows, last step {last_step}"]
    if len(table) > 1:
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        for r in table:
            lines.append("  ".join(r[0].ljust(widths[0]) if i == 0 else r[i].rjust(widths[i])
                                   for i in range(len(header))).rstrip())
    else:
        lines.append("(none of the key metrics is in metrics.jsonl yet)")
    if notes:
        lines.append("non-finite values (NaN/inf are excluded from min, max and last10%):")
        lines += notes
    lines += _summary_json_lines(run_dir)
    return "\n".join(lines)


def _summary_json_lines(run_dir: Path) -> list[str]:
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return []
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        return ["", f"{SUMMARY_FILE}: unreadable ({err})"]
    if not isinstance(summary, dict):
        return ["", f"{SUMMARY_FILE}: {json.dumps(summary)}"]
    lines = ["", f"{SUMMARY_FILE}:"]
    width = max((len(str(k)) for k in summary), default=0)
    for key, value in summary.items():
        shown = _num(value) if isinstance(value, float) else json.dumps(value) if not isinstance(value, str) else value
        lines.append(f"  {str(key).ljust(width)}  {shown}")
    return lines


__all__ = ["make_plots", "summary_table", "TABLE_KEYS"]
