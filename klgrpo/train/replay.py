"""The replay anchor: a KL to the reference on unlabeled prompts of the skills GRPO does not train.

Why: the KL on the training prompts constrains the policy only where those prompts lead. On the demo, GRPO on
addition with the usual KL at beta 0 / 0.04 / 0.2 moved subtraction (never trained) by -12.5 / -10.3 / -7.3
points on average in a prototype of the demo (docs/retention.md); the exact KL on a few replay prompts of
subtraction kept it within -4.5..+6.5.

    L_replay = coef * (1 / N_tok) * sum_{i, t} KL_t          over the completion positions of the replay batch
    KL_t     = KL(pi(. | x_i, y_i,<t) || ref(. | x_i, y_i,<t))   at temperature 1 (the models' own distributions)

Build, once per run folder: the first ``num_prompts`` replay prompts, ``completions_per_prompt`` completions
each sampled from the REFERENCE (at ``kl.replay.temperature``, with a private seed: the trainer's RNG stream
is untouched), cached in ``<run>/replay_cache.safetensors`` + ``replay_cache.json`` (state_io: nothing is
unpickled) with what the KL form needs and reused on resume:

    "full"       the reference's log-softmax over the vocabulary at every completion position, when
                 N x T x V float32 fits ``cache_budget_bytes`` (default 256 MiB); otherwise the reference's
                 logits are recomputed for the replay batch each step (one no-grad forward; logged once).
    k1, k3, ...  the reference's per-token log-probs of the cached tokens. The tokens come from the
                 reference q, not from pi, so the estimator is importance-weighted with w_t = pi(y_t) / q(y_t)
                 kept in the graph: E_q[w_t k(l_t)] = E_pi[k(l_t)] estimates the same KL_t as "full", and the
                 gradient follows the reverse KL for the estimators whose registry declaration says so for
                 (loss, off_policy_in_graph): k1 and k3 (docs/kl_math.md). Others get a warning at build.

Each optimizer step takes the next ``batch_size`` cached sequences (a seeded permutation per epoch, resumable
through ``state_dict``), runs the policy on them in micro-batches (train.micro_batch_size) and backpropagates
``coef * KL`` normalised by the batch's token count, so the gradient does not depend on the micro-batch size.

The anchor's target is the reference at build time (the cache). With kl.sync_every the main KL's reference
moves; a cached anchor keeps the original reference, a recomputing one follows the synced reference.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from klgrpo.backends.samplers import AUTO, Sampler
from klgrpo.config.validation import validate_replay
from klgrpo.core.batch import micro_slices
from klgrpo.core.data import PromptSampler, load_prompts
from klgrpo.core.forward import position_ids_from_mask
from klgrpo.core.rollout import RolloutBatch, SamplingParams, generate_groups
from klgrpo.errors import ConfigError, warn
from klgrpo.math.kl import ESTIMATORS, exact_kl, kl_estimate
from klgrpo.math.logprobs import token_logprobs
from klgrpo.store.state_io import StateFileError, folder_lock, load_state, save_state
from klgrpo.train import metric_names as m

CACHE_STEM = "replay_cache"
CACHE_FILE = CACHE_STEM + ".json"  # beside replay_cache.safetensors
#: Largest full-vocabulary reference cache held (N x T x V float32); above it "full" recomputes each step.
DEFAULT_CACHE_BUDGET_BYTES = 256 * 2**20
#: Rows of the cache recomputed at load to check that the cache belongs to this reference.
_FINGERPRINT_ROWS = 8
_VERSION = 1


@dataclass
class ReplayCache:
    """The reference's completions of the replay prompts, fixed for the whole run.

    input_ids_NL        prompt (left-padded to prompt_len) + completion (right-padded to T), L = prompt_len + T
    attention_mask_NL   1 on real prompt tokens and completion tokens through EOS
    completion_mask_NT  1 on completion tokens through the first EOS
    ref_logp_NT         log ref(y_t) at temperature 1 (float32; float64 for a float64 reference)
    sample_logp_NT      log q(y_t), q = the reference at the sampling temperature (the importance weight's base)
    ref_logsoftmax_NTV  log ref(.) over the vocabulary (as ref_logp), "full" within the budget; else None
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    ref_logp: Tensor
    sample_logp: Tensor
    ref_logsoftmax: Tensor | None
    prompt_len: int
    meta: dict

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def to_dict(self) -> dict:
        return {"version": _VERSION, "meta": self.meta, "prompt_len": self.prompt_len,
                **{k: getattr(self, k) for k in ("input_ids", "attention_mask", "completion_mask", "ref_logp",
                                                 "sample_logp", "ref_logsoftmax")}}

    @classmethod
    def from_dict(cls, d: dict, device: torch.device) -> "ReplayCache":
        move = (lambda t: None if t is None else t.to(device))
        return cls(**{k: move(d[k]) for k in ("input_ids", "attention_mask", "completion_mask", "ref_logp",
                                               "sample_logp", "ref_logsoftmax")},
                   prompt_len=int(d["prompt_len"]), meta=d["meta"])


@dataclass(frozen=True)
class AnchorModels:
    """The run's loaded models the anchor is built from: ``policy`` (the cache goes to its device), its
    ``tokenizer`` (the replay prompts), ``reference`` (samples the completions and scores them)."""

    policy: Any
    tokenizer: Any
    reference: Any


class ReplayAnchor:
    """coef * KL(pi || ref) on cached reference completions of replay prompts; see the module docstring."""

    def __init__(self, cache: ReplayCache, *, coef: float, estimator: str, batch_size: int, seed: int,
                 micro_batch_size: int = 0, log_ratio_clamp: float | None = 20.0, reference=None,
                 unwritten: Path | None = None):
        self.cache = cache
        self.unwritten = unwritten  # where write_cache writes a cache that build(write_now=False) kept
        self.coef = float(coef)
        self.estimator = estimator
        self.batch_size = min(int(batch_size), cache.size)
        self.micro_batch_size = int(micro_batch_size or 0)
        self.clamp = log_ratio_clamp or None
        self.reference = reference  # used only when "full" recomputes the reference each step
        self.sampler = PromptSampler(cache.size, self.batch_size, seed, shuffle=True)
        self._lengths = cache.completion_mask.sum(-1).cpu()  # on the host: no device sync to size a batch
        if estimator == "full" and cache.ref_logsoftmax is None and reference is None:
            raise ConfigError("the replay anchor recomputes the reference's logits each step but has no reference")

    # ------------------------------------------------------------------------------------------- build
    @classmethod
    def build(cls, cfg, models: AnchorModels, run_dir: str | Path, *, log: Callable[[str], None] = print,
              cache_budget_bytes: int = DEFAULT_CACHE_BUDGET_BYTES, sampler: Sampler | str = AUTO,
              write_now: bool = True) -> "ReplayAnchor":
        """Load ``<run_dir>/replay_cache.*`` when it matches these settings and this reference; else sample
        the completions from the reference once, with ``sampler`` (the run's), and write the cache, or with
        ``write_now=False`` keep it for ``write_cache`` (a folder that holds files is written only once the run
        has opened it: it may be another run's, which nothing may change unasked)."""
        r, model, reference = cfg.kl.replay, models.policy, models.reference
        _check_settings(cfg, reference)
        device = next(model.parameters()).device
        meta = {"source": str(r.source), "prompt_column": r.prompt_column, "num_prompts": r.num_prompts,
                "completions_per_prompt": r.completions_per_prompt,
                "max_new_tokens": r.max_new_tokens or cfg.rollout.max_new_tokens, "temperature": r.temperature,
                "seed": cfg.train.seed, "system_prompt": cfg.data.system_prompt,
                "as_chat": bool(getattr(cfg.data, "as_chat", False)), "form": _form(r.estimator)}
        path = Path(run_dir) / CACHE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        # Every rank of a launch builds the anchor: the first to get here samples and writes the cache, the
        # others wait and load it (the same content: the sampling seed is the run's, not the rank's).
        with folder_lock(path.parent, on_wait=lambda: log(f"replay anchor: waiting for another process to "
                                                          f"write {path}")):
            cache, unwritten = _load_cache(path, meta, reference, device, log), None
            if cache is None:
                t0 = time.perf_counter()
                cache = _sample_cache(cfg, meta, model, models.tokenizer, reference, device, cache_budget_bytes,
                                      sampler)
                if write_now:
                    save_state(path.parent, CACHE_STEM, cache.to_dict())
                else:
                    unwritten = path
                kept = "full-vocabulary log-probs" if cache.ref_logsoftmax is not None else "per-token log-probs"
                log(f"replay anchor: sampled {cache.size} reference completions ({r.completions_per_prompt} per "
                    f"replay prompt) in {time.perf_counter() - t0:.1f} s; cached with the reference's {kept} in "
                    f"{path}{'' if write_now else ' once the run has opened its folder'}")
                if r.estimator == "full" and cache.ref_logsoftmax is None:
                    log(f"replay anchor: the full-vocabulary cache would exceed {cache_budget_bytes / 2**20:.0f} "
                        f"MiB; the reference's logits are recomputed for the replay batch each step")
        if r.estimator != "full":
            target = ESTIMATORS[r.estimator].gradient_target("loss", "off_policy_in_graph", level="token")
            if target != "reverse":
                warn(f"kl.replay.estimator={r.estimator} on reference samples (importance weight in the "
                     f"graph) has an expected gradient that follows {target!r}, not the reverse KL; use 'full', "
                     f"k1 or k3")
        return cls(cache, coef=r.coef, estimator=r.estimator, batch_size=r.batch_size, seed=cfg.train.seed,
                   micro_batch_size=cfg.train.micro_batch_size, log_ratio_clamp=cfg.kl.log_ratio_clamp,
                   reference=reference, unwritten=unwritten)

    def write_cache(self) -> None:
        """Write the cache ``build(write_now=False)`` kept (nothing if it was loaded or already written)."""
        if self.unwritten is not None:
            save_state(self.unwritten.parent, CACHE_STEM, self.cache.to_dict())
            self.unwritten = None

    # -------------------------------------------------------------------------------------------- step
    def per_token_kl(self, logits_BTV: Tensor, rows: Tensor) -> Tensor:
        """KL_t of the policy to the reference at each completion position of cache rows ``rows``, [b, T],
        differentiable in the policy's logits; the caller masks the positions past each row's EOS."""
        c = self.cache
        t = logits_BTV.shape[1]
        if self.estimator == "full":
            if c.ref_logsoftmax is not None:
                ref = c.ref_logsoftmax[rows, :t]
            else:
                ref = _completion_logits(self.reference.logits, c, rows, t)
            return exact_kl(logits_BTV, ref)  # log_softmax is idempotent: cached log-probs work as logits
        logp = token_logprobs(logits_BTV, c.input_ids[rows, c.prompt_len:c.prompt_len + t])
        log_w = logp - c.sample_logp[rows, :t]
        if self.clamp is not None:
            log_w = log_w.clamp(-self.clamp, self.clamp)
        return log_w.exp() * kl_estimate(logp, c.ref_logp[rows, :t], self.estimator, clamp=self.clamp)

    def accumulate_gradients(self, model, main_loss: Tensor | float | None = None,
                             backward: Callable[[Tensor], None] = Tensor.backward) -> dict[str, float]:
        """Backpropagate coef * (replay KL) for the next replay batch into ``model``'s .grad (adding to it).

        Returns ``kl/replay`` (mean per token), ``train/replay_penalty`` (coef times it), ``time/replay`` and,
        when ``main_loss`` (the step's train/loss) is given, ``train/replay_share`` (:func:`replay_share`).
        One host sync. ``backward``: how each micro-batch's loss is backpropagated (several processes:
        the engine's, which takes this loss's gradient once although every rank computes it)."""
        t0 = time.perf_counter()
        c = self.cache
        indices = self.sampler.next_indices()
        rows = torch.tensor(indices, device=c.input_ids.device)
        t_max = max(int(self._lengths[indices].max()), 1)  # positions past every row's EOS carry no KL
        n_tok = c.completion_mask[rows, :t_max].sum().clamp(min=1)
        kl_sum = torch.zeros((), device=c.input_ids.device)
        for sl in micro_slices(len(rows), self.micro_batch_size):
            sub = rows[sl]
            logits = _completion_logits(lambda i, a: model(input_ids=i, attention_mask=a,
                                                           position_ids=position_ids_from_mask(a),
                                                           use_cache=False).logits, c, sub, t_max)
            kl_BT = self.per_token_kl(logits, sub)
            part = (kl_BT * c.completion_mask[sub, :t_max]).sum()
            backward(self.coef * part / n_tok)
            kl_sum = kl_sum + part.detach()
        kl = kl_sum / n_tok
        values = [kl, self.coef * kl]
        if main_loss is not None:
            values.append(replay_share(self.coef * kl, torch.as_tensor(main_loss, device=kl.device)))
        floats = torch.stack([v.float().reshape(()) for v in values]).cpu().tolist()
        out = {m.KL_REPLAY: floats[0], m.REPLAY_PENALTY: floats[1]}
        if main_loss is not None:
            out[m.REPLAY_SHARE] = floats[2]
        out[m.TIME_REPLAY] = time.perf_counter() - t0
        return out

    # --------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "cache_rows": self.cache.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("cache_rows", self.cache.size) != self.cache.size:
            raise ConfigError(f"the checkpoint's replay anchor cycled over {state['cache_rows']} cached sequences "
                              f"but this run's replay cache has {self.cache.size}; resume with the same kl.replay "
                              f"settings, or start a new run")
        self.sampler.load_state_dict(state["sampler"])


# ---------------------------------------------------------------------------------------------- helpers
def replay_share(penalty: Tensor, main_loss: Tensor) -> Tensor:
    """|penalty| / (|main_loss| + |penalty|), in [0, 1]; 0 when both are 0.

    Magnitudes on both sides: the GRPO loss is often near 0 or negative, and the replay KL's value can round
    below 0 when the policy still equals the reference (step 1) or be negative under k1, where the signed
    ratio penalty / (|loss| + penalty) left [0, 1] (a -1.59 was logged at the demo's first step)."""
    p, m = penalty.abs().double(), main_loss.abs().double()
    total = p + m
    return torch.where(total > 0, p / total.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(total))


def _form(estimator: str) -> str:
    return "full" if estimator == "full" else "tokens"


def _check_settings(cfg, reference) -> None:
    if not cfg.validated:  # a run's config was validated, these checks included, before anything was built
        validate_replay(cfg)
    if reference is None:
        raise ConfigError("kl.replay.coef > 0 needs the reference model, and this configuration builds none "
                          "(kl.coef 0 with kl.monitor false): set kl.monitor true")


@contextmanager
def reference_sampling_model(reference, policy):
    """A model whose ``generate`` samples from the reference.

    A reference may offer ``sampling_model()`` (a context manager) itself; a frozen copy is its ``.model``;
    a LoRA policy's reference is the policy inside peft's ``disable_adapter()``.
    """
    if hasattr(reference, "sampling_model"):
        with reference.sampling_model() as m:
            yield m
        return
    own = getattr(reference, "model", None)
    if own is not None and own is not policy and not _same_module(own, policy):
        yield own
        return
    if hasattr(policy, "disable_adapter"):
        with policy.disable_adapter():
            yield policy
        return
    raise ConfigError(f"the replay anchor cannot sample from a {type(reference).__name__} reference; "
                      f"use kl.replay.coef 0 or a frozen-copy reference")


def _same_module(a, b) -> bool:
    get = getattr(b, "get_base_model", None)
    return get is not None and get() is a


def _sample_cache(
    cfg, meta: dict, model, tokenizer, reference, device, budget: int, sampler: Sampler | str
) -> ReplayCache:
    r = cfg.kl.replay
    chunk = max(1, cfg.rollout.prompts_per_step)
    params = SamplingParams(group_size=r.completions_per_prompt, max_new_tokens=meta["max_new_tokens"],
                            temperature=r.temperature, system_prompt=cfg.data.system_prompt, as_chat=meta["as_chat"],
                            sampler=sampler)
    # A private seed, and the global RNG state restored afterwards: the trainer's stream (and resume equality)
    # does not depend on whether the cache was sampled or loaded.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), reference_sampling_model(reference, model) as sampling_model:
        prompts = load_prompts(r.source, prompt_column=r.prompt_column, limit=r.num_prompts,
                               field="kl.replay.source").prompts
        torch.manual_seed(int(cfg.train.seed) + 7919)
        parts = [generate_groups(sampling_model, tokenizer, prompts[s:s + chunk], params)
                 for s in range(0, len(prompts), chunk)]
    input_ids, attention_mask, completion_mask, prompt_len = _merge(parts, tokenizer.pad_token_id)
    n, t = completion_mask.shape
    seqs = _Seqs(input_ids, attention_mask, prompt_len)
    vocab, keep_full = None, False
    ref_logp, sample_logp, full = [], [], []
    with torch.no_grad():
        # Fixed chunks of _FINGERPRINT_ROWS rows: the load-time check recomputes chunk 0 exactly like this.
        for s in range(0, n, _FINGERPRINT_ROWS):
            rows = torch.arange(s, min(s + _FINGERPRINT_ROWS, n), device=device)
            logits = _completion_logits(reference.logits, seqs, rows, t)
            logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            if vocab is None:
                vocab = logits.shape[-1]
                keep_full = meta["form"] == "full" and n * t * vocab * logits.element_size() <= budget
            lsm = torch.log_softmax(logits, dim=-1)
            ids = input_ids[rows, prompt_len:][..., None]
            ref_logp.append(lsm.gather(-1, ids).squeeze(-1))
            q = lsm if r.temperature == 1.0 else torch.log_softmax(logits / r.temperature, dim=-1)
            sample_logp.append(q.gather(-1, ids).squeeze(-1))
            if keep_full:
                full.append(lsm)
    return ReplayCache(input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask,
                       ref_logp=torch.cat(ref_logp), sample_logp=torch.cat(sample_logp),
                       ref_logsoftmax=torch.cat(full) if keep_full else None, prompt_len=prompt_len,
                       meta={**meta, "vocab": vocab})


@dataclass
class _Seqs:
    input_ids: Tensor
    attention_mask: Tensor
    prompt_len: int


def _completion_logits(forward, seqs, rows: Tensor, t: int) -> Tensor:
    """Next-token logits [b, t, V] predicting the first t completion tokens of cache rows ``rows``."""
    p = seqs.prompt_len
    ids, mask = seqs.input_ids[rows, :p + t], seqs.attention_mask[rows, :p + t]
    return forward(ids, mask)[:, p - 1:p + t - 1]


def _merge(parts: list[RolloutBatch], pad_id: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """Concatenate rollout batches whose prompt and completion widths differ: prompts left-padded to the
    widest prompt, completions right-padded to the longest completion."""
    p = max(b.prompt_len for b in parts)
    t = max(b.completion_ids.shape[1] for b in parts)
    ids, att, cmask = [], [], []
    for b in parts:
        lp, rt = p - b.prompt_len, t - b.completion_ids.shape[1]
        pad = (lambda x, left, right, value: torch.nn.functional.pad(x, (left, right), value=value))
        ids.append(pad(b.input_ids, lp, rt, pad_id))
        att.append(pad(b.attention_mask, lp, rt, 0))
        cmask.append(pad(b.completion_mask.long(), 0, rt, 0).bool())
    return torch.cat(ids), torch.cat(att), torch.cat(cmask), p


def _load_cache(path: Path, meta: dict, reference, device, log) -> ReplayCache | None:
    """The cache at ``path`` if it was built with these settings for this reference; else None (with a note)."""
    if not path.exists():
        return None
    try:
        data = load_state(path.parent, CACHE_STEM)
    except StateFileError as exc:  # a truncated or foreign file: resample rather than fail
        log(f"replay anchor: cannot read {path} ({exc}); sampling a new cache")
        return None
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        log(f"replay anchor: cannot read {path} (not a replay cache); sampling a new cache")
        return None
    old = {k: v for k, v in data.get("meta", {}).items() if k != "vocab"}
    if data.get("version") != _VERSION or old != meta:
        changed = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
        log(f"replay anchor: {path} was built with other settings ({', '.join(changed) or 'version'}); "
            f"sampling a new cache")
        return None
    cache = ReplayCache.from_dict(data, device)
    rows = torch.arange(min(_FINGERPRINT_ROWS, cache.size), device=device)
    t = cache.completion_mask.shape[1]
    with torch.no_grad():
        logits = _completion_logits(reference.logits, cache, rows, t)
    tol = 1e-3 if logits.dtype in (torch.float32, torch.float64) else 5e-2  # 16-bit logits round coarsely
    now = torch.log_softmax(logits.float(), dim=-1).gather(-1, cache.input_ids[rows, cache.prompt_len:][..., None])
    diff = ((now.squeeze(-1) - cache.ref_logp[rows]) * cache.completion_mask[rows]).abs().max().item()
    if diff > tol:
        log(f"replay anchor: {path} was built for another reference (log-probs differ by {diff:.3g}); "
            f"sampling a new cache")
        return None
    return cache


__all__ = ["ReplayAnchor", "ReplayCache", "CACHE_FILE", "DEFAULT_CACHE_BUDGET_BYTES", "reference_sampling_model"]
