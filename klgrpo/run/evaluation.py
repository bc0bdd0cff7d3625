"""Greedy-decoding accuracy of a causal LM on (prompt, answer) pairs.

Used for the demo's before/after numbers, the trainer's evaluation and retention sets, and the SFT
warm start's stopping rule. Prompts are tokenized with the tokenizer's defaults (``add_special_tokens``
left on, as for any generation), left-padded, and decoded greedily with transformers ``generate``. The
trainer's sets also log the mean per-token entropy of those greedy completions, read off the scores greedy
decoding picks from (no second forward).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from klgrpo.core.rewards.builtins import exact_match
from klgrpo.core.rollout import encode_prompts, eos_token_ids
from klgrpo.train.metric_names import eval_entropy, eval_set

#: reward_fn(prompts, completions, answer=answers) -> one score per completion (klgrpo.core.rewards' signature).
RewardFn = Callable[..., Sequence[float]]


class GreedyEntropy:
    """What :func:`greedy_completions` measured besides the text: the summed per-token entropy over the
    completion tokens (EOS included) and their count."""

    def __init__(self) -> None:
        self.total, self.tokens = 0.0, 0

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else float("nan")


class _EntropyRecorder(LogitsProcessor):
    """Records each row's entropy of softmax(scores / temperature) at every decoding step; scores pass
    unchanged (the last processor, so these are the scores greedy decoding takes its argmax of)."""

    def __init__(self, temperature: float) -> None:
        self.temperature, self.steps = temperature, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self.steps.append(-(logp.exp() * logp).nan_to_num().sum(-1))  # 0 * log 0 = 0 for masked tokens
        return scores


def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 256,
    entropy: GreedyEntropy | None = None,
    temperature: float = 1.0,
) -> list[str]:
    """The greedy completion of every prompt, cut at the first EOS, special tokens removed.

    EOS is :func:`klgrpo.core.rollout.eos_token_ids`, the rollout's rule. The model's train/eval mode is
    restored afterwards; no gradients are recorded. ``entropy``, when given, accumulates the per-token entropy
    (at ``temperature``) of the completion tokens up to and including the first EOS.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token before evaluating")
    eos_ids = eos_token_ids(model, tokenizer)
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad_id, eos_token_id=eos_ids or None
    )
    was_training = model.training
    model.eval()
    completions: list[str] = []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                chunk = list(prompts[start : start + batch_size])
                rows = tokenizer(chunk)["input_ids"]
                if not all(rows):
                    empty = start + next(i for i, r in enumerate(rows) if not r)
                    raise ValueError(f"prompt {empty} ({prompts[empty]!r}) encodes to no tokens; "
                                     "give every prompt some text")
                input_ids, attention_mask = _left_padded(rows, pad_id, model.device)
                recorder = _EntropyRecorder(temperature) if entropy is not None else None
                # synced_gpus=False: transformers turns it on for any FSDP-managed model in a process group and
                # then all-reduces at every token, which hangs when one rank evaluates alone (the trainer's way).
                output_ids = model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                    synced_gpus=False, logits_processor=LogitsProcessorList([recorder] if recorder else []),
                )
                new_ids = [_cut_at(ids, eos_ids) for ids in output_ids[:, input_ids.shape[1] :].tolist()]
                completions += [tokenizer.decode(ids, skip_special_tokens=True) for ids in new_ids]
                if recorder is not None:
                    _add_entropy(entropy, recorder, new_ids)
    finally:
        model.train(was_training)
    return completions


def _add_entropy(entropy: GreedyEntropy, recorder: _EntropyRecorder, cut_ids: list[list[int]]) -> None:
    """Adds the recorded entropies of each row's completion tokens: the kept ones, and the EOS if one ended it."""
    if not recorder.steps:
        return
    per_step = torch.stack(recorder.steps, 1).double()  # [rows, generated steps]
    lengths = torch.tensor([len(ids) for ids in cut_ids], device=per_step.device)
    counted = torch.clamp(lengths + 1, max=per_step.shape[1])  # + the EOS (absent only at the length limit)
    mask = torch.arange(per_step.shape[1], device=per_step.device) < counted[:, None]
    entropy.total += float((per_step * mask).sum())
    entropy.tokens += int(mask.sum())


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    answers: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 256,
    reward_fn: RewardFn | None = None,
    entropy: GreedyEntropy | None = None,
    temperature: float = 1.0,
) -> float:
    """Mean of ``reward_fn(prompts, completions, answer=answers)`` over greedy completions.

    The default ``reward_fn`` is :func:`exact_match`. An empty prompt list is an error (no accuracy).
    ``entropy`` and ``temperature``: as :func:`greedy_completions`.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"greedy_accuracy: {len(prompts)} prompts but {len(answers)} answers; "
                         "pass one answer per prompt")
    if not prompts:
        raise ValueError("greedy_accuracy: no prompts to evaluate")
    completions = greedy_completions(model, tokenizer, prompts, max_new_tokens, batch_size, entropy, temperature)
    scores = (reward_fn or exact_match)(list(prompts), completions, answer=list(answers))
    return float(sum(float(s) for s in scores) / len(prompts))


def _left_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _cut_at(ids: list[int], eos_ids: list[int]) -> list[int]:
    """``ids`` up to (excluding) the first EOS."""
    for t, token in enumerate(ids):
        if token in eos_ids:
            return ids[:t]
    return ids


def load_eval_sets(cfg) -> dict[str, dict]:
    """The config's eval.sets as {name: {"prompts", "answers", "reward_fn"}} (prompts with answers)."""
    from klgrpo.config.entries import eval_set_specs
    from klgrpo.core.data import load_prompts
    from klgrpo.core.rewards import load_reward_function

    sets = {}
    for i, spec in enumerate(eval_set_specs(cfg.eval.sets)):
        ds = load_prompts(spec.source, prompt_column=spec.prompt_column, columns={"answer": spec.answer_column},
                          split=spec.split, limit=spec.limit or None, field=f"eval.sets[{i}].source")
        sets[spec.name] = {"prompts": ds.prompts, "answers": [str(a) for a in ds.columns["answer"]],
                           "reward_fn": load_reward_function(spec.reward)}
    return sets


def evaluate_sets(model, tokenizer, sets: dict[str, dict], cfg) -> dict[str, float]:
    """Greedy accuracy of every set, as {"eval/<name>": value}, and with train.entropy_metrics the mean
    per-token entropy of its greedy completions ("eval/<name>/entropy", at the sampling temperature); prompts
    are templated like the rollout's."""
    from tqdm.auto import tqdm

    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    results = {}
    # A bar of its own (gone when done): evaluating takes seconds, beside the step bar or before it starts.
    bar = tqdm(sets.items(), total=len(sets), desc="evaluating", unit="set", leave=False, dynamic_ncols=True,
               disable=not cfg.logging.progress or not sets)
    for name, s in bar:
        bar.set_postfix_str(f"{name} ({len(s['prompts'])} prompts)")
        texts = encode_prompts(tokenizer, s["prompts"], cfg.data.system_prompt, cfg.data.as_chat)
        entropy = GreedyEntropy() if cfg.train.entropy_metrics else None
        results[eval_set(name)] = greedy_accuracy(model, tokenizer, texts, s["answers"], max_new,
                                                  cfg.eval.batch_size, s["reward_fn"], entropy,
                                                  cfg.rollout.temperature)
        if entropy is not None:
            results[eval_entropy(name)] = entropy.mean
    return results
