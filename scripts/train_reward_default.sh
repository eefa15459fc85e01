#!/usr/bin/env bash
# `make train-reward`: reward fine-tuning on the embedded default. The tiny pipeline and a
# reward model that scores how red an image is are generated locally (once); the UNet is
# trained under DeepSpeed ZeRO-3 on 2 CPU processes (one per GPU on a CUDA host) with the
# reward model sharded as a ZeRO-3 inference engine. The mean reward per step is printed and
# plotted to rewards.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
# NUM_PROCESSES and CONFIG: one process per GPU in bf16 on a CUDA host, else 2 CPU ranks in
# fp32 with DS_ACCELERATOR=cpu (diffusers_zero3/runtime/launch.py; NUM_PROCESSES=N overrides).
SETTINGS=$($PYTHON -m diffusers_zero3.runtime.launch)
eval "$SETTINGS"
$PYTHON -m diffusers_zero3.demo "$OUT"
$PYTHON -m accelerate.commands.launch --config_file "$CONFIG" --num_processes "$NUM_PROCESSES" \
  scripts/train_reward.py \
  --pretrained_model_name_or_path "$OUT/tiny-sd" \
  --reward_model_name_or_path "$OUT/redness-reward" \
  --prompts "a red circle" "a blue square" "a green circle" "a yellow square" \
  --output_dir "$OUT/reward-run" \
  --resolution 32 --train_batch_size 2 --max_train_steps 60 --num_inference_steps 8 \
  --truncated_backprop_steps 1 --learning_rate 1e-3 --use_ema \
  --reward_placement shard --checkpointing_steps 30 --checkpoints_total_limit 1 \
  --seed 0 "$@"
