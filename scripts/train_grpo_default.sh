#!/usr/bin/env bash
# `make train-grpo`: online RL (DiffusionNFT on Flow-GRPO's SDE rounds) on the embedded default.
# A tiny SD3 pipeline is generated locally (once); its transformer is trained under DeepSpeed
# ZeRO-3 on 2 CPU processes (one per GPU on a CUDA host) from a python-function reward that
# scores how red each image is (diffusers_zero3.demo.rewards:redness), 4 prompts x 4 images
# per round, each prompt's group spread over the ranks. The mean reward per round is printed
# and plotted to rewards.png; rewards.json holds it.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${MODEL:-sd}" in
  sd | sd3) ;;
  wan) exec bash scripts/train_grpo_wan_default.sh "$@" ;;  # video RL on a tiny Wan 2.1
  *) echo "error: MODEL=$MODEL: make train-grpo trains the tiny SD3 (the default) or MODEL=wan" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
# NUM_PROCESSES and CONFIG: one process per GPU in bf16 on a CUDA host, else 2 CPU ranks in
# fp32 with DS_ACCELERATOR=cpu (diffusers_zero3/runtime/launch.py; NUM_PROCESSES=N overrides).
SETTINGS=$($PYTHON -m diffusers_zero3.runtime.launch)
eval "$SETTINGS"
if [ ! -f "$OUT/tiny-sd3/model_index.json" ]; then
  $PYTHON -c "import sys; from diffusers_zero3.demo import save_tiny_pipeline; from diffusers_zero3.families import SD3; save_tiny_pipeline(SD3, sys.argv[1])" "$OUT/tiny-sd3"
fi
$PYTHON -m accelerate.commands.launch --config_file "$CONFIG" --num_processes "$NUM_PROCESSES" \
  scripts/train_grpo.py \
  --pretrained_model_name_or_path "$OUT/tiny-sd3" \
  --prompts "a red circle" "a blue square" "a green circle" "a yellow square" \
  --reward diffusers_zero3.demo.rewards:redness \
  --objective nft --group_size 4 \
  --output_dir "$OUT/grpo-run" \
  --resolution 32 --num_inference_steps 6 --sample_batch_size 8 --train_batch_size 8 \
  --nft_beta 0.1 --max_train_steps 60 --learning_rate 3e-3 \
  --checkpointing_steps 30 --checkpoints_total_limit 1 \
  --seed 0 "$@"
