"""Reward functions: built-ins (hand-computed values), loading by name, the weighted total and every error."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from klgrpo.core.rewards import (
    BUILTIN_REWARDS,
    RewardComputer,
    RewardSpec,
    exact_match,
    extract_answer_number,
    extract_completion_number,
    format_match,
    load_reward_function,
    numeric_match,
)
from klgrpo.errors import ConfigError, KLGRPOError, RewardError

# A batch every built-in can score (format's pattern comes from the kwargs).
_BATCH = dict(prompts=["p1", "p2"], completions=["42", "<a>7</a>"], answer=["42", "#### 8"])
_KWARGS = {"format": {"pattern": r"<a>.*</a>"}}
_EXPECTED = {"exact_match": [1.0, 0.0], "numeric_match": [1.0, 0.0], "format": [0.0, 1.0],
             "math_verify": [1.0, 0.0]}


@pytest.mark.parametrize("name", BUILTIN_REWARDS.names())
def test_every_builtin_loads_runs_and_ignores_extra_columns(name):
    package = getattr(BUILTIN_REWARDS[name], "requires_package", (None,))[0]
    if package:  # an optional extra's reward: skipped where its package is absent
        pytest.importorskip(package)
    fn = load_reward_function(name)
    assert fn is BUILTIN_REWARDS[name]
    values = fn(**_BATCH, unused_column=[1, 2], **_KWARGS.get(name, {}))
    assert values == _EXPECTED[name]
    result = RewardComputer([RewardSpec(name, kwargs=_KWARGS.get(name, {}))])(
        _BATCH["prompts"], _BATCH["completions"], {"answer": _BATCH["answer"], "unused_column": [1, 2]})
    assert result.per_function[name].tolist() == _EXPECTED[name]


def test_builtin_registry_is_complete():
    assert set(BUILTIN_REWARDS.names()) == set(_EXPECTED)


# ---------------------------------------------------------------------------------------------- built-ins

def test_exact_match_strips_and_stringifies():
    completions = [" 42\n", "42.0", "forty-two", "7"]
    assert exact_match(None, completions, answer=["42", "42", "42", 7]) == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is 42.", "#### 42", 1.0),
    ("3 + 4 = 7", "She has 3 apples and gets 4 more: 3+4=7\n#### 7", 1.0),  # number after ####, not the last
    ("total 1,234", "#### 1,234", 1.0),                                     # commas on both sides
    ("\\boxed{1,234}", "1234", 1.0),
    ("first 12, \\boxed{7}, then 9", "7", 1.0),       # the boxed number wins over the last number 9
    ("\\boxed{a} then \\boxed{x = 5}", "5", 1.0),     # the last box, its last number
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{-\\dfrac{3}{4}}", "-0.75", 1.0),
    ("answer: -5", "#### -5", 1.0),
    ("range 3-5", "5", 1.0),                          # 3-5 reads as 3 and 5, not -5
    ("3.0000001", "3", 1.0),                          # |diff| / 3 = 3.3e-8 <= 1e-6
    ("3.0001", "3", 0.0),                             # 3.3e-5 > 1e-6
    ("1000001", "1000000", 1.0),                      # 1 / 1e6 = 1e-6 <= 1e-6
    ("1000002", "1000000", 0.0),                      # 2e-6 > 1e-6
    ("no number here", "5", 0.0),
    ("0", "#### 0", 1.0),
    ("the result is 12", 12, 1.0),                    # a numeric answer is used as is
    ("12", 12.5, 0.0),
    ("so $\\boxed{1\\,000}$", "1000", 1.0),           # LaTeX thin space as thousands separator
])
def test_numeric_match_cases(completion, answer, expected):
    assert numeric_match(["p"], [completion], [answer]) == [expected]


def test_numeric_match_rel_tol_is_a_kwarg():
    # |3.01 - 3| / 3.01 = 3.3e-3: outside the default 1e-6, inside 1e-2.
    computer = RewardComputer([RewardSpec("numeric_match"), RewardSpec("numeric_match", kwargs={"rel_tol": 1e-2})])
    result = computer(["p"], ["3.01"], {"answer": ["3"]})
    assert result.per_function == {"numeric_match": torch.tensor([0.0]), "numeric_match_2": torch.tensor([1.0])}


def test_number_extraction_helpers():
    assert extract_completion_number("nothing") is None
    assert extract_completion_number("x 2, y 1,000,000.5") == 1000000.5
    assert extract_answer_number("#### nothing") is None
    assert extract_answer_number("\\boxed{\\frac{3}{2}} and 9") == 1.5


def test_format_match_uses_dotall_search():
    pattern = r"^<think>.*</think>\s*<answer>.*</answer>$"
    completions = ["<think>a\nb</think>\n<answer>4</answer>", "<answer>4</answer>",
                   "x <think></think><answer></answer>"]
    assert format_match(None, completions, pattern=pattern) == [1.0, 0.0, 0.0]
    assert format_match(None, ["foo bar"], pattern="bar") == [1.0]  # search, not match


# ---------------------------------------------------------------------------------------------- computer

def test_weighted_total_and_per_function_values():
    specs = [RewardSpec("exact_match", weight=0.5), RewardSpec("numeric_match", weight=2.0),
             RewardSpec("format", weight=-1.0, kwargs={"pattern": r"\\boxed"})]
    completions = ["42", "\\boxed{42}", "41"]
    result = RewardComputer(specs)(["a", "b", "c"], completions, {"answer": ["42", "42", "42"]})
    # exact [1, 0, 0], numeric [1, 1, 0], format [0, 1, 0]
    # total = 0.5*exact + 2*numeric - format = [2.5, 1.0, 0.0]
    assert result.total.dtype == torch.float32 and result.total.shape == (3,)
    assert result.total.tolist() == [2.5, 1.0, 0.0]
    assert list(result.per_function) == ["exact_match", "numeric_match", "format"]
    assert result.per_function["format"].tolist() == [0.0, 1.0, 0.0]
    assert result.weights == {"exact_match": 0.5, "numeric_match": 2.0, "format": -1.0}


def test_same_function_twice_gets_unique_keys():
    computer = RewardComputer([RewardSpec("format", kwargs={"pattern": "a"}),
                               RewardSpec("format", kwargs={"pattern": "b"})])
    assert computer.names == ["format", "format_2"]
    result = computer(["p", "p"], ["a", "b"], {})
    assert result.per_function["format"].tolist() == [1.0, 0.0]
    assert result.per_function["format_2"].tolist() == [0.0, 1.0]
    assert result.total.tolist() == [1.0, 1.0]


def test_spec_parse_and_validation():
    assert RewardSpec.parse("exact_match") == RewardSpec("exact_match", 1.0, {})
    assert RewardSpec.parse({"name": "format", "weight": 2, "kwargs": {"pattern": "x"}}) == RewardSpec(
        "format", 2.0, {"pattern": "x"})
    for bad in ({"weight": 1.0}, {"name": "f", "wieght": 1.0}, 3):
        with pytest.raises(ConfigError, match="reward function entry"):
            RewardSpec.parse(bad)
    for weight in (float("nan"), float("inf"), "1", None):
        with pytest.raises(ConfigError, match="weight must be a finite number"):
            RewardSpec("exact_match", weight)
    with pytest.raises(ConfigError, match="'completions' cannot be a kwarg"):
        RewardSpec("format", kwargs={"completions": 1})
    with pytest.raises(ConfigError, match="rewards.functions is empty"):
        RewardComputer([])


# ---------------------------------------------------------------------------------------------- custom functions

CUSTOM = textwrap.dedent("""
    import torch

    def length_reward(prompts, completions, answer):
        # no **kwargs: must not receive the dataset's other columns
        return [float(len(c)) + (1.0 if c == a else 0.0) for c, a in zip(completions, answer)]

    def sees_everything(prompts, completions, **columns):
        return [float(len(columns)) + b for b in columns["bonus"]]

    def with_default(prompts, completions, scale=3.0):
        return [scale] * len(completions)

    def as_tuple(prompts, completions, **_):
        return tuple(True for _ in completions)

    def as_numpy(prompts, completions, **_):
        import numpy
        return numpy.arange(len(completions), dtype=numpy.float64)

    def as_tensor(prompts, completions, **_):
        return torch.full((len(completions),), 0.25)

    def as_scalar_tensors(prompts, completions, **_):
        return [torch.tensor(1.5) for _ in completions]

    def boom(prompts, completions, **_):
        raise ZeroDivisionError("division by zero in my reward")

    def wrong_length(prompts, completions, **_):
        return [1.0]

    def returns_none(prompts, completions, **_):
        pass

    def none_at_1(prompts, completions, **_):
        return [1.0, None, 1.0]

    def nan_at_2(prompts, completions, **_):
        return [1.0, 1.0, float("nan")]

    def inf_at_0(prompts, completions, **_):
        return [float("inf"), 1.0, 1.0]

    def string_at_1(prompts, completions, **_):
        return [1.0, "0.5", 1.0]

    def two_d(prompts, completions, **_):
        return torch.zeros(len(completions), 2)

    def a_dict(prompts, completions, **_):
        return {"r": 1.0}

    def one_arg(completions):
        return [0.0] * len(completions)

    NOT_A_FUNCTION = 3
