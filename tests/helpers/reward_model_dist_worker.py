"""Run under ``accelerate launch`` with 2 CPU processes: ``CONFIG OUT_PREFIX``. A 2-step GRPO run whose rewards
include a reward model; each rank counts how often the reward model's weights load, scores fixed texts with the
trainer's own reward model after the run, and writes {rank, world_size, loads, scores, steps} to
OUT_PREFIX.<rank>.json."""

import json
import os
import sys
from pathlib import Path

import klgrpo.core.rewards.model as reward_model_module
from klgrpo.config.schema import GRPOConfig
from klgrpo.run.trainer import GRPOTrainer

PROMPTS = ["12+3=", "7-4=", "99+1=", "0+0=", "5-5="]
COMPLETIONS = ["15", "3", "100", "", "0"]


def main(config_file: str, out_prefix: str) -> None:
    loads = []
    real = reward_model_module.load_classifier

    def counted(*args, **kwargs):
        loads.append(args[0])
        return real(*args, **kwargs)

    reward_model_module.load_classifier = counted  # RewardModel.load calls it by this module's name
    trainer = GRPOTrainer(GRPOConfig.from_dict(json.loads(Path(config_file).read_text())), log=lambda *a, **k: None)
    summary = trainer.train()
    (model,) = trainer.grpo_step.rewards.reward_models
    scores = model(PROMPTS, COMPLETIONS)
    Path(f"{out_prefix}.{trainer.dist.rank}.json").write_text(json.dumps(
        {"rank": trainer.dist.rank, "world_size": trainer.dist.world_size, "loads": loads, "scores": scores,
         "steps": summary["steps"]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Every result is written: leave without the interpreter's teardown (tests/helpers/dist_worker.py says why).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
