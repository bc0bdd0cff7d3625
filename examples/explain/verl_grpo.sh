#!/usr/bin/env bash
# verl GRPO on GSM8K, written as verl's own example scripts are: one key=value per line after main_ppo.
set -x
ENGINE=${1:-vllm}
MODEL=Qwen/Qwen2.5-0.5B-Instruct
KL_COEF=0.001

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.train_batch_size=256 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=$KL_COEF \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=$ENGINE \
    actor_rollout_ref.rollout.n=8 \
    algorithm.use_kl_in_reward=False \
    trainer.logger='["console"]' \
    trainer.total_epochs=15 $@
