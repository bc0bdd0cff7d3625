"""Generation while training (rollout.max_staleness K > 0): the next batches are drawn while the trainer updates,
each batch b from the weights of update max(0, b - K), a fixed lag.

    trainer, before step t     issue batch t + K (the prompts drawn and encoded here, the weights after t updates
                               copied once per version); wait for batch t, drawn K updates back (t < K: from the
                               start)
    GenerationProcess          kv_loop and generate: a process of its own with its own copy of the policy and its
                               own torch threads (rollout.generation_threads); for each batch: the weights of its
                               version put in, the random state seeded from (train.seed, b), the sampler's draw
                               sent back. The weights cross as shared-memory tensors, never through the disk.
    ServerPipeline             vllm_server: a thread of the trainer's that sends each batch's weights (from the
                               copy taken when it was issued) and its request, seeded from (train.seed, b), to the
                               server, which is a process of its own already

``open_pipeline`` picks one for the run's sampler. Every rollout carries the
update count it was drawn at, and a batch more than K updates old is refused, never trained on. Because batch b's
draw depends only on (the weights after b - K updates, the seed, b), a run is reproducible at a seed; a checkpoint
holds the batches already issued (their rollouts, waited for), so a resume draws nothing twice and loses nothing.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import sys
import traceback
import types
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import Tensor

from klgrpo.backends.sampling import SampledRollout, SamplingParams
from klgrpo.core.rollout import EncodedPrompts, RolloutBatch
from klgrpo.errors import KLGRPOError, first_line

#: seconds the trainer waits for the generation process to start (import torch and transformers, build the model)
START_TIMEOUT_S = 600.0
#: how often a wait checks that the generation process is still alive
POLL_S = 0.5


@dataclass
class IssuedBatch:
    """A batch handed to the generation process (``rollout`` None until it came back) or brought back by a resume.

    index       the batch's number in the run (0, 1, ...): batch t trains step t
    drawn_at    the updates the weights it was drawn with had had (the policy's version)
    local       the dataset rows of its prompts, in order
    encoded     its prompts as the sampler took them (None once the rollout is in)
    rollout     the padded batch of its completions
    """

    index: int
    drawn_at: int
    local: list[int]
    encoded: EncodedPrompts | None = None
    rollout: RolloutBatch | None = None
    sampler_name: str = ""

    def state(self) -> dict:
        """As a checkpoint stores it (the rollout in; data only)."""
        return {"index": self.index, "drawn_at": self.drawn_at, "local": list(self.local), "rollout": self.rollout}

    @classmethod
    def from_state(cls, state: dict) -> "IssuedBatch":
        return cls(index=int(state["index"]), drawn_at=int(state["drawn_at"]), local=[int(i) for i in state["local"]],
                   rollout=state["rollout"])


def batch_seed(seed: int, index: int) -> int:
    """The generation process's random seed for batch ``index`` of a run at train.seed ``seed``."""
    return (seed * 1_000_003 + index * 7919 + 17) % (2 ** 63)


def split_threads(total: int, generation_threads: int) -> tuple[int, int]:
    """(the trainer's torch threads, the generation process's) out of ``total``: rollout.generation_threads, or
    half of them (0), each at least 1."""
    generation = generation_threads or max(1, total // 2)
    return max(1, total - generation), generation


def open_pipeline(model, sampler, threads: int, seed: int, trainer_threads: int | None = None):
    """The run's pipeline for its ``sampler`` (a Sampler): the server's thread for vllm_server, else a
    generation process of ``threads`` torch threads (this process keeps ``trainer_threads``)."""
    if sampler.name == "vllm_server":
        return ServerPipeline(model, sampler, seed)
    return GenerationProcess(model, sampler.name, threads, seed, trainer_threads)


class _InOrder:
    """The batches handed over and not yet taken back (``in_flight``, in the order issued), and their answers read
    in that order (``_next``: one (kind, batch, value) message, "done" or "error")."""

    what = "the generation"

    def result(self, index: int) -> tuple[SampledRollout, str]:
        """(batch ``index``'s draw, the name of the sampler that drew it), waited for; the batches before it that
        are still in flight are waited for too (they are drawn in order)."""
        if index not in self.in_flight:
            raise KLGRPOError(f"{self.what} was never given batch {index}")
        while True:
            kind, got, value = self._next()
            self.in_flight.remove(got)
            if kind == "error":
                raise KLGRPOError(f"{self.what} failed on batch {got}: {value}")
            if got == index:
                return value

    def drain(self) -> None:
        """Wait for every batch in flight and drop it (a rollback or a load replaces what was issued)."""
        while self.in_flight:
            _kind, got, _value = self._next()
            self.in_flight.remove(got)

    def _next(self):
        raise NotImplementedError


class GenerationProcess(_InOrder):
    """The generation process of one run and the batches handed to it, in the order issued.

    ``model`` is the policy (its architecture and dtype are copied; LoRA comes merged), ``sampler`` the name of
    the run's sampler, ``threads`` the generation process's torch threads, ``trainer_threads`` this process's
    until ``close`` (None: left as they are)."""

    def __init__(self, model, sampler: str, threads: int, seed: int, trainer_threads: int | None = None):
        from klgrpo.backends.weights import base_model

        base = base_model(model)
        self.sampler, self.threads, self.seed = sampler, threads, seed
        self._threads_before = torch.get_num_threads()  # the trainer's share while the run lasts, then put back
        if trainer_threads is not None:
            torch.set_num_threads(trainer_threads)
        context = torch.multiprocessing.get_context("spawn")  # a fork would copy the trainer's threads and locks
        self.jobs, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=_generation_process, name="klgrpo-generation", daemon=True,
                                       args=(type(base), base.config, next(base.parameters()).dtype, sampler,
                                             threads, self.jobs, self.results))
        with _main_script_hidden():
            self.process.start()
        self.sent_version: int | None = None
        self._held: list[dict] = []  # the last weights sent: alive until the process has taken them
        self.in_flight: list[int] = []
        self._started = False

    def submit(self, index: int, encoded: EncodedPrompts, params: SamplingParams, version: int,
               weights: Callable[[], dict[str, Tensor]]) -> None:
        """Hand batch ``index`` over: drawn from the weights at ``version`` (``weights()`` reads them, sent when the
        version is new to the process)."""
        sent = None
        if version != self.sent_version:
            sent = weights()
            self._held = [*self._held[-1:], sent]
            self.sent_version = version
        params = replace(params, sampler=self.sampler)
        self.jobs.put({"index": index, "version": version, "seed": batch_seed(self.seed, index), "params": params,
                       "ids": encoded.ids.cpu(), "mask": encoded.mask.cpu(), "pad_id": encoded.pad_id,
                       "eos_ids": list(encoded.eos_ids), "weights": sent})
        self.in_flight.append(index)

    what = "the generation process"

    def result(self, index: int) -> tuple[SampledRollout, str]:
        sampled, name = super().result(index)
        return _owned(sampled), name

    def _next(self):
        waited, limit = 0.0, START_TIMEOUT_S if not self._started else math.inf
        while True:
            try:
                message = self.results.get(timeout=POLL_S)
            except queue.Empty:
                waited += POLL_S
                if not self.process.is_alive():
                    raise KLGRPOError(f"the generation process (rollout.max_staleness) died with exit code "
                                      f"{self.process.exitcode}; its batches were not drawn (out of memory? "
                                      f"lower rollout.prompts_per_step or set rollout.max_staleness 0)") from None
                if waited > limit:
                    raise KLGRPOError(f"the generation process did not start within {limit:.0f} s") from None
                continue
            if message[0] == "ready":
                self._started = True
                continue
            if message[0] == "fatal":
                raise KLGRPOError(f"the generation process could not start: {message[2]}")
            self._started = True
            return message

    def close(self) -> None:
        """Stop the generation process (what is in flight is dropped)."""
        if self.process.is_alive():
            try:
                self.jobs.put(None)
                self.process.join(timeout=10)
            except (OSError, ValueError):
                pass
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.in_flight.clear()
        self._held.clear()
        torch.set_num_threads(self._threads_before)
        for q in (self.jobs, self.results):
            q.close()
            q.cancel_join_thread()


class ServerPipeline(_InOrder):
    """vllm_server's batches issued ahead: one thread of this process sends each batch's weights (when its version
    is new to the server; the folder transfer, from the copy ``submit`` took) and then its request, in the order
    issued; the server draws while the trainer updates. Same interface as ``GenerationProcess``."""

    what = "the vLLM server's requests"

    def __init__(self, model, sampler, seed: int):
        import threading

        self.model, self.sampler, self.seed = model, sampler, seed
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.sent_version: int | None = None
        self.in_flight: list[int] = []
        self.thread = threading.Thread(target=self._work, name="klgrpo-server-requests", daemon=True)
        self.thread.start()

    def submit(self, index: int, encoded: EncodedPrompts, params: SamplingParams, version: int,
               weights: Callable[[], dict[str, Tensor]]) -> None:
        sent = None
        if version != self.sent_version:
            sent = weights()
            self.sent_version = version
        self.jobs.put((index, version, encoded, params, sent))
        self.in_flight.append(index)

    def _work(self) -> None:
        from klgrpo.backends.vllm_sampler import vllm_filters
        from klgrpo.backends.vllm_server import vocab_size

        client = self.sampler.client
        while (job := self.jobs.get()) is not None:
            index, version, encoded, params, sent = job
            try:
                if sent is not None:
                    client.sync(FrozenWeights(sent), version)
                ids, logp = client.generate(encoded.ids, encoded.mask, params, encoded.pad_id, encoded.eos_ids,
                                            vocab_size(self.model), seed=batch_seed(self.seed, index) % (2 ** 31))
                sampled = SampledRollout(ids, logp, vllm_filters(params), version)
                self.results.put(("done", index, (sampled, self.sampler.name)))
            except BaseException as exc:  # noqa: BLE001 - said by the trainer, which stops with it
                self.results.put(("error", index, f"{type(exc).__name__}: {first_line(exc)}"))

    def _next(self):
        return self.results.get()

    def close(self) -> None:
        """Stop the thread once the request in progress has its answer (the client's timeout bounds it)."""
        self.jobs.put(None)
        self.thread.join(timeout=self.sampler.timeout_s + 5)
        self.in_flight.clear()


class FrozenWeights:
    """Weights copied at one version, as a model looks to the code that sends a model's weights (its state dict
    and parameters): what the server is sent while the trainer's own weights move on."""

    def __init__(self, weights: dict[str, Tensor]):
        self._weights = weights

    def state_dict(self, keep_vars: bool = False) -> dict[str, Tensor]:
        return dict(self._weights)

    def parameters(self) -> Iterator[Tensor]:
        return iter(self._weights.values())


@contextmanager
def _main_script_hidden() -> Iterator[None]:
    """While the generation process is started: spawn would otherwise import the script that started the run again
    in the new process, which (a script without an ``if __name__ == "__main__":`` guard) would start another run
    there. The generation process needs nothing of it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def shared_weights(model) -> dict[str, Tensor]:
    """CPU copies of the policy's whole weights under transformers' names (a LoRA policy merged), one copy per
    storage (tied weights stay tied): what the generation process loads."""
    from klgrpo.backends.weights import named_whole_weights

    copies: dict[int, Tensor] = {}
    out = {}
    for name, value in named_whole_weights(model):
        key = value.data_ptr()
        if key not in copies:
            copies[key] = value.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out


def _owned(sampled: SampledRollout) -> SampledRollout:
    """The draw in this process's own memory (the shared-memory tensors it came in are released)."""
    clone = (lambda t: None if t is None else t.clone())
    return replace(sampled, completion_ids=clone(sampled.completion_ids), logp=clone(sampled.logp),
                   kept_count=clone(sampled.kept_count))


def _generation_process(model_cls, config, dtype, sampler_name: str, threads: int, jobs, results) -> None:
    """The generation process: a copy of the policy, then one draw per job until None comes or the trainer is gone.
    Ctrl-C and SIGTERM reach the whole process group: they are the trainer's to handle (it saves a checkpoint,
    which waits for the batches in flight here), so this process ignores them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer = os.getppid()
    try:
        torch.set_num_threads(threads)
        from klgrpo.backends.samplers import open_sampler
        from klgrpo.backends.weights import check_weight_names
        from klgrpo.core.rollout import sample_encoded

        model = model_cls(config).to(dtype).eval()
        sampler = open_sampler(sampler_name)
    except BaseException as exc:  # noqa: BLE001 - said to the trainer, which stops with it
        results.put(("fatal", -1, f"{type(exc).__name__}: {first_line(exc)}"))
        return
    results.put(("ready", -1, None))
    while (job := _next_job(jobs, trainer)) is not None:
        try:
            if job["weights"] is not None:
                weights = job["weights"]
                check_weight_names(model, weights, "the trainer's weights", "report this (rollout.max_staleness)")
                with torch.no_grad():
                    model.load_state_dict(weights, strict=False)
                del weights, job["weights"]
            sampler.weights_version = job["version"]
            torch.manual_seed(job["seed"])
            encoded = EncodedPrompts(prompts=[], ids=job["ids"], mask=job["mask"], eos_ids=job["eos_ids"],
                                     pad_id=job["pad_id"])
            sampled, name = sample_encoded(model, encoded, replace(job["params"], sampler=sampler))
            results.put(("done", job["index"], (replace(sampled, weights_version=job["version"]), name)))
        except BaseException as exc:  # noqa: BLE001
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
            results.put(("error", job["index"], detail))
    sampler.close()


def _next_job(jobs, trainer: int):
    """The next job; None when the trainer says so or is gone (killed: nobody would read another draw)."""
    while True:
        try:
            return jobs.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != trainer:
                return None
