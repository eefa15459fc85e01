#!/usr/bin/env bash
# `make train`: the embedded default. A tiny pipeline and a captioned shapes dataset are
# generated locally (once), then the denoiser is fine-tuned under DeepSpeed ZeRO-3 on 2 CPU
# processes (gloo; one process per GPU on a CUDA host) with EMA, placed frozen models,
# checkpoints and validation images. No network is used.
#   MODEL=sd (default), sdxl, sd3, flux, ...: a family's short name (diffusers_zero3.families);
#   each family's module says which placements its default run uses (default_run_args), e.g.
#   SD's text encoder sharded, SDXL's text_encoder_2 sharded and VAE cached (on images of
#   varied sizes), Flux's T5 sharded, SD3's T5 and VAE cached.
#   BUCKETS=1: an image family on landscape and portrait images with aspect-ratio buckets
#   (--use_aspect_ratio_buckets: one bucket per micro-batch, the same on every rank).
#   CONTEXT_PARALLEL=K: each sample's tokens split over groups of K ranks
#   (--context_parallel_size; a family whose denoiser has a context-parallel plan, e.g. wan).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
MODEL=${MODEL:-sd}
# NUM_PROCESSES and CONFIG: one process per GPU in bf16 on a CUDA host, else 2 CPU ranks in
# fp32 with DS_ACCELERATOR=cpu (diffusers_zero3/runtime/launch.py; NUM_PROCESSES=N overrides).
SETTINGS=$($PYTHON -m diffusers_zero3.runtime.launch)
eval "$SETTINGS"
# PIPE, DATA and RUN_ARGS (the family's placements, and an editing family's validation edits:
# after the generic prompts below, so that they win); an unknown MODEL is one error line.
BUCKET_ARGS=()
VARIED=()
if [ "${BUCKETS:-0}" = 1 ]; then
  BUCKET_ARGS=(--use_aspect_ratio_buckets --train_batch_size 4)
  VARIED=(--varied)
fi
CP_ARGS=()
if [ "${CONTEXT_PARALLEL:-1}" != 1 ]; then
  CP_ARGS=(--context_parallel_size "$CONTEXT_PARALLEL")
fi
DEFAULT=$($PYTHON -m diffusers_zero3.demo "$OUT" --model "$MODEL" "${VARIED[@]}" --shell) || exit 2
eval "$DEFAULT"
RUN="$OUT/run-$MODEL"
[ "$MODEL" = sd ] && RUN="$OUT/run"
[ "${BUCKETS:-0}" = 1 ] && RUN="$RUN-buckets"
[ "${CONTEXT_PARALLEL:-1}" != 1 ] && RUN="$RUN-cp$CONTEXT_PARALLEL"
$PYTHON -m accelerate.commands.launch --config_file "$CONFIG" --num_processes "$NUM_PROCESSES" \
  scripts/train_text_to_image.py \
  --pretrained_model_name_or_path "$PIPE" \
  --train_data_dir "$DATA" \
  --output_dir "$RUN" \
  --resolution 32 --center_crop --random_flip \
  --train_batch_size 8 --max_train_steps 120 \
  --learning_rate 1e-3 --lr_scheduler constant --lr_warmup_steps 0 \
  --use_ema "${BUCKET_ARGS[@]}" "${CP_ARGS[@]}" \
  --checkpointing_steps 60 --checkpoints_total_limit 2 \
  --validation_prompts "a red circle" "a blue square" "a green circle" "a yellow square" \
  --validation_epochs 15 --num_validation_inference_steps 20 \
  --seed 0 --report_to tensorboard "${RUN_ARGS[@]}" "$@"
