"""The GRPO loop. It composes the arrows of docs/design.md and computes nothing itself:

    prompts --rollout--> completions --rewards--> rewards --reference--> ref logp (once per batch)
            --advantages--> A --objective--> loss (micro-batched, global normaliser) --AdamW--> controller

A "step" is one optimizer update (TRL's convention): a batch of prompts_per_step x group_size completions
is generated every ``num_iterations`` steps and reused, off-policy, by the steps in between. The policy is
loaded by backends/policy.py, the reference built by core/reference.py, AdamW and its schedule by
train/building.py; the run around the steps (lock, evaluation, logging, stop rules, checkpoints, summary) is in
train/loop.py.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from klgrpo.train.building import build_optimizer, make_scheduler, run_dir_for, seed_everything
from klgrpo.train.checkpoint import SHARDS_DIR, rng_state, save_checkpoint, set_rng_state, shard_folder
from klgrpo.train.config import GRPOConfig
from klgrpo.core.data import PromptSampler, load_prompts
from klgrpo.train.distributed import Distributed
from klgrpo.train.engine import Engine
from klgrpo.errors import ConfigError, warn
from klgrpo.train.evaluation import evaluate_sets, load_eval_sets
from klgrpo.math.advantages import group_advantages, kl_penalized_scores
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.kl_control import KLObservation
from klgrpo.math.objective import KLTerm, grpo_objective, reward_kl
from klgrpo.backends.hf import resolve_device
from klgrpo.backends.policy import load_policy, load_reference_model
from klgrpo.backends.samplers import sampler_for_run
from klgrpo.core.forward import completion_logprobs
from klgrpo.core.full_kl import completion_logprobs_and_full_kl
from klgrpo.math.full_kl import FULL_KL
from klgrpo.core.loss_api import LossInput, call_loss, resolve_loss_function
from klgrpo.core.reference import FrozenCopyReference, build_reference
from klgrpo.core.rewards import RewardComputer, RewardSpec
from klgrpo.core.rollout import SamplingParams, generate_groups, longest_prompt_tokens
from klgrpo.core.batch import StepBatch
from klgrpo.train import metric_names as names
from klgrpo.train.step_metrics import StepSums, step_metrics
from klgrpo.train.timing import phase_timer as _timed
from klgrpo.train.guard import NonFiniteGuard
from klgrpo.train.kl_watch import EntropyWatch, KLWatch
from klgrpo.train.loop import run_training
from klgrpo.train.resume import load_resumable_checkpoint
from klgrpo.train.state_io import to_device
from klgrpo.train.terms import (build_entropy_controller, build_kl_controller, entropy_in_use, entropy_term, kl_term,
                                 policy_term)
from klgrpo.train.validation import check_step_memory


class GRPOTrainer:
    """Train ``config.model`` with GRPO and the configured KL; ``train()`` returns the run summary."""

    def __init__(self, config: GRPOConfig, *, model=None, tokenizer=None, train_dataset=None,
                 eval_sets: dict[str, Any] | None = None, loss_fn=None, log=print):
        """Built in the order of the layers it draws on: the run's own settings (train/), the data and rewards
        (core/), the policy and its sampler (backends/), the reference (core/), then what trains the policy."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard save/load bars would break the step progress bar
        self.cfg = cfg = config
        self.log = log
        # The run: its settings, processes, seeds, folder name, KL controller and stop rules.
        self.warnings = config.validate(dataset_given=train_dataset is not None)
        for w in self.warnings:
            warn(w)
        if cfg.train.torch_threads:
            torch.set_num_threads(cfg.train.torch_threads)
        self.dist = Distributed(cfg.train.dist_timeout_s)
        self.engine = Engine()  # DDP / FSDP2 / DeepSpeed from `accelerate launch`, or nothing
        self.engine.check(cfg)
        if cfg.rollout.prompts_per_step % self.dist.world_size:
            raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                              f"{self.dist.world_size} processes, so every prompt's group stays on one process")
        seed_everything(cfg.train.seed + self.dist.rank)  # rank 0 samples exactly as a single process would
        self.run_dir = Path(self.dist.gather_objects(str(run_dir_for(cfg)))[0])  # rank 0's name (it has a timestamp)
        self.controller = build_kl_controller(cfg.kl)
        self.entropy_controller = build_entropy_controller(cfg.loss)  # the entropy bonus's coefficient
        self.guard = NonFiniteGuard(cfg.train.max_skipped_steps)
        self.kl_watch = KLWatch(cfg.kl.warn_above, cfg.kl.warn_below, cfg.kl.warn_window)
        self.entropy_watch = EntropyWatch(cfg.train.entropy_warn_below, cfg.train.entropy_warn_window)
        self.needs_reference = (cfg.kl.coef > 0 or cfg.kl.monitor or cfg.kl.controller != "fixed"
                                or cfg.kl.replay.coef > 0)
        self.eval_sets = eval_sets if eval_sets is not None else load_eval_sets(cfg)
        # The data: prompts, the order they are drawn in, the rewards and the loss.
        self.dataset = train_dataset or load_prompts(cfg.data.source, prompt_column=cfg.data.prompt_column,
                                                     columns=cfg.data.columns, split=cfg.data.split,
                                                     limit=cfg.data.limit or None)
        self.sampler = PromptSampler(len(self.dataset), cfg.rollout.prompts_per_step, cfg.train.seed,
                                     shuffle=cfg.data.shuffle)
        self.loss_fn = resolve_loss_function(  # None: the built-in objective
            cfg.loss.function, loss_fn, warn=warn if self.dist.is_main else None)
        self.rewards = RewardComputer([RewardSpec.parse(f) for f in cfg.rewards.functions])
        # The policy on its device, how it samples, and the reference's own weights (kl.reference) if any.
        self.device = resolve_device(cfg.model.device)
        if self.dist.device is not None and cfg.model.device == "auto":
            self.device = self.dist.device
        self.tokenizer, self.model = load_policy(cfg.model, self.device, log if self.dist.is_main else None, model,
                                                 tokenizer)
        self.rollout_sampler, why = sampler_for_run(cfg.rollout.sampler, self.model, self.device, cfg.model.fast_path,
                                                    cfg.rollout.generate_cache)
        if self.dist.is_main:
            log(f"sampler: {self.rollout_sampler} ({why})")
        if self.needs_reference and self.dist.is_main:
            log("building the reference model")
        own_reference = (load_reference_model(cfg.kl.reference, cfg.model, self.device, self.model)
                         if self.needs_reference and cfg.kl.reference else None)
        # The frozen reference: the model at kl.reference, or the policy itself (its LoRA adapter off, or a copy).
        self.reference = (build_reference(self.model, own_reference, adapter=cfg.model.lora.r > 0,
                                          fast_path=cfg.model.fast_path) if self.needs_reference else None)
        # A step beyond the free memory is refused here, not after minutes of swapping (rank 0 checks, every
        # rank gets its verdict: no rank is left waiting in a collective for one that refused).
        self.dist.agreed(self._check_step_memory)
        # What trains the policy. The loss's forward runs the policy, or with train.compile its compiled wrapper
        # (same weights); sampling, evaluation and checkpoints always use the model itself.
        self.train_forward = self.model
        if cfg.train.compile:
            self.train_forward = torch.compile(self.model)
            if isinstance(self.reference, FrozenCopyReference):
                self.reference.compile()
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.replay = None
        # One process: rank 0 alone adds the anchor's gradient. Under an engine every rank computes the same anchor
        # loss (a sharded model needs every rank in its forward) and its gradient is taken once.
        if cfg.kl.replay.coef > 0 and (self.dist.is_main or self.engine.kind != "single"):
            from klgrpo.train.replay import ReplayAnchor

            # A new or empty folder gets the cache now; one that holds files only once train() has opened it.
            fresh = not self.run_dir.is_dir() or not any(self.run_dir.iterdir())
            self.replay = ReplayAnchor.build(cfg, self.model, self.tokenizer, self.reference, self.run_dir, log=log,
                                             sampler=self.rollout_sampler, write_now=fresh)
        if self.engine.kind != "single":
            self.train_forward, self.optimizer = self.engine.prepare(self.model, self.optimizer)
            self.engine.prepare_reference(self.reference)
        self.loss_fast_path = cfg.model.fast_path and not self.engine.fast_path_outside_loss_only
        self.step = 0
        self._run_lock = None  # rank 0's, while train() runs
        self._batch: StepBatch | None = None
        self._stop_reason = ""
        self._eval_before: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ pieces
    def _check_step_memory(self) -> None:
        """Refuse a step that cannot fit in the free memory, estimated from the longest prompt as the rollout
        encodes it."""
        prompts = getattr(self.dataset, "prompts", None)
        longest = longest_prompt_tokens(
            self.tokenizer, prompts if prompts is not None else [row["prompt"] for row in self.dataset],
            self.cfg.data.system_prompt, self.cfg.data.as_chat)
        check_step_memory(self.cfg, self.model, longest, self.dist.world_size, self.device)

    def _kl_term(self) -> KLTerm:
        return kl_term(self.cfg.kl, self.controller.value)

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
        with _timed(timings, names.TIME_GENERATE), self.engine.full_weights(self.model):
            rollout = generate_groups(self.model, self.tokenizer, prompts, SamplingParams(
                group_size=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                system_prompt=cfg.data.system_prompt, as_chat=cfg.data.as_chat, compiled=cfg.train.compile,
                sampler=self.rollout_sampler))
        with _timed(timings, names.TIME_REWARD):
            columns = {k: [r[k] for r in rows for _ in range(cfg.rollout.group_size)]
                       for k in rows[0] if k != "prompt"}
            result = self.rewards(rollout.prompts, rollout.completions, columns)
        rewards = result.total.to(self.device)
        loss_mask = rollout.completion_mask
        if cfg.rollout.mask_truncated:
            loss_mask = loss_mask & ~rollout.truncated.unsqueeze(-1)
        ref_logp = old_logp = None
        with _timed(timings, names.TIME_REFERENCE):
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
            return torch.cat([completion_logprobs(self.train_forward, rollout, self.cfg.rollout.temperature, sl,
                                                  fast_path=self.loss_fast_path)[0]
                              for sl in self._micro_slices(rollout.size)])

    def accumulate_gradients(self, batch: StepBatch, keep_logp: bool = False) -> tuple[StepSums, torch.Tensor | None]:
        """Forward/backward over micro-batches; the loss is normalised globally, so .grad is the full-batch
        gradient whatever the micro-batch size. Returns (this rank's sums for the metrics, logp or None)."""
        kl = self._kl_term()
        objective, loss_sum, custom_sums = None, torch.zeros((), device=self.device), {}
        entropy_sum = torch.zeros((), device=self.device)
        logp_sum = torch.zeros((), device=self.device)  # logp/policy_mean
        kept, token_kl, token_entropy = [], [], []
        for sl in self._micro_slices(batch.rollout.size):
            loss, out, logp, entropy, custom = self._micro_batch_loss(batch, sl, kl)
            self.engine.backward(loss)
            objective = out.sums if objective is None else objective + out.sums
            for k, v in custom.items():
                custom_sums[k] = custom_sums.get(k, 0.0) + v.detach()
            loss_sum = loss_sum + loss.detach()
            logp_sum = logp_sum + (logp.detach() * batch.loss_mask[sl]).sum()
            if entropy is not None:  # the percentiles pool the completion tokens' entropies (0 elsewhere)
                token_entropy.append(entropy.detach() * batch.rollout.completion_mask[sl])
                entropy_sum = entropy_sum + token_entropy[-1].sum()
            if out.token_kl is not None:  # per-token values for the KL percentiles
                token_kl.append(out.token_kl)
            if keep_logp:
                kept.append(logp.detach())
        sums = StepSums(loss=loss_sum, entropy=entropy_sum if token_entropy else None, objective=objective,
                        custom=custom_sums, logp_policy=logp_sum,
                        token_kl=torch.cat(token_kl, 1) if token_kl else None,  # [2, B, T], micro-batches joined
                        token_entropy=torch.cat(token_entropy) if token_entropy else None)
        return sums, (torch.cat(kept) if keep_logp else None)

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
                                                with_entropy=cfg.train.entropy_metrics or entropy_in_use(cfg.loss),
                                                fast_path=self.loss_fast_path)
        old = batch.old_logp[sl] if batch.old_logp is not None else logp.detach()
        in_loss = entropy_in_use(cfg.loss)
        with torch.set_grad_enabled(self.loss_fn is None):
            out = grpo_objective(logp, old, ref, batch.advantages[sl], batch.loss_mask[sl],
                                 policy=policy_term(cfg.loss), kl=kl, aggregation=cfg.loss.aggregation,
                                 normalizer=batch.normalizer, full_kl_BT=full_kl,
                                 entropy_BT=entropy if in_loss else None,
                                 entropy=entropy_term(cfg.loss, self.entropy_controller.applied))
        if self.loss_fn is None:
            return out.loss, out, logp, entropy, {}
        rollout, prompt = batch.rollout, slice(0, batch.rollout.prompt_len)
        loss, custom = call_loss(self.loss_fn, LossInput(
            logp, old, ref, batch.advantages[sl], batch.loss_mask[sl], kl.coef, batch.normalizer,
            cfg.loss.aggregation, rollout.completion_ids[sl], rollout.input_ids[sl, prompt],
            rollout.attention_mask[sl, prompt]))
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
        with _timed(timings, names.TIME_UPDATE):
            sums, logp = self.accumulate_gradients(batch, keep_logp=dump or keep_old)
            if keep_old:
                batch.old_logp = logp
            replay_metrics = (self._replay_gradients(sums.loss) if self.replay is not None else {})
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            # A non-finite loss or gradient norm never reaches the weights: the step is skipped and counted.
            loss_sum = self.dist.sum(sums.loss) if self.dist.enabled else sums.loss  # ranks decide alike
            grad_norm, applied = self.engine.step(self.model, self.optimizer, max_norm,
                                                  allow=lambda norm: self.guard.allows_update(loss_sum, norm))
            if applied:
                self.scheduler.step()
            else:
                self.optimizer.zero_grad(set_to_none=True)
        if dump:
            self._dump_kl(logp, batch)
        metrics, observation = step_metrics(batch, sums, grad_norm, beta, self.scheduler.get_last_lr()[0], timings,
                                            self.dist, self.device)
        if entropy_in_use(cfg.loss):
            metrics[names.ENTROPY_COEF] = self.entropy_controller.applied
        metrics.update(replay_metrics)
        metrics.update(self._custom_metrics(sums.custom, batch))
        metrics[names.SKIPPED_STEPS] = self.guard.skipped_total
        return metrics, observation

    def _custom_metrics(self, custom: dict[str, torch.Tensor], batch: StepBatch) -> dict[str, float]:
        """The custom loss's metrics, averaged over the step's micro-batches (on every rank)."""
        keys = sorted(custom)
        if not keys:
            return {}
        total = self.dist.sum(torch.stack([custom[k].to(self.device, torch.float32) for k in keys]))
        count = len(self._micro_slices(batch.rollout.size)) * self.dist.world_size
        return {names.custom(k): v / count for k, v in zip(keys, total.tolist())}

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
        if self.guard.consecutive == 0 and observation.entropy is not None and math.isfinite(observation.entropy):
            self.entropy_controller.observe(observation.entropy)
        self.step += 1
        if self.reference is not None and self.cfg.kl.sync_every and self.step % self.cfg.kl.sync_every == 0:
            self.engine.sync_reference(self.reference, self.model, self.cfg.kl.sync_alpha)
        self._step_start = None
        metrics[names.TIME_STEP] = time.perf_counter() - t0
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
                "entropy_controller": self.entropy_controller.state_dict(),
                "pending_batch": self._batch, "replay": self.replay.state_dict() if self.replay else None,
                "eval_before": self._eval_before, "guard": self.guard.state_dict(),
                "kl_watch": self.kl_watch.state_dict(), "entropy_watch": self.entropy_watch.state_dict()}

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
        if state.get("entropy_controller") is not None:  # absent in checkpoints written before the entropy bonus
            self.entropy_controller.load_state_dict(state["entropy_controller"])
        self.sampler.load_state_dict(state["sampler"])
        self._batch = state.get("pending_batch")
        if self._batch is not None:
            self._batch = to_device(self._batch, self.device)
        self.guard.load_state_dict(state.get("guard"))
        self.kl_watch.load_state_dict(state.get("kl_watch"))
        self.entropy_watch.load_state_dict(state.get("entropy_watch"))
        if self._batch is not None and len(state.get("rng_by_rank", [None])) != self.dist.world_size:
            self._batch = None  # a half-used batch belongs to the old process layout: draw a new one
        if self.replay is not None and state.get("replay") is not None:
            self.replay.load_state_dict(state["replay"])
        rng_by_rank = state.get("rng_by_rank") or [state["rng"]]
        if len(rng_by_rank) == self.dist.world_size:
            set_rng_state(rng_by_rank[self.dist.rank])
        else:  # another world size: resumes correctly but not bit-identically
            seed_everything(self.cfg.train.seed + self.dist.rank + 7919 * int(state["step"]))
        self._eval_before = state.get("eval_before") or {}
        self.step = int(state["step"])

    def train(self, resume: str | None = None, overwrite: bool = False,
              summary_extras: Callable[[dict], dict] | None = None) -> dict[str, Any]:
        """Run to train.steps. A fresh run refuses a folder that holds a run unless ``overwrite``; ``resume``
        ("latest" or a checkpoint folder) continues one (run_folder.py). ``summary_extras(summary)`` returns
        fields to add to the summary before summary.json is written (the demo's). The loop: train/loop.py."""
        return run_training(self, resume, overwrite, summary_extras)


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
