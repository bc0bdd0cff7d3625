"""One GRPO step's data path, as library pieces the trainer composes:

    data (prompts) -> rollout (G completions per prompt) -> rewards -> reference (log-probs, once per batch)
    -> batch (StepBatch: advantages, masks, the global normaliser) -> forward (the policy's log-probs)

The loss itself is klgrpo.math.objective; the loop that runs all this is klgrpo.train.
"""
