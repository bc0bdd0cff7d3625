"""A tiny local model, char tokenizer and prompt dataset for running TRL's GRPOTrainer (and the bridge) on the CPU."""

from __future__ import annotations

from datasets import Dataset

from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer
from klgrpo.apps.demo.tokenizer import build_char_tokenizer

TINY = {"hidden": 16, "layers": 1, "heads": 2, "intermediate": 32}


def save_tiny_model(path, seed: int = 0):
    """A tiny Llama + char tokenizer saved under ``path``: TRL loads its reference model from this folder."""
    return str(save_tiny_model_and_tokenizer(path, seed=seed, **TINY))


def char_tokenizer():
    return build_char_tokenizer()


def addition_prompts(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{a}+{a % 5}=" for a in range(n)]})


def count_zeros(completions, **_):
    """Reward: the number of '0' characters, so random completions get different rewards."""
    return [float(c.count("0")) for c in completions]


def run_args(out_dir, **overrides) -> dict:
    """GRPOConfig arguments for a 2-step CPU run: 4 prompts x 2 completions of <= 4 tokens per step."""
    args = dict(output_dir=str(out_dir), use_cpu=True, per_device_train_batch_size=4, num_generations=2,
                max_completion_length=4, max_steps=2, learning_rate=1e-2, beta=0.1, logging_steps=1,
                report_to=[], save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
                temperature=1.0)
    args.update(overrides)
    return args