""")


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(CUSTOM)
    return path


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    name = "klgrpo_test_user_rewards"
    (tmp_path / f"{name}.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


COMPLETIONS = ["ab", "abc", "x"]
COLUMNS = {"answer": ["ab", "no", "no"], "bonus": [0.5, 0.5, 0.5]}


def test_custom_file_function_gets_only_the_columns_it_accepts(reward_file, tmp_path, monkeypatch):
    computer = RewardComputer([RewardSpec(f"{reward_file}:length_reward")])
    # len(c) + (c == answer): [2 + 1, 3 + 0, 1 + 0]
    assert computer(["p"] * 3, COMPLETIONS, COLUMNS).total.tolist() == [3.0, 3.0, 1.0]
    assert computer.names == ["length_reward"]
    monkeypatch.chdir(tmp_path)  # a relative path starts at the working directory
    assert load_reward_function("my_rewards.py:length_reward").__name__ == "length_reward"


def test_custom_module_function_with_kwargs_sees_all_columns_and_spec_kwargs(reward_module):
    computer = RewardComputer([
        RewardSpec(f"{reward_module}:sees_everything"),
        RewardSpec(f"{reward_module}:with_default"),
        RewardSpec(f"{reward_module}:with_default", weight=2.0, kwargs={"scale": 0.5}),
    ])
    result = computer(["p"] * 3, COMPLETIONS, COLUMNS)
    # sees_everything: 2 columns + bonus 0.5 = 2.5; with_default: 3.0; then 2 * 0.5 = 1.0 -> 6.5
    assert result.per_function["sees_everything"].tolist() == [2.5] * 3
    assert result.per_function["with_default_2"].tolist() == [0.5] * 3
    assert result.total.tolist() == [6.5] * 3


@pytest.mark.parametrize("fn, expected", [
    ("as_tuple", [1.0, 1.0, 1.0]),
    ("as_numpy", [0.0, 1.0, 2.0]),
    ("as_tensor", [0.25, 0.25, 0.25]),
    ("as_scalar_tensors", [1.5, 1.5, 1.5]),
])
def test_accepted_return_types(reward_module, fn, expected):
    result = RewardComputer([RewardSpec(f"{reward_module}:{fn}")])(["p"] * 3, COMPLETIONS, COLUMNS)
    assert result.per_function[fn].tolist() == expected


def test_module_in_working_directory_found_without_it_on_sys_path(tmp_path, monkeypatch):
    name = "klgrpo_test_cwd_rewards"
    (tmp_path / f"{name}.py").write_text("def one(prompts, completions):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    # As under a console script: neither "" nor the working directory on sys.path (restored afterwards).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert load_reward_function(f"{name}:one")(["p"], ["c"]) == [1.0]
    finally:
        sys.modules.pop(name, None)


# ---------------------------------------------------------------------------------------------- errors

def _load_error(name) -> str:
    with pytest.raises(RewardError) as info:
        load_reward_function(name)
    return str(info.value)


def test_error_unknown_builtin_lists_the_builtins():
    message = _load_error("exact_macth")
    assert "'exact_macth'" in message
    assert "exact_match, numeric_match, format" in message and "module.path:function" in message


def test_error_unimportable_module():
    message = _load_error("klgrpo_no_such_module_xyz:fn")
    assert "no module named 'klgrpo_no_such_module_xyz'" in message and "PYTHONPATH" in message


def test_error_module_raising_on_import(tmp_path, monkeypatch):
    (tmp_path / "klgrpo_test_broken.py").write_text("import klgrpo_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = _load_error("klgrpo_test_broken:fn")
    assert "importing klgrpo_test_broken raised ModuleNotFoundError" in message
    assert "klgrpo_missing_dependency_xyz" in message
    sys.modules.pop("klgrpo_test_broken", None)


def test_error_missing_function_lists_functions(reward_module, reward_file):
    message = _load_error(f"{reward_module}:lenght_reward")
    assert "has no attribute 'lenght_reward'" in message and "length_reward" in message and "boom" in message
    message = _load_error(f"{reward_file}:nope")
    assert "has no attribute 'nope'" in message and "length_reward" in message


def test_error_file_not_found_or_broken(tmp_path):
    message = _load_error(f"{tmp_path}/missing.py:fn")
    assert "missing.py not found" in message
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    message = _load_error(f"{broken}:f")
    assert "importing" in message and "broken.py raised SyntaxError" in message


def test_error_not_callable_or_bad_signature(reward_module):
    assert "is of type int, not a function" in _load_error(f"{reward_module}:NOT_A_FUNCTION")
    assert "must accept (prompts, completions, **columns)" in _load_error(f"{reward_module}:one_arg")


def _call_error(spec_name, kwargs=None, columns=COLUMNS, prompts=("p",) * 3, completions=COMPLETIONS) -> str:
    computer = RewardComputer([RewardSpec(spec_name, kwargs=kwargs or {})])
    with pytest.raises(RewardError) as info:
        computer(list(prompts), list(completions), columns)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("fn, fragments", [
    ("boom", ["'boom' raised ZeroDivisionError: division by zero in my reward"]),
    ("wrong_length", ["'wrong_length' returned 1 values, expected 3"]),
    ("returns_none", ["'returns_none' returned None", "return statement missing"]),
    ("none_at_1", ["'none_at_1' returned None at index 1 (completion 'abc')"]),
    ("nan_at_2", ["'nan_at_2' returned nan at index 2 (completion 'x')", "finite"]),
    ("inf_at_0", ["'inf_at_0' returned inf at index 0"]),
    ("string_at_1", ["'string_at_1' returned a str ('0.5') at index 1"]),
    ("two_d", ["'two_d' returned an array of shape (3, 2)"]),
    ("a_dict", ["'a_dict' returned a dict", "a list of 3 numbers"]),
])
def test_error_bad_results_name_function_and_row(reward_module, fn, fragments):
    message = _call_error(f"{reward_module}:{fn}")
    for fragment in fragments:
        assert fragment in message, message


def test_error_missing_required_column_names_it_and_the_fix():
    message = _call_error("exact_match", columns={"solution": ["a", "b", "c"]})
    assert "'exact_match' needs the argument 'answer'" in message
    assert "columns: solution" in message and "data.columns" in message
    message = _call_error("format", columns={})
    assert "'format' needs the argument 'pattern'" in message and "kwargs" in message


def test_error_builtin_rows_with_bad_answers():
    message = _call_error("numeric_match", columns={"answer": ["1", "none here", "3"]})
    assert "'numeric_match' raised ValueError" in message and "index 1 ('none here') contains no number" in message
    message = _call_error("exact_match", columns={"answer": ["1", None, "3"]})
    assert "index 1 is missing" in message
    assert "not a valid regular expression" in _call_error("format", kwargs={"pattern": "("}, columns={})


def test_error_batch_shape_mismatches():
    assert "got 2 prompts for 3 completions" in _call_error("exact_match", prompts=("p", "p"))
    message = _call_error("exact_match", columns={"answer": ["a"]})
    assert "column 'answer' has 1 values for 3 completions" in message
    message = _call_error("exact_match", columns={"answer": ["a"] * 3, "completions": ["a"] * 3})
    assert "'completions'" in message and "data.columns" in message


def test_error_column_and_kwarg_clash():
    message = _call_error("format", kwargs={"pattern": "a"}, columns={"pattern": ["a"] * 3})
    assert "pattern is both a dataset column and a kwarg" in message


def test_error_kwarg_the_function_does_not_accept(reward_module):
    with pytest.raises(RewardError, match=r"'length_reward' does not accept the kwargs scale \(its arguments .*answer"):
        RewardComputer([RewardSpec(f"{reward_module}:length_reward", kwargs={"scale": 1})])


def test_errors_are_user_facing():
    assert issubclass(RewardError, KLGRPOError)


def test_error_inside_a_reward_file_names_the_users_file_and_line(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("import json\n\n\ndef parse(text):\n    return json.loads(text)['score']\n\n\n"
                    "def reward(prompts, completions, **columns):\n    return [parse(c) for c in completions]\n")
    message = _call_error(f"{path}:reward", completions=('{"score": 1}', "not json", "{}"))
    # json.loads raises deep inside the standard library; the line shown is the user's call of it (line 5)
    assert "'reward' raised JSONDecodeError" in message
    assert message.endswith(f"(at {path}:5 in parse)"), message


# -------------------------------------------------------------------------------------------- math_verify
@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("so the probability is $0.5$", "\\frac{1}{2}", 1.0),                       # decimal vs fraction
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),                            # unreduced fraction
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "$\\sqrt{2}/2$", 1.0),                  # equivalent forms
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),                                     # expanded polynomial, no $
    ("\\boxed{x^2+2x}", "x^2+2x+1", 0.0),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),                                # sets ignore order
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("the total is \\boxed{72}", "Natalia sold 48/2 = 24 clips in May... #### 72", 1.0),   # GSM8K's answer
    ("I think 41", "42", 0.0),
    ("\\boxed{0.333}", "1/3", 0.0),                                             # a rounded value is not equal
    ("no answer here", "42", 0.0),
])
def test_math_verify_reads_latex_answers_and_equivalent_forms(completion, answer, expected):
    pytest.importorskip("math_verify")
    fn = load_reward_function("math_verify")
    assert fn(["p"], [completion], answer=[answer]) == [expected]


def test_math_verify_needs_its_package_and_a_readable_answer(monkeypatch):
    import importlib.util

    from klgrpo.core.rewards import loading

    real = importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda n, *a: None if n == "math_verify" else real(n, *a))
    with pytest.raises(RewardError, match=r"needs the math-verify package: pip install \"klgrpo\[math\]\""):
        load_reward_function("math_verify")
    monkeypatch.undo()
    pytest.importorskip("math_verify")
    with pytest.raises(ValueError, match="the answer at index 0 .* holds no expression"):
        BUILTIN_REWARDS["math_verify"](["p"], ["\\boxed{1}"], answer=[""])


# ------------------------------------------------------------------ time-bounded rewards (math_verify's budget)
class _FakeClock:
    """A clock that only the scorer advances: the budget's arithmetic, without sleeping."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_step_budget_bounds_the_whole_batch_and_counts_what_ran_out():
    from klgrpo.core.rewards.builtins import score_within_budget

    clock, limits = _FakeClock(), []

    def score(i, limit):  # every check runs into its limit, as a comparison that never finishes
        limits.append(limit)
        clock.now += limit
        return 1.0

    scores = score_within_budget(16, score, step_budget_s=12.0, per_item_s=5, clock=clock)
    # 5 s, 5 s, then the 2 whole seconds left; the other 13 completions are not checked at all
    assert limits == [5, 5, 2] and clock.now == 12.0
    assert list(scores) == [1.0, 1.0, 1.0] + [0.0] * 13 and scores.timed_out == [True] * 16


