"""Score a batch of completions with weighted reward functions.

    total_i = sum_f weight_f * r_f(prompts, completions, **columns)_i

Each function sees the whole batch once. A function receives every dataset column unless its signature
neither names the column nor takes ``**kwargs`` (so a custom ``def reward(prompts, completions, answer)``
works on a dataset with more columns). A column the function requires but the batch lacks, an exception,
a result of the wrong length and a None, NaN, infinite or non-numeric value each raise a ``RewardError``
naming the function and, where there is one, the row.
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from klgrpo.core.rewards.loading import _describe, display_name, load_reward_function
from klgrpo.core.rewards.model import RewardModel, RewardModelContext
from klgrpo.core.rewards.specs import RESERVED_ARGUMENTS, RewardModelSpec, RewardSpec
from klgrpo.errors import ConfigError, RewardError, warn

#: Largest |reward| accepted: the group variance of float32 rewards of this size stays far from overflow
#: (float32 squares overflow above ~1.8e19) and keeps 7 significant digits of the centred rewards.
REWARD_LIMIT = 1e12
#: The key of RewardResult.per_function that holds a function's timed-out rows (1.0: not checked in time).
TIMED_OUT_SUFFIX = "#timed_out"


@dataclass
class RewardResult:
    """total: float32 [N], the weighted sum; per_function: display name -> unweighted float32 [N], and for a
    function that reports the rows whose check ran out of time (``TimedScores``), "<name>#timed_out" -> 0/1 [N];
    model_seconds: the wall seconds the reward models took (part of the call's time); None without one."""

    total: Tensor
    per_function: dict[str, Tensor]
    weights: dict[str, float]
    model_seconds: float | None = None


@dataclass
class _Bound:
    spec: RewardSpec | RewardModelSpec
    fn: Callable
    display: str
    accepts_any: bool  # has **kwargs
    accepted: frozenset[str]  # keyword-passable parameter names after the first two
    required: tuple[str, ...]  # of those, the ones without a default


class RewardComputer:
    """Calls every reward function on a batch and forms the weighted total (module docstring).

    A reward model's entry is checked when the computer is built (its config, not its weights); ``load_models``
    loads the weights once, on the policy's device (a call before it loads them on the CPU in float32).
    """

    def __init__(self, specs: list[RewardSpec | RewardModelSpec], trust_remote_code: bool = False):
        specs = [RewardSpec.parse(s) for s in specs]
        if not specs:
            raise ConfigError("rewards.functions is empty; add at least one reward function, e.g. exact_match")
        self._bound: list[_Bound] = []
        taken: set[str] = set()
        for spec in specs:
            if isinstance(spec, RewardModelSpec):
                fn = RewardModel(spec, trust_remote_code)
                display = fn.display
            else:
                fn = load_reward_function(spec.name)
                display = display_name(spec.name)
            base, k = display, 2
            while display in taken:  # the same function twice (e.g. two format patterns): format, format_2
                display, k = f"{base}_{k}", k + 1
            taken.add(display)
            self._bound.append(_bind(spec, fn, display))
        self._timeouts_said: set[str] = set()  # the functions whose timed-out rows were said (once each)

    @property
    def names(self) -> list[str]:
        """Display names, in spec order (the keys of ``RewardResult.per_function``)."""
        return [b.display for b in self._bound]

    @property
    def reward_models(self) -> list[RewardModel]:
        return [b.fn for b in self._bound if isinstance(b.fn, RewardModel)]

    def reward_model_bytes(self, context: RewardModelContext) -> int:
        """Bytes the reward models' weights take once loaded in ``context`` (counted without loading them)."""
        return sum(m.weight_bytes(context) for m in self.reward_models)

    def load_models(self, context: RewardModelContext) -> None:
        """Load every reward model's weights and tokenizer (once; a loaded one stays as it is)."""
        for model in self.reward_models:
            model.load(context)

    def __call__(self, prompts: list, completions: list[str], columns: dict[str, list] | None = None) -> RewardResult:
        columns = dict(columns or {})
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(f"the reward functions got {len(prompts)} prompts for {n} completions; repeat each "
                              f"prompt once per completion")
        for col, values in columns.items():
            if col in RESERVED_ARGUMENTS:
                raise RewardError(f"a dataset column is named {col!r}, which the reward functions take as their "
                                  f"own argument; rename it with data.columns")
            if not isinstance(values, (list, tuple)) or len(values) != n:
                got = f"{len(values)} values" if hasattr(values, "__len__") else f"a {type(values).__name__}"
                raise RewardError(f"column {col!r} has {got} for {n} completions; repeat each prompt's column "
                                  f"values once per completion")
        per_function: dict[str, Tensor] = {}
        total = torch.zeros(n, dtype=torch.float64)
        model_seconds = 0.0 if self.reward_models else None
        for bound in self._bound:
            t0 = time.perf_counter()
            values, timed_out = _call(bound, prompts, completions, columns)
            if isinstance(bound.fn, RewardModel):
                model_seconds += time.perf_counter() - t0
            per_function[bound.display] = torch.tensor(values, dtype=torch.float32)
            if timed_out is not None:  # a function that bounds its time: which rows ran out of it
                per_function[bound.display + TIMED_OUT_SUFFIX] = torch.tensor(timed_out, dtype=torch.float32)
                self._say_timeouts(bound.display, timed_out)
            total += bound.spec.weight * torch.tensor(values, dtype=torch.float64)
        if n and float(total.abs().max()) > REWARD_LIMIT:
            i = int(total.abs().argmax())
            raise RewardError(f"the weighted total reward is {float(total[i]):g} at index {i}; it must lie within "
                              f"+-{REWARD_LIMIT:g}: lower the rewards.functions weights or rescale the rewards")
        weights = {b.display: b.spec.weight for b in self._bound}
        return RewardResult(total=total.to(torch.float32), per_function=per_function, weights=weights,
                            model_seconds=model_seconds)


    def _say_timeouts(self, display: str, timed_out: list[bool]) -> None:
        """The first batch in which ``display`` could not check a row in time: one KLGRPOWarning line (once per
        computer, i.e. per run); the later ones are counted in reward_timeouts/<function> only."""
        if not any(timed_out) or display in self._timeouts_said:
            return
        self._timeouts_said.add(display)
        warn(f"reward {display}: {sum(timed_out)} of {len(timed_out)} completions could not be checked in time "
             f"and scored 0.0 (math_verify: its timeout_s per completion and step_budget_s per step, reward "
             f"kwargs); from now on they are counted in reward_timeouts/{display}, not said again")


def _bind(spec: RewardSpec | RewardModelSpec, fn: Callable, display: str) -> _Bound:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return _Bound(spec, fn, display, accepts_any=True, accepted=frozenset(), required=())
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = [p for p in params if p not in positional[:2]
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = frozenset(p.name for p in rest)
    required = tuple(p.name for p in rest if p.default is p.empty)
    if not accepts_any:
        unknown = sorted(set(spec.kwargs) - accepted)
        if unknown:
            raise RewardError(f"reward function {display!r} does not accept the kwargs {', '.join(unknown)} "
                              f"(its arguments after prompts, completions: {', '.join(sorted(accepted)) or 'none'}); "
                              f"remove them from the reward's kwargs")
    return _Bound(spec, fn, display, accepts_any, accepted, required)


def _call(bound: _Bound, prompts: list, completions: list[str],
          columns: dict[str, list]) -> tuple[list[float], list | None]:
    """The function's scores, and its timed-out flags where it reports them (else None)."""
    clash = sorted(set(columns) & set(bound.spec.kwargs))
    if clash:
        raise RewardError(f"reward function {bound.display!r}: {', '.join(clash)} is both a dataset column and a "
                          f"kwarg of the reward; rename the column with data.columns or drop the kwarg")
    available = {**columns, **bound.spec.kwargs}
    missing = [name for name in bound.required if name not in available]
    if missing:
        have = ", ".join(sorted(columns)) or "none"
        raise RewardError(f"reward function {bound.display!r} needs the argument {missing[0]!r}, which is neither a "
                          f"dataset column (columns: {have}) nor in its kwargs; map a column to it with data.columns "
                          f"(e.g. {{{missing[0]}: <dataset column>}}) or add it to the reward's kwargs")
    if not bound.accepts_any:
        available = {k: v for k, v in available.items() if k in bound.accepted}
    if isinstance(bound.fn, RewardModel):  # klgrpo's own: its errors are already one line about the model
        return _as_floats(bound.fn(prompts, completions), len(completions), bound.display, completions), None
    try:
        result = bound.fn(prompts, completions, **available)
    except SystemExit as e:  # would end the run with its exit code (0: "success") and no message
        raise RewardError(f"reward function {bound.display!r} called sys.exit({e.code!r}); a reward must return "
                          f"scores (raise an exception to stop the run)") from None
    except Exception as e:
        where = _user_frame(e, bound.fn)
        raise RewardError(f"reward function {bound.display!r} raised {_describe(e)}"
                          + (f" (at {where})" if where else "")) from e
    timed_out = getattr(result, "timed_out", None)
    if timed_out is not None and len(timed_out) != len(completions):
        raise RewardError(f"reward function {bound.display!r} returned {len(timed_out)} timed_out flags for "
                          f"{len(completions)} completions")
    return _as_floats(result, len(completions), bound.display, completions), timed_out


def _user_frame(error: BaseException, fn: Callable) -> str:
    """``file:line in function`` of the line that raised, as the user wrote it: the deepest frame in the reward
    function's own file, else the deepest frame outside klgrpo and installed packages; "" when there is none."""
    import os
    import traceback

    frames = traceback.extract_tb(error.__traceback__)[1:]  # [0] is _call itself
    try:
        own_file = os.path.realpath(inspect.getsourcefile(inspect.unwrap(fn)) or "")
    except TypeError:  # a builtin or C callable
        own_file = ""
    klgrpo_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    own = [f for f in frames if own_file and os.path.realpath(f.filename) == own_file]
    other = [f for f in frames if not os.path.realpath(f.filename).startswith(klgrpo_dir + os.sep)
             and "site-packages" not in f.filename and not f.filename.startswith("<")]
    chosen = (own or other or [None])[-1]
    return f"{chosen.filename}:{chosen.lineno} in {chosen.name}" if chosen is not None else ""


def _as_floats(result: Any, n: int, display: str, completions: list[str]) -> list[float]:
    def returned(what: str) -> RewardError:
        return RewardError(f"reward function {display!r} returned {what}")

    expected = f"a list of {n} numbers, one per completion"
    if result is None:
        raise returned(f"None; it must return {expected} (is a return statement missing?)")
    if hasattr(result, "ndim") and hasattr(result, "tolist"):  # torch or numpy array
        if result.ndim != 1:
            raise returned(f"an array of shape {tuple(result.shape)}; it must return {expected}")
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        raise returned(f"a {type(result).__name__}; it must return {expected}")
    if len(result) != n:
        raise returned(f"{len(result)} values, expected {n} (one per completion)")
    values = []
    for i, value in enumerate(result):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool):
            value = float(value)
        where = f"at index {i} (completion {_preview(completions[i])})"
        if value is None:
            raise returned(f"None {where}; return a number for every completion (0.0 for a wrong one)")
        if not isinstance(value, numbers.Real):
            raise returned(f"a {type(value).__name__} ({_preview(value)}) {where}; return a number for every "
                           f"completion")
        value = float(value)
        if not math.isfinite(value):
            raise returned(f"{value} {where}; return a finite number for every completion")
        if abs(value) > REWARD_LIMIT:
            raise returned(f"{value:g} {where}; rewards must lie within +-{REWARD_LIMIT:g} (larger ones overflow "
                           f"the advantages' float32 variance): rescale the reward")
        values.append(value)
    return values


def _preview(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
