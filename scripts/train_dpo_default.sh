#!/usr/bin/env bash
# `make train-dpo`: Diffusion-DPO on the embedded default. A tiny SD pipeline and a generated
# preference dataset (each caption paired with a matching image and one of the wrong colour;
# a few ties, which are dropped) are written locally (once). The tiny pipeline's weights are
# random, so it is first fine-tuned on the shapes for 150 steps (text-to-image, once: DPO
# needs a model that denoises), then trained with DPO on 2 CPU processes (one per GPU on a
# CUDA host) under ZeRO-3 (LoRA rank 8; the reference is the fine-tuned base with the
# adapters disabled). Implicit accuracy is logged per step; its curve is drawn to
# RUN/implicit_accuracy.png.
# `--rank 0 --reference_placement shard` trains the whole UNet beside a sharded reference.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
# NUM_PROCESSES and CONFIG: one process per GPU in bf16 on a CUDA host, else 2 CPU ranks in
# fp32 with DS_ACCELERATOR=cpu (diffusers_zero3/runtime/launch.py; NUM_PROCESSES=N overrides).
SETTINGS=$($PYTHON -m diffusers_zero3.runtime.launch)
eval "$SETTINGS"
LAUNCH=($PYTHON -m accelerate.commands.launch --config_file "$CONFIG" --num_processes "$NUM_PROCESSES")
$PYTHON -m diffusers_zero3.demo "$OUT" --model sd --preferences
if [ ! -f "$OUT/run-sft/model_index.json" ]; then
  "${LAUNCH[@]}" scripts/train_text_to_image.py --pretrained_model_name_or_path "$OUT/tiny-sd" \
    --train_data_dir "$OUT/shapes" --output_dir "$OUT/run-sft" --resolution 32 --center_crop --random_flip \
    --train_batch_size 8 --max_train_steps 150 --learning_rate 1e-3 --lr_warmup_steps 0 \
    --checkpointing_steps 1000 --seed 0 --report_to none
fi
"${LAUNCH[@]}" scripts/train_dpo.py \
  --pretrained_model_name_or_path "$OUT/run-sft" \
  --dataset_name "$OUT/preferences" \
  --output_dir "$OUT/run-dpo" \
  --rank 8 --text_encoder_placement shard \
  --resolution 32 --center_crop \
  --train_batch_size 16 --max_train_steps 100 \
  --learning_rate 1e-3 --lr_scheduler constant --lr_warmup_steps 0 --beta_dpo 2500 \
  --checkpointing_steps 50 --checkpoints_total_limit 2 \
  --validation_prompts "a red circle" "a blue square" --validation_steps 100 --num_validation_inference_steps 20 \
  --seed 0 --report_to tensorboard "$@"