def test_checks_within_their_limits_are_not_counted():
    from klgrpo.core.rewards.builtins import score_within_budget

    clock = _FakeClock()

    def score(i, limit):
        clock.now += 0.5 if i != 2 else limit  # completion 2 runs into its limit
        return float(i % 2)

    scores = score_within_budget(4, score, step_budget_s=60.0, per_item_s=5, clock=clock)
    assert list(scores) == [0.0, 1.0, 0.0, 1.0] and scores.timed_out == [False, False, True, False]


def test_the_computer_reports_a_functions_timed_out_rows(tmp_path):
    from klgrpo.core.rewards import RewardComputer, RewardSpec
    from klgrpo.core.rewards.computer import TIMED_OUT_SUFFIX

    (tmp_path / "bounded.py").write_text(
        "from klgrpo.core.rewards.builtins import TimedScores\n"
        "def bounded(prompts, completions, **kw):\n"
        "    return TimedScores([1.0, 0.0, 0.0], [False, True, True])\n")
    from klgrpo.errors import KLGRPOWarning

    with pytest.warns(KLGRPOWarning, match="reward bounded: 2 of 3 completions could not be checked in time"):
        result = RewardComputer([RewardSpec(f"{tmp_path / 'bounded.py'}:bounded")])(["p"] * 3, ["a", "b", "c"])
    assert result.per_function["bounded"].tolist() == [1.0, 0.0, 0.0]
    assert result.per_function["bounded" + TIMED_OUT_SUFFIX].tolist() == [0.0, 1.0, 1.0]
    assert result.total.tolist() == [1.0, 0.0, 0.0]


