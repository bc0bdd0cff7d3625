"""Built-in reward functions, registered by name.

Every reward function has the signature ``fn(prompts, completions, **columns) -> list[float]``: the batch's
prompts and completions, row-aligned with one list per dataset column, returning one float per completion.
Built-ins take ``**_`` so that they ignore the columns they do not use.

    exact_match    1.0 if completion.strip() == str(answer).strip() else 0.0
    numeric_match  1.0 if the completion's number equals the answer's within a relative tolerance
    format         1.0 if re.search(pattern, completion, re.DOTALL) else 0.0 (pattern from the reward's kwargs)
    math_verify    1.0 if Hugging Face's math-verify finds the completion's answer equal to the reference's
                   (LaTeX, \\boxed{}, fractions, equivalent expressions and sets); needs pip install "klgrpo[math]"
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import time
from typing import Any

from klgrpo.math.registry import Registry

#: name -> reward function; ``load_reward_function`` looks names up here first.
BUILTIN_REWARDS: Registry = Registry("built-in reward function")

#: Default relative tolerance of ``numeric_match``: |pred - gold| <= rel_tol * max(|pred|, |gold|).
DEFAULT_REL_TOL = 1e-6

# A decimal number: thousands separated by commas (1,234,567.5), plain digits (1234.5) or a leading dot (.5).
# A minus sign counts only when it does not follow a word character or a closing bracket, so "3-5" reads
# as 3 and 5 rather than 3 and -5; the Unicode minus sign counts too.
_NUMBER = r"(?:(?<![\w)\]])[-\u2212])?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_FRACTION = rf"(?:(?<![\w)\]])[-\u2212])?\\[dt]?frac\s*\{{\s*({_NUMBER})\s*\}}\s*\{{\s*({_NUMBER})\s*\}}"
_TOKEN = re.compile(rf"{_FRACTION}|({_NUMBER})")
# LaTeX spacing that may separate thousands or wrap a number: 1{,}000, 1\,000, 1\!000, $42$.
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\$")


def _number_value(text: str) -> float:
    return float(text.replace(",", "").replace("\u2212", "-"))


def numbers_in(text: str) -> list[float]:
    """Every number in ``text`` in order: decimals with optional thousands commas, and \\frac{a}{b}."""
    text = _LATEX_NOISE.sub("", text.replace("{,}", ","))
    values = []
    for match in _TOKEN.finditer(text):
        numerator, denominator, plain = match.groups()
        if plain is not None:
            values.append(_number_value(plain))
            continue
        den = _number_value(denominator)
        if den != 0:
            sign = -1.0 if match.group(0).lstrip()[0] in "-\u2212" else 1.0
            values.append(sign * _number_value(numerator) / den)
    return values


def boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces included."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]  # unclosed: everything after the brace


def extract_completion_number(completion: str) -> float | None:
    """The completion's answer: the last number in its last \\boxed{...} if it has one, else its last number."""
    boxed = boxed_content(completion)
    values = numbers_in(completion if boxed is None else boxed)
    return values[-1] if values else None


def extract_answer_number(answer: Any) -> float | None:
    """The reference answer's number: a number as is; in text, the first number after the last "####"
    (GSM8K), else the last number in its last \\boxed{...}, else its last number."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    text = str(answer)
    if "####" in text:
        values = numbers_in(text.rsplit("####", 1)[1])
        return values[0] if values else None
    boxed = boxed_content(text)
    values = numbers_in(text if boxed is None else boxed)
    return values[-1] if values else None


def _check_column(name: str, values: Any, completions: list) -> None:
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise ValueError(f"column {name!r} must hold one value per completion ({len(completions)}), got {got}")


@BUILTIN_REWARDS.register("exact_match")
def exact_match(prompts: list, completions: list[str], answer: list, **_: Any) -> list[float]:
    """1.0 where the stripped completion equals the stripped ``str(answer)``, else 0.0."""
    _check_column("answer", answer, completions)
    rewards = []
    for i, (completion, gold) in enumerate(zip(completions, answer)):
        if gold is None:
            raise ValueError(f"the answer at index {i} is missing (None)")
        rewards.append(1.0 if completion.strip() == str(gold).strip() else 0.0)
    return rewards


@BUILTIN_REWARDS.register("numeric_match")
def numeric_match(prompts: list, completions: list[str], answer: list, rel_tol: float = DEFAULT_REL_TOL,
                  **_: Any) -> list[float]:
    """1.0 where the completion's number equals the answer's, |pred - gold| <= rel_tol * max(|pred|, |gold|).

    The completion's number is the last one in its last \\boxed{...}, or its last number when nothing is
    boxed; a completion without a number scores 0.0. The answer's number is the first after "####" when the
    answer has one (GSM8K's "... #### 42"), else as for the completion. Commas in numbers ("1,234") and
    \\frac{a}{b} are read; "a/b" is read as two numbers.
    """
    _check_column("answer", answer, completions)
    rewards = []
    for i, (completion, gold) in enumerate(zip(completions, answer)):
        gold_value = extract_answer_number(gold) if gold is not None else None
        if gold_value is None:
            raise ValueError(f"the answer at index {i} ({gold!r}) contains no number")
        pred = extract_completion_number(completion)
        ok = pred is not None and math.isclose(pred, gold_value, rel_tol=rel_tol, abs_tol=0.0)
        rewards.append(1.0 if ok else 0.0)
    return rewards


@BUILTIN_REWARDS.register("format")
def format_match(prompts: list, completions: list[str], pattern: str, **_: Any) -> list[float]:
    """1.0 where ``re.search(pattern, completion, re.DOTALL)`` finds a match, else 0.0."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a regular expression string, got a {type(pattern).__name__}")
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression ({e})") from None
    return [1.0 if regex.search(completion) else 0.0 for completion in completions]


