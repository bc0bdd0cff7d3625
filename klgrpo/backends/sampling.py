"""The sampler contract: what a rollout asks a sampler for, what a sampler gives back, and every method a sampler
has (klgrpo/backends/samplers.py registers the samplers; core/rollout.py and train/step.py call them).

    SamplingParams   how one rollout samples (G, length, temperature and filters, chat template, which sampler)
    SamplingFilters  the distribution a sampler draws each token from: softmax(logits / temperature) after top-k,
                     top-p and min-p; what the trainer needs to rebuild each position's kept set
    SampledRollout   what a sampler drew: the completion ids, its own log-probs of them (under the distribution
                     drawn from), the size of each position's kept set where it records it, the filters, and
                     the version of the policy's weights that drew them
    Sampler          the base class: ``sample`` is the one method a sampler must write; the others are declared
                     here with the defaults of a sampler that draws from the live policy (nothing to push, compile
                     or close)

A sampler is made for one run (``samplers.pick_sampler``) and closed with it: an engine with its own copy of the
weights (vLLM) lives inside its sampler, never in a table of the process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import Tensor

#: rollout.sampler's value that picks the sampler for the device and model (``samplers.auto_sampler``).
AUTO = "auto"
#: rollout.old_logprobs's values: where pi_old comes from (trainer first, the default).
OLD_LOGPROBS = ("trainer", "sampler")


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout samples: the rollout settings of one call, by name.

    group_size      G, completions per prompt
    max_new_tokens  completion length limit; a row without EOS by then is truncated
    temperature     sample from softmax(logits / temperature); > 0
    top_p, top_k    nucleus and top-k filters (1.0 and 0: off)
    min_p           min-p filter: drop the tokens less likely than min_p times the most likely one (0: off)
    system_prompt   system message prepended to chat prompts
    as_chat         wrap string prompts as one user message and apply the tokenizer's chat template
    compiled        run the KV-cached loop's steps through torch.compile where the model allows it
    sampler         the Sampler (a run's, from ``pick_sampler``), a name in SAMPLERS, or "auto" (``auto_sampler``)
    """

    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    system_prompt: str = ""
    as_chat: bool = False
    compiled: bool = False
    sampler: "Sampler | str" = AUTO

    @property
    def filters(self) -> "SamplingFilters":
        return SamplingFilters(self.temperature, self.top_p, self.top_k, self.min_p)


@dataclass(frozen=True)
class SamplingFilters:
    """Each token is drawn from softmax(logits / temperature) with -inf outside the top_k largest scores, then
    outside the smallest set whose probability reaches top_p, then below min_p times the largest probability
    (top_k 0, top_p 1.0, min_p 0: off), in that order, as transformers' TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper apply them; ``min_p_first``: min-p before top-k and
    top-p, vLLM's order (klgrpo.math.truncation.truncate_scores)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_p_first: bool = False

    @property
    def truncates(self) -> bool:
        """Whether a position's kept set can be smaller than the vocabulary."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass
class SampledRollout:
    """What a sampler drew for N prompts x G: rows [i*G, (i+1)*G) continue prompt i.

    completion_ids   [N*G, T] T <= max_new_tokens; after a row's EOS anything (the caller masks it)
    logp             [N*G, T] float32, the sampler's own log-prob of each sampled token under the distribution
                     it drew from (after temperature and the filters), or None for a sampler that gives none
    kept_count       [N*G, T] int32, the size of the kept set each token was drawn from, or None where the
                     sampler does not record it (the trainer then rebuilds the sets from the filters)
    filters          the distribution drawn from (SamplingFilters)
    weights_version  the version of the policy's weights the tokens were drawn with (``Sampler.sync_weights``)
    """

    completion_ids: Tensor
    logp: Tensor | None
    filters: SamplingFilters
    weights_version: int = 0
    kept_count: Tensor | None = None


#: a training engine's tensor-by-tensor gathering of the policy's weights: (transformers' name, whole tensor)
WeightsStream = Callable[[], Iterator[tuple[str, Tensor]]]


class Sampler:
    """Draws ``params.group_size`` completions for each of the (left-padded) prompts given once each. ``name`` is
    the name it is registered under (rollout.sampler); ``holds_weights``: it keeps its own copy of the policy's
    weights (vLLM), which ``sync_weights`` refreshes, so sampling needs no gathered policy."""

    name: str = ""
    holds_weights: bool = False
    #: its log-probs are the trainer's own forward's to float rounding (the same weights, the same math; the
    #: trainer's checks measure it in sampler/logp_diff_max): rollout.old_logprobs sampler may take them as pi_old.
    scores_as_trainer: bool = False

    def __init__(self):
        self.weights_version = 0

    @classmethod
    def open(cls, settings=None) -> "Sampler":
        """A new sampler for one run; ``settings`` is rollout.vllm (a sampler with settings of its own reads its
        fields there; None: its defaults)."""
        return cls()

    def supports(self, model, total_len: int, params: SamplingParams) -> bool:
        """Whether this sampler reproduces ``model``'s distribution over ``total_len`` positions."""
        return True

    def sample(self, model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, pad_id: int,
               eos_ids: list[int]) -> SampledRollout:
        """The completions of ``prompt_ids`` [N, P] (left-padded; ``prompt_mask`` 1 on real tokens), ``pad_id``
        after a row's EOS. Called under no_grad with the model in eval mode."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} sampler does not define sample()")

    def sync_weights(self, model, version: int, weights: WeightsStream | None = None) -> bool:
        """Before a rollout: the policy's weights are at ``version`` (the training step's count of the changes it
        made to them). A sampler that draws from the live policy only records it; one that holds its own copy
        pushes the weights when they changed, read from ``weights()`` (else from ``model``). Every rank calls it.
        Returns whether it pushed."""
        self.weights_version = version
        return False

    def compiles(self, model, params: SamplingParams) -> bool:
        """Whether it compiles a kernel per input shape here (core/rollout.py:warm_up_sampler then compiles every
        shape before step 1, so no step pays for a shape it meets for the first time)."""
        return False

    def padded_width(self, width: int) -> int:
        """The prompt width its kernel sees for a batch this wide."""
        return width

    def warm_up(self, model, width: int, prompts: int, params: SamplingParams, pad_id: int,
                eos_ids: list[int]) -> None:
        """Compile the kernels of a batch of ``prompts`` prompts ``width`` wide (where ``compiles``)."""

    def close(self) -> None:
        """Release what the sampler holds (an engine, a connection); the run calls it when it ends."""

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
