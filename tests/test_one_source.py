"""One source for each name: config choices come from the registries, one EOS rule, one exact_match, one
summary file name, and the replay settings are checked in one place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import klgrpo.core.rollout as rollout
import klgrpo.run.evaluation as evaluation
from klgrpo.apps.args import parse_args
from klgrpo.backends.hf import DTYPE_NAMES
from klgrpo.backends.samplers import AUTO, LEGACY_GENERATE_CACHES, SAMPLERS
from klgrpo.backends.sampling import OLD_LOGPROBS
from klgrpo.config.schema import LR_SCHEDULES, RUNAWAY_ACTIONS, WEIGHT_TRANSFERS, GRPOConfig, all_field_paths
from klgrpo.core.forward import FORWARDS
from klgrpo.core.rewards import BUILTIN_REWARDS, exact_match
from klgrpo.errors import ConfigError
from klgrpo.math.advantages import ADVANTAGE_SCALES, KL_REWARD_MODES
from klgrpo.math.aggregation import AGGREGATIONS
from klgrpo.math.full_kl import FULL_KL_ESTIMATORS
from klgrpo.math.kl import ESTIMATORS, PLACEMENTS, Estimator, k2
from klgrpo.math.kl_control import CONTROLLERS, ENTROPY_CONTROLLERS, KL_MEASURES
from klgrpo.math.kl_shaping import SHAPINGS
from klgrpo.math.objective import KL_MASKED_TOKENS
from klgrpo.math.policy_loss import IS_CORRECTIONS, POLICY_LOSSES
from klgrpo.math.sampler_correction import SAMPLER_CORRECTIONS
from klgrpo.math.truncation import TRUNCATIONS

PACKAGE = Path(__file__).resolve().parents[1] / "klgrpo"

#: config field -> the names it must accept, read from where the code that uses the field looks them up.
SOURCES = {
    "rollout.truncation": TRUNCATIONS,
    "model.dtype": DTYPE_NAMES,
    "model.forward": FORWARDS,
    "kl.estimator": (*ESTIMATORS, *FULL_KL_ESTIMATORS),
    "kl.placement": PLACEMENTS,
    "kl.reward_mode": KL_REWARD_MODES,
    "kl.masked_tokens": KL_MASKED_TOKENS,
    "kl.is_correction": IS_CORRECTIONS,
    "kl.controller": CONTROLLERS,
    "kl.kl_measure": KL_MEASURES,
    "kl.shaping": SHAPINGS,
    "kl.replay.estimator": ("full", *ESTIMATORS),
    "loss.aggregation": AGGREGATIONS,
    "loss.advantage_scale": ADVANTAGE_SCALES,
    "loss.policy_loss": POLICY_LOSSES,
    "loss.entropy_controller": ENTROPY_CONTROLLERS,
    "rollout.sampler": (AUTO, *SAMPLERS),
    "rollout.generate_cache": ("", *LEGACY_GENERATE_CACHES),
    "rollout.sampler_correction": SAMPLER_CORRECTIONS,
    "rollout.old_logprobs": OLD_LOGPROBS,
    "optim.schedule": LR_SCHEDULES,
    "kl.on_runaway": RUNAWAY_ACTIONS,
    "rollout.vllm.weight_transfer": WEIGHT_TRANSFERS,
}


def _set(path: str, value) -> dict:
    tree: dict = {}
    node = tree
    *groups, leaf = path.split(".")
    for g in groups:
        node = node.setdefault(g, {})
    node[leaf] = value
    return tree


def _get(cfg: GRPOConfig, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_field_with_choices_has_a_source():
    with_choices = {p for p, f in all_field_paths() if f.metadata.get("choices")}
    assert with_choices == set(SOURCES)


@pytest.mark.parametrize("path", sorted(SOURCES))
def test_every_registered_name_is_accepted_by_the_config_and_the_cli(path):
    names = list(SOURCES[path])
    assert names
    for name in names:
        assert _get(GRPOConfig.from_dict(_set(path, name)), path) == name
        cfg, _ = parse_args([f"--{path}", name])
        assert _get(cfg, path) == name
    assert set(next(f for p, f in all_field_paths() if p == path).metadata["choices"]) == set(names)


def test_unknown_name_is_refused_with_the_field_and_the_valid_names():
    with pytest.raises(ConfigError, match=r"kl\.estimator .*'k9'.*k1, k2, k3, k1_st, k3_st"):
        parse_args(["--kl.estimator", "k9"])


def test_a_newly_registered_estimator_is_accepted_without_touching_the_config():
    ESTIMATORS.register("k2_copy", Estimator(name="k2_copy", fn=k2, value_unbiased=False, nonnegative=True,
                                             uses_clamp=False, gradients={}, score_factor=lambda l: l))
    try:
        cfg, _ = parse_args(["--kl.estimator", "k2_copy", "--kl.replay.estimator", "k2_copy"])
        assert (cfg.kl.estimator, cfg.kl.replay.estimator) == ("k2_copy", "k2_copy")
    finally:
        ESTIMATORS._items.pop("k2_copy")
    with pytest.raises(ConfigError, match="kl.estimator"):
        parse_args(["--kl.estimator", "k2_copy"])


class _Tok:
    def __init__(self, eos):
        self.eos_token_id = eos


class _Model:
    def __init__(self, eos):
        self.generation_config = type("GC", (), {"eos_token_id": eos})()


@pytest.mark.parametrize("model_eos,tok_eos,expected", [
    (None, 2, [2]),            # the tokenizer's alone
    (7, 2, [7, 2]),            # both end a completion (a chat model's end-of-turn and the tokenizer's eos)
    ([7, 9], 9, [7, 9]),       # a list, the tokenizer's already in it: no repeat
    ([], None, []),
])
def test_one_eos_rule(model_eos, tok_eos, expected):
    assert rollout.eos_token_ids(_Model(model_eos), _Tok(tok_eos)) == expected
    # greedy evaluation stops at the same ids as the rollout: the same function, not a copy
    assert evaluation.eos_token_ids is rollout.eos_token_ids


def test_rollout_and_evaluation_stop_at_every_eos_id():
    """A completion [5, 3, 9] with eos ids {3, 9}: the mask ends at the first EOS (3), evaluation cuts before it."""
    ids = torch.tensor([[5, 3, 9], [5, 5, 5]])
    mask, truncated = rollout.completion_mask_from_ids(ids, [9, 3])
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert truncated.tolist() == [False, True]
    assert evaluation._cut_at([5, 3, 9], [9, 3]) == [5]


def test_one_exact_match():
    assert evaluation.exact_match is exact_match is BUILTIN_REWARDS["exact_match"]
    assert exact_match(["p", "p"], [" 7\n", "8"], answer=["7", " 9"]) == [1.0, 0.0]


def test_one_summary_file_name():
    """Only klgrpo/store/run_folder.py spells the summary file's name; everything else imports SUMMARY_FILE."""
    spelled = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if '"summary.json"' in p.read_text()]
    assert spelled == ["store/run_folder.py"]


