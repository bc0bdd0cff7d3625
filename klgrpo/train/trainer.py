"""The GRPO loop. It composes the arrows of docs/design.md and computes nothing itself:

    prompts --rollout--> completions --rewards--> rewards --reference--> ref logp (once per batch)
            --advantages--> A --objective--> loss (micro-batched, global normaliser) --AdamW--> controller

A "step" is one optimizer update (TRL's convention): a batch of prompts_per_step x group_size completions
is generated every ``num_iterations`` steps and reused, off-policy, by the steps in between.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from klgrpo.train.checkpoint import SHARDS_DIR, rng_state, save_checkpoint, set_rng_state, shard_folder
from klgrpo.train.config import LR_SCHEDULES, GRPOConfig
from klgrpo.core.data import PromptSampler, load_prompts
from klgrpo.train.distributed import Distributed
from klgrpo.train.engine import Engine
from klgrpo.errors import ConfigError
from klgrpo.train.evaluation import evaluate_sets, load_eval_sets
from klgrpo.math.advantages import group_advantages, kl_penalized_scores
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.kl_control import KLObservation, build_controller
from klgrpo.math.objective import KLTerm, grpo_objective, reward_kl
from klgrpo.train.metrics import SUMMARY_FILE, MetricsLogger
from klgrpo.backends.hf import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from klgrpo.core.forward import completion_logprobs
from klgrpo.core.full_kl import completion_logprobs_and_full_kl
from klgrpo.math.full_kl import FULL_KL
from klgrpo.core.loss_api import LossInput, call_loss, resolve_loss_function
from klgrpo.core.reference import FrozenCopyReference
from klgrpo.core.rewards import RewardComputer, RewardSpec
from klgrpo.core.rollout import SamplingParams, generate_groups
from klgrpo.core.batch import StepBatch
from klgrpo.train.step_metrics import step_metrics
from klgrpo.train.timing import phase_timer as _timed
from klgrpo.train.guard import NonFiniteError, NonFiniteGuard
from klgrpo.train.resume import load_resumable_checkpoint
from klgrpo.train.run_folder import open_run_folder, resolve_auto_resume, sigterm_as_interrupt, timestamped_run_dir
from klgrpo.train.state_io import to_device
from klgrpo.train.tally import StepTally


def _controller_params(cfg: GRPOConfig) -> dict[str, Any]:
    k = cfg.kl
    by_name = {
        "fixed": {},
        "adaptive": {"target": k.target, "horizon": k.horizon},
        "step": {"target": k.target},
        "dual": {"target": k.target, "lr": k.dual_lr, "beta_min": k.beta_min, "beta_max": k.beta_max},
        "dynamic": {"reward_threshold": k.reward_threshold, "decay": k.decay, "beta_min": k.beta_min,
                    "schedule_steps": k.schedule_steps},
    }
    return {**by_name[k.controller], "kl_measure": k.kl_measure}


class GRPOTrainer:
    """Train ``config.model`` with GRPO and the configured KL; ``train()`` returns the run summary."""

    def __init__(self, config: GRPOConfig, *, model=None, tokenizer=None, train_dataset=None,
                 eval_sets: dict[str, Any] | None = None, loss_fn=None, log=print):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard save/load bars would break the step progress bar
        self.cfg = config
        self.log = log
        self.warnings = config.validate()
        for w in self.warnings:
            log(f"warning: {w}")
        cfg = config
        if cfg.train.torch_threads:
            torch.set_num_threads(cfg.train.torch_threads)
        self.dist = Distributed(cfg.train.dist_timeout_s)
        self.engine = Engine(cfg.model.fast_path)  # DDP / FSDP2 / DeepSpeed from `accelerate launch`, or nothing
        self.engine.check(cfg)
        if cfg.rollout.prompts_per_step % self.dist.world_size:
            raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                              f"{self.dist.world_size} processes, so every prompt's group stays on one process")
        _seed_everything(cfg.train.seed + self.dist.rank)  # rank 0 samples exactly as a single process would
        self.device = resolve_device(cfg.model.device)
        if self.dist.device is not None and cfg.model.device == "auto":
            self.device = self.dist.device
        self.tokenizer, self.model = self._load_policy(model, tokenizer)
        self.dataset = train_dataset or load_prompts(cfg.data.source, prompt_column=cfg.data.prompt_column,
                                                     columns=cfg.data.columns, split=cfg.data.split,
                                                     limit=cfg.data.limit or None)
        self.loss_fn = resolve_loss_function(cfg.loss.function, loss_fn)  # None: the built-in objective
        self.rewards = RewardComputer([RewardSpec.parse(f) for f in cfg.rewards.functions])
        self.eval_sets = eval_sets if eval_sets is not None else load_eval_sets(cfg)
        self.needs_reference = (cfg.kl.coef > 0 or cfg.kl.monitor or cfg.kl.controller != "fixed"
                                or cfg.kl.replay.coef > 0)
        if self.needs_reference and self.dist.is_main:
            log("building the reference model")
        self.reference = self._build_reference() if self.needs_reference else None
        # What the loss's forward runs: the policy, or with train.compile its compiled wrapper (same weights);
        # sampling, evaluation and checkpoints always use the model itself.
        self.train_forward = self.model
        if cfg.train.compile:
            self.train_forward = torch.compile(self.model)
            if isinstance(self.reference, FrozenCopyReference):
                self.reference.compile()
        self.controller = build_controller(cfg.kl.controller, cfg.kl.coef, **_controller_params(cfg))
        self.optimizer = self._build_optimizer()
        self.scheduler = _make_scheduler(self.optimizer, cfg)
        self.sampler = PromptSampler(len(self.dataset), cfg.rollout.prompts_per_step, cfg.train.seed,
                                     shuffle=cfg.data.shuffle)
        self.run_dir = Path(self.dist.gather_objects(str(_run_dir(cfg)))[0])  # rank 0's name (it has a timestamp)
        self.replay = None
        # One process: rank 0 alone adds the anchor's gradient. Under an engine every rank computes the same anchor
        # loss (a sharded model needs every rank in its forward) and its gradient is taken once.
        if cfg.kl.replay.coef > 0 and (self.dist.is_main or self.engine.kind != "single"):
            from klgrpo.train.replay import ReplayAnchor

            self.replay = ReplayAnchor.build(cfg, self.model, self.tokenizer, self.reference, self.run_dir, log=log)
        if self.engine.kind != "single":
            self.train_forward, self.optimizer = self.engine.prepare(self.model, self.optimizer)
            self.engine.prepare_reference(self.reference)
        self.step = 0
        self._run_lock = None  # rank 0's, while train() runs
        self.guard = NonFiniteGuard(cfg.train.max_skipped_steps)
        self._batch: StepBatch | None = None
        self._stop_reason = ""
        self._eval_before: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ pieces
    def _load_policy(self, model=None, tokenizer=None):
        """(tokenizer, policy): given or loaded (folder, hub name or GGUF file), dropout off, LoRA-wrapped and
        gradient-checkpointed as configured, in train mode."""
        cfg = self.cfg
        dtype = resolve_dtype(cfg.model.dtype, self.device)
        if model is None and self.dist.is_main:
            self.log(f"loading {cfg.model.name_or_path} ({dtype}, {self.device})")
        own_tokenizer = bool(cfg.model.tokenizer)
        tokenizer = tokenizer or load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path,
                                                cfg.model.trust_remote_code,
                                                gguf_file="" if own_tokenizer else cfg.model.gguf_file,
                                                field="model.tokenizer" if own_tokenizer else "model.name_or_path")
        model = model.to(self.device) if model is not None else load_causal_lm(
            cfg.model.name_or_path, cfg.model, self.device, dtype, gguf_file=cfg.model.gguf_file)
        _disable_dropout(model)
        model.klgrpo_fast_path = cfg.model.fast_path  # read by the sampling loop and completion_logprobs
        if cfg.model.lora.r > 0:
            from klgrpo.backends.lora import apply_lora

            model = apply_lora(model, cfg.model.lora)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        return tokenizer, model

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # One fused kernel over all parameters instead of a loop of small ops per tensor (0.45 ms of a 38 ms step
        # for the demo-size model on the CPU); its rounding differs from the loop's by at most an ulp or so.
        fused = self.device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in trainable)
        return torch.optim.AdamW(trainable, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                                 fused=fused or None)

    def _build_reference(self):
        ref_path = self.cfg.kl.reference
        if self.cfg.model.lora.r > 0 and not ref_path:
            from klgrpo.core.reference import AdapterDisabledReference

            return AdapterDisabledReference(self.model)
        if ref_path:
            dtype = next(self.model.parameters()).dtype
            ref_model = load_causal_lm(ref_path, self.cfg.model, self.device, dtype, field="kl.reference")
            ref_model.klgrpo_fast_path = self.cfg.model.fast_path
            return FrozenCopyReference(ref_model)
        return FrozenCopyReference.copy_of(self.model)

    def _kl_term(self) -> KLTerm:
        k = self.cfg.kl
        return KLTerm(coef=self.controller.value, estimator=k.estimator, placement=k.placement,
                      is_correction=k.is_correction, shaping=k.shaping, clip_threshold=k.clip_threshold,
                      shaping_target=k.shaping_target, clamp=k.log_ratio_clamp or None, reward_mode=k.reward_mode)

    def _micro_slices(self, n: int):
        size = self.cfg.train.micro_batch_size or n
        return [slice(s, min(s + size, n)) for s in range(0, n, size)]

    def make_batch(self) -> StepBatch:
        cfg, timings = self.cfg, {}
        indices = self.sampler.next_indices()  # the same global indices on every rank
        local = indices[self.dist.local_slice(len(indices))]
        rows = [self.dataset[i] for i in local]
        prompts = [r["prompt"] for r in rows]
        _check_context(self.model, self.tokenizer, prompts, local, cfg)
        with _timed(timings, "time/generate"), self.engine.full_weights(self.model):
            rollout = generate_groups(self.model, self.tokenizer, prompts, SamplingParams(
                group_size=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                system_prompt=cfg.data.system_prompt, as_chat=cfg.data.as_chat, compiled=cfg.train.compile,
                generate_cache=cfg.rollout.generate_cache))
        with _timed(timings, "time/reward"):
            columns = {k: [r[k] for r in rows for _ in range(cfg.rollout.group_size)]
                       for k in rows[0] if k != "prompt"}
            result = self.rewards(rollout.prompts, rollout.completions, columns)
        rewards = result.total.to(self.device)
        loss_mask = rollout.completion_mask
        if cfg.rollout.mask_truncated:
            loss_mask = loss_mask & ~rollout.truncated.unsqueeze(-1)
        ref_logp = old_logp = None
        with _timed(timings, "time/reference"):
            if self.reference is not None:
                ref_logp = self.reference.logprobs(rollout, cfg.rollout.temperature, cfg.train.micro_batch_size)
        scores, kl = rewards, self._kl_term()
        if ref_logp is not None and kl.in_reward and kl.reward_mode == "sequence_score" and kl.coef > 0:
            old_logp = self._rollout_logprobs(rollout)  # pi_old: the KL must be in the score before normalising
            scores = kl_penalized_scores(rewards, reward_kl(old_logp, ref_logp, kl), loss_mask, kl.coef)
        all_scores = self.dist.gather(scores)  # groups never straddle ranks; "batch" scale needs them all
        advantages = group_advantages(all_scores, cfg.rollout.group_size, cfg.loss.advantage_scale,
                                      cfg.loss.std_eps, cfg.loss.std_ddof)[self.dist.local_slice(all_scores.numel())]
        return StepBatch(rollout=rollout, rewards=rewards, reward_columns=result.per_function,
                         advantages=advantages, loss_mask=loss_mask,
                         normalizer=Normalizer(num_sequences=float(all_scores.numel()),
                                               num_tokens=self.dist.sum(loss_mask.sum().to(torch.float32)),
                                               max_len=float(cfg.rollout.max_new_tokens)),
                         ref_logp=ref_logp, old_logp=old_logp, timings=timings)

    def _rollout_logprobs(self, rollout) -> torch.Tensor:
        """log pi_old of the sampled tokens (no gradient), micro-batched like the update's forward."""
        with torch.no_grad():
            return torch.cat([completion_logprobs(self.train_forward, rollout, self.cfg.rollout.temperature, sl)[0]
                              for sl in self._micro_slices(rollout.size)])

    def accumulate_gradients(self, batch: StepBatch, keep_logp: bool = False):
        """Forward/backward over micro-batches; the loss is normalised globally, so .grad is the full-batch
        gradient whatever the micro-batch size. Returns (metric sums, maxima, entropy sum, logp or None)."""
        kl = self._kl_term()
        sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        entropy_sum = torch.zeros((), device=self.device)
        kept, token_kl = [], []
        for sl in self._micro_slices(batch.rollout.size):
            loss, out, logp, entropy, custom = self._micro_batch_loss(batch, sl, kl)
            self.engine.backward(loss)
            for k, v in [*out.sums.items(), *((f"custom/{k}", v) for k, v in custom.items())]:
                sums[k] = sums.get(k, 0.0) + v.detach()
            for k, v in out.maxes.items():
                maxes[k] = torch.maximum(maxes[k], v) if k in maxes else v
            sums["loss"] = sums.get("loss", 0.0) + loss.detach()
            entropy_sum += (entropy * batch.rollout.completion_mask[sl]).sum()
            if out.token_kl is not None:  # per-token values for the KL percentiles
                token_kl.append(out.token_kl)
            if keep_logp:
                kept.append(logp.detach())
        if token_kl:
            sums["token_kl"] = torch.cat(token_kl, 1)  # [2, B, T], the micro-batches joined along the batch
        return sums, maxes, entropy_sum, (torch.cat(kept) if keep_logp else None)

    def _micro_batch_loss(self, batch: StepBatch, sl: slice, kl: KLTerm):
        """(loss to backpropagate, ObjectiveOut, logp, entropy, custom metrics) of rows ``sl``. With a custom loss
        the built-in objective still runs, without gradient, for the KL monitors."""
        cfg = self.cfg
        ref = batch.ref_logp[sl] if batch.ref_logp is not None else None
        full_kl = None
        if kl.estimator == FULL_KL and self.reference is not None:  # the reference re-runs here (core.full_kl)
            logp, entropy, full_kl = completion_logprobs_and_full_kl(
                self.train_forward, self.reference, batch.rollout, cfg.rollout.temperature, sl, ref)
        else:
            logp, entropy = completion_logprobs(self.train_forward, batch.rollout, cfg.rollout.temperature, sl,
                                                with_entropy=True)
        old = batch.old_logp[sl] if batch.old_logp is not None else logp.detach()
        with torch.set_grad_enabled(self.loss_fn is None):
            out = grpo_objective(logp, old, ref, batch.advantages[sl], batch.loss_mask[sl], kl,
                                 cfg.loss.aggregation, batch.normalizer, cfg.loss.eps_low, cfg.loss.eps_high,
                                 policy_loss=cfg.loss.policy_loss, delta=cfg.loss.delta or None,
                                 dual_clip=cfg.loss.dual_clip or None, full_kl_BT=full_kl)
        if self.loss_fn is None:
            return out.loss, out, logp, entropy, {}
        loss, custom = call_loss(self.loss_fn, LossInput(
            logp, old, ref, batch.advantages[sl], batch.loss_mask[sl], kl.coef, batch.normalizer,
            cfg.loss.aggregation, batch.rollout.completion_ids[sl]))
        return loss, out, logp, entropy, custom

    def _update(self, batch: StepBatch) -> tuple[dict[str, float], KLObservation]:
        """One optimizer step on ``batch``: gradients, clipping, AdamW, scheduler."""
        cfg = self.cfg
        beta = self.controller.value
        timings: dict[str, float] = {}
        dump = bool(cfg.kl.dump_every and (self.step + 1) % cfg.kl.dump_every == 0 and batch.ref_logp is not None)
        # The first update of a batch runs at the sampling policy, so its log-probs ARE pi_old: later updates of
        # the same batch reuse them instead of paying a separate no-grad forward.
        keep_old = batch.old_logp is None and cfg.train.num_iterations > 1
        self.optimizer.zero_grad(set_to_none=True)
        with _timed(timings, "time/update"):
            sums, maxes, entropy_sum, logp = self.accumulate_gradients(batch, keep_logp=dump or keep_old)
            if keep_old:
                batch.old_logp = logp
            replay_metrics = (self._replay_gradients(sums["loss"]) if self.replay is not None else {})
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            # A non-finite loss or gradient norm never reaches the weights: the step is skipped and counted.
            loss_sum = self.dist.sum(sums["loss"]) if self.dist.enabled else sums["loss"]  # ranks decide alike
            grad_norm, applied = self.engine.step(self.model, self.optimizer, max_norm,
                                                  allow=lambda norm: self.guard.allows_update(loss_sum, norm))
            if applied:
                self.scheduler.step()
            else:
                self.optimizer.zero_grad(set_to_none=True)
        if dump:
            self._dump_kl(logp, batch)
        metrics, observation = step_metrics(batch, sums, maxes, entropy_sum, grad_norm, beta,
                                            self.scheduler.get_last_lr()[0], timings, self.dist, self.device)
        metrics.update(replay_metrics)
        metrics.update(self._custom_metrics(sums, batch))
        metrics["train/skipped_steps"] = self.guard.skipped_total
        return metrics, observation

    def _custom_metrics(self, sums: dict, batch: StepBatch) -> dict[str, float]:
        """The custom loss's metrics, averaged over the step's micro-batches (on every rank)."""
        names = sorted(k for k in sums if k.startswith("custom/"))
        if not names:
            return {}
        total = self.dist.sum(torch.stack([sums[k].to(self.device, torch.float32) for k in names]))
        count = len(self._micro_slices(batch.rollout.size)) * self.dist.world_size
        return {k: v / count for k, v in zip(names, total.tolist())}

    def _replay_gradients(self, main_loss) -> dict[str, float]:
        if self.engine.kind == "single":
            return self.replay.accumulate_gradients(self.model, main_loss=main_loss)
        # The replay batch is the same on every rank: its gradient is taken once (see Engine.backward).
        return self.replay.accumulate_gradients(
            self.train_forward, main_loss=self.dist.sum(main_loss),
            backward=lambda loss: self.engine.backward(loss, same_on_every_rank=True))

    def _dump_kl(self, logp: torch.Tensor, batch: StepBatch) -> None:
        from klgrpo.core.kl_dump import DUMP_DIR, save_dump

        folder = self.run_dir / DUMP_DIR
        folder.mkdir(parents=True, exist_ok=True)
        save_dump(folder / f"step_{self.step + 1:06d}.safetensors", self.step + 1, logp, batch.ref_logp,
                  batch.loss_mask)

    def evaluate(self) -> dict[str, float]:
        """Rank 0 evaluates; with sharded parameters every rank enters (to gather the weights) and waits."""
        with self.engine.full_weights(self.model):
            return evaluate_sets(self.model, self.tokenizer, self.eval_sets, self.cfg) if self.dist.is_main else {}

    # ------------------------------------------------------------------------------------------- loop
    def train_step(self) -> dict[str, float]:
        """Generate when needed, then one optimizer update and the controller update."""
        t0 = time.perf_counter()
        self._step_start = (self.sampler.state_dict(), rng_state(), self._batch,
                            self._batch.iterations_done if self._batch else 0)
        generated = self._batch is None
        if generated:
            self._batch = self.make_batch()
        batch = self._batch
        metrics, observation = self._update(batch)
        batch.iterations_done += 1
        if batch.iterations_done >= self.cfg.train.num_iterations:
            self._batch = None
        if generated:
            metrics.update(batch.timings)
        if self.guard.consecutive == 0 and math.isfinite(observation.token_mean):  # a skipped step leaves beta
            self.controller.observe(observation)
        self.step += 1
        if self.reference is not None and self.cfg.kl.sync_every and self.step % self.cfg.kl.sync_every == 0:
            self.engine.sync_reference(self.reference, self.model, self.cfg.kl.sync_alpha)
        self._step_start = None
        metrics["time/step"] = time.perf_counter() - t0
        return metrics

    def _rollback_partial_step(self) -> None:
        """Undo the data and RNG side effects of a step that did not finish (Ctrl-C mid-step)."""
        snapshot = getattr(self, "_step_start", None)
        if snapshot is None:
            return
        sampler_state, rng, batch, iterations_done = snapshot
        self.sampler.load_state_dict(sampler_state)
        set_rng_state(rng)
        self._batch = batch
        if batch is not None:
            batch.iterations_done = iterations_done
        self._step_start = None

    def _trainer_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        optimizer = self.engine.optimizer_state_dict(self.optimizer) if with_optimizer else None  # None: sharded
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "controller": self.controller.state_dict(), "sampler": self.sampler.state_dict(),
                "pending_batch": self._batch, "replay": self.replay.state_dict() if self.replay else None,
                "eval_before": self._eval_before, "guard": self.guard.state_dict()}

    def save(self, whole: bool = False) -> Path:
        """Every rank calls this (RNG states are gathered); rank 0 writes the checkpoint, into which, with
        train.sharded_checkpoints (unless ``whole``), every rank first writes its shards."""
        rng = self.dist.gather_objects(rng_state())
        if self.cfg.train.sharded_checkpoints and not whole:
            folder = shard_folder(self.run_dir, self.step, self.dist.broadcast_object(os.getpid()))
            if self.dist.is_main:
                shutil.rmtree(folder.parent, ignore_errors=True)
                folder.mkdir(parents=True)
            self.dist.barrier()
            self.engine.save_sharded(folder, self.model, self.optimizer)
            state, model_state = self._trainer_state(with_optimizer=False), SHARDS_DIR
        else:
            state, model_state = self._trainer_state(), self.engine.full_state_dict(self.model)  # collectives
        reference_state = None
        if isinstance(self.reference, FrozenCopyReference) and self.reference.synced:  # kl.sync_every's weights
            reference_state = self.engine.full_state_dict(self.reference.model)  # a collective under FSDP2
        path = self.run_dir / "checkpoints" / f"step_{self.step}"
        if self.dist.is_main:
            path = save_checkpoint(self.run_dir, self.step, model=self.model, tokenizer=self.tokenizer,
                                   trainer_state={**state, "rng_by_rank": rng}, model_state=model_state,
                                   reference=self.reference, keep=self.cfg.train.keep_checkpoints,
                                   reference_state=reference_state)
        self.dist.barrier()
        return path

    def resume(self, resume: str) -> None:
        # The newest checkpoint that loads (a corrupt newest one is named and skipped for an older one).
        ckpt, state = load_resumable_checkpoint(self, resume, apply=self._apply_state)
        self.log(f"resumed from {ckpt} at step {self.step}")

    def _apply_state(self, state: dict[str, Any]) -> None:
        if state["optimizer"] is not None:  # None: a sharded checkpoint's moments, loaded with its weights
            self.engine.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.controller.load_state_dict(state["controller"])
        self.sampler.load_state_dict(state["sampler"])
        self._batch = state.get("pending_batch")
        if self._batch is not None:
            self._batch = to_device(self._batch, self.device)
        self.guard.load_state_dict(state.get("guard"))
        if self._batch is not None and len(state.get("rng_by_rank", [None])) != self.dist.world_size:
            self._batch = None  # a half-used batch belongs to the old process layout: draw a new one
        if self.replay is not None and state.get("replay") is not None:
            self.replay.load_state_dict(state["replay"])
        rng_by_rank = state.get("rng_by_rank") or [state["rng"]]
        if len(rng_by_rank) == self.dist.world_size:
            set_rng_state(rng_by_rank[self.dist.rank])
        else:  # another world size: resumes correctly but not bit-identically
            _seed_everything(self.cfg.train.seed + self.dist.rank + 7919 * int(state["step"]))
        self._eval_before = state.get("eval_before") or {}
        self.step = int(state["step"])

    def _should_stop(self, metrics: dict[str, float], start: float, signals=None) -> bool:
        """Decided identically on every rank (the wall-clock verdict of rank 0 is shared). ``signals``: a
        ``DeferredStop`` (several processes); a signal any rank received stops all of them here, raising the
        interrupt that saves the step just completed."""
        cfg = self.cfg
        if self.guard.exhausted:
            self._stop_reason = self.guard.stop_message(self.step)
            return True
        over = bool(cfg.train.max_wall_seconds) and time.perf_counter() - start > cfg.train.max_wall_seconds
        if self.dist.enabled:
            noted = signals is not None and signals.signal is not None
            verdict = self.dist.max(torch.tensor([float(over and self.dist.is_main), float(noted)],
                                                 device=self.device))
            over = bool(verdict[0].item())
            if verdict[1].item():
                raise signals.interrupt()
        if over:
            self._stop_reason = f"train.max_wall_seconds={cfg.train.max_wall_seconds:g} reached"
        return over

    def train(self, resume: str | None = None, overwrite: bool = False) -> dict[str, Any]:
        """Run to train.steps. A fresh run refuses a folder that holds a run unless ``overwrite``; ``resume``
        ("latest", a checkpoint folder, or "auto": latest if there is one, else a fresh start) continues one
        (run_folder.py)."""
        # Rank 0 decides; a refusal reaches every rank before any collective of the run, so none is left waiting.
        if resume == "auto":
            resume, overwrite = self.dist.agreed(lambda: resolve_auto_resume(self.run_dir, self.cfg), shared=True)
        lock = self.dist.agreed(lambda: open_run_folder(self.run_dir, self.cfg, resume, overwrite, log=self.log))
        self._run_lock = lock
        try:
            return self._train(resume)
        finally:
            if lock is not None:
                lock.release()

    def _train(self, resume: str | None) -> dict[str, Any]:
        cfg, main = self.cfg, self.dist.is_main
        if resume:
            self.resume(resume)
            if self._run_lock is not None:
                self._run_lock.config_after_resume(self.log)
        start = time.perf_counter()
        # Greedy evaluation runs on rank 0 only (sharded parameters: the others help gather the weights).
        evaluate = bool(self.eval_sets) and (main or self.engine.shards_parameters)
        if evaluate and self.step == 0:
            self._eval_before = self.evaluate()
        eval_before = self._eval_before  # a resumed run keeps the numbers measured before its first step
        history = StepTally()  # what the summary needs, not every row (constant memory per step)
        logger = (MetricsLogger(self.run_dir, cfg.train.steps, tensorboard=cfg.logging.tensorboard,
                                progress=cfg.logging.progress, start_step=self.step) if main else _SilentLogger())
        with logger:
            if eval_before and self.step == 0:
                logger.log(0, eval_before)
            with sigterm_as_interrupt(deferred=self.dist.enabled) as signals, _save_on_interrupt(self, logger):
                while self.step < cfg.train.steps:
                    metrics = self.train_step()
                    if evaluate and cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                        metrics.update(self.evaluate())
                    logger.log(self.step, metrics)
                    history.append(metrics)
                    stop = self._should_stop(metrics, start, signals)
                    if cfg.train.save_every and self.step % cfg.train.save_every == 0 and not stop:
                        self.save()
                    if stop:
                        break
            if self._stop_reason:
                logger.message(f"stopped at step {self.step}: {self._stop_reason}")
            eval_after = self.evaluate() if evaluate else {}
            if eval_after:
                logger.log(self.step, eval_after)
        last = self.run_dir / "checkpoints" / f"step_{self.step}"
        if not last.exists() or (last / SHARDS_DIR).is_dir():
            self.save(whole=True)  # the last checkpoint is always whole (sharded or missing: written now)
        if main and cfg.model.lora.r > 0 and cfg.model.lora.save_merged:
            from klgrpo.backends.lora import export_merged

            export_merged(self.run_dir / "checkpoints" / f"step_{self.step}", self.run_dir / "merged",
                          base_model=_base_model_path(cfg.model) or None)
        summary = self._summary(history, eval_before, eval_after, time.perf_counter() - start)
        if main:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
            if cfg.logging.plots:
                from klgrpo.train.report import make_plots

                make_plots(self.run_dir)
        self.dist.barrier()
        if self.guard.exhausted:
            raise NonFiniteError(self.guard.stop_message(self.step))
        return summary

    def _summary(self, history, eval_before, eval_after, wall) -> dict[str, Any]:
        last = history.last
        return {
            "steps": self.step,
            "wall_seconds": round(wall, 2),
            "seconds_per_step": history.mean("time/step", digits=4),
            "eval_before": {k.removeprefix("eval/"): v for k, v in eval_before.items()},
            "eval_after": {k.removeprefix("eval/"): v for k, v in eval_after.items()},
            "final_kl": last.get("adaptive_kl/raw_kl"),
            "final_replay_kl": last.get("kl/replay"),
            "final_beta": self.controller.value,
            "final_reward": last.get("train/reward"),
            "kl_estimator": self.cfg.kl.estimator,
            "kl_placement": self.cfg.kl.placement,
            "stopped_early": self._stop_reason or None,
            "world_size": self.dist.world_size,
            "run_dir": str(self.run_dir),
        }


