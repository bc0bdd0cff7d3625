"""docs/design.md against the code: the data path of one step, as the doc draws it, is the order in which the
trainer calls those functions (recorded while a step runs), and the doc's paths exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from klgrpo.run.metrics import MetricsLogger
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import step as step_module
from tests.helpers.configs import make_config, quiet

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
#: One arrow of the data path: "--name-->  value  room/file.py  function(...)".
ARROW = re.compile(r"^\s+--([A-Za-z ]+?)-*>\s+.*?\s(\S+\.py|\S+/)\s+([A-Za-z_][A-Za-z_.]*)")


def data_path() -> list[tuple[str, str, str]]:
    """(phase, file or folder, function) of every arrow in the doc's data path, in the doc's order."""
    text = DESIGN.read_text()
    block = text[text.index("## The data path of one step"):text.index("## The rooms")]
    first = re.search(r"^\s+prompts \(dataset rows\)\s+(\S+)\s+([A-Za-z_.]+)", block, re.M)
    rows = [("prompts", first.group(1), first.group(2))]
    rows += [m.groups() for m in map(ARROW.match, block.splitlines()) if m]
    return rows


#: The doc's function name -> how to watch it on a built trainer: (object getter, attribute).
WATCH = {
    "PromptSampler.next_indices": (lambda t: t.grpo_step.prompt_order, "next_indices"),
    "generate_groups": (lambda t: step_module, "generate_groups"),
    "RewardComputer": (lambda t: t.grpo_step, "rewards"),
    "Reference.logprobs": (lambda t: t.reference, "logprobs"),
    "kl_penalized_scores": (lambda t: step_module, "kl_penalized_scores"),
    "group_advantages": (lambda t: step_module, "group_advantages"),
    "completion_logprobs": (lambda t: step_module, "completion_logprobs"),
    "grpo_objective": (lambda t: step_module, "grpo_objective"),
    "Engine.backward": (lambda t: t.engine, "backward"),
    "step_metrics": (lambda t: step_module, "step_metrics"),
    "KLController.observe": (lambda t: t.controller, "observe"),
    "MetricsLogger.log": (lambda t: MetricsLogger, "log"),
}


def is_in_order(expected: list[str], calls: list[str]) -> bool:
    """Whether ``expected`` occurs in ``calls`` in this order (other calls, and repeats, in between)."""
    remaining = iter(calls)
    return all(any(name == call for call in remaining) for name in expected)


@pytest.fixture(scope="module")
def recorded_calls(tiny_model_dir, addition_file, tmp_path_factory):
    """The watched functions, in the order one training step (with the KL in the score) calls them."""
    cfg = make_config(tiny_model_dir, addition_file, tmp_path_factory.mktemp("design") / "run", train={"steps": 1},
                      kl={"coef": 0.1, "estimator": "k1", "placement": "reward", "reward_mode": "sequence_score"})
    trainer = GRPOTrainer(cfg, log=quiet)
    calls: list[str] = []
    patch = pytest.MonkeyPatch()

    def watched(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    for name, (owner, attribute) in WATCH.items():
        target = owner(trainer)
        patch.setattr(target, attribute, watched(name, getattr(target, attribute)))
    try:
        trainer.train()
    finally:
        patch.undo()
    return calls


def test_the_step_calls_the_functions_in_the_order_of_the_doc(recorded_calls):
    functions = [function for _, _, function in data_path()]
    unwatched = [f for f in functions if f not in WATCH]
    assert unwatched == [], f"add {unwatched} to WATCH, or name a function the trainer calls in docs/design.md"
    assert functions[:3] == ["PromptSampler.next_indices", "generate_groups", "RewardComputer"]
    assert is_in_order(functions, recorded_calls), (functions, recorded_calls)


def test_a_swapped_phase_is_caught(recorded_calls):
    """The planted error of the old doc: advantages before the reference."""
    functions = [function for _, _, function in data_path()]
    ref, adv = functions.index("Reference.logprobs"), functions.index("group_advantages")
    swapped = list(functions)
    swapped[ref], swapped[adv] = swapped[adv], swapped[ref]
    assert not is_in_order(swapped, recorded_calls)


def test_the_phases_are_named_as_the_trainer_names_them():
    phases = [phase for phase, _, _ in data_path()]
    assert phases == ["prompts", "rollout", "rewards", "reference", "sequence KL", "advantages", "forward",
                      "objective", "update", "metrics", "controller", "log"]


def test_the_files_the_doc_names_exist():
    missing = [where for _, where, _ in data_path() if not (ROOT / "klgrpo" / where).exists()]
    assert missing == []
