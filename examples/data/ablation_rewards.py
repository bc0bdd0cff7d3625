"""The beta ablation's retention reward (examples/smollm2-beta-ablation.yaml): the answer as a whole word."""

import re


def word_match(prompts, completions, answer, **_):
    """1.0 where the answer occurs in the completion as whole words, ignoring case, else 0.0:
    "The capital of France is Paris." scores 1 for "Paris"; "Parisian" does not."""
    return [1.0 if re.search(r"\b" + re.escape(str(gold).strip().lower()) + r"\b", text.lower()) else 0.0
            for text, gold in zip(completions, answer)]