class TimedScores(list):
    """A reward function's values (a list, one per completion) with ``timed_out``: per completion, whether its
    check ran out of time and scored 0.0. The reward computer logs their share as reward_timeouts/<function>."""

    def __init__(self, values, timed_out):
        super().__init__(values)
        self.timed_out = [bool(t) for t in timed_out]


def score_within_budget(n: int, score_one, step_budget_s: float, per_item_s: int,
                        clock=time.monotonic) -> TimedScores:
    """``score_one(i, limit_s)`` for i in range(n), each given at most ``per_item_s`` whole seconds and all of
    them together ``step_budget_s``: once the budget is spent the rest score 0.0 unchecked. A row counts as
    timed out when it was skipped or its call took its whole limit (the checker's alarm ended it)."""
    deadline = clock() + step_budget_s
    values, timed_out = [], []
    for i in range(n):
        remaining = deadline - clock()
        if remaining < 1.0:  # the checker's alarm counts whole seconds
            values.append(0.0)
            timed_out.append(True)
            continue
        limit = max(1, min(per_item_s, int(remaining)))
        start = clock()
        values.append(score_one(i, limit))
        timed_out.append(clock() - start >= limit)
    return TimedScores(values, timed_out)


#: The loggers of math-verify and the LaTeX parser under it: silenced around its calls, whose timeouts it logs
#: with the whole text (a million-character completion is a million-character line, once per parse and pair).
MATH_VERIFY_LOGGERS = ("math_verify", "latex2sympy2_extended")


@contextlib.contextmanager
def quiet_math_verify():
    """math-verify's own log lines (its "Timeout during parsing: <text>", "Timeout during comparison") held back
    while the block runs: a row it cannot check is klgrpo's one line (RewardComputer) and reward_timeouts, not
    the library's repeated output."""
    names = [name for name in list(logging.root.manager.loggerDict)
             if name.split(".")[0] in MATH_VERIFY_LOGGERS] + list(MATH_VERIFY_LOGGERS)
    loggers = [logging.getLogger(name) for name in dict.fromkeys(names)]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, was in zip(loggers, before):
            logger.disabled = was


def verify_within(gold: list, completion: str, limit: int, parse, verify, clock=time.monotonic) -> float:
    """1.0 where math-verify finds ``completion``'s answer equal to one of ``gold``'s, all of it (the parse and
    every gold x answer comparison, each of which math-verify would time on its own) within ``limit`` seconds,
    rounded up to math-verify's whole-second alarm: under ``limit`` + 1 s in all. A row that ran out of it took
    ``limit`` seconds or more (what score_within_budget counts as timed out)."""
    deadline = clock() + limit
    target = parse(completion, parsing_timeout=limit)
    for g, t in itertools.product(gold, target):
        left = deadline - clock()
        if left <= 0:  # no time left for another comparison
            return 0.0
        if verify(g, t, timeout_seconds=math.ceil(left)):
            return 1.0
    return 0.0


@BUILTIN_REWARDS.register("math_verify")
def math_verify_match(prompts: list, completions: list[str], answer: list, step_budget_s: float = 60.0,
                      timeout_s: int = 5, **_: Any) -> list[float]:
    """1.0 where math-verify's ``verify(parse(answer), parse(completion))`` holds, else 0.0 (the check open-r1's
    and TRL's accuracy rewards use).

    ``parse`` extracts the final answer (the last \\boxed{...}, a $...$ expression or a plain number) and
    ``verify`` compares symbolically: 2/4 = \\frac{1}{2} = 0.5, (x+1)^2 = x^2+2x+1, \\{2,1\\} = \\{1,2\\}. The
    reference answer may be plain LaTeX without $ ("x^2+2x+1") or GSM8K's "... #### 42" (the text after the
    last "####"). A completion with no parseable answer scores 0.0; a reference without one is an error.

    Time is bounded: each completion's parse and comparisons together get ``timeout_s`` seconds (math-verify's
    own alarm), the whole batch ``step_budget_s`` (the reward's kwargs); a completion not checked in time (a
    50-deep power tower, a million-character answer) scores 0.0 and is counted in reward_timeouts/math_verify,
    said once per run in one warning line; math-verify's own log lines are silenced."""
    from math_verify import parse, verify

    _check_column("answer", answer, completions)
    start = time.monotonic()
    golds, parsed = [], {}
    with quiet_math_verify():
        for i, gold in enumerate(answer):  # each distinct answer parsed once (a group repeats it G times), timed
            text = str(gold).rsplit("####", 1)[-1].strip() if gold is not None else ""
            if text not in parsed:
                parsed[text] = (parse(text, parsing_timeout=timeout_s)
                                or parse(f"${text}$", parsing_timeout=timeout_s))
            if not parsed[text]:
                raise ValueError(f"the answer at index {i} ({str(gold)[:60]!r}) holds no expression math-verify can "
                                 f"read within timeout_s={timeout_s} s")
            golds.append(parsed[text])

        def score(i: int, limit: int) -> float:
            return verify_within(golds[i], completions[i], limit, parse, verify)

        left = step_budget_s - (time.monotonic() - start)  # the answers' parsing counts against the step's budget
        return score_within_budget(len(completions), score, left, timeout_s)


#: The package a built-in needs beyond klgrpo's own dependencies (checked when the reward is loaded).
math_verify_match.requires_package = ("math_verify", "klgrpo[math]")
