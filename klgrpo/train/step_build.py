"""Building a GRPOStep from the config, in the order of the rooms it draws on: the data and rewards (core/), the
policy and its sampler (backends/), the reference (core/), then what trains the policy (train/building.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from klgrpo.backends.hf import resolve_device
from klgrpo.backends.policy import load_policy, load_reference_model
from klgrpo.backends.samplers import pick_sampler
from klgrpo.config.entries import reward_specs
from klgrpo.config.schema import GRPOConfig
from klgrpo.config.terms import build_entropy_controller, build_kl_controller, step_plan
from klgrpo.config.validation import PIPELINED_SAMPLERS
from klgrpo.core.data import PromptSampler, dataset_prompts, load_prompts
from klgrpo.core.forward import uses_fast_forward
from klgrpo.core.loss_api import resolve_loss_function
from klgrpo.core.reference import FrozenCopyReference, build_reference
from klgrpo.core.rewards import RewardComputer, RewardModelContext
from klgrpo.core.rollout import longest_prompt_tokens
from klgrpo.errors import ConfigError, warn
from klgrpo.store.checkpoint import check_checkpoint
from klgrpo.train.building import build_optimizer, make_scheduler
from klgrpo.train.distributed import Distributed
from klgrpo.train.engine import Engine
from klgrpo.train.guard import NonFiniteGuard
from klgrpo.train.pipeline import open_pipeline, split_threads
from klgrpo.train.step import GRPOStep
from klgrpo.train.step_memory import check_step_memory


def needs_reference(cfg: GRPOConfig) -> bool:
    """A reference is built when the KL enters the loss or the reward, is monitored, is controlled or anchors
    the replay."""
    return cfg.kl.coef > 0 or cfg.kl.monitor or cfg.kl.controller != "fixed" or cfg.kl.replay.coef > 0


@dataclass(frozen=True)
class GivenParts:
    """What the caller hands in instead of what the config names (GRPOTrainer's arguments); None: built from the
    config. ``model`` a loaded policy (with ``tokenizer``, or the one at model.name_or_path), ``train_dataset``
    the prompts (instead of data.source), ``loss_fn`` a custom loss (instead of loss.function)."""

    model: Any = None
    tokenizer: Any = None
    train_dataset: Any = None
    loss_fn: Callable | None = None


def build_step(cfg: GRPOConfig, dist: Distributed, engine: Engine, run_dir: Path, given: GivenParts = GivenParts(),
               *, log: Callable = print) -> GRPOStep:
    """The step of a run whose folder is ``run_dir`` (the replay anchor's cache lives there)."""
    main_log = log if dist.is_main else None
    dataset = given.train_dataset or load_prompts(cfg.data.source, prompt_column=cfg.data.prompt_column,
                                                  columns=cfg.data.columns, split=cfg.data.split,
                                                  limit=cfg.data.limit or None)
    prompt_order = PromptSampler(len(dataset), cfg.rollout.prompts_per_step, cfg.train.seed, shuffle=cfg.data.shuffle)
    # None: the built-in objective
    loss_fn = resolve_loss_function(cfg.loss.function, given.loss_fn, warn=warn if dist.is_main else None)
    # Reward models' configs are checked here; their weights load after the memory check below.
    rewards = RewardComputer(reward_specs(cfg.rewards.functions),
                             trust_remote_code=cfg.model.trust_remote_code)
    device = resolve_device(cfg.model.device)
    if dist.device is not None and cfg.model.device == "auto":
        device = dist.device
    if given.model is None:
        check_checkpoint(cfg.model.name_or_path, "model.name_or_path")
    check_checkpoint(cfg.kl.reference, "kl.reference")
    tokenizer, model = load_policy(cfg.model, device, main_log, given.model, given.tokenizer)
    rollout_tokens = cfg.rollout.prompts_per_step // dist.world_size * cfg.rollout.group_size * \
        cfg.rollout.max_new_tokens  # one process's rollout: what auto's choice on the CPU is measured by
    sampler, why = pick_sampler(cfg.rollout.sampler, model, cfg.model.fast_path, cfg.rollout.generate_cache,
                                settings=cfg.rollout.vllm, rollout_tokens=rollout_tokens,
                                processes=dist.world_size)
    if main_log:
        main_log(f"sampler: {sampler.name} ({why})")
    check_old_logprobs_source(cfg.rollout.old_logprobs, sampler, next(model.parameters()).dtype)
    reference = _reference(cfg, model, device, main_log)
    # A step beyond the free memory is refused here, not after minutes of swapping (rank 0 checks, every rank gets
    # its verdict: no rank is left waiting in a collective for one that refused).
    scoring = RewardModelContext(device=device, dtype=next(model.parameters()).dtype,
                                 system_prompt=cfg.data.system_prompt, as_chat=cfg.data.as_chat)
    dist.agreed(lambda: _check_step_memory(cfg, dataset, tokenizer, model, dist.world_size, device,
                                           rewards.reward_model_bytes(scoring)))
    # Each process loads its own reward models, once: not trained, prepared by the engine or checkpointed.
    for reward_model in rewards.reward_models if main_log else ():
        main_log(f"loading the reward model {reward_model.spec.model}")
    rewards.load_models(scoring)
    return _trainable_step(cfg, dist, engine, run_dir, log, device=device, dataset=dataset,
                           prompt_order=prompt_order, rewards=rewards, loss_fn=loss_fn, tokenizer=tokenizer,
                           model=model, sampler=sampler, reference=reference,
                           pipeline=_generation_process(cfg, dist, engine, model, sampler, device, main_log))


def _generation_process(cfg: GRPOConfig, dist: Distributed, engine: Engine, model, sampler, device: torch.device,
                        log: Callable | None):
    """rollout.max_staleness > 0: the run's generation process (train/pipeline.py), given its share of torch's
    threads (the trainer keeps the rest); None otherwise. Refused in one line where it cannot run yet."""
    ahead = cfg.rollout.max_staleness
    if ahead == 0:
        return None
    where = ("a run of one process" if dist.world_size == 1 and engine.kind == "single" else
             f"this run has {dist.world_size} processes ({engine.kind})")
    on_server = sampler.name == "vllm_server"
    if dist.world_size > 1 or engine.kind != "single" or (device.type != "cpu" and not on_server):
        raise ConfigError(f"rollout.max_staleness {ahead}: generation while training runs in a one-process run, "
                          f"on the CPU or with rollout.sampler vllm_server, so far ({where}, device {device.type}); "
                          f"set rollout.max_staleness 0")
    if sampler.name not in PIPELINED_SAMPLERS:
        raise ConfigError(f"rollout.max_staleness {ahead}: the run's sampler {sampler.name} does not draw ahead; "
                          f"set rollout.sampler kv_loop, generate or vllm_server")
    if sampler.name == "vllm_server":
        if cfg.rollout.vllm.weight_transfer != "folder":
            raise ConfigError(f"rollout.max_staleness {ahead} with rollout.vllm.weight_transfer "
                              f"{cfg.rollout.vllm.weight_transfer}: batches issued ahead send the weights of their "
                              f"own version from a copy, through the folder; set rollout.vllm.weight_transfer folder")
        if log:
            log(f"generation while training (rollout.max_staleness {ahead}): the vLLM server draws batch t from the "
                f"weights {ahead} update(s) back while the trainer updates")
        return open_pipeline(model, sampler, 0, cfg.train.seed)
    trainer_threads, generation_threads = split_threads(torch.get_num_threads(), cfg.rollout.generation_threads)
    if log:
        log(f"generation while training (rollout.max_staleness {ahead}): a generation process with "
            f"{generation_threads} torch thread(s) draws batch t from the weights {ahead} update(s) back; the "
            f"trainer keeps {trainer_threads} (both share this machine's cores: the generation is hidden, the "
            f"update slower; docs/benchmarks.md section 12 measures what that nets)")
    return open_pipeline(model, sampler, generation_threads, cfg.train.seed, trainer_threads)


def check_old_logprobs_source(old_logprobs: str, sampler, dtype: torch.dtype) -> None:
    """rollout.old_logprobs sampler with the sampler and dtype the run resolved (auto may pick vLLM, model.dtype
    auto bfloat16): refused in one line where the sampler's log-probs are not the trainer's to float rounding."""
    if old_logprobs != "sampler":
        return
    if not sampler.scores_as_trainer:
        raise ConfigError(f"rollout.old_logprobs sampler: this run samples with {sampler.name}, whose log-probs are "
                          f"not the trainer's to float rounding; set rollout.sampler kv_loop or generate, or "
                          f"rollout.old_logprobs trainer")
    if dtype != torch.float32:
        raise ConfigError(f"rollout.old_logprobs sampler: the policy loaded in {str(dtype).removeprefix('torch.')}, "
                          f"whose sampled log-probs differ from the trainer's forward by more than float rounding; "
                          f"set model.dtype float32 or rollout.old_logprobs trainer")


def _partitioned_by_zero3(model) -> bool:
    """transformers loads a model already partitioned (deepspeed.zero.Init) once accelerate's DeepSpeed ZeRO-3
    config is active, whatever its zero3_init_flag; a deep copy of it would share the policy's partitions."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _reference(cfg: GRPOConfig, model, device: torch.device, log: Callable | None):
    """The frozen reference: the model at kl.reference, or the policy itself (its LoRA adapter off, or a copy)."""
    if not needs_reference(cfg):
        return None
    if log:
        log("building the reference model")
    source = cfg.kl.reference
    if not source and cfg.model.lora.r == 0 and _partitioned_by_zero3(model):
        source = cfg.model.name_or_path  # the policy's starting weights, loaded again rather than deep-copied
    own = load_reference_model(source, cfg.model, device, model) if source else None
    return build_reference(model, own, adapter=cfg.model.lora.r > 0, fast_path=fast_forward(cfg, device))


def _check_step_memory(cfg: GRPOConfig, dataset, tokenizer, model, world_size: int, device: torch.device,
                       reward_model_bytes: int) -> None:
    """Refuse a step that cannot fit in the free memory, estimated from the longest prompt as the rollout
    encodes it (the reward models' weights counted)."""
    longest = longest_prompt_tokens(tokenizer, dataset_prompts(dataset), cfg.data.system_prompt, cfg.data.as_chat)
    check_step_memory(cfg, model, longest, world_size, device, reward_model_bytes=reward_model_bytes)


def _trainable_step(cfg: GRPOConfig, dist: Distributed, engine: Engine, run_dir: Path, log: Callable,
                    **parts: Any) -> GRPOStep:
    """What trains the policy: the loss's forward (the policy, or with train.compile its compiled wrapper),
    AdamW and its schedule, the replay anchor, and the engine's wrapping."""
    model, reference = parts["model"], parts["reference"]
    train_forward = model
    if cfg.train.compile:
        train_forward = torch.compile(model)
        if isinstance(reference, FrozenCopyReference):
            reference.compile()
    optimizer = build_optimizer(model, cfg.optim, parts["device"])
    scheduler = make_scheduler(optimizer, cfg)
    replay = None
    # One process: rank 0 alone adds the anchor's gradient. Under an engine every rank computes the same anchor loss
    # (a sharded model needs every rank in its forward) and its gradient is taken once.
    if cfg.kl.replay.coef > 0 and (dist.is_main or engine.kind != "single"):
        from klgrpo.train.replay import AnchorModels, ReplayAnchor

        # A new or empty folder gets the cache now, under its lock, so the ranks of a run share one cache (the replay
        # batch must be the same on every rank); one that holds files only once the run has opened it (GRPOStep.start).
        fresh = not run_dir.is_dir() or not any(run_dir.iterdir())
        replay = ReplayAnchor.build(cfg, AnchorModels(model, parts["tokenizer"], reference), run_dir, log=log,
                                    sampler=parts["sampler"], write_now=fresh)
    if engine.kind != "single":
        train_forward, optimizer = engine.prepare(model, optimizer)
        engine.prepare_reference(reference)
    return GRPOStep(plan=step_plan(cfg), dist=dist, engine=engine, train_forward=train_forward, optimizer=optimizer,
                    scheduler=scheduler, controller=build_kl_controller(
                        cfg.kl, cfg.train.steps, cfg.rollout.prompts_per_step * cfg.rollout.group_size),
                    entropy_controller=build_entropy_controller(cfg.loss),
                    guard=NonFiniteGuard(cfg.train.max_skipped_steps), replay=replay,
                    loss_fast_path=fast_forward(cfg, parts["device"]) and not engine.fast_path_outside_loss_only,
                    **parts)


def fast_forward(cfg: GRPOConfig, device: torch.device) -> bool:
    """model.forward (and model.fast_path) resolved for ``device``: klgrpo's decoder or transformers' forward,
    for the training log-probs and the reference alike."""
    return uses_fast_forward(cfg.model.forward, cfg.model.fast_path, device.type)
