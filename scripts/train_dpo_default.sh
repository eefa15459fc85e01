#!/usr/bin/env bash
# `make train-dpo`: Diffusion-DPO on the embedded default. A tiny SD pipeline and a generated
# preference dataset (each caption paired with a matching image and one of the wrong colour;
# a few ties, which are dropped) are written locally (once), then the whole UNet is trained
# with DPO on 2 CPU processes under ZeRO-3, the reference UNet sharded as a ZeRO-3 inference
# engine. Implicit accuracy is logged per step; its curve is drawn to RUN/implicit_accuracy.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
$PYTHON -m diffusers_zero3.demo "$OUT" --model sd --preferences
$PYTHON -m accelerate.commands.launch --config_file configs/accelerate_zero3.yaml --num_processes 2 \
  scripts/train_dpo.py \
  --pretrained_model_name_or_path "$OUT/tiny-sd" \
  --dataset_name "$OUT/preferences" \
  --output_dir "$OUT/run-dpo" \
  --rank 0 --reference_placement shard --text_encoder_placement shard \
  --resolution 32 --center_crop --random_flip \
  --train_batch_size 8 --max_train_steps 120 \
  --learning_rate 1e-4 --lr_scheduler constant --lr_warmup_steps 0 --beta_dpo 2500 \
  --checkpointing_steps 60 --checkpoints_total_limit 2 \
  --validation_prompts "a red circle" "a blue square" --validation_steps 120 --num_validation_inference_steps 20 \
  --seed 0 --report_to tensorboard "$@"
