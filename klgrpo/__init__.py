"""klgrpo: GRPO for causal language models with the KL regularisation against a frozen reference done right."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "GRPOTrainer", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import klgrpo.math` does not pull in transformers.
    if name == "GRPOConfig":
        from klgrpo.config.schema import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from klgrpo.run.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'klgrpo' has no attribute {name!r}")
