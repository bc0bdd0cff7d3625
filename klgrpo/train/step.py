"""One GRPO optimizer step. It composes the arrows of docs/design.md and computes nothing itself:

    prompts --rollout--> completions --rewards--> rewards --reference--> ref logp (once per batch)
            --advantages--> A --objective--> loss (micro-batched, global normaliser) --AdamW--> controller

A "step" is one optimizer update (TRL's convention): a batch of prompts_per_step x group_size completions
is generated every ``num_iterations`` steps and reused, off-policy, by the steps in between.

``GRPOStep`` holds what a step needs (policy, reference, optimizer, scheduler, KL controller, non-finite guard,
the batch being reused) and knows nothing of run folders, locks or logs: ``make_batch()``, ``update(batch)``,
``advance()`` (both, as a run calls them), and ``save(folder)`` / ``load(folder)``, which write and read everything
it owns in a checkpoint folder the run names, or ``snapshot()`` / ``restore(snapshot)`` in memory (a rollback), and
``rescale(beta_factor, lr_factor)``. Its state has no other owner: nothing outside it sets its optimizer, scheduler
or controllers (train/step_state.py holds the plain helpers, over its parts, that these compose). It is built by
``train/step_build.py``; the run around the steps is ``run/loop.py``'s ``TrainingRun``.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from klgrpo.backends.samplers import Sampler
from klgrpo.config.terms import StepPlan
from klgrpo.core.batch import StepBatch, micro_slices
from klgrpo.core.data import PromptSampler, dataset_prompts
from klgrpo.core.forward import completion_logprobs
from klgrpo.core.full_kl import completion_logprobs_and_full_kl
from klgrpo.core.kept_sets import kept_set_pass
from klgrpo.core.loss_api import LossInput, call_loss
from klgrpo.core.rewards import RewardComputer
from klgrpo.core.rollout import (
    PromptTooLong,
    SamplingParams,
    compiling_sampler,
    encode_groups,
    generate_groups,
    grouped_batch,
    warm_up_sampler,
)
from klgrpo.errors import ConfigError, KLGRPOError
from klgrpo.math.advantages import group_advantages, kl_penalized_scores
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.full_kl import FULL_KL
from klgrpo.math.kl_control import EntropyController, KLController, KLObservation
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, grpo_objective, reward_kl
from klgrpo.store.checkpoint import SHARDS_DIR, load_trainer_state, rng_state, set_rng_state, write_checkpoint_files
from klgrpo.store.state_io import to_device
from klgrpo.train import metric_names as names
from klgrpo.train.building import seed_everything
from klgrpo.train.distributed import Distributed
from klgrpo.train.engine import Engine
from klgrpo.train.guard import NonFiniteGuard
from klgrpo.train.pipeline import IssuedBatch, shared_weights
from klgrpo.train.step_metrics import StepSums, kept_set_metrics, sampler_metrics, step_metrics
from klgrpo.train.step_state import (
    StepSnapshot,
    cpu_copy,
    load_weights,
    state_named,
    synced_reference_model,
    synced_reference_state,
    tensor_bytes,
    trainable,
)
from klgrpo.train.stop_signals import StopGate
from klgrpo.train.timing import phase_timer as _timed


def _rows(values: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    return None if values is None else values[sl]


@dataclass
class GRPOStep:
    """One optimizer update at a time on the configured policy; ``completed`` counts the updates done.

    ``train_forward`` runs the loss's forward: the policy itself, its compiled wrapper (train.compile) or the
    engine's wrapped module (same weights); sampling, evaluation and checkpoints use ``model``."""

    plan: StepPlan
    dist: Distributed
    engine: Engine
    device: torch.device
    dataset: Any
    prompt_order: PromptSampler
    rewards: RewardComputer
    loss_fn: Callable | None
    tokenizer: Any
    model: Any
    sampler: Sampler
    reference: Any
    train_forward: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    controller: KLController
    entropy_controller: EntropyController  # the entropy bonus's coefficient
    guard: NonFiniteGuard
    replay: Any = None
    loss_fast_path: bool = True
    #: rollout.max_staleness > 0: the generation process (train/pipeline.py) and the batches handed to it
    pipeline: Any = None
    issued: list[IssuedBatch] = field(default_factory=list)
    completed: int = 0
    #: how many times this process's step changed the policy's weights (optimizer steps, loads): the version a
    #: sampler holding its own copy compares with its own (``Sampler.sync_weights``)
    weights_version: int = 0
    batch: StepBatch | None = None
    #: the data position, RNG and pending batch before the step in progress (``rollback``)
    _started: tuple | None = field(default=None, repr=False)
    #: held from the optimizer step on: a stop then waits for the step's end (the run releases it)
    stop_gate: StopGate = field(default_factory=StopGate, repr=False)

    # ------------------------------------------------------------------------------------------ the batch
    def sampling_params(self) -> SamplingParams:
        return replace(self.plan.sampling, sampler=self.sampler)

    def start(self, log: Callable | None = None) -> list[int]:
        """Before the first step of this process, once the run has opened its folder: the files the step keeps
        there (the replay anchor's sampled cache: before that the folder may be another run's), then the sampler's
        warm-up (``warm_up``). Returns the prompt widths compiled."""
        if self.replay is not None and self.dist.is_main:
            self.replay.write_cache()
        return self.warm_up(log)

    def warm_up(self, log: Callable | None = None) -> list[int]:
        """Before the first step of this process: compile every prompt width the sampler will meet, where it
        compiles per shape (transformers' static cache on CUDA), so no step pays for a shape it meets first;
        ``log`` gets one line saying so. Sampling afterwards is what it would have been without. Returns the
        widths compiled."""
        params = self.sampling_params()
        if compiling_sampler(self.model, params) is None:  # nothing to compile: no gathering of sharded weights
            return []
        per_rank = self.plan.prompts_per_step // self.dist.world_size  # local_slice's share

        def announce(widths: list[int]) -> None:
            if log is not None:
                log(f"compiling the sampler ({self.sampler.name}) before the first step, once per prompt width a "
                    f"batch of {per_rank * params.group_size} rows can have: {', '.join(map(str, widths))} tokens")

        with self.engine.full_weights(self.model):
            return warm_up_sampler(self.model, self.tokenizer, dataset_prompts(self.dataset), params, per_rank,
                                   announce)

    def kl_term(self) -> KLTerm:
        return self.plan.kl_term(self.controller.value)

    def make_batch(self) -> StepBatch:
        """Sample the next prompts' groups (or, generating ahead, take the batch drawn for this step), score them,
        and compute the reference log-probs and advantages."""
        plan, timings = self.plan, {}
        if self.pipeline is not None:
            with _timed(timings, names.TIME_GENERATE):  # the wait for the generation process: what it did not hide
                rows, rollout = self._drawn_ahead(timings)
        else:
            indices = self.prompt_order.next_indices()  # the same global indices on every rank
            local = indices[self.dist.local_slice(len(indices))]
            rows = [self.dataset[i] for i in local]
            with _timed(timings, names.TIME_GENERATE), self._weights_for_sampling(), self._prompt_named(local):
                rollout = generate_groups(self.model, self.tokenizer, [r["prompt"] for r in rows],
                                          self.sampling_params())
        with _timed(timings, names.TIME_REWARD):
            columns = {k: [r[k] for r in rows for _ in range(plan.sampling.group_size)]
                       for k in rows[0] if k != "prompt"}
            result = self.rewards(rollout.prompts, rollout.completions, columns)
        if result.model_seconds is not None:  # the reward models' own phase: time/reward keeps the others' time
            timings[names.TIME_REWARD] -= result.model_seconds
            timings[names.TIME_REWARD_MODEL] = result.model_seconds
        rewards = result.total.to(self.device)
        loss_mask = rollout.completion_mask
        if plan.mask_truncated:
            loss_mask = loss_mask & ~rollout.truncated.unsqueeze(-1)
        ref_logp = old_logp = kept_sets = None
        with _timed(timings, names.TIME_REFERENCE):
            if plan.trains_kept_sets:  # the reference renormalised over the policy's kept sets (core/kept_sets.py)
                kept_sets = kept_set_pass(self.train_forward, self.reference, rollout,
                                          self._micro_slices(rollout.size))
                rollout.kept_count = kept_sets.kept_count
                ref_logp = kept_sets.ref_logp if self.reference is not None else None
            else:
                rollout.kept_count = None  # rollout.truncation ignore: the whole softmax, as the trainer scored it
                if self.reference is not None:
                    ref_logp = self.reference.logprobs(rollout, plan.sampling.temperature, plan.micro_batch_size)
        scores, kl = rewards, self.kl_term()
        if plan.old_from_sampler:  # the sampler's log-probs are pi_old (rollout.old_logprobs sampler): no forward
            old_logp = self._sampler_logprobs(rollout)
        if ref_logp is not None and kl.in_reward and kl.reward_mode == "sequence_score" and kl.coef > 0:
            if old_logp is None:  # pi_old: the KL must be in the score before normalising
                old_logp = self._rollout_logprobs(rollout)
            scores = kl_penalized_scores(rewards, reward_kl(old_logp, ref_logp, kl), loss_mask, kl.coef)
        all_scores = self.dist.gather(scores)  # groups never straddle ranks; "batch" scale needs them all
        advantages = group_advantages(all_scores, plan.sampling.group_size, plan.advantage_scale,
                                      plan.std_eps, plan.std_ddof)[self.dist.local_slice(all_scores.numel())]
        return StepBatch(rollout=rollout, rewards=rewards, reward_columns=result.per_function,
                         advantages=advantages, loss_mask=loss_mask,
                         normalizer=Normalizer(num_sequences=float(all_scores.numel()),
                                               num_tokens=self.dist.sum(loss_mask.sum().to(torch.float32)),
                                               max_len=float(plan.sampling.max_new_tokens)),
                         ref_logp=ref_logp, old_logp=old_logp, kept_sets=kept_sets, timings=timings)

    @contextmanager
    def _prompt_named(self, local) -> Iterator[None]:
        """A prompt too long for the model, said in the run's terms: which row of which file, and the remedy."""
        try:
            yield
        except PromptTooLong as exc:
            raise ConfigError(
                f"prompt {int(local[exc.index])} of {self.plan.data_source} has {exc.tokens} tokens: with "
                f"rollout.max_new_tokens={exc.max_new_tokens} it needs {exc.tokens + exc.max_new_tokens} "
                f"positions, more than the model's context of {exc.limit} (max_position_embeddings); shorten "
                f"or drop that prompt (data.limit, or a filtered file) or lower rollout.max_new_tokens") from None

    # ----------------------------------------------------------------------- generating ahead (max_staleness)
    def issue_ahead(self) -> None:
        """rollout.max_staleness K: hand the generation process every batch up to this step's + K not issued yet,
        drawn from the weights as they are now: batch t + K from those after t updates. The last steps issue
        batches beyond train.steps too: the final checkpoint holds them, so a resume with more steps continues as
        the longer run would have."""
        index = self.completed + len(self.issued)
        while index <= self.completed + self.plan.max_staleness:
            indices = self.prompt_order.next_indices()
            local = [int(i) for i in indices[self.dist.local_slice(len(indices))]]
            params = self.sampling_params()
            with self._prompt_named(local):
                encoded = encode_groups(self.model, self.tokenizer, [self.dataset[i]["prompt"] for i in local],
                                        params)
            self.pipeline.submit(index, encoded, params, self.weights_version, lambda: shared_weights(self.model))
            self.issued.append(IssuedBatch(index=index, drawn_at=self.completed, local=local, encoded=encoded))
            index += 1

    def _drawn_ahead(self, timings: dict) -> tuple[list, Any]:
        """(the dataset rows, the rollout) of the batch issued for this step, waited for; one drawn more than
        rollout.max_staleness updates back is refused."""
        if not self.issued or self.issued[0].index != self.completed:
            raise KLGRPOError(f"no batch was issued for step {self.completed + 1} (rollout.max_staleness): report "
                              f"this")
        item = self.issued.pop(0)
        staleness = self.completed - item.drawn_at
        if not 0 <= staleness <= self.plan.max_staleness:
            raise KLGRPOError(f"the batch for step {self.completed + 1} was drawn {staleness} updates back, beyond "
                              f"rollout.max_staleness {self.plan.max_staleness}: it is not trained on")
        # logged with the batch's timings (its own metrics, written once when it is generated)
        timings[names.ROLLOUT_STALENESS_MEAN] = timings[names.ROLLOUT_STALENESS_MAX] = float(staleness)
        return [self.dataset[i] for i in item.local], self._collected(item)

    def _collected(self, item: IssuedBatch):
        """``item``'s rollout, waited for where it is still in the generation process."""
        if item.rollout is None:
            sampled, sampler_name = self.pipeline.result(item.index)
            item.rollout = grouped_batch(self.model, self.tokenizer, item.encoded, sampled,
                                         self.plan.sampling.group_size, sampler_name)
            item.encoded = None
        return item.rollout

    def close(self) -> None:
        """Release what the step holds for sampling: the generation process, the sampler's engine."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.sampler.close()

    def _weights_for_sampling(self):
        """The context sampling runs in. A sampler with its own copy of the weights (vLLM) gets them pushed one
        tensor at a time when they changed, and the policy stays sharded; any other samples from the policy
        itself, gathered whole for it (``Engine.full_weights``)."""
        if not self.sampler.holds_weights:
            self.sampler.sync_weights(self.model, self.weights_version)
            return self.engine.full_weights(self.model)
        self.sampler.sync_weights(self.model, self.weights_version, lambda: self.engine.whole_weights(self.model))
        return nullcontext()

    def _micro_slices(self, n: int) -> list[slice]:
        return micro_slices(n, self.plan.micro_batch_size)

    def _sampler_logprobs(self, rollout) -> torch.Tensor:
        """The sampler's log-probs as pi_old, padded with 0 to the completions' width."""
        if rollout.sampler_logp is None:
            raise ConfigError(f"rollout.old_logprobs sampler: rollout.sampler {self.sampler.name} gave no log-probs "
                              f"for this batch (greedy decoding gives none); set rollout.old_logprobs trainer")
        return rollout.sampler_logp.to(self.device, torch.float32) * rollout.completion_mask

    def _rollout_logprobs(self, rollout) -> torch.Tensor:
        """log pi_old of the sampled tokens (no gradient), micro-batched like the update's forward."""
        with torch.no_grad():
            return torch.cat([completion_logprobs(self.train_forward, rollout, self.plan.sampling.temperature, sl,
                                                  fast_path=self.loss_fast_path, kept_sets=True)[0]
                              for sl in self._micro_slices(rollout.size)])

    # ----------------------------------------------------------------------------------------- the update
    def accumulate_gradients(self, batch: StepBatch, keep_logp: bool = False) -> tuple[StepSums, torch.Tensor | None]:
        """Forward/backward over micro-batches; the loss is normalised globally, so .grad is the full-batch
        gradient whatever the micro-batch size. Returns (this rank's sums for the metrics, logp or None)."""
        kl = self.kl_term()
        objective, loss_sum, custom_sums = None, torch.zeros((), device=self.device), {}
        entropy_sum = torch.zeros((), device=self.device)
        logp_sum = torch.zeros((), device=self.device)  # logp/policy_mean
        kept, token_kl, token_entropy = [], [], []
        slices = self._micro_slices(batch.rollout.size)
        for i, sl in enumerate(slices):
            loss, out, logp, entropy, custom = self._micro_batch_loss(batch, sl, kl)
            self.engine.backward(loss, last=i == len(slices) - 1 and self.replay is None)
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
        plan, temperature = self.plan, self.plan.sampling.temperature
        ref = batch.ref_logp[sl] if batch.ref_logp is not None else None
        full_kl = None
        if kl.estimator == FULL_KL and self.reference is not None:  # the reference re-runs here (core.full_kl)
            logp, entropy, full_kl = completion_logprobs_and_full_kl(
                self.train_forward, self.reference, batch.rollout, temperature, sl, ref)
        else:
            logp, entropy = completion_logprobs(self.train_forward, batch.rollout, temperature, sl,
                                                with_entropy=plan.with_entropy, fast_path=self.loss_fast_path,
                                                kept_sets=True)
        old = batch.old_logp[sl] if batch.old_logp is not None else logp.detach()
        with torch.set_grad_enabled(self.loss_fn is None):
            inputs = ObjectiveInputs(logp, old, ref, batch.advantages[sl], batch.loss_mask[sl], full_kl_BT=full_kl,
                                     entropy_BT=entropy if plan.entropy_in_loss else None,
                                     sampler_logp_BT=_rows(batch.rollout.sampler_logp, sl))
            terms = ObjectiveTerms(kl=kl, aggregation=plan.aggregation, policy=plan.policy,
                                   entropy=plan.entropy_term(self.entropy_controller.applied),
                                   sampler_correction=plan.sampler_correction)
            out = grpo_objective(inputs, terms, batch.normalizer)
        if self.loss_fn is None:
            return out.loss, out, logp, entropy, {}
        rollout, prompt = batch.rollout, slice(0, batch.rollout.prompt_len)
        loss, custom = call_loss(self.loss_fn, LossInput(
            logp, old, ref, batch.advantages[sl], batch.loss_mask[sl], kl.coef, batch.normalizer,
            plan.aggregation, rollout.completion_ids[sl], rollout.input_ids[sl, prompt],
            rollout.attention_mask[sl, prompt]))
        return loss, out, logp, entropy, custom

    def update(self, batch: StepBatch, dump_kl: Callable | None = None) -> tuple[dict[str, float], KLObservation]:
        """One optimizer step on ``batch``: gradients, clipping, AdamW, scheduler. ``dump_kl(logp, batch)``, when
        given, receives the policy's log-probs of this update (kl.dump_every)."""
        beta = self.controller.value
        timings: dict[str, float] = {}
        if batch.ref_logp is None:
            dump_kl = None  # nothing to compare the policy with
        # The first update of a batch runs at the sampling policy, so its log-probs ARE pi_old: later updates of
        # the same batch reuse them instead of paying a separate no-grad forward.
        keep_old = batch.old_logp is None and self.plan.num_iterations > 1
        # The sampler panel compares mu with the trainer's pi_old: this update's log-probs on a batch's first update
        # (taken at the sampling weights), the kept ones after it.
        first = batch.iterations_done == 0
        scores_sampler = batch.rollout.sampler_logp is not None and first
        self.optimizer.zero_grad(set_to_none=True)
        with _timed(timings, names.TIME_UPDATE):
            sums, logp = self.accumulate_gradients(batch, keep_logp=dump_kl is not None or keep_old or scores_sampler)
            if first and self.plan.old_from_sampler and self.plan.num_iterations > 1:
                batch.trainer_old_logp = logp  # old_logp holds mu
            trainer_old = logp if first else (batch.trainer_old_logp if self.plan.old_from_sampler
                                              else batch.old_logp)
            if keep_old:
                batch.old_logp = logp
            replay_metrics = (self._replay_gradients(sums.loss) if self.replay is not None else {})
            # A non-finite loss or gradient norm never reaches the weights: the step is skipped and counted.
            loss_sum = self.dist.sum(sums.loss) if self.dist.enabled else sums.loss  # ranks decide alike
            self.stop_gate.hold()  # the weights change now: rollback() could no longer undo this step
            grad_norm, applied = self.engine.step(self.model, self.optimizer, self.plan.max_grad_norm,
                                                  allow=lambda norm: self.guard.allows_update(loss_sum, norm))
            if applied:
                self.scheduler.step()
                self.weights_version += 1  # a sampler holding its own copy of the weights refreshes it
            else:
                self.optimizer.zero_grad(set_to_none=True)
        if dump_kl is not None:
            dump_kl(logp, batch)
        metrics, observation = step_metrics(batch, sums, grad_norm, beta, self.scheduler.get_last_lr()[0], timings,
                                            self.dist, self.device)
        if self.plan.entropy_in_loss:
            metrics[names.ENTROPY_COEF] = self.entropy_controller.applied
        metrics.update(replay_metrics)
        if batch.rollout.sampler_logp is not None and trainer_old is not None:
            metrics.update(sampler_metrics(trainer_old, batch.rollout.sampler_logp, batch.rollout.completion_mask,
                                           int(batch.normalizer.max_len), self.dist, self.plan.sampler_correction))
        if batch.kept_sets is not None:
            metrics.update(kept_set_metrics(batch.kept_sets.log_kept_mass, batch.kept_sets.mismatch,
                                            batch.rollout.completion_mask, int(batch.normalizer.max_len), self.dist))
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

    # ------------------------------------------------------------------------------------------ a whole step
    def advance(self, dump_kl: Callable | None = None) -> tuple[dict[str, float], KLObservation]:
        """Generate when needed, then one optimizer update and the controller's; returns the step's metrics and
        the KL the controller observed. ``rollback()`` undoes a call that did not return."""
        t0 = time.perf_counter()
        self.stop_gate.reset()  # a caller of train_step() alone never released the previous step's
        if self.pipeline is not None:
            self.issue_ahead()  # never undone: what it issued is drawn the same whenever it is taken
        self._started = (self.prompt_order.state_dict(), rng_state(), self.batch,
                         self.batch.iterations_done if self.batch else 0, list(self.issued))
        generated = self.batch is None
        if generated:
            self.batch = self.make_batch()
        batch = self.batch
        metrics, observation = self.update(batch, dump_kl)
        batch.iterations_done += 1
        if batch.iterations_done >= self.plan.num_iterations:
            self.batch = None
        if generated:
            metrics.update(batch.timings)
        if self.guard.consecutive == 0 and math.isfinite(observation.token_mean):  # a skipped step leaves beta
            self.controller.observe(observation)
        if self.guard.consecutive == 0 and observation.entropy is not None and math.isfinite(observation.entropy):
            self.entropy_controller.observe(observation.entropy)
        self.completed += 1
        sync_every = self.plan.sync_every
        if self.reference is not None and sync_every and self.completed % sync_every == 0:
            self.engine.sync_reference(self.reference, self.model, self.plan.sync_alpha)
        self._started = None
        metrics[names.TIME_STEP] = time.perf_counter() - t0
        return metrics, observation

    def rollback(self) -> None:
        """Undo the data and RNG side effects of a step that did not reach its optimizer step (Ctrl-C mid-step;
        from the optimizer step on, ``stop_gate`` lets the step finish)."""
        self.stop_gate.reset()
        self._undo_unfinished()

    def _undo_unfinished(self) -> None:
        if self._started is None:
            return
        order, rng, batch, iterations_done, issued = self._started
        self.issued = issued
        self.prompt_order.load_state_dict(order)
        set_rng_state(rng)
        self.batch = batch
        if batch is not None:
            batch.iterations_done = iterations_done
        self._started = None

    # ---------------------------------------------------------------------------------------------- state
    def state_dict(self, with_optimizer: bool = True) -> dict[str, Any]:
        """Everything a resume needs from the step but the weights and the RNG; every rank calls it (the engine
        gathers sharded AdamW moments). ``with_optimizer=False``: the moments travel with a sharded checkpoint's
        shards."""
        optimizer = self.engine.optimizer_state_dict(self.optimizer) if with_optimizer else None
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "controller": self.controller.state_dict(), "sampler": self.prompt_order.state_dict(),
                "entropy_controller": self.entropy_controller.state_dict(),
                "pending_batch": self.batch, "replay": self.replay.state_dict() if self.replay else None,
                "guard": self.guard.state_dict(), "step": self.completed,
                "issued": self._issued_state()}

    def load_state_dict(self, state: dict[str, Any], same_layout: bool = True) -> None:
        """Restore ``state_dict()``'s output; ``same_layout=False`` (another world size) drops a half-used batch,
        which belongs to the old process layout."""
        if state["optimizer"] is not None:  # None: a sharded checkpoint's moments, loaded with its weights
            self.engine.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.controller.load_state_dict(state["controller"])
        if state.get("entropy_controller") is not None:  # absent in checkpoints written before the entropy bonus
            self.entropy_controller.load_state_dict(state["entropy_controller"])
        self.prompt_order.load_state_dict(state["sampler"])
        batch = state.get("pending_batch")
        self.batch = to_device(batch, self.device) if batch is not None and same_layout else None
        self.guard.load_state_dict(state.get("guard"))
        self._load_issued(state.get("issued") or [], same_layout)
        if self.replay is not None and state.get("replay") is not None:
            self.replay.load_state_dict(state["replay"])
        self.completed = int(state["step"])

    def _issued_state(self) -> list[dict]:
        """The batches issued ahead, each waited for: a checkpoint holds their rollouts, never a batch in flight."""
        for item in self.issued:
            self._collected(item)
        return [item.state() for item in self.issued]

    def _load_issued(self, issued: list[dict], same_layout: bool) -> None:
        """The batches a checkpoint had issued ahead, in place of what the generation process holds now (dropped).
        A run without rollout.max_staleness, or another process layout, cannot take them: refused, since the
        prompt order has moved past them."""
        if self.pipeline is not None:
            self.pipeline.drain()
        if issued and (self.pipeline is None or not same_layout):
            raise ConfigError(f"the checkpoint holds {len(issued)} batch(es) drawn ahead with rollout.max_staleness "
                              f"> 0; resume it with rollout.max_staleness set as it was, on as many processes")
        self.issued = [IssuedBatch.from_state(item) for item in issued]
        for item in self.issued:
            item.rollout = to_device(item.rollout, self.device)

    @property
    def beta(self) -> float:
        """The KL controller's current beta."""
        return self.controller.value

    @property
    def beta_updates(self) -> int:
        """How many times the KL controller has updated beta."""
        return self.controller.num_updates

    def rescale(self, beta_factor: float, lr_factor: float) -> tuple[float, float]:
        """beta x ``beta_factor``; the learning rate, and the schedule it follows from here on, x ``lr_factor``.
        Returns the new beta and the schedule's base learning rate (this step's lr may be a warm-up's 0)."""
        self.controller.value *= beta_factor
        for group in getattr(self.optimizer, "optimizer", self.optimizer).param_groups:  # an engine's wrapper
            group["lr"] *= lr_factor
            if "initial_lr" in group:  # the schedule's start, which a scheduler built later reads
                group["initial_lr"] *= lr_factor
        self.scheduler.base_lrs = [lr * lr_factor for lr in self.scheduler.base_lrs]
        return self.controller.value, self.scheduler.base_lrs[0]

    # ------------------------------------------------------------------------------------------- in memory
    def snapshot(self) -> StepSnapshot:
        """CPU copies of the trainable weights, a synced reference's weights, the state and the RNG, which
        ``restore`` puts back without a checkpoint folder (one process: the weights are this process's)."""
        reference = synced_reference_model(self.reference)
        return StepSnapshot(weights=cpu_copy(trainable(self.model)),
                            reference=cpu_copy(reference.state_dict()) if reference is not None else None,
                            state=cpu_copy(self.state_dict()), rng=cpu_copy(rng_state()))

    def restore(self, snapshot: StepSnapshot) -> None:
        """Put ``snapshot()``'s copies back; the snapshot stays intact for another restore (the live state gets
        copies of it, which AdamW then updates in place)."""
        with torch.no_grad():
            for name, param in trainable(self.model).items():
                param.copy_(snapshot.weights[name])
            reference = synced_reference_model(self.reference)
            if snapshot.reference is not None and reference is not None:
                reference.load_state_dict(snapshot.reference)
        self.weights_version += 1  # as a load: a sampler with its own copy pushes them again
        self.load_state_dict(cpu_copy(snapshot.state))
        set_rng_state(cpu_copy(snapshot.rng))

    def snapshot_bytes(self) -> int:
        """What ``snapshot()`` holds: the trainable weights and their two AdamW moments, and a synced reference."""
        reference = synced_reference_model(self.reference)
        weights = tensor_bytes(trainable(self.model).values())
        return 3 * weights + (tensor_bytes(reference.state_dict().values()) if reference is not None else 0)

    # ----------------------------------------------------------------------------------------- checkpoint
    def save(self, folder: Path, *, sharded: bool = False, run_state: dict | None = None) -> None:
        """Write everything the step owns into ``folder`` (train/step_state.py's helpers); every rank calls it. A
        step interrupted before its optimizer step is undone first: a checkpoint holds the last completed step.
        ``sharded``: every rank writes its shards of the weights and AdamW moments into folder/sharded, rank 0 the
        rest. ``run_state``: the run's own part of the state, stored beside the step's and returned by ``load``."""
        self._undo_unfinished()
        engine, dist = self.engine, self.dist
        rng_by_rank = dist.gather_objects(rng_state())
        model_state = None
        if sharded:
            engine.save_sharded(Path(folder) / SHARDS_DIR, self.model, self.optimizer)
            state = self.state_dict(with_optimizer=False)
        else:
            state = self.state_dict()
            model_state = engine.full_state_dict(self.model)  # collectives
        reference_state = synced_reference_state(engine, self.reference)  # kl.sync_every's weights
        if dist.is_main:
            write_checkpoint_files(folder, model=self.model, tokenizer=self.tokenizer, reference=self.reference,
                                   trainer_state={**(run_state or {}), **state, "rng_by_rank": rng_by_rank},
                                   model_state=model_state, reference_state=reference_state, sharded=sharded)

    def load(self, folder: Path) -> dict[str, Any]:
        """Read everything the step owns from the checkpoint ``folder``; returns the whole trainer state (the run's
        part included). Raises CheckpointLoadError naming the file that cannot be read or used. The trainer state
        is read before anything is applied; the weights are applied first (a failure afterwards leaves them
        changed, and the next candidate checkpoint overwrites them)."""
        self.weights_version += 1  # the weights change (a sampler with its own copy pushes them again)
        state = load_trainer_state(Path(folder))
        load_weights(folder, engine=self.engine, model=self.model, optimizer=self.optimizer,
                     reference=self.reference, device=self.device)
        with state_named(folder):
            # Checkpoints before every rank's RNG was kept hold one state, "rng" (rank 0's).
            rng_by_rank = state.get("rng_by_rank") or [state["rng"]]
            same_layout = len(rng_by_rank) == self.dist.world_size
            self.load_state_dict(state, same_layout=same_layout)
            if same_layout:
                set_rng_state(rng_by_rank[self.dist.rank])
            else:  # another world size: resumes correctly but not bit-identically
                seed_everything(self.plan.seed + self.dist.rank + 7919 * int(state["step"]))
        return state

    @contextmanager
    def full_weights(self) -> Iterator[Any]:
        """The policy with its full weights (sharded engines gather them; every rank enters), for evaluation."""
        with self.engine.full_weights(self.model):
            yield self.model