def test_replay_settings_checked_once_with_the_same_message(tmp_path):
    from klgrpo.train.replay import _check_settings

    cfg = GRPOConfig.from_dict({"kl": {"replay": {"coef": 0.1, "source": "", "num_prompts": 4}}})
    with pytest.raises(ConfigError) as from_config:
        cfg.validate()
    with pytest.raises(ConfigError) as from_replay:
        _check_settings(cfg, reference=object())
    assert str(from_config.value) == str(from_replay.value)
    assert "kl.replay.source" in str(from_config.value)


def test_no_file_cites_anything_outside_the_repository():
    """Code, tests, benchmarks and docs point at docs/ in the repository, never at notes kept elsewhere."""
    import re

    root = PACKAGE.parent
    # Spelled in pieces so that this file does not match itself.
    outside = re.compile("|".join([r"KL_" + "MATH", r"\bDESIGN" + r"\.md", r"\bNOTES_" + "[A-Z]", r"\bSTYLE" + r"\.md",
                                   r"\b[Ii]ssue" + r" #?[0-9]"]))
    files = [root / "README.md", root / "CONTRIBUTING.md"]
    for folder in ("klgrpo", "tests", "benchmarks", "docs", "examples"):
        files += [p for p in (root / folder).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".toml")]
    hits = [f"{p.relative_to(root)}:{i}" for p in files if p.is_file()
            for i, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not hits, hits
