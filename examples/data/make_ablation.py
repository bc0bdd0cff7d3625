"""Writes the beta ablation's prompt files next to this script (re-running it gives the same files).

The trained task is one SmolLM2-135M-Instruct is poor at; the two retention skills are ones it already has
(greedy accuracy before training: docs/ablation.md). Retention prompts are never trained on, and the replay
anchor's prompts are other questions of the same two kinds (no test prompt among them).

    ablation_add_train.jsonl   trained: "What is 6 + 9? Answer with only the number." -> "15"
    ablation_add_eval.jsonl    held-out sums (no (a, b) pair of the training file), scored with numeric_match
    ablation_capitals.jsonl    retention: "What is the capital of France?" -> "Paris"
    ablation_opposites.jsonl   retention: "What is the opposite of hot?" -> "cold"
    ablation_replay.jsonl      the replay anchor's unlabeled prompts: other countries and other words

The retention sets are scored with ablation_rewards.py:word_match (the answer as a whole word, any case).
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL_PAIRS = 32
INSTRUCTION = "Answer with only the number."

CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"), ("England", "London"),
    ("the United Kingdom", "London"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Denmark", "Copenhagen"),
    ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Hungary", "Budapest"), ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Cuba", "Havana"), ("India", "New Delhi"), ("Thailand", "Bangkok"),
    ("South Korea", "Seoul"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Kenya", "Nairobi"),
    ("Iran", "Tehran"), ("Turkey", "Ankara"), ("Australia", "Canberra"), ("Brazil", "Brasilia"),
    ("the United States", "Washington"), ("Switzerland", "Bern"), ("the Czech Republic", "Prague"),
    ("Vietnam", "Hanoi"), ("Iraq", "Baghdad"), ("Saudi Arabia", "Riyadh"), ("Ukraine", "Kyiv"),
    ("Scotland", "Edinburgh"),
]
OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("day", "night"),
    ("black", "white"), ("old", "new"), ("open", "closed"), ("light", "dark"), ("wet", "dry"), ("high", "low"),
    ("left", "right"), ("in", "out"), ("yes", "no"), ("good", "bad"), ("rich", "poor"), ("strong", "weak"),
    ("hard", "soft"), ("early", "late"), ("long", "short"), ("full", "empty"), ("win", "lose"), ("push", "pull"),
    ("love", "hate"), ("true", "false"), ("inside", "outside"), ("top", "bottom"), ("start", "end"),
    ("buy", "sell"), ("near", "far"), ("thick", "thin"), ("heavy", "light"), ("clean", "dirty"),
    ("loud", "quiet"), ("young", "old"), ("first", "last"), ("easy", "difficult"), ("alive", "dead"),
    ("north", "south"), ("east", "west"), ("before", "after"), ("above", "below"), ("give", "take"),
    ("laugh", "cry"), ("always", "never"),
]
#: The replay anchor's prompts: the same two kinds of question about other countries and words.
REPLAY_COUNTRIES = [
    "Romania", "Bulgaria", "Serbia", "Croatia", "Slovakia", "Slovenia", "Estonia", "Latvia", "Lithuania",
    "Iceland", "Morocco", "Nigeria", "Ghana", "Ethiopia", "Pakistan", "Bangladesh", "Malaysia", "Singapore",
    "Colombia", "Venezuela", "Uruguay", "New Zealand", "Israel", "Syria", "Jordan", "Lebanon", "Nepal",
    "Mongolia", "Afghanistan", "Algeria", "Tunisia", "Libya",
]
REPLAY_WORDS = [
    "cheap", "wide", "sweet", "deep", "tall", "brave", "kind", "warm", "safe", "smooth", "sharp", "bright",
    "quick", "friend", "guilty", "asleep", "arrive", "accept", "remember", "question", "summer", "morning", "boy",
    "king", "sunny", "simple", "private", "future", "positive", "major", "inner", "forward",
]


def sums(pairs: list[tuple[int, int]]) -> list[dict]:
    return [{"prompt": f"What is {a} + {b}? {INSTRUCTION}", "answer": str(a + b)} for a, b in pairs]


def write(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(0).shuffle(pairs)
    write("ablation_add_eval.jsonl", sums(pairs[:EVAL_PAIRS]))
    write("ablation_add_train.jsonl", sums(pairs[EVAL_PAIRS:]))
    write("ablation_capitals.jsonl", [{"prompt": f"What is the capital of {c}?", "answer": a} for c, a in CAPITALS])
    write("ablation_opposites.jsonl", [{"prompt": f"What is the opposite of {w}?", "answer": a} for w, a in OPPOSITES])
    replay = ([f"What is the capital of {c}?" for c in REPLAY_COUNTRIES]
              + [f"What is the opposite of {w}?" for w in REPLAY_WORDS])
    random.Random(1).shuffle(replay)  # both kinds in the first kl.replay.num_prompts rows
    write("ablation_replay.jsonl", [{"prompt": p} for p in replay])


if __name__ == "__main__":
    main()
