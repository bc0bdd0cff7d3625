"""The small run configuration trainer tests share: a tiny local model, 4 prompts x 4 completions, 2 steps."""

from __future__ import annotations

from klgrpo.config.schema import GRPOConfig

# A reward that varies across a random model's samples, so advantages are non-zero.
HAS_ZERO = {"name": "format", "kwargs": {"pattern": "0"}}


def make_config(model_dir, data_file, out, **groups) -> GRPOConfig:
    """The base run, with ``groups`` (e.g. kl={"coef": 0.5}) laid over each group's defaults."""
    base = {
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(data_file)},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
        "rewards": {"functions": [HAS_ZERO]},
        "kl": {"coef": 0.1},
        "optim": {"lr": 1e-2},
        "train": {"steps": 2, "output_dir": str(out), "seed": 0},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }
    for group, values in groups.items():
        base.setdefault(group, {}).update(values)
    return GRPOConfig.from_dict(base)


def quiet(*_):
    pass