# --------------------------------------------------- math_verify on an answer it cannot compare within its time
TOWER = "\\boxed{" + "^".join(["2"] * 50) + "}"  # 2^2^...^2, 50 deep: sympy's comparison never ends
HUGE = "\\boxed{" + "1+" * 500_000 + "1}"  # a million characters: the parse alone runs out of time


def test_math_verify_scores_an_uncomparable_answer_0_in_bounded_time_without_the_librarys_log(caplog, capfd):
    """Each bad row: scored 0.0, counted as timed out, in bounded time; none of math-verify's own
    "Timeout during parsing: <the whole text>" / "Timeout during comparison" lines, on a logger or stderr."""
    import logging
    import time

    pytest.importorskip("math_verify")
    fn = load_reward_function("math_verify")
    caplog.set_level(logging.DEBUG)
    started = time.monotonic()
    scores = fn(["p"] * 3, [TOWER, HUGE, "\\boxed{4}"], answer=["4"] * 3, timeout_s=1)
    took = time.monotonic() - started
    assert list(scores) == [0.0, 0.0, 1.0] and scores.timed_out == [True, True, False]
    # unbounded, the tower's comparison never ends: 12 s tells bounded apart with room for a loaded machine (the
    # limit's own arithmetic, timeout_s + 1 s per row, is checked on a fake clock below)
    assert took < 12, took
    assert [r for r in caplog.records if r.name.startswith(("math_verify", "latex2sympy2_extended"))] == []
    out, err = capfd.readouterr()
    assert "Timeout" not in out + err and "1+1+1" not in out + err
    assert not logging.getLogger("math_verify.parser").disabled  # silenced only around its calls


