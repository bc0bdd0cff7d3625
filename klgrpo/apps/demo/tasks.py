"""The demo's arithmetic skills, with fixed-width prompts and deterministic disjoint splits.

Formats (every prompt is 6 characters and every answer 3 digits, so a batch never needs padding and a
completion is at most 4 tokens: 3 digits + EOS):

    addition     ``ab+cd=`` -> ``efg``   two-digit operands 00..99, the sum zero-padded to 3 digits
                 e.g. ``07+45=`` -> ``052``; 10,000 prompts
    subtraction  ``ab-cd=`` -> ``efg``   operands 00..99 with ab >= cd, so the difference is
                 non-negative, zero-padded to 3 digits, e.g. ``73-45=`` -> ``028``; 5,050 prompts

Each skill's prompts are shuffled once with a fixed RNG (independent of the training seed, so every seed
is tested on the same prompts) and cut into four disjoint parts: test, validation, replay, train.
No test prompt is ever in the train, validation or replay part.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SKILLS = ("addition", "subtraction")
PROMPT_LENGTH = 6
ANSWER_LENGTH = 3
#: Greedy/sampled decoding needs the 3 answer digits plus the EOS token.
MAX_NEW_TOKENS = ANSWER_LENGTH + 1
#: Fixed seed of the split shuffle; changing it changes every split (bump assets.FORMAT_VERSION).
SPLIT_SEED = 20240917


def format_prompt(skill: str, a: int, b: int) -> str:
    """``07+45=`` for addition, ``73-45=`` for subtraction."""
    return f"{a:02d}{_operator(skill)}{b:02d}="


def format_answer(skill: str, a: int, b: int) -> str:
    """The zero-padded 3-digit result: ``052`` for 07+45, ``028`` for 73-45."""
    value = a + b if skill == "addition" else a - b
    return f"{value:03d}"


def _operator(skill: str) -> str:
    if skill == "addition":
        return "+"
    if skill == "subtraction":
        return "-"
    raise ValueError(f"unknown skill {skill!r}; choose one of {', '.join(SKILLS)}")


def all_pairs(skill: str) -> list[tuple[int, int]]:
    """Every operand pair of a skill in a fixed order (subtraction keeps a >= b)."""
    _operator(skill)
    return [(a, b) for a in range(100) for b in range(100) if skill == "addition" or a >= b]


@dataclass(frozen=True)
class Split:
    """One part of a skill: parallel lists of prompts and answers."""

    prompts: list[str]
    answers: list[str]

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self) -> list[dict[str, str]]:
        return [{"prompt": p, "answer": a} for p, a in zip(self.prompts, self.answers)]


@dataclass(frozen=True)
class SkillSplits:
    train: Split
    validation: Split
    test: Split
    replay: Split


def make_splits(skill: str, n_test: int = 200, n_validation: int = 200, n_replay: int = 1000) -> SkillSplits:
    """Deterministic disjoint test / validation / replay / train parts of a skill; train gets the rest."""
    pairs = all_pairs(skill)
    if n_test + n_validation + n_replay >= len(pairs):
        raise ValueError(f"{skill}: n_test + n_validation + n_replay must be below {len(pairs)} prompts")
    random.Random(f"{skill}/{SPLIT_SEED}").shuffle(pairs)

    def part(chunk: list[tuple[int, int]]) -> Split:
        return Split([format_prompt(skill, a, b) for a, b in chunk], [format_answer(skill, a, b) for a, b in chunk])

    cuts = [0, n_test, n_test + n_validation, n_test + n_validation + n_replay, len(pairs)]
    test, validation, replay, train = (part(pairs[lo:hi]) for lo, hi in zip(cuts, cuts[1:]))
    return SkillSplits(train=train, validation=validation, test=test, replay=replay)


def write_jsonl(path: str | Path, rows: list[dict[str, str]]) -> Path:
    """One JSON object per line, UTF-8."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
