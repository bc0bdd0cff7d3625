"""The warning signs, watched over windows of steps (``kl.warn_above``, ``kl.warn_below``, ``kl.warn_window``), and
the one window collector every judge of a window uses (the signs here, the runaway guard and the controller's
reach in run/runaway.py, ``klgrpo explain --run``'s bands), so they cannot disagree on where a window starts.

The steps are cut into consecutive windows of ``window`` steps (1..W, W+1..2W, ...); at the end of each window its
mean per-token KL (``adaptive_kl/raw_kl``) is compared with the two bands:

    drifting      mean > warn_above and above the previous window's mean (the KL keeps growing; before the first
                  window the previous mean is 0: every run starts at the reference)
    not learning  mean < warn_below, from the second window on (the first window starts at the reference, KL 0)

A sign is announced when a window enters it (once, not at every window it stays in) and again only after a window
outside it. 0 turns a band off. :class:`EntropyWatch` watches the entropy the same way (a collapse band), and
:class:`SamplerWatch` the sampler panel (``sampler/ess`` below ``rollout.warn_ess_below``, ``sampler/chi2_token``
above ``rollout.warn_chi2_above``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DRIFTING, NOT_LEARNING = "drifting", "not_learning"


@dataclass(frozen=True)
class Window:
    """One complete window: its steps, its mean, the previous window's mean (``start`` before the first) and its
    place (0: the first window)."""

    first_step: int
    last_step: int
    mean: float
    previous: float
    index: int


class WindowMeans:
    """Consecutive windows of ``window`` values (steps 1..W, W+1..2W, ...): ``observe`` returns the :class:`Window`
    a value completes, else None. ``start`` is the mean before the first window (0: the KL at the reference)."""

    def __init__(self, window: int, start: float = 0.0):
        self.window = max(1, int(window))
        self.values: list[float] = []
        self.previous = float(start)
        self.last_end = 0
        self.done = 0

    def observe(self, step: int, value: float) -> Window | None:
        self.values.append(float(value))
        if len(self.values) < self.window:
            return None
        mean = sum(self.values) / len(self.values)
        done = Window(step - len(self.values) + 1, step, mean, self.previous, self.done)
        self.values, self.last_end, self.previous, self.done = [], step, mean, self.done + 1
        return done

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "previous": self.previous, "last_end": self.last_end, "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = [float(v) for v in state["values"]]
        self.previous, self.last_end = float(state["previous"]), int(state["last_end"])
        self.done = int(state.get("done", 1 if self.last_end else 0))


def kl_signs(window: Window, warn_above: float, warn_below: float) -> list[str]:
    """The bands (DRIFTING, NOT_LEARNING) a window of the KL lies in (module docstring)."""
    signs = []
    if warn_above > 0 and window.mean > warn_above and window.mean > window.previous:
        signs.append(DRIFTING)
    if warn_below > 0 and window.mean < warn_below and window.index > 0:
        signs.append(NOT_LEARNING)
    return signs


class KLWatch:
    def __init__(self, warn_above: float, warn_below: float, window: int):
        self.warn_above, self.warn_below = warn_above, warn_below
        self.windows = WindowMeans(window)
        self._active: set[str] = set()

    @property
    def window(self) -> int:
        return self.windows.window

    @property
    def enabled(self) -> bool:
        return self.warn_above > 0 or self.warn_below > 0

    def observe(self, step: int, kl: float | None) -> list[str]:
        """Record the step's KL; at a window's end return the lines of the signs that begin there."""
        if not self.enabled or kl is None or not math.isfinite(kl):
            return []
        window = self.windows.observe(step, kl)
        if window is None:
            return []
        mean, first, previous = window.mean, window.first_step, window.previous
        texts = {
            DRIFTING: (f"KL warning at step {step}: the KL is {mean:.4g} per token (mean of steps {first}-{step}) "
                       f"and rising (previous window {previous:.4g}), above kl.warn_above {self.warn_above:g}: "
                       f"the policy is drifting from the reference; raise kl.coef (kl.target with an adaptive "
                       f"kl.controller) or lower optim.lr"),
            NOT_LEARNING: (f"KL warning at step {step}: the KL is {mean:.4g} per token (mean of steps "
                           f"{first}-{step}), below kl.warn_below {self.warn_below:g}: the policy is barely "
                           f"moving from the reference (not learning); check train/reward_std (no spread, "
                           f"no signal), raise optim.lr, or lower kl.coef")}
        signs = kl_signs(window, self.warn_above, self.warn_below)
        new = [texts[name] for name in signs if name not in self._active]
        self._active = set(signs)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows.state_dict(), "active": sorted(self._active)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        if "windows" in state:
            self.windows.load_state_dict(state["windows"])
        else:  # a checkpoint of an earlier release: values, previous_mean (None before the first window)
            previous = state.get("previous_mean")
            self.windows.load_state_dict({"values": state.get("values", []), "previous": previous or 0.0,
                                          "last_end": 0, "done": int(state.get("windows_done", 0))})
        self._active = set(state.get("active", []))


COLLAPSING = "collapsing"


class EntropyWatch:
    """The entropy's warning sign (``train.entropy_warn_below``, ``train.entropy_warn_window``), on the KL bands'
    windows: a window whose mean per-token entropy (the ``entropy`` metric) is below the threshold announces
    that the policy is collapsing, once on entering the band and again only after a window outside it. 0: off."""

    def __init__(self, warn_below: float, window: int):
        self.warn_below = warn_below
        self.windows = WindowMeans(window)
        self._active = False

    @property
    def window(self) -> int:
        return self.windows.window

    @property
    def enabled(self) -> bool:
        return self.warn_below > 0

    def observe(self, step: int, entropy: float | None) -> list[str]:
        """Record the step's entropy; at a window's end return the line of a collapse that begins there."""
        if not self.enabled or entropy is None or not math.isfinite(entropy):
            return []
        window = self.windows.observe(step, entropy)
        if window is None:
            return []
        collapsing = window.mean < self.warn_below
        new = collapsing and not self._active
        self._active = collapsing
        if not new:
            return []
        return [f"entropy warning at step {step}: the entropy is {window.mean:.4g} nats per token (mean of steps "
                f"{window.first_step}-{step}), below train.entropy_warn_below {self.warn_below:g}: the policy is "
                f"collapsing onto few answers; see entropy/p10 and train/reward_std, add an entropy bonus "
                f"(loss.entropy_coef, or loss.entropy_controller adaptive), raise kl.coef or lower optim.lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows.state_dict(), "active": self._active}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        if "windows" in state:
            self.windows.load_state_dict(state["windows"])
        else:  # a checkpoint of an earlier release
            self.windows.values = [float(v) for v in state.get("values", [])]
        self._active = bool(state.get("active", False))


class SamplerWatch:
    """The sampler's warning sign on the KL bands' windows: a window whose mean normalised effective sample size
    (``sampler/ess``) is below ``ess_below`` or whose mean per-token chi-square (``sampler/chi2_token``) is above
    ``chi2_above`` announces that the sampler has drifted from the trainer, once on entering and again only after a
    window outside. A step without the panel (no sampler log-probs) is not counted. 0 turns a band off."""

    def __init__(self, ess_below: float, chi2_above: float, window: int):
        self.ess_below, self.chi2_above = ess_below, chi2_above
        self.ess, self.chi2 = WindowMeans(window, start=1.0), WindowMeans(window)
        self._active = False

    @property
    def enabled(self) -> bool:
        return self.ess_below > 0 or self.chi2_above > 0

    def observe(self, step: int, ess: float | None, chi2: float | None) -> list[str]:
        """Record the step's panel; at a window's end return the line of a drift that begins there."""
        if not self.enabled or ess is None or chi2 is None or not (math.isfinite(ess) and math.isfinite(chi2)):
            return []
        ess_window, chi2_window = self.ess.observe(step, ess), self.chi2.observe(step, chi2)
        if ess_window is None or chi2_window is None:
            return []
        seen = []
        if self.ess_below > 0 and ess_window.mean < self.ess_below:
            seen.append(f"sampler/ess {ess_window.mean:.4g} below rollout.warn_ess_below {self.ess_below:g}")
        if self.chi2_above > 0 and chi2_window.mean > self.chi2_above:
            seen.append(f"sampler/chi2_token {chi2_window.mean:.4g} above rollout.warn_chi2_above "
                        f"{self.chi2_above:g}")
        new = bool(seen) and not self._active
        self._active = bool(seen)
        if not new:
            return []
        return [f"sampler warning at step {step}: {' and '.join(seen)} (mean of steps {ess_window.first_step}-{step}): "
                f"the sampler's distribution has drifted from the trainer's, so the samples stand for another "
                f"policy; check the sampler's dtype and kernels against the trainer's (sampler/logp_diff_max, "
                f"sampler/ratio_p99), or weigh and reject the drifted samples with rollout.sampler_correction "
                f"sequence_truncate or rollout.divergence_mask seq_mean_k1 (docs/kl_guide.md)"]

    def state_dict(self) -> dict[str, Any]:
        return {"ess": self.ess.state_dict(), "chi2": self.chi2.state_dict(), "active": self._active}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.ess.load_state_dict(state["ess"])
        self.chi2.load_state_dict(state["chi2"])
        self._active = bool(state.get("active", False))
