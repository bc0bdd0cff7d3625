"""A reward model as a reward function: a sequence classifier scores prompt + completion, one float per completion.

The text is what the reward model was trained on: a conversation (a prompt given as chat messages, or any prompt
with data.as_chat) is rendered with the reward model's own chat template, the completion as the assistant's turn;
a plain prompt is concatenated with its completion and tokenized with the tokenizer's special tokens. Inputs are
padded on the right and scored ``batch_size`` at a time under ``torch.no_grad``; the reward is the logit of the
head's single label (or of the ``label`` the entry names). An input longer than the context loses tokens from the
left of the prompt (its leading special tokens kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

import torch

from klgrpo.backends.classifier import (
    classifier_weight_bytes,
    load_classifier,
    load_classifier_config,
    load_classifier_tokenizer,
)
from klgrpo.backends.hf import resolve_dtype
from klgrpo.errors import ConfigError, RewardError, warn

if TYPE_CHECKING:
    from klgrpo.core.rewards.specs import RewardModelSpec

#: A tokenizer's model_max_length at or above this means "no limit" (transformers' placeholder is ~1e30).
_NO_LIMIT = 1_000_000


@dataclass(frozen=True)
class RewardModelContext:
    """Where and how a reward model scores: the policy's device and dtype (an entry's dtype overrides it), and
    the prompt settings the policy saw (data.system_prompt, data.as_chat)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    system_prompt: str = ""
    as_chat: bool = False


