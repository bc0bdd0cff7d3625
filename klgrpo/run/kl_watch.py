"""The KL's warning signs, watched over windows of steps (``kl.warn_above``, ``kl.warn_below``, ``kl.warn_window``).

The steps are cut into consecutive windows of ``window`` steps (1..W, W+1..2W, ...); at the end of each window its
mean per-token KL (``adaptive_kl/raw_kl``) is compared with the two bands:

    drifting      mean > warn_above and above the previous window's mean (the KL keeps growing)
    not learning  mean < warn_below, from the second window on (every run starts at the reference, KL = 0)

A sign is announced when a window enters it (once, not at every window it stays in) and again only after a window
outside it. 0 turns a band off. :class:`EntropyWatch` watches the entropy the same way (a collapse band), and
:class:`SamplerWatch` the sampler panel (``sampler/ess`` below ``rollout.warn_ess_below``, ``sampler/chi2_token``
above ``rollout.warn_chi2_above``).
"""

from __future__ import annotations

import math
from typing import Any

DRIFTING, NOT_LEARNING = "drifting", "not_learning"


class KLWatch:
    def __init__(self, warn_above: float, warn_below: float, window: int):
        self.warn_above, self.warn_below, self.window = warn_above, warn_below, max(1, int(window))
        self._values: list[float] = []
        self._previous_mean: float | None = None
        self._windows_done = 0
        self._active: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.warn_above > 0 or self.warn_below > 0

    def observe(self, step: int, kl: float | None) -> list[str]:
        """Record the step's KL; at a window's end return the lines of the signs that begin there."""
        if not self.enabled or kl is None or not math.isfinite(kl):
            return []
        self._values.append(float(kl))
        if len(self._values) < self.window:
            return []
        mean = sum(self._values) / len(self._values)
        first, previous = step - len(self._values) + 1, self._previous_mean
        self._values, self._previous_mean = [], mean
        self._windows_done += 1
        signs = {}
        if self.warn_above > 0 and mean > self.warn_above and previous is not None and mean > previous:
            signs[DRIFTING] = (f"KL warning at step {step}: the KL is {mean:.4g} per token "
                               f"(mean of steps {first}-{step}) "
                               f"and rising (previous window {previous:.4g}), above kl.warn_above {self.warn_above:g}: "
                               f"the policy is drifting from the reference; raise kl.coef (kl.target with an adaptive "
                               f"kl.controller) or lower optim.lr")
        if self.warn_below > 0 and mean < self.warn_below and self._windows_done > 1:
            signs[NOT_LEARNING] = (f"KL warning at step {step}: the KL is {mean:.4g} per token (mean of steps "
                                   f"{first}-{step}), below kl.warn_below {self.warn_below:g}: the policy is barely "
                                   f"moving from the reference (not learning); check train/reward_std (no spread, "
                                   f"no signal), raise optim.lr, or lower kl.coef")
        new = [text for name, text in signs.items() if name not in self._active]
        self._active = set(signs)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self._values), "previous_mean": self._previous_mean,
                "windows_done": self._windows_done, "active": sorted(self._active)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self._values = [float(v) for v in state.get("values", [])]
        self._previous_mean = state.get("previous_mean")
        self._windows_done = int(state.get("windows_done", 0))
        self._active = set(state.get("active", []))


COLLAPSING = "collapsing"


class EntropyWatch:
    """The entropy's warning sign (``train.entropy_warn_below``, ``train.entropy_warn_window``), on the KL bands'
    windows: a window whose mean per-token entropy (the ``entropy`` metric) is below the threshold announces
    that the policy is collapsing, once on entering the band and again only after a window outside it. 0: off."""

    def __init__(self, warn_below: float, window: int):
        self.warn_below, self.window = warn_below, max(1, int(window))
        self._values: list[float] = []
        self._active = False

    @property
    def enabled(self) -> bool:
        return self.warn_below > 0

    def observe(self, step: int, entropy: float | None) -> list[str]:
        """Record the step's entropy; at a window's end return the line of a collapse that begins there."""
        if not self.enabled or entropy is None or not math.isfinite(entropy):
            return []
        self._values.append(float(entropy))
        if len(self._values) < self.window:
            return []
        mean, first = sum(self._values) / len(self._values), step - len(self._values) + 1
        self._values = []
        collapsing = mean < self.warn_below
        new = collapsing and not self._active
        self._active = collapsing
        if not new:
            return []
        return [f"entropy warning at step {step}: the entropy is {mean:.4g} nats per token (mean of steps "
                f"{first}-{step}), below train.entropy_warn_below {self.warn_below:g}: the policy is collapsing "
                f"onto few answers; see entropy/p10 and train/reward_std, add an entropy bonus (loss.entropy_coef, "
                f"or loss.entropy_controller adaptive), raise kl.coef or lower optim.lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self._values), "active": self._active}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self._values = [float(v) for v in state.get("values", [])]
        self._active = bool(state.get("active", False))


DRIFTED = "drifted"


class SamplerWatch:
    """The sampler's warning sign on the KL bands' windows: a window whose mean normalised effective sample size
    (``sampler/ess``) is below ``ess_below`` or whose mean per-token chi-square (``sampler/chi2_token``) is above
    ``chi2_above`` announces that the sampler has drifted from the trainer, once on entering and again only after a
    window outside. A step without the panel (no sampler log-probs) is not counted. 0 turns a band off."""

    def __init__(self, ess_below: float, chi2_above: float, window: int):
        self.ess_below, self.chi2_above, self.window = ess_below, chi2_above, max(1, int(window))
        self._ess: list[float] = []
        self._chi2: list[float] = []
        self._active = False

    @property
    def enabled(self) -> bool:
        return self.ess_below > 0 or self.chi2_above > 0

    def observe(self, step: int, ess: float | None, chi2: float | None) -> list[str]:
        """Record the step's panel; at a window's end return the line of a drift that begins there."""
        if not self.enabled or ess is None or chi2 is None or not (math.isfinite(ess) and math.isfinite(chi2)):
            return []
        self._ess.append(float(ess))
        self._chi2.append(float(chi2))
        if len(self._ess) < self.window:
            return []
        ess_mean, chi2_mean = sum(self._ess) / len(self._ess), sum(self._chi2) / len(self._chi2)
        first = step - len(self._ess) + 1
        self._ess, self._chi2 = [], []
        seen = []
        if self.ess_below > 0 and ess_mean < self.ess_below:
            seen.append(f"sampler/ess {ess_mean:.4g} below rollout.warn_ess_below {self.ess_below:g}")
        if self.chi2_above > 0 and chi2_mean > self.chi2_above:
            seen.append(f"sampler/chi2_token {chi2_mean:.4g} above rollout.warn_chi2_above {self.chi2_above:g}")
        new = bool(seen) and not self._active
        self._active = bool(seen)
        if not new:
            return []
        return [f"sampler warning at step {step}: {' and '.join(seen)} (mean of steps {first}-{step}): the sampler's "
                f"distribution has drifted from the trainer's, so the samples stand for another policy; check the "
                f"sampler's dtype and kernels against the trainer's (sampler/logp_diff_max, sampler/ratio_p99), or "
                f"weigh and reject the drifted samples with rollout.sampler_correction sequence_truncate or "
                f"rollout.divergence_mask seq_mean_k1 (docs/kl_guide.md)"]

    def state_dict(self) -> dict[str, Any]:
        return {"ess": list(self._ess), "chi2": list(self._chi2), "active": self._active}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self._ess = [float(v) for v in state.get("ess", [])]
        self._chi2 = [float(v) for v in state.get("chi2", [])]
        self._active = bool(state.get("active", False))
