"""What a run's summary needs from its steps, in constant memory: the last row and running sums.

The trainer used to keep every step's metrics row in a list (a few KB per step, growing for the whole run);
the summary reads only the last row and the mean step time.
"""

from __future__ import annotations

from klgrpo.train.metric_names import TIME_STEP


class StepTally:
    """``add(row)`` per step; ``last`` is the latest row, ``mean(name)`` the mean of a metric over the steps."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def append(self, row: dict[str, float]) -> None:
        self.last = dict(row)
        for name in (TIME_STEP,):
            if name in row:
                self._sums[name] = self._sums.get(name, 0.0) + float(row[name])
                self._counts[name] = self._counts.get(name, 0) + 1

    add = append

    def __len__(self) -> int:
        return max(self._counts.values(), default=0)

    def mean(self, name: str, digits: int | None = None) -> float | None:
        if not self._counts.get(name):
            return None
        value = self._sums[name] / self._counts[name]
        return round(value, digits) if digits is not None else value
