#!/usr/bin/env bash
# `make train`: the embedded default. A tiny Stable-Diffusion-architecture pipeline and a
# captioned shapes dataset are generated locally (once), then the UNet is fine-tuned under
# DeepSpeed ZeRO-3 on 2 CPU processes (gloo) with EMA, a sharded text encoder, checkpoints
# and validation images. No network is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
$PYTHON -m diffusers_zero3.demo "$OUT"
$PYTHON -m accelerate.commands.launch --config_file configs/accelerate_zero3.yaml --num_processes 2 \
  scripts/train_text_to_image.py \
  --pretrained_model_name_or_path "$OUT/tiny-sd" \
  --train_data_dir "$OUT/shapes" \
  --output_dir "$OUT/run" \
  --resolution 32 --center_crop --random_flip \
  --train_batch_size 8 --max_train_steps 120 \
  --learning_rate 1e-3 --lr_scheduler constant --lr_warmup_steps 0 \
  --use_ema --text_encoder_placement shard --vae_placement replicate \
  --checkpointing_steps 60 --checkpoints_total_limit 2 \
  --validation_prompts "a red circle" "a blue square" "a green circle" "a yellow square" \
  --validation_epochs 15 --num_validation_inference_steps 20 \
  --seed 0 --report_to tensorboard "$@"
