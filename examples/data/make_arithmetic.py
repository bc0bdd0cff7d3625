"""Writes the SmolLM2 example's prompt files next to this script (re-running it gives the same files):

    arithmetic_train.jsonl  the training prompts: "What is 6 + 9?" with answer "15"
    arithmetic_eval.jsonl   held-out prompts (no (a, b) pair of the training file), scored greedily

Every single-digit sum a + b (a, b in 1..9: 81 pairs) goes to one file or the other, split by a fixed shuffle.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL_PAIRS = 32


def rows(pairs):
    return [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]


def main() -> None:
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(0).shuffle(pairs)
    for name, part in (("arithmetic_eval.jsonl", pairs[:EVAL_PAIRS]), ("arithmetic_train.jsonl", pairs[EVAL_PAIRS:])):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows(part)))


if __name__ == "__main__":
    main()
