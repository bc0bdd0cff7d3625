"""Supervised warm start of the demo model, so that GRPO's reference is a real SFT model.

Recipe (settings a prototype of the demo found to work on the CPU): AdamW at lr 3e-3, batches of 128 drawn 30%
from addition and 70% from subtraction, cross-entropy on the answer tokens and the EOS only (prompt tokens carry
no loss). Accuracy jumps at an unpredictable step, so instead of a fixed step count the run stops as soon as
greedy accuracy on the trained skill's validation set reaches the target (checked every 10 steps), with a step
cap. On the CPU with a fixed thread count the whole run is bit-for-bit repeatable per seed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from klgrpo.apps.demo.tasks import MAX_NEW_TOKENS, Split
from klgrpo.core.threads import torch_threads
from klgrpo.run.evaluation import greedy_accuracy

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SFTSettings:
    """Every knob of the warm start; all of them enter the demo cache key."""

    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default)."""
    batch_size: int = 128
    """Sequences per step."""
    mix: tuple[tuple[str, float], ...] = (("addition", 0.3), ("subtraction", 0.7))
    """(skill, probability) of each batch row's skill."""
    target_skill: str = "addition"
    """Skill whose validation accuracy stops the run (the one GRPO trains next)."""
    target_accuracy: float = 0.30
    """Stop once greedy validation accuracy on target_skill reaches this."""
    eval_every: int = 10
    """Steps between validation checks."""
    max_steps: int = 1500
    """Hard cap on steps when the target is never reached."""
    num_threads: int | None = 1
    """torch threads during SFT (restored afterwards). 1 is both the fastest on a shared 2-core machine
    and what makes the run independent of the core count; None keeps the current setting."""


@dataclass
class EncodedExamples:
    """Right-padded prompt+answer+EOS sequences; labels are IGNORE_INDEX except on answer and EOS tokens."""

    input_ids_NT: torch.Tensor
    attention_mask_NT: torch.Tensor
    labels_NT: torch.Tensor


def encode_examples(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], answers: Sequence[str]
) -> EncodedExamples:
    """Tokenize ``prompt + answer + EOS``, with the loss restricted to the answer and the EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("SFT needs a tokenizer with an eos token to end every answer")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_rows = tokenizer(list(prompts))["input_ids"]
    answer_rows = tokenizer(list(answers), add_special_tokens=False)["input_ids"]
    rows = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompt_rows, answer_rows)]
    width = max(len(r) for r in rows)
    # Plain lists first, one tensor conversion at the end: a per-row loop over tensors is 10x slower.
    input_ids = [r + [pad_id] * (width - len(r)) for r in rows]
    attention_mask = [[1] * len(r) + [0] * (width - len(r)) for r in rows]
    labels = [
        [IGNORE_INDEX] * len(p) + r[len(p) :] + [IGNORE_INDEX] * (width - len(r)) for r, p in zip(rows, prompt_rows)
    ]
    return EncodedExamples(*(torch.tensor(x, dtype=torch.long) for x in (input_ids, attention_mask, labels)))


def answer_loss(model: PreTrainedModel, batch: EncodedExamples) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (answer + EOS) tokens."""
    logits_NTV = model(input_ids=batch.input_ids_NT, attention_mask=batch.attention_mask_NT).logits
    # Position t predicts token t+1.
    return F.cross_entropy(
        logits_NTV[:, :-1].flatten(0, 1).float(), batch.labels_NT[:, 1:].flatten(), ignore_index=IGNORE_INDEX
    )


@torch.no_grad()
def evaluate_answer_loss(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts, answers) -> float:
    """:func:`answer_loss` on the given pairs, in eval mode (restored afterwards)."""
    was_training = model.training
    model.eval()
    try:
        return float(answer_loss(model, encode_examples(tokenizer, prompts, answers)))
    finally:
        model.train(was_training)


def run_sft(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train: Mapping[str, Split],
            validation: Split, settings: SFTSettings = SFTSettings(), seed: int = 0,
            log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Train ``model`` in place (a progress bar on stderr unless ``progress`` is False); returns stats: steps,
    seconds, reached_target, val_accuracy [[step, acc], ...], final_val_accuracy, first_loss, last_loss (mean of
    the last 10 steps)."""
    skills = [skill for skill, _ in settings.mix]
    missing = [s for s in skills if s not in train]
    if missing:
        raise ValueError(f"SFT mix names skills without train data: {missing}")
    data = {s: encode_examples(tokenizer, train[s].prompts, train[s].answers) for s in skills}
    skill_probs = torch.tensor([p for _, p in settings.mix], dtype=torch.float)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    history: list[list[float]] = []
    losses: list[float] = []
    # The run stops at the accuracy target, usually well before max_steps: the bar shows steps and accuracy.
    bar = tqdm(total=settings.max_steps, desc="SFT warm start", unit="step", leave=False, dynamic_ncols=True,
               disable=not progress)
    with torch_threads(settings.num_threads), bar:
        start = time.perf_counter()
        model.train()
        accuracy = 0.0
        while len(losses) < settings.max_steps:
            batch = _sample_batch(data, skills, skill_probs, settings.batch_size, generator)
            losses.append(_train_step(model, optimizer, batch))
            bar.update(1)
            step = len(losses)
            if step % settings.eval_every == 0 or step == settings.max_steps:
                accuracy = greedy_accuracy(model, tokenizer, validation.prompts, validation.answers,
                                           max_new_tokens=MAX_NEW_TOKENS)
                history.append([step, accuracy])
                bar.set_postfix_str(f"loss {losses[-1]:.3f}, {settings.target_skill} accuracy {accuracy:.1%} "
                                    f"(stops at {settings.target_accuracy:.0%})")
                if accuracy >= settings.target_accuracy:
                    break
        seconds = time.perf_counter() - start
    model.eval()
    reached = accuracy >= settings.target_accuracy
    log(f"SFT: {len(losses)} steps in {seconds:.1f} s, {settings.target_skill} validation accuracy {accuracy:.1%}"
        + ("" if reached
           else f" (target {settings.target_accuracy:.0%} not reached within {settings.max_steps} steps)"))
    return {"steps": len(losses), "seconds": round(seconds, 3), "reached_target": reached,
            "target_accuracy": settings.target_accuracy, "final_val_accuracy": accuracy, "val_accuracy": history,
            "first_loss": losses[0] if losses else None,
            "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None, "settings": asdict(settings)}


def _train_step(model, optimizer, batch) -> float:
    """One AdamW step on the answer tokens' cross-entropy; returns the loss."""
    loss = answer_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _sample_batch(
    data: Mapping[str, EncodedExamples], skills: list[str], skill_probs: torch.Tensor, size: int,
    generator: torch.Generator,
) -> EncodedExamples:
    skill_of_row = torch.multinomial(skill_probs, size, replacement=True, generator=generator)
    parts = []
    for k, skill in enumerate(skills):
        n = int((skill_of_row == k).sum())
        if n:
            pool = data[skill]
            idx = torch.randint(len(pool.input_ids_NT), (n,), generator=generator)
            parts.append((pool.input_ids_NT[idx], pool.attention_mask_NT[idx], pool.labels_NT[idx]))
    return EncodedExamples(*(_cat_right_padded([p[j] for p in parts], fill)
                             for j, fill in ((0, 0), (1, 0), (2, IGNORE_INDEX))))


def _cat_right_padded(tensors: list[torch.Tensor], fill: int) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors])
