"""What ``trl grpo --config`` reads, in klgrpo's terms: the GRPOConfig fields through
klgrpo.integrations.trl_mapping, the model, LoRA, dataset and optimizer fields of TRL's other dataclasses onto their
klgrpo keys, the rest named.

TRL's field names, types and defaults come from :mod:`klgrpo.apps.explain.trl_fields` (data, no TRL import).
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from klgrpo.apps.explain.rewards import reward_entries
from klgrpo.apps.explain.trl_fields import FIELDS, TRL_FIELDS_VERSION
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import Mapped
from klgrpo.integrations.trl_mapping import ADAPTIVE_KL_DEFAULTS, LOSS_TYPES, TRL_DEFAULTS, map_trl
from klgrpo.integrations.versions import NotInRange, TRLRange, unsloth_config_fields

#: Names of earlier TRL releases that ``trl grpo`` configs still carry -> the 1.16 name.
EARLIER_NAMES = {"torch_dtype": "dtype"}
#: Fields of launchers that extend TRL's dataclasses (open-r1's src/open_r1/configs.py at commit 1416fa0:
#: GRPOConfig's and GRPOScriptArguments' own fields) -> what they change. Listed as the launcher's, never refused.
_OPEN_R1 = "open-r1's launcher field (src/open_r1/configs.py), not TRL's"
_REWARD_SHAPE = (f"{_OPEN_R1}: shapes its reward functions; changes training, not mapped: klgrpo's rewards are "
                 "named in rewards.functions")
LAUNCHER_FIELDS = {
    **{name: _REWARD_SHAPE for name in (
        "cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct", "cosine_max_value_correct",
        "cosine_max_len", "repetition_n_grams", "repetition_max_penalty", "code_language", "code_eval_test_batch_size",
        "code_eval_scoring_mode", "parallel_code_exec_per_proc", "e2b_router_url", "morph_router_url",
        "code_provider", "ioi_provider", "max_completion_len", "soft_punish_cache")},
    **{name: f"{_OPEN_R1}: changes the prompts; changes training, not mapped: klgrpo applies the tokenizer's chat "
             "template to the dataset's prompt column" for name in ("system_prompt", "chat_template",
                                                                    "dataset_prompt_column", "dataset_mixture")},
    **{name: f"{_OPEN_R1}: evaluation, hub or logging only" for name in (
        "benchmarks", "callbacks", "hub_model_revision", "overwrite_hub_revision", "push_to_hub_revision",
        "wandb_entity", "wandb_project", "wandb_run_group", "wandb_log_unique_prompts")},
}
#: TrainingArguments fields of the transformers releases that older TRL ran on (gone from TRL 1.16's).
OLDER_TRAINING_ARGUMENTS = {
    "warmup_ratio": "changes training, not mapped: the warm-up as a fraction of the run's steps; klgrpo's "
                    "optim.warmup_steps counts steps",
    "dataset_configs": "changes training, not mapped: the dataset's configurations (TRL's ScriptArguments before "
                       "0.17); klgrpo's data.source takes NAME:CONFIG",
    "overwrite_output_dir": None, "logging_dir": None, "evaluation_strategy": None, "push_to_hub_model_id": None,
    "no_cuda": None, "use_mps_device": None,
}
#: GRPOConfig fields of earlier TRL releases (klgrpo/integrations/versions/trl.json's removed_since) -> what they do.
REMOVED_FIELDS = {
    "max_prompt_length": "changes training, not mapped: TRL cut each prompt to this many tokens (from the left); "
                         "klgrpo keeps whole prompts",
    "vllm_guided_decoding_regex": "changes training, not mapped: vLLM samples only completions matching the regex",
    "vllm_device": "speed and memory only: where vLLM runs", "vllm_dtype": "speed and memory only: vLLM's dtype",
    "vllm_max_model_len": "speed and memory only: vLLM's context length",
    "vllm_enable_prefix_caching": "speed only: vLLM's prefix cache",
    "use_liger_loss": "speed and memory only: Liger's fused loss computes the same objective",
    "wandb_log_unique_prompts": "logging only",
}
#: Keys TRL's parser takes beside the dataclass fields (``env``: environment variables it sets).
PARSER_KEYS = {"env": "environment variables TRL sets before the run"}
#: Field -> klgrpo key, set when the file sets the field (a value klgrpo reads as it is).
SAME_VALUE = {"model_name_or_path": "model.name_or_path", "trust_remote_code": "model.trust_remote_code",
              "gradient_checkpointing": "model.gradient_checkpointing", "dataset_train_split": "data.split",
              "shuffle_dataset": "data.shuffle", "weight_decay": "optim.weight_decay", "adam_beta1": "optim.beta1",
              "adam_beta2": "optim.beta2", "max_grad_norm": "optim.max_grad_norm", "seed": "train.seed"}
DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
LR_SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_task_type")
#: LoRA and quantisation options klgrpo's LoRA lacks, when switched on.
NO_LORA_COUNTERPART = {"use_rslora": "klgrpo's LoRA scales by alpha / r, not alpha / sqrt(r)",
                       "use_dora": "klgrpo's LoRA has no DoRA magnitude vector",
                       "load_in_4bit": "klgrpo loads unquantised weights", "load_in_8bit": "klgrpo loads unquantised "
                                                                                           "weights",
                       "lora_modules_to_save": "klgrpo's LoRA trains the adapters only",
                       "lora_target_parameters": "klgrpo's LoRA adapts modules, not parameters"}
#: Fields whose klgrpo counterpart is written differently: named, with where it goes.
OTHER_COUNTERPARTS = {
    "reward_funcs": "TRL's reward functions by name; klgrpo's are rewards.functions (built-in names or "
                    "module:function)",
    "reward_model_name_or_path": "a reward model: in klgrpo a rewards.functions entry {model: PATH} (listed under "
                                 "rewards: one logit, its own tokenizer and chat template, as TRL scores it)",
    "chat_template_kwargs": "klgrpo applies the tokenizer's chat template without extra arguments (data.as_chat)",
}
#: Fields that change speed, memory, I/O, logging or the hub, never the loss.
NOT_THE_OBJECTIVE = frozenset((
    "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "bf16", "fp16", "tf32", "per_device_train_batch_size",
    "per_device_eval_batch_size", "logging_steps", "logging_strategy", "logging_first_step", "logging_dir",
    "output_dir", "report_to", "save_steps", "save_strategy", "save_total_limit", "save_only_model",
    "save_on_each_node", "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_liger_kernel",
    "ds3_gather_for_generation", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "dataloader_drop_last", "log_completions", "num_completions_to_print",
    "log_unique_prompts", "log_multimodal", "log_completions_hub_repo", "run_name", "project", "push_to_hub",
    "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision",
    "eval_strategy", "eval_steps", "eval_on_start", "do_eval", "do_train", "do_predict", "num_generations_eval",
    "overwrite_output_dir", "resume_from_checkpoint", "log_level", "log_level_replica", "log_on_each_node",
    "disable_tqdm", "remove_unused_columns", "model_revision", "attn_implementation", "dataset_test_split",
    "dataset_streaming", "ddp_timeout", "ddp_backend", "ddp_find_unused_parameters", "deepspeed", "fsdp",
    "fsdp_config", "gradient_checkpointing_kwargs", "vllm_server_host", "vllm_server_port", "vllm_server_base_url",
    "vllm_server_timeout", "vllm_group_port", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
    "vllm_model_impl", "vllm_max_model_length", "generation_batch_size", "torch_empty_cache_steps",
    "use_transformers_paged", "cache_implementation", "bnb_4bit_quant_type", "use_bnb_nested_quant",
    "bnb_4bit_quant_storage", "lora_task_type", "model_init_kwargs", "use_cpu", "local_rank", "skip_memory_metrics",
    "include_num_input_tokens_seen", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    "num_train_epochs", "max_steps", "pad_to_multiple_of", "cast_lm_head_to_fp32", "data_seed", "full_determinism",
    "dataloader_in_order", "accelerator_config", "parallelism_config", "ignore_data_skip", "eval_delay",
    "activation_checkpointing", "activation_checkpointing_kwargs", "auto_find_batch_size", "optim",
    "average_tokens_across_devices", "use_cache", "enable_jit_checkpoint", "liger_kernel_config",
    "per_device_eval_batch_size", "eval_accumulation_steps", "load_best_model_at_end", "metric_for_best_model",
    "greater_is_better", "batch_eval_metrics", "prediction_loss_only", "include_for_metrics", "label_names",
    "restore_callback_states_from_checkpoint", "debug", "dataloader_multiprocessing_context",
    "ddp_broadcast_buffers", "ddp_bucket_cap_mb", "ddp_static_graph", "eval_do_concat_batches",
    "eval_use_gather_object", "fp16_full_eval", "bf16_full_eval", "length_column_name", "train_sampling_strategy",
    "logging_nan_inf_filter", "shuffle_dataset", "env", *SAME_VALUE, *LORA_FIELDS, "use_peft", "dtype",
    "model_name_or_path", "dataset_name", "dataset_config", "learning_rate", "lr_scheduler_type", "warmup_steps"))


def known_fields(adaptive: bool, profile: TRLRange | None = None, unsloth: bool = False) -> set[str]:
    names = set(FIELDS) | set(EARLIER_NAMES) | set(PARSER_KEYS) | set(LAUNCHER_FIELDS) | set(OLDER_TRAINING_ARGUMENTS)
    if profile is not None:
        names = (names - profile.absent) | profile.removed_since
    if unsloth:  # Unsloth's patched GRPOConfig, in the ranges whose releases have each field
        names |= {name for name, (first, _) in unsloth_config_fields().items()
                  if profile is None or profile.high is None or profile.high > first}
    return names | set(ADAPTIVE_KL_DEFAULTS) if adaptive else names


def check_names_and_types(data: dict, origin: str, adaptive: bool, profile: TRLRange | None = None,
                          unsloth: bool = False) -> None:
    """One line naming every key no TRL dataclass has (each with its closest name), or a value of the wrong type.
    Under a release range (``profile``), a field that range lacks is a :class:`NotInRange` error."""
    known = known_fields(adaptive, profile, unsloth)
    unknown = [key for key in data if key not in known]
    if profile is not None:
        later = sorted(str(key) for key in unknown if key in profile.absent or key in other_releases_fields()
                       or unsloth and key in unsloth_config_fields())
        if later:
            raise NotInRange(f"{origin}: {', '.join(later)}: no field of {profile.label}")
    where = profile.label if profile is not None else f"TRL {TRL_FIELDS_VERSION}"
    if len(unknown) == 1:
        key = unknown[0]
        close = difflib.get_close_matches(str(key)[:100], sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else (
            f" (no field of {where}'s GRPOScriptArguments, GRPOConfig, ModelConfig or DatasetMixtureConfig)")
        what = "TRL GRPOConfig or adaptive-KL" if adaptive else "TRL GRPOConfig"
        raise ConfigError(f"{origin}: unknown {what} field {_short(key)}{hint}")
    if unknown:
        named = []
        for key in unknown:
            close = difflib.get_close_matches(str(key)[:100], sorted(known), n=1)
            named.append(f"{_short(key)}" + (f" (did you mean {close[0]}?)" if close else ""))
        what = "TRL GRPOConfig or adaptive-KL" if adaptive else "TRL GRPOConfig"
        raise ConfigError(f"{origin}: unknown {what} field{'s' if len(named) > 1 else ''} {', '.join(named)} "
                          f"(no field of {where}'s GRPOScriptArguments, GRPOConfig, ModelConfig or "
                          "DatasetMixtureConfig, nor of a known launcher)")
    for key, value in data.items():
        _check_type(key, value, origin)
        _check_bound(key, value, origin)


#: TRL's bounds on the fields that shape the objective (its GRPOConfig and trainer refuse or misbehave outside):
#: field -> (low, high, what), both inclusive.
BOUNDS = {"beta": (0.0, math.inf, ">= 0"), "epsilon": (0.0, math.inf, ">= 0"),
          "epsilon_high": (0.0, math.inf, ">= 0"), "top_entropy_quantile": (0.0, 1.0, "in [0, 1]"),
          "temperature": (0.0, math.inf, "> 0"), "learning_rate": (0.0, math.inf, ">= 0"),
          "num_iterations": (1, math.inf, ">= 1"), "num_generations": (1, math.inf, ">= 1"),
          "entropy_coef": (0.0, math.inf, ">= 0"), "top_p": (0.0, 1.0, "in (0, 1]")}


def _check_bound(key: str, value: Any, origin: str) -> None:
    """A number must be finite, and within TRL's bound where it has one; loss_type one of TRL's names."""
    if key == "loss_type" and isinstance(value, str) and value.lower() not in LOSS_TYPES:
        raise ConfigError(f"{origin}: loss_type {_short(value)} is none of TRL's: {', '.join(LOSS_TYPES)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):
        raise ConfigError(f"{origin}: {key} must be a finite number, got {value}")
    low, high, what = BOUNDS.get(key, (-math.inf, math.inf, ""))
    if not low <= value <= high or key == "temperature" and value == 0 or key == "top_p" and value == 0:
        raise ConfigError(f"{origin}: {key} must be {what}, got {value}")


def other_releases_fields() -> set[str]:
    """GRPOConfig fields of some TRL release that the newest no longer has."""
    from klgrpo.integrations.versions import trl_profiles

    return set().union(*(p.removed_since for p in trl_profiles()))


#: Types of the TRL / adaptive-KL fields the mapping reads whose default is None (the others: their default's type).
_NONE_DEFAULT_TYPES = {"epsilon_high": float, "delta": float, "steps_per_generation": int,
                       "off_policy_mask_threshold": float, "kl_importance_weight": str, "kl_controller": str,
                       "reward_weights": list}
_KIND_NAMES = {bool: "true or false", str: "a name", list: "a list", int: "an integer", float: "a number"}


def _check_type(key: str, value: Any, origin: str) -> None:
    if value is None or key == "scale_rewards":  # TRL takes a name or a boolean there
        return
    defaults = {**TRL_DEFAULTS, **ADAPTIVE_KL_DEFAULTS}
    if key in defaults:
        kind = _NONE_DEFAULT_TYPES.get(key) or type(defaults[key])
        kinds: tuple[type, ...] = (int, float) if kind in (int, float) else (kind,)
        wrong = kind is int and isinstance(value, float) and not value.is_integer()
        name = _KIND_NAMES.get(kind, "a number")
    elif key in FIELDS or key in EARLIER_NAMES:
        kinds = _field_kinds(FIELDS[EARLIER_NAMES.get(key, key)][1])
        wrong = False
        name = " or ".join(sorted({_KIND_NAMES.get(k, "a mapping") for k in kinds}))
    else:
        return
    if wrong or isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ConfigError(f"{origin}: {key} must be {name}, got {_short(value)}")


def _field_kinds(annotation: str) -> tuple[type, ...]:
    """The YAML value types a TRL annotation such as ``list[str] | None`` accepts (a list also as one name)."""
    kinds: set[type] = set()
    for part in annotation.split(" | "):
        kinds |= {"bool": {bool}, "int": {int}, "float": {int, float}, "str": {str}, "None": set()}.get(
            part, {list, str} if part.startswith("list") else {dict, str} if part.startswith("dict") else {str})
    return tuple(kinds)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def map_trl_config(data: dict, origin: str, adaptive: bool, profile: TRLRange | None = None,
                   unsloth: bool = False) -> Mapped:
    """A ``trl grpo --config`` mapping (or a GRPOConfig call's keywords) -> klgrpo's config; under ``profile``,
    by that release range's fields and defaults (and, for Unsloth, its rewrites and its loss's unweighted KL)."""
    unsloth = profile is not None and profile.framework == "unsloth" or unsloth
    check_names_and_types(data, origin, adaptive, profile, unsloth)
    data = {EARLIER_NAMES.get(key, key): value for key, value in data.items()}
    unset = {k: v for k, v in (profile.defaults if profile is not None else {}).items()
             if k in TRL_DEFAULTS and k not in data}
    notes = _profile_rules(data, profile) if profile is not None else {}
    objective = {k: v for k, v in data.items() if k in TRL_DEFAULTS or k in ADAPTIVE_KL_DEFAULTS}
    mapped = map_trl(objective, defaults=profile.defaults if profile is not None else None)
    mapped.defaults = unset
    mapped.unmapped.update(notes)
    _map_model_and_data(data, mapped)
    for key in data:
        if key in objective:
            continue
        if key in OTHER_COUNTERPARTS:
            mapped.unmapped.setdefault(key, OTHER_COUNTERPARTS[key])
            if key == "reward_model_name_or_path" and isinstance(data[key], str) and data[key]:
                mapped.rewards += reward_entries([{"model": data[key]}], as_chat=False)
        elif unsloth and key in unsloth_config_fields():
            does = unsloth_config_fields()[key][1]
            if does:
                mapped.unmapped.setdefault(key, f"Unsloth's GRPOConfig field: {does}")
            else:
                mapped.ignored.append(key)  # Unsloth's chunking of the loss: speed and memory only
        elif key in LAUNCHER_FIELDS or OLDER_TRAINING_ARGUMENTS.get(key):
            mapped.unmapped.setdefault(key, LAUNCHER_FIELDS.get(key) or OLDER_TRAINING_ARGUMENTS[key])
        elif key in NOT_THE_OBJECTIVE or key in PARSER_KEYS or key in OLDER_TRAINING_ARGUMENTS:
            if key not in mapped.unmapped and key not in _mapped_fields(data):
                mapped.ignored.append(key)
        elif profile is not None and key in profile.removed_since:
            why = REMOVED_FIELDS.get(key, "not read by the mapping; check that it does not change the objective")
            mapped.unmapped.setdefault(key, f"a field of {profile.label} that later TRL removed: {why}")
        elif key not in mapped.unmapped:
            mapped.unmapped[key] = "not read by the mapping: check that it does not change the objective"
    return mapped


def _profile_rules(data: dict, profile: TRLRange) -> dict[str, str]:
    """Unsloth's rewrites of a dapo / dr_grpo config and its loss's KL, applied to ``data`` in place; the notes."""
    notes = {}
    if not profile.unweighted_kl:
        return notes
    loss_type = str(data.get("loss_type", profile.defaults.get("loss_type"))).lower()
    for name, value in profile.rewrites.get(loss_type, {}).items():
        if name == "scale_rewards" and data.get(name, True) is not True:
            continue  # Unsloth turns scale_rewards True to False under dr_grpo; other values stay
        if data.get(name) != value:
            notes[name] = f"Unsloth sets {name} {value!r} for loss_type {loss_type} (unsloth/models/rl.py)"
        data[name] = value
    if data.get("use_bias_correction_kl"):
        notes["use_bias_correction_kl"] = ("Unsloth's own loss (unsloth_zoo grpo_compute_loss) never weights the KL "
                                           "by the importance ratio: the verdict uses no weight")
    data["use_bias_correction_kl"] = False
    return notes


def _mapped_fields(data: dict) -> set[str]:
    """The fields of ``data`` that set a klgrpo key (so neither ignored nor unmapped)."""
    fields = {k for k in SAME_VALUE if k in data} | {"model_name_or_path", "dataset_name", "dataset_config"} & set(data)
    if data.get("use_peft"):
        fields |= {"use_peft", *LORA_FIELDS} & set(data)
    return fields | {k for k in ("dtype", "lr_scheduler_type", "warmup_steps") if k in data}


def _map_model_and_data(v: dict, out: Mapped) -> None:
    for field_name, key in SAME_VALUE.items():
        if v.get(field_name) is not None:
            out.config[key] = v[field_name]
    if v.get("dataset_name"):
        config = v.get("dataset_config")
        out.config["data.source"] = f"{v['dataset_name']}:{config}" if config else v["dataset_name"]
    if v.get("dtype") is not None:
        if str(v["dtype"]) in DTYPES:
            out.config["model.dtype"] = DTYPES[str(v["dtype"])]
        else:
            out.unmapped["dtype"] = f"{v['dtype']!r}: klgrpo's model.dtype is one of {', '.join(sorted(set(DTYPES)))}"
    _map_lora(v, out)
    _map_schedule(v, out)


def _map_lora(v: dict, out: Mapped) -> None:
    if not v.get("use_peft"):
        return
    lora = {name: v.get(name, FIELDS[name][2]) for name in LORA_FIELDS}
    out.config.update({"model.lora.r": int(lora["lora_r"]), "model.lora.alpha": float(lora["lora_alpha"]),
                       "model.lora.dropout": float(lora["lora_dropout"])})
    targets = lora["lora_target_modules"]
    if targets is None:
        out.unmapped["lora_target_modules"] = ("unset: PEFT's per-architecture default modules; klgrpo's "
                                               "model.lora.target_modules is all-linear unless set")
    else:
        out.config["model.lora.target_modules"] = [targets] if isinstance(targets, str) else list(targets)
    for name, why in NO_LORA_COUNTERPART.items():
        if v.get(name):
            out.unmapped[name] = why


def _map_schedule(v: dict, out: Mapped) -> None:
    schedule = v.get("lr_scheduler_type")
    if schedule is not None:
        if schedule in LR_SCHEDULES:
            out.config["optim.schedule"] = LR_SCHEDULES[schedule]
        else:
            out.unmapped["lr_scheduler_type"] = f"{schedule!r}: klgrpo's optim.schedule is constant, linear or cosine"
    warmup = v.get("warmup_steps")
    if warmup is not None:
        if float(warmup) >= 1 and float(warmup).is_integer() or warmup == 0:
            out.config["optim.warmup_steps"] = int(warmup)
        else:
            out.unmapped["warmup_steps"] = (f"{warmup}: a fraction of the run's steps in TRL; klgrpo's "
                                            "optim.warmup_steps counts steps")