class RewardModel:
    """``fn(prompts, completions, **_) -> list[float]`` backed by a sequence classifier (module docstring).

    Constructing it reads only the model's config (a folder that is not a sequence classifier, or a head of several
    labels without ``label``, is refused before any weight loads); ``load`` loads the weights and the tokenizer once.
    """

    def __init__(self, spec: "RewardModelSpec", trust_remote_code: bool = False):
        self.spec = spec
        self.field = f"rewards.functions model {spec.model!r}"
        self.trust_remote_code = trust_remote_code
        self.config = load_classifier_config(spec.model, self.field, trust_remote_code)
        self.label_index = label_index(self.config, spec)
        self.model = self.tokenizer = None
        self.context = RewardModelContext()
        self.max_length: int | None = None
        self._said: set[str] = set()

    @property
    def display(self) -> str:
        """The metric name: the folder's or the hub name's last part."""
        return PurePath(self.spec.model.rstrip("/\\")).name or self.spec.model

    def dtype_for(self, context: RewardModelContext) -> torch.dtype:
        return resolve_dtype(self.spec.dtype, context.device) if self.spec.dtype else context.dtype

    def weight_bytes(self, context: RewardModelContext) -> int:
        """Bytes of its weights as ``load(context)`` would hold them (counted without loading them)."""
        return classifier_weight_bytes(self.config, self.dtype_for(context), self.trust_remote_code)

    def load(self, context: RewardModelContext) -> None:
        """Load the weights and the tokenizer, once: later calls leave the loaded model as it is."""
        if self.model is not None:
            return
        self.context = context
        tokenizer = load_classifier_tokenizer(self.spec.model, self.field, self.trust_remote_code)
        if tokenizer.pad_token is None:
            stand_in = tokenizer.eos_token or tokenizer.unk_token
            if stand_in is None:
                raise ConfigError(f"the tokenizer of the reward model {self.spec.model!r} has no pad, eos or unk "
                                  f"token to pad with; add a pad token to its tokenizer_config.json")
            tokenizer.pad_token = stand_in
            warn(f"the tokenizer of the reward model {self.spec.model!r} has no pad token; padding with "
                 f"{stand_in!r} (the model reads the last token that is not padding)")
        model = load_classifier(self.spec.model, context.device, self.dtype_for(context), self.field,
                                self.trust_remote_code)
        # The head pools the last token that is not padding, which it finds through this id.
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.tokenizer, self.model = tokenizer, model
        self.max_length = self.spec.max_length or context_length(model.config, tokenizer)

    def __call__(self, prompts: list, completions: list[str], **_: Any) -> list[float]:
        if self.model is None:
            self.load(self.context)
        ids = self._encode(self.render(prompts, completions))
        scores = []
        with torch.no_grad():
            for start in range(0, len(ids), self.spec.batch_size):
                scores.append(self._score(ids[start:start + self.spec.batch_size]))
        values = torch.cat(scores).float().cpu() if scores else torch.zeros(0)
        bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(f"reward model {self.spec.model!r} gave {values[bad[0]].item()} for completion "
                              f"{bad[0]} ({completions[bad[0]][:40]!r}); every reward must be finite: check its "
                              f"weights, or score in float32 (dtype: float32 in its entry)")
        return values.tolist()

    # ------------------------------------------------------------------------------------------ pieces
    def render(self, prompts: list, completions: list[str]) -> list[tuple[str, bool]]:
        """(text, rendered by the chat template) per completion."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list) or (self.context.as_chat and isinstance(prompt, str)):
                out.append(self._render_conversation(prompt, completion))
            else:
                out.append((f"{prompt}{completion}", False))
        return out

    def _render_conversation(self, prompt, completion: str) -> tuple[str, bool]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        system = self.context.system_prompt
        messages = ([{"role": "system", "content": system}] if system else []) + messages
        messages.append({"role": "assistant", "content": completion})
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False), True
        self._say_once("template", f"the tokenizer of the reward model {self.spec.model!r} has no chat template; "
                                   f"it scores conversations as their messages' contents joined by newlines")
        return "\n".join(str(m["content"]) for m in messages), False

    def _encode(self, rendered: list[tuple[str, bool]]) -> list[list[int]]:
        """Token ids per row; a chat template writes its special tokens itself, plain text gets the tokenizer's."""
        ids: list[list[int]] = [[] for _ in rendered]
        for templated in (True, False):  # one tokenizer call for each kind
            rows = [i for i, (_, t) in enumerate(rendered) if t == templated]
            if rows:
                encoded = self.tokenizer([rendered[i][0] for i in rows], add_special_tokens=not templated)
                for i, row_ids in zip(rows, encoded["input_ids"]):
                    ids[i] = self._truncated(row_ids, i)
        return ids

    def _truncated(self, ids: list[int], row: int) -> list[int]:
        """``ids`` within the context: tokens dropped from the left, after the leading special tokens."""
        limit = self.max_length
        if limit is None or len(ids) <= limit:
            return ids
        special = set(self.tokenizer.all_special_ids)
        head = 0
        while head < len(ids) and ids[head] in special and head < limit - 1:
            head += 1
        self._say_once("truncated", f"completion {row} with its prompt is {len(ids)} tokens, more than the "
                                    f"{limit} of the reward model {self.spec.model!r}; inputs that long lose "
                                    f"tokens from the left of the prompt (said once; max_length in its entry)")
        return ids[:head] + ids[len(ids) - (limit - head):]

    def _score(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            attention[i, :len(r)] = 1
        device = self.context.device
        logits = self.model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
        return logits[:, self.label_index]

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            warn(message)


def label_index(config, spec: "RewardModelSpec") -> int:
    """The column of the head's logits that is the reward: the single label's, or the one ``spec.label`` names."""
    count = int(getattr(config, "num_labels", 1) or 1)
    names = {str(v): int(k) for k, v in (getattr(config, "id2label", None) or {}).items()}
    if spec.label is None:
        if count == 1:
            return 0
        listing = ", ".join(f"{i}: {n}" for n, i in sorted(names.items(), key=lambda kv: kv[1]))
        raise ConfigError(f"reward model {spec.model!r} has a head of {count} labels ({listing}); set label in its "
                          f"rewards.functions entry to the one whose logit is the reward (an index 0..{count - 1} "
                          f"or a name)")
    if isinstance(spec.label, str):
        if spec.label not in names:
            raise ConfigError(f"reward model {spec.model!r}: label {spec.label!r} is not one of its labels "
                              f"({', '.join(names) or 'none named'})")
        return names[spec.label]
    if spec.label >= count:
        raise ConfigError(f"reward model {spec.model!r}: label {spec.label} is out of range; its head has {count} "
                          f"label(s), 0..{count - 1}")
    return spec.label


def context_length(config, tokenizer) -> int | None:
    """The longest input the model reads: its position limit and its tokenizer's, whichever is known and smaller."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limits = [getattr(text, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [n for n in limits if isinstance(n, int) and 0 < n < _NO_LIMIT]
    return min(limits) if limits else None