def test_a_rows_parse_and_comparisons_share_one_limit():
    """math-verify times the parse and each gold x answer comparison on its own; klgrpo gives them one limit."""
    from klgrpo.core.rewards.builtins import verify_within

    clock, asked = _FakeClock(), []

    def parse(text, parsing_timeout):
        clock.now += 0.4
        return ["a", "b", "c"]

    def verify(gold, target, timeout_seconds):
        asked.append(timeout_seconds)
        clock.now += timeout_seconds  # every comparison runs into its alarm
        return False

    assert verify_within(["g"], "x", 2, parse, verify, clock=clock) == 0.0
    assert asked == [2] and clock.now == pytest.approx(2.4)  # 1.6 s left, rounded up; nothing after it


def test_the_computer_says_a_functions_timeouts_once_in_one_line():
    from klgrpo.core.rewards import RewardComputer, RewardSpec
    from klgrpo.errors import KLGRPOWarning

    pytest.importorskip("math_verify")
    computer = RewardComputer([RewardSpec("math_verify", kwargs={"timeout_s": 1})])
    with pytest.warns(KLGRPOWarning) as said:
        first = computer(["p"] * 2, [TOWER, "\\boxed{4}"], {"answer": ["4", "4"]})
        computer(["p"] * 2, [TOWER, TOWER], {"answer": ["4", "4"]})  # a later batch: counted, not said
    assert first.per_function["math_verify"].tolist() == [0.0, 1.0]
    assert first.per_function["math_verify#timed_out"].tolist() == [1.0, 0.0]
    assert [str(w.message) for w in said] == [
        "reward math_verify: 1 of 2 completions could not be checked in time and scored 0.0 (math_verify: its "
        "timeout_s per completion and step_budget_s per step, reward kwargs); from now on they are counted in "
        "reward_timeouts/math_verify, not said again"]
