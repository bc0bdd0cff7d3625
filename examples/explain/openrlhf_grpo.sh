#!/bin/bash
# OpenRLHF GRPO with k3 in the loss, the flags kept in a bash array as OpenRLHF users often do.
set -x
MODEL=Qwen/Qwen2.5-0.5B-Instruct

ARGS=(
   --actor.model_name_or_path $MODEL
   --algo.advantage.estimator group_norm   # GRPO's group normalisation
   --algo.kl.use_loss
   --algo.kl.estimator k3
   --algo.kl.init_coef 1e-3
   --algo.advantage.is_correction_enable   # vLLM importance-sampling correction (policy term)
   --actor.eps_clip_low_high 0.2 0.28
   --rollout.n_samples_per_prompt 8
   --rollout.batch_size 128
   --train.batch_size 1024
   --ds.zero_stage 3
)

ray job submit --address="http://127.0.0.1:8265" -- python3 -m openrlhf.cli.train_ppo_ray "${ARGS[@]}"
