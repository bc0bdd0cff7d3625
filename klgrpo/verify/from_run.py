"""k1 / k2 / k3 side by side on the per-token log-probs a training run dumped.

A run may write ``RUN_DIR/kl_dumps/step_NNNNNN.safetensors``: tensors ``logp`` float32 [B, T], ``ref_logp``
float32 [B, T], ``mask`` bool [B, T] (log-probs of the sampled tokens under the policy and the reference) and the
step in the file's metadata (``{"step": "N"}``); read as data, nothing in it is executed. For every dump and
estimator this reports, over the masked tokens, the mean, the 50/90/99th percentiles (linear interpolation between
order statistics, as ``numpy.percentile``), the max, and for k1 the fraction of negative values; plus the fraction
of tokens whose |log-ratio| exceeds the k3 clamp. The values go through ``kl_estimate`` in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from klgrpo.core.kl_dump import DUMP_DIR, DUMP_GLOB, DumpError, load_dump
from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP, clamp_fraction, kl_estimate

DUMP_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class EstimatorStats:
    file: str
    step: int
    estimator: str
    tokens: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    frac_negative: float | None   # k1 only
    clamp_frac: float             # |log-ratio| > clamp (where k3 is clamped)


def quantile(sorted_x: Tensor, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default); ``sorted_x`` ascending, non-empty."""
    pos = q * (sorted_x.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, sorted_x.numel() - 1)
    return float(sorted_x[lo] + (sorted_x[hi] - sorted_x[lo]) * (pos - lo))


def find_dumps(run_dir: str | Path) -> list[Path]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DumpError(f"run folder {str(run_dir)!r} does not exist; pass the folder of a training run")
    dump_dir = run_dir / DUMP_DIR
    files = sorted(dump_dir.glob(DUMP_GLOB)) if dump_dir.is_dir() else []
    if not files:
        raise DumpError(f"no KL dumps in {str(dump_dir)!r} (expected {DUMP_GLOB} files); "
                        "train with --kl.dump_every N to write them, then point --from-run at that run folder")
    return files




def dump_stats(dump: dict, file: str = "", clamp: float | None = DEFAULT_LOG_RATIO_CLAMP) -> list[EstimatorStats]:
    mask = dump["mask"].to(torch.bool)
    logp, ref_logp = dump["logp"].to(torch.float64), dump["ref_logp"].to(torch.float64)
    step = int(dump.get("step", -1))
    clamped = float(clamp_fraction(logp, ref_logp, mask, clamp))
    out = []
    for name in DUMP_ESTIMATORS:
        values = kl_estimate(logp, ref_logp, name, clamp=clamp)[mask]
        n = values.numel()
        if n == 0:
            out.append(EstimatorStats(file, step, name, 0, *([float("nan")] * 5),
                                      float("nan") if name == "k1" else None, clamped))
            continue
        s = values.sort().values
        out.append(EstimatorStats(
            file=file, step=step, estimator=name, tokens=n, mean=float(values.mean()),
            p50=quantile(s, 0.50), p90=quantile(s, 0.90), p99=quantile(s, 0.99), max=float(s[-1]),
            frac_negative=float((values < 0).double().mean()) if name == "k1" else None, clamp_frac=clamped,
        ))
    return out


def analyse_run(run_dir: str | Path) -> list[EstimatorStats]:
    stats = []
    for path in find_dumps(run_dir):
        stats += dump_stats(load_dump(path), file=path.name)
    return stats


def format_stats(stats: list[EstimatorStats]) -> str:
    head = f"{'dump':<18} {'step':>7} {'est':<3} {'tokens':>7} {'mean':>10} {'p50':>10} {'p90':>10} " \
           f"{'p99':>10} {'max':>10} {'neg_frac':>8} {'clamp':>6}"
    lines = [head, "-" * len(head)]
    for s in stats:
        neg = f"{s.frac_negative:8.4f}" if s.frac_negative is not None else f"{'':>8}"
        lines.append(f"{s.file:<18} {s.step:>7} {s.estimator:<3} {s.tokens:>7} {s.mean:>10.4g} {s.p50:>10.4g} "
                     f"{s.p90:>10.4g} {s.p99:>10.4g} {s.max:>10.4g} {neg} {s.clamp_frac:>6.3f}")
    return "\n".join(lines)
