"""One declaration per config field: its bound, whether a resume may change it and the typed entries of its list
are read from the declaration (klgrpo/config/schema.py), so a new field is one edit there."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest

from klgrpo.config.entries import EvalSetSpec, eval_set_specs, reward_specs
from klgrpo.config.fields import group, is_resume_safe, leaves
from klgrpo.config.fields import setting as _f
from klgrpo.config.schema import GRPOConfig, TrainConfig, all_field_paths
from klgrpo.core.rewards import RewardModelSpec, RewardSpec
from klgrpo.errors import ConfigError
from klgrpo.store.run_folder import compare_configs

BASE = {"data": {"source": "x.jsonl"}, "model": {"name_or_path": "m"}}

#: (field, lowest allowed value, whether the bound itself is allowed, what the field means there): the bounds the
#: config enforced before they moved into the declarations, written out to show that none was lost or changed.
LOWER_BOUNDS = {
    "rollout.top_k": (0, True, "0 turns top-k off"), "optim.warmup_steps": (0, True, "0: no warm-up"),
    "rollout.sampler_correction_min": (0, True, ""), "rollout.sampler_correction_max": (0, True, "0: no upper bound"),
    "rollout.vllm.memory_fraction": (0, False, ""), "rollout.warn_chi2_above": (0, True, "0: off"),
    "rollout.max_staleness": (0, True, "0: generate, then update"),
    "rollout.generation_threads": (0, True, "0: half of torch's threads"),
    "optim.weight_decay": (0, True, ""), "train.save_every": (0, True, "0 saves only at the end"),
    "train.keep_checkpoints": (0, True, "0 keeps all"), "train.max_wall_seconds": (0, True, "0: no limit"),
    "train.micro_batch_size": (0, True, "0: the whole batch"), "train.torch_threads": (0, True, "0: torch's default"),
    "train.max_skipped_steps": (1, True, ""), "train.dist_timeout_s": (0, False, ""),
    "data.limit": (0, True, "0: all rows"), "loss.std_eps": (0, True, ""), "kl.target": (0, True, ""),
    "kl.horizon": (0, False, ""), "kl.dual_lr": (0, True, ""), "kl.beta_min": (0, True, ""),
    "kl.schedule_steps": (0, True, "0: never"), "kl.clip_threshold": (0, False, ""),
    "kl.dump_every": (0, True, "0: never"), "kl.warn_above": (0, True, "0: off"), "kl.warn_below": (0, True, "0: off"),
    "kl.warn_window": (1, True, ""), "kl.replay.temperature": (0, False, ""), "loss.entropy_coef_delta": (0, True, ""),
    "loss.entropy_coef_min": (0, True, ""), "loss.off_policy_mask_threshold": (0, True, "0: off"),
    "loss.sapo_temperature_pos": (0, False, ""), "loss.sapo_temperature_neg": (0, False, ""),
    "train.entropy_warn_below": (0, True, "0: off"), "train.entropy_warn_window": (1, True, ""),
    "eval.every": (0, True, "0: before and after training only"),
    "eval.max_new_tokens": (0, True, "0: rollout.max_new_tokens"), "eval.batch_size": (1, True, ""),
    "model.lora.r": (0, True, "0: no LoRA"), "model.lora.alpha": (0, False, ""),
    # the checks written out by hand in klgrpo/config/validation.py before they were declared, same bounds
    "rollout.group_size": (2, True, "GRPO's baseline is the mean of a prompt's group"),
    "rollout.prompts_per_step": (1, True, ""), "rollout.max_new_tokens": (1, True, ""),
    "rollout.temperature": (0, False, "use a small value such as 0.1 for near-greedy"),
    "train.steps": (1, True, ""), "train.num_iterations": (1, True, ""), "optim.lr": (0, False, ""),
    "optim.max_grad_norm": (0, True, "0 turns clipping off"), "loss.eps_high": (0, True, ""),
    "kl.log_ratio_clamp": (0, True, "0 turns the guard off"),
    "kl.replay.coef": (0, True, "0 turns the replay anchor off"), "kl.sync_every": (0, True, "0: never"),
    # added with its declaration: an entropy is never negative
    "loss.entropy_target": (0, True, "an entropy is never negative"),
    "kl.runaway_above": (0, False, ""), "kl.runaway_beta_factor": (1, True, ""),
    "kl.runaway_max_rollbacks": (1, True, ""),
}
#: (field, lowest, whether allowed, highest, whether allowed, what the refusal adds): the two-sided bounds that were
#: hand-written checks before (same bounds; the refusal now ends with the value given).
RANGES = {
    "rollout.top_p": (0, False, 1, True, ""), "kl.decay": (0, False, 1, True, ""),
    "kl.sync_alpha": (0, False, 1, True, ""), "optim.beta1": (0, True, 1, False, ""),
    "optim.beta2": (0, True, 1, False, ""), "model.lora.dropout": (0, True, 1, False, ""),
    "loss.eps_low": (0, True, 1, True, "the ratio's lower clip is 1 - eps_low; 1: no lower clip, as TRL's cispo"),
    "loss.top_entropy_quantile": (0, True, 1, True, "1 keeps every token"),
    # added with their declarations (klgrpo/math/policy_params.py): VESPO's Gamma shape, kept a float32 number
    "loss.vespo_k_pos": (0, True, 100.0, True, ""), "loss.vespo_k_neg": (0, True, 100.0, True, ""),
    "loss.vespo_lambda_pos": (0, True, 100.0, True, ""), "loss.vespo_lambda_neg": (0, True, 100.0, True, ""),
    # added with their declarations: a vLLM server's request timeout (a day at most) and its retries
    "rollout.vllm.server_timeout": (0, False, 86400, True, ""), "rollout.vllm.server_retries": (0, True, 20, True, ""),
    "rollout.vllm.group_port": (1, True, 65535, True, ""),
    "kl.runaway_lr_factor": (0, False, 1, True, ""),
    # added with its declaration: min-p's share of the largest probability, below 1 (1 keeps only ties)
    "rollout.min_p": (0, True, 1, False, ""),
    # added with its declaration: the sampler warning's ESS band, a share of the batch
    "rollout.warn_ess_below": (0, True, 1, True, "0: off"),
}
#: Other settings a field needs to be valid at its bound (a cross-field check would refuse it otherwise).
AT_BOUND_WITH = {"kl.log_ratio_clamp": {"kl.estimator": "k1"}}
#: The fields a resume may change, as the run folder listed them before they were declared.
RESUME_SAFE = {"train.steps", "train.save_every", "train.keep_checkpoints", "train.max_wall_seconds",
               "train.output_dir", "train.run_name", "train.torch_threads", "train.max_skipped_steps",
               "train.dist_timeout_s", "train.sharded_checkpoints", "train.compile", "kl.dump_every", "model.device",
               "model.gradient_checkpointing", "model.fast_path", "model.forward", "model.lora.save_merged",
               # added with their declarations: where the vLLM server is and how long to wait, not what it computes
               "rollout.vllm.server_url", "rollout.vllm.server_timeout", "rollout.vllm.server_retries",
               "rollout.vllm.weights_dir", "rollout.vllm.weight_transfer", "rollout.vllm.group_port"}


def test_the_declared_bounds_are_the_checked_ones():
    declared = {path: (f.metadata["low"], not f.metadata["above"], f.metadata["at_low"])
                for path, f in all_field_paths() if f.metadata.get("low") is not None and f.metadata["high"] is None}
    assert declared == LOWER_BOUNDS
    ranges = {path: (f.metadata["low"], not f.metadata["above"], f.metadata["high"], not f.metadata["below"],
                     f.metadata["at_low"]) for path, f in all_field_paths() if f.metadata.get("high") is not None}
    assert ranges == RANGES


@pytest.mark.parametrize("path", sorted(LOWER_BOUNDS))
def test_a_value_past_a_declared_bound_is_refused_in_one_line_and_the_bound_itself_as_declared(path):
    low, inclusive, meaning = LOWER_BOUNDS[path]
    kind = dict(all_field_paths())[path].type
    past = low - 1 if kind == "int" else low - 0.5
    with pytest.raises(ConfigError) as err:
        GRPOConfig.from_dict(BASE).override({path: past}).validate()
    op = ">=" if inclusive else ">"
    assert str(err.value) == f"{path} must be {op} {low}, got {past!r}" + (f" ({meaning})" if meaning else "")
    at_bound = GRPOConfig.from_dict(BASE).override({path: low, **AT_BOUND_WITH.get(path, {})})
    if inclusive:
        at_bound.validate()
    else:
        with pytest.raises(ConfigError, match=re.escape(f"{path} must be > {low}, got {low!r}")):
            at_bound.validate()


@pytest.mark.parametrize("path", sorted(RANGES))
def test_a_value_outside_a_declared_range_is_refused_in_one_line_and_its_ends_as_declared(path):
    low, low_ok, high, high_ok, note = RANGES[path]
    wanted = f"{path} must be in {'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
    step = 1 if dict(all_field_paths())[path].type == "int" else 0.5  # an int field refuses 0.5 as not an int
    for past, end, allowed in ((low - step, low, low_ok), (high + step, high, high_ok)):
        with pytest.raises(ConfigError) as err:
            GRPOConfig.from_dict(BASE).override({path: past}).validate()
        assert str(err.value) == f"{wanted}, got {past!r}" + (f" ({note})" if note else "")
        if allowed:
            GRPOConfig.from_dict(BASE).override({path: end}).validate()
        else:
            with pytest.raises(ConfigError, match=re.escape(f"{wanted}, got {float(end)!r}")):
                GRPOConfig.from_dict(BASE).override({path: end}).validate()


@pytest.mark.parametrize("dotted, message", [
    ({"kl.on_runaway": "undo"}, "kl.on_runaway in command line is 'undo'; choose one of: warn, stop, rollback"),
    ({"kl.horizon": "fast"}, "kl.horizon in command line must be a number or auto, got 'fast'"),
    ({"kl.on_runaway": "rollback", "kl.runaway_beta_factor": 1, "kl.runaway_lr_factor": 1},
     "kl.on_runaway rollback with kl.runaway_beta_factor 1 and kl.runaway_lr_factor 1 would repeat the same steps: "
     "set kl.runaway_beta_factor > 1 or kl.runaway_lr_factor < 1"),
    ({"kl.on_runaway": "stop", "kl.coef": 0, "kl.monitor": False},
     "kl.on_runaway stop watches the KL, which kl.coef 0 with kl.monitor false does not compute: set kl.monitor "
     "true or kl.on_runaway warn"),
])
def test_the_runaway_settings_and_the_auto_horizon_are_refused_in_one_line(dotted, message):
    with pytest.raises(ConfigError) as err:
        GRPOConfig.from_dict(BASE).override(dotted).validate()
    assert str(err.value) == message


def test_the_auto_horizon_is_a_word_the_number_field_takes_and_the_run_sizes():
    from klgrpo.config.terms import run_controller_params, run_horizon

    cfg = GRPOConfig.from_dict(BASE).override({"kl.controller": "adaptive", "kl.horizon": "auto", "train.steps": 20,
                                               "rollout.prompts_per_step": 4, "rollout.group_size": 8})
    cfg.validate()
    assert cfg.kl.horizon == "auto" and cfg.to_dict()["kl"]["horizon"] == "auto"
    # 20 steps: 10^(4/20) - 1 = 0.585 per update is above the 0.5 cap, so H = 0.2 x 32 / 0.5 = 12.8
    assert run_horizon(cfg) == pytest.approx(12.8, rel=1e-12)
    assert run_controller_params(cfg)["horizon"] == pytest.approx(12.8, rel=1e-12)
    # 1000 steps: 0.2 x 32 / (10^(4/1000) - 1) = 6.4 / 0.0092529 = 691.68
    assert run_horizon(cfg.override({"train.steps": 1000})) == pytest.approx(691.68, abs=0.01)


def test_only_the_declared_fields_may_be_infinite():
    infinite_ok = [path for path, f in all_field_paths() if f.metadata.get("infinite_ok")]
    assert infinite_ok == ["kl.beta_max"]
    GRPOConfig.from_dict(BASE).override({"kl.beta_max": float("inf")}).validate()
    with pytest.raises(ConfigError, match=r"^kl.horizon is inf; give it a finite number$"):
        GRPOConfig.from_dict(BASE).override({"kl.horizon": float("inf")}).validate()
    with pytest.raises(ConfigError, match=r"^kl.beta_max is NaN; give it a number$"):
        GRPOConfig.from_dict(BASE).override({"kl.beta_max": float("nan")}).validate()


def test_resume_safety_is_read_from_the_fields_and_their_groups():
    safe = {path for path, _, _ in leaves(GRPOConfig()) if is_resume_safe(GRPOConfig, path)}
    logging_and_eval = {path for path, _ in all_field_paths() if path.startswith(("logging.", "eval."))}
    assert safe == RESUME_SAFE | logging_and_eval
    assert not is_resume_safe(GRPOConfig, "kl.replay.coef") and not is_resume_safe(GRPOConfig, "train.nope")


def test_a_resume_applies_a_declared_change_and_refuses_another():
    old = GRPOConfig.from_dict(BASE)
    new = old.override({"train.steps": 7, "logging.project": "p", "eval.sets": [{"name": "a", "source": "a.jsonl"}]})
    assert compare_configs(old.to_dict(), new.to_dict(), "run") == [
        "resuming with eval.sets [] -> [{'name': 'a', 'source': 'a.jsonl'}]", "resuming with logging.project "
        "'klgrpo' -> 'p'", "resuming with train.steps 100 -> 7"]
    with pytest.raises(ConfigError, match=r"would not continue the run in run: kl.coef 0.04 -> 0.1;"):
        compare_configs(old.to_dict(), old.override({"kl.coef": 0.1}).to_dict(), "run")


@dataclass
class TrainWithTokenBudget(TrainConfig):
    max_tokens: int = _f(0, "stop after this many completion tokens", low=0, at_low="0: no limit", resume_safe=True)


@dataclass
class ConfigWithTokenBudget(GRPOConfig):
    train: TrainWithTokenBudget = group(TrainWithTokenBudget)


def test_a_new_field_is_checked_and_resumed_from_its_declaration_alone():
    cfg = ConfigWithTokenBudget.from_dict(BASE)
    cfg.train.max_tokens = -3
    with pytest.raises(ConfigError, match=re.escape("train.max_tokens must be >= 0, got -3 (0: no limit)")):
        cfg.validate()
    cfg.train.max_tokens = 0
    cfg.validate()
    assert is_resume_safe(ConfigWithTokenBudget, "train.max_tokens")
    assert not is_resume_safe(ConfigWithTokenBudget, "train.seed")


# ---------------------------------------------------------------------------------------------- eval.sets
def test_an_eval_set_entry_is_typed_with_its_defaults_and_the_yaml_stays_as_written():
    entries = [{"name": "gsm8k", "source": "t.jsonl"},
               {"name": 2024, "source": "u.jsonl", "prompt_column": "question", "limit": 5, "reward": "numeric_match"}]
    cfg = GRPOConfig.from_dict({**BASE, "eval": {"sets": entries}})
    cfg.validate()
    assert eval_set_specs(cfg.eval.sets) == [
        EvalSetSpec("gsm8k", "t.jsonl", "prompt", "answer", "test", 0, "exact_match"),
        EvalSetSpec("2024", "u.jsonl", "question", "answer", "test", 5, "numeric_match")]
    assert cfg.to_dict()["eval"]["sets"] == entries
    assert eval_set_specs([{"name": "a", "source": "a.jsonl", "limit": None}])[0].limit == 0  # YAML's `limit:`


@pytest.mark.parametrize("entries, message", [
    ([{"source": "x.jsonl"}], "eval.sets[0] needs a name and a source, e.g. {name: gsm8k, source: test.jsonl}"),
    (["gsm8k"], "eval.sets[0] needs a name and a source"),
    ([{"name": "a", "source": "a.jsonl", "promt_column": "q"}],
     "eval.sets[0]: unknown key 'promt_column'; an evaluation set has name, source, prompt_column, answer_column, "
     "split, limit, reward"),
    ([{"name": "a", "source": "a.jsonl"}, {"name": "b", "source": "b.jsonl", "limit": -1}],
     "eval.sets[1].limit must be an integer >= 0 (0: all rows), got -1"),
    ([{"name": "a", "source": "a.jsonl", "limit": 2.5}], "eval.sets[0].limit must be an integer >= 0 (0: all rows), "
                                                         "got 2.5"),
    ([{"name": "a", "source": "a.jsonl", "answer_column": None}],
     "eval.sets[0].answer_column must be a non-empty text, got None"),
    ([{"name": "a", "source": "a.jsonl", "reward": ["exact_match"]}],
     "eval.sets[0].reward must be a non-empty text, got ['exact_match']"),
    ([{"name": "a", "source": "a.jsonl"}, {"name": "a", "source": "b.jsonl"}],
     "eval.sets[1].name 'a' is eval.sets[0]'s too; give each set its own name (its metric is eval/<name>)"),
])
def test_a_bad_eval_set_entry_is_refused_by_the_config_check_in_one_line(entries, message):
    cfg = GRPOConfig.from_dict({**BASE, "eval": {"sets": entries}})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- rewards.functions
def test_reward_entries_are_typed_by_the_reward_specs():
    specs = reward_specs(["exact_match", {"name": "format", "weight": 0.5, "kwargs": {"pattern": "x"}},
                         {"model": "rm", "batch_size": 4}])
    assert specs == [RewardSpec("exact_match"), RewardSpec("format", 0.5, {"pattern": "x"}),
                     RewardModelSpec("rm", batch_size=4)]


@pytest.mark.parametrize("entry, message", [
    ({"name": "exact_match", "weight": float("inf")}, "rewards.functions[1].weight must be a finite number, got inf"),
    ({"name": "exact_match", "weight": "2"}, "rewards.functions[1].weight must be a finite number, got '2'"),
    ({"name": "format", "kwargs": [1]}, "rewards.functions[1].kwargs must be a mapping of argument names to values, "
                                        "got [1]"),
    ({"name": "format", "kwargs": {"prompts": 1}}, "rewards.functions[1]: reward function 'format': 'prompts' cannot "
                                                   "be a kwarg"),
    ({"nam": "format"}, "rewards.functions[1]: a reward function entry needs 'name'"),
    ({"model": "rm", "label": -1}, "rewards.functions[1].label must be a label index (0, 1, ...)"),
])
def test_a_bad_reward_entry_is_refused_by_the_config_check_naming_its_key(entry, message):
    cfg = GRPOConfig.from_dict({**BASE, "rewards": {"functions": ["exact_match", entry]}})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_every_list_setting_of_the_config_has_its_typed_entry():
    lists = [path for path, f in all_field_paths() if f.type == "list"]
    typed = {"eval.sets": eval_set_specs, "rewards.functions": reward_specs}
    names_only = {"model.lora.target_modules", "logging.report_to"}  # lists of names, checked by their owners
    assert set(lists) == set(typed) | names_only
    assert all(dataclasses.is_dataclass(s) for s in eval_set_specs([{"name": "a", "source": "b"}]))
