#!/usr/bin/env bash
# `make train`: the embedded default. A tiny pipeline and a captioned shapes dataset are
# generated locally (once), then the UNet is fine-tuned under DeepSpeed ZeRO-3 on 2 CPU
# processes (gloo; one process per GPU on a CUDA host) with EMA, sharded frozen models,
# checkpoints and validation images.
# No network is used.
#   MODEL=sd   (default) Stable Diffusion architecture, text encoder sharded.
#   MODEL=sdxl SDXL architecture (two text encoders, text_encoder_2 sharded, the VAE cached),
#              on images of varied sizes (SDXL's size and crop conditioning).
#   MODEL=flux Flux.1 architecture (flow matching, packed latents, guidance embedding): the T5
#              encoder (text_encoder_2) sharded, CLIP replicated, 32 T5 tokens.
#   MODEL=sd3  SD3 architecture (two CLIPs and a T5): the T5 (text_encoder_3) cached, encoded
#              sharded and freed; the VAE cached too.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
MODEL=${MODEL:-sd}
# NUM_PROCESSES: one per GPU on a CUDA host, else 2 CPU ranks with DS_ACCELERATOR=cpu
# (diffusers_zero3/launch.py; NUM_PROCESSES=N overrides).
SETTINGS=$($PYTHON -m diffusers_zero3.launch)
eval "$SETTINGS"
$PYTHON -m diffusers_zero3.demo "$OUT" --model "$MODEL"
case "$MODEL" in
  sd) PIPE="$OUT/tiny-sd"; DATA="$OUT/shapes"; RUN="$OUT/run"
      PLACEMENTS=(--text_encoder_placement shard --vae_placement replicate) ;;
  sdxl) PIPE="$OUT/tiny-sdxl"; DATA="$OUT/shapes-varied"; RUN="$OUT/run-sdxl"
      PLACEMENTS=(--text_encoder_placement replicate --text_encoder_2_placement shard --vae_placement cache) ;;
  flux) PIPE="$OUT/tiny-flux"; DATA="$OUT/shapes"; RUN="$OUT/run-flux"
      PLACEMENTS=(--text_encoder_placement replicate --text_encoder_2_placement shard --vae_placement replicate
                  --max_sequence_length 32) ;;
  sd3) PIPE="$OUT/tiny-sd3"; DATA="$OUT/shapes"; RUN="$OUT/run-sd3"
      PLACEMENTS=(--text_encoder_placement replicate --text_encoder_2_placement replicate
                  --text_encoder_3_placement cache --vae_placement cache --max_sequence_length 32) ;;
  *) echo "error: MODEL must be sd, sdxl, flux or sd3, got '$MODEL'" >&2; exit 2 ;;
esac
$PYTHON -m accelerate.commands.launch --config_file configs/accelerate_zero3.yaml --num_processes "$NUM_PROCESSES" \
  scripts/train_text_to_image.py \
  --pretrained_model_name_or_path "$PIPE" \
  --train_data_dir "$DATA" \
  --output_dir "$RUN" \
  --resolution 32 --center_crop --random_flip \
  --train_batch_size 8 --max_train_steps 120 \
  --learning_rate 1e-3 --lr_scheduler constant --lr_warmup_steps 0 \
  --use_ema "${PLACEMENTS[@]}" \
  --checkpointing_steps 60 --checkpoints_total_limit 2 \
  --validation_prompts "a red circle" "a blue square" "a green circle" "a yellow square" \
  --validation_epochs 15 --num_validation_inference_steps 20 \
  --seed 0 --report_to tensorboard "$@"
