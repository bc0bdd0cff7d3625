# An Unsloth GRPO script: Unsloth patches TRL's GRPOConfig; this one also sets the adaptive-KL fields.
from trl import GRPOConfig as Config
from trl import GRPOTrainer
from unsloth import FastLanguageModel

model, tokenizer = FastLanguageModel.from_pretrained("unsloth/Qwen2.5-0.5B-Instruct", max_seq_length=1024,
                                                     load_in_4bit=True)
model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16)

args = Config(
    learning_rate=5e-6,
    beta=0.04,
    loss_type="grpo",
    kl_adaptation_method="dynamic",
    reward_threshold=0.8,
    dynamic_beta_decay=0.9,
    beta_min=0.001,
    beta_schedule_steps=1000,
    num_generations=8,
    max_completion_length=256,
    output_dir="outputs",
)
GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[], args=args).train()
