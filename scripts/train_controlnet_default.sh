#!/usr/bin/env bash
# `make train-controlnet`: a ControlNet on the embedded default. The tiny SD pipeline is first
# fine-tuned on the shapes data (once, as for make train-dpo), then a ControlNet initialised
# from its UNet learns to follow shape masks (a generated dataset of shapes, their masks and
# captions) under ZeRO-3, the UNet frozen and sharded. Validation rows show the mask, then the
# samples. No network is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
# NUM_PROCESSES and CONFIG: one process per GPU in bf16 on a CUDA host, else 2 CPU ranks in
# fp32 with DS_ACCELERATOR=cpu (diffusers_zero3/runtime/launch.py; NUM_PROCESSES=N overrides).
SETTINGS=$($PYTHON -m diffusers_zero3.runtime.launch)
eval "$SETTINGS"
LAUNCH=($PYTHON -m accelerate.commands.launch --config_file "$CONFIG" --num_processes "$NUM_PROCESSES")
$PYTHON -m diffusers_zero3.demo "$OUT" --model sd --controlnet
if [ ! -f "$OUT/run-sft/model_index.json" ]; then
  "${LAUNCH[@]}" scripts/train_text_to_image.py --pretrained_model_name_or_path "$OUT/tiny-sd" \
    --train_data_dir "$OUT/shapes" --output_dir "$OUT/run-sft" --resolution 32 --center_crop --random_flip \
    --train_batch_size 8 --max_train_steps 150 --learning_rate 1e-3 --lr_warmup_steps 0 \
    --checkpointing_steps 1000 --seed 0 --report_to none
fi
"${LAUNCH[@]}" scripts/train_controlnet.py \
  --pretrained_model_name_or_path "$OUT/run-sft" \
  --dataset_name "$OUT/controlnet-shapes" \
  --unet_placement shard --text_encoder_placement shard \
  --output_dir "$OUT/run-controlnet" \
  --resolution 32 --train_batch_size 8 --max_train_steps 100 \
  --learning_rate 1e-4 --lr_scheduler constant --lr_warmup_steps 0 \
  --checkpointing_steps 50 --checkpoints_total_limit 2 \
  --validation_prompt "a red circle" "a blue square" \
  --validation_image "$OUT/controlnet-shapes-masks/circle.png" "$OUT/controlnet-shapes-masks/square.png" \
  --num_validation_images 2 --validation_steps 100 --num_validation_inference_steps 20 \
  --seed 0 --report_to tensorboard "$@"
