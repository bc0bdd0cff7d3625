"""train.compile on prompts of varied length (slow: torch.compile of the sampling step and of the log-prob
forward and backward, at two prompt widths, ~1-2 min on 2 CPU cores).

The second width makes torch recompile with dynamic shapes; on torch 2.13's CPU inductor the fast path's backward
then failed its own stride check on the slices of the KV cache (an AssertionError at the third step). Compiled,
the run must finish and train as the eager run does from the same seed: the same completions, the same losses
and weights to float rounding."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import write_jsonl
from tests.helpers.configs import make_config

pytestmark = pytest.mark.slow


def test_compiled_training_on_prompts_of_several_widths_equals_eager(tiny_model_dir, tmp_path):
    from klgrpo.run.trainer import GRPOTrainer

    # batches of 2 prompts whose longest is 4, 8 or 12 characters: three widths over 4 steps
    rows = [{"prompt": "1+" + "2" * n + "=", "answer": "3"} for n in (1, 1, 5, 5, 9, 9, 1, 9)]
    data = write_jsonl(tmp_path / "widths.jsonl", rows)
    runs = {}
    for compiled in (False, True):
        cfg = make_config(tiny_model_dir, data, tmp_path / f"run-{compiled}", train={
            "steps": 4, "output_dir": str(tmp_path / f"run-{compiled}"), "seed": 0, "compile": compiled},
            rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4}, data={"shuffle": False})
        trainer = GRPOTrainer(cfg, log=lambda *_: None)
        trainer.train()
        metrics = [json.loads(x) for x in (tmp_path / f"run-{compiled}" / "metrics.jsonl").read_text().splitlines()]
        runs[compiled] = ([r for r in metrics if "train/loss" in r],
                          {k: v.clone() for k, v in trainer.model.state_dict().items()})
    (eager, eager_weights), (compiled, compiled_weights) = runs[False], runs[True]
    assert [r["step"] for r in compiled] == [1, 2, 3, 4]
    for a, b in zip(eager, compiled):
        assert a["completions/mean_length"] == b["completions/mean_length"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
    # AdamW at lr 1e-2 moves every weight by up to 1e-2 a step, and where a gradient is near 0 its sign-like update
    # turns float rounding of the gradient into a visible difference in a few entries; a wrong gradient moves
    # most entries, by ~1e-2.
    diff = torch.cat([(compiled_weights[k] - w).abs().flatten() for k, w in eager_weights.items()])
    assert diff.max() < 1e-3 and (diff > 1e-5).float().mean() < 0.01, (diff.max(), (diff > 1e-5).float().mean())
