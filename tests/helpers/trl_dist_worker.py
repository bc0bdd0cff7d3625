"""Run under `accelerate launch --cpu --num_processes 2`: 3 steps of the bridge's GRPOTrainer with the adaptive
controller; every rank writes its logged metrics and final controller state to <out>/rank<k>.json."""

import json
import sys

from klgrpo.trl import GRPOConfig, GRPOTrainer
from tests.helpers.trl_setup import addition_prompts, char_tokenizer, count_zeros, run_args

if __name__ == "__main__":
    model_dir, out = sys.argv[1:3]
    args = GRPOConfig(**run_args(out, max_steps=3, kl_controller="adaptive", kl_target=1e-4, kl_horizon=20.0))
    trainer = GRPOTrainer(model=model_dir, reward_funcs=count_zeros, args=args, train_dataset=addition_prompts(),
                          processing_class=char_tokenizer())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    result = {"world_size": trainer.accelerator.num_processes, "logs": logs,
              "controller": trainer.kl_controller.state_dict()}
    with open(f"{out}/rank{trainer.accelerator.process_index}.json", "w") as f:
        json.dump(result, f)
