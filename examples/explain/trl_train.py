# Requires trl==1.16.0.
# A TRL training script, the way TRL's documentation writes one. klgrpo explain reads its GRPOConfig call
# without running it.
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("openai/gsm8k", "main", split="train")
steps = 500

training_args = GRPOConfig(
    output_dir="runs/qwen-gsm8k-grpo",
    learning_rate=1e-6,
    beta=0.04,
    loss_type="grpo",
    num_generations=8,
    max_completion_length=256,
    max_steps=steps,  # a name: computed when the script runs
    bf16=True,
)
trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=accuracy_reward, args=training_args,
                      train_dataset=dataset)
trainer.train()