# ---------------------------------------------------------------------------------------------- helpers
def _base_model_path(model_cfg) -> str:
    """model.name_or_path, with model.gguf_file joined on (the spelling export_merged loads a GGUF base from)."""
    if model_cfg.gguf_file:
        return str(Path(model_cfg.name_or_path) / model_cfg.gguf_file)
    return model_cfg.name_or_path


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)  # seed + rank (+ a resume's offset) may pass numpy's upper bound
    except ImportError:
        pass


def _check_context(model, tokenizer, prompts, indices, cfg) -> None:
    """A prompt plus rollout.max_new_tokens must fit the model's context (transformers only warns, then samples
    from positions the model never saw)."""
    from klgrpo.core.rollout import encode_prompts

    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return
    texts = encode_prompts(tokenizer, prompts, cfg.data.system_prompt, cfg.data.as_chat)
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    worst = max(range(len(lengths)), key=lengths.__getitem__)
    need = lengths[worst] + cfg.rollout.max_new_tokens
    if need > limit:
        raise ConfigError(f"prompt {int(indices[worst])} of {cfg.data.source} has {lengths[worst]} tokens: with "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} it needs {need} positions, more than "
                          f"the model's context of {limit} (max_position_embeddings); shorten or drop that prompt "
                          f"(data.limit, or a filtered file) or lower rollout.max_new_tokens")


def _disable_dropout(model) -> None:
    """Dropout off, so the log-probs of the rollout policy equal the old log-probs of the first update."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _make_scheduler(optimizer, cfg: GRPOConfig):
    from transformers import get_scheduler

    name = LR_SCHEDULES[cfg.optim.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.optim.warmup_steps,
                         num_training_steps=cfg.train.steps)


def _run_dir(cfg: GRPOConfig) -> Path:
    if cfg.train.output_dir:
        return Path(cfg.train.output_dir)
    return Path("runs") / cfg.train.run_name if cfg.train.run_name else timestamped_run_dir()


class _SilentLogger:
    """The metrics sink of ranks other than 0."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def log(self, step, metrics):
        pass

    def message(self, text):
        pass


@contextmanager
def _save_on_interrupt(trainer: GRPOTrainer, logger):
    """Ctrl-C: write a checkpoint of the last completed step, then stop (exit code 130 from the CLI)."""
    try:
        yield
    except KeyboardInterrupt:
        # A second Ctrl-C (or a SIGTERM) must not cut the save short.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            trainer._rollback_partial_step()
            path = trainer.save()
            logger.message(f"interrupted: saved {path}; continue with --resume latest")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        raise
