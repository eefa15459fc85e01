#!/usr/bin/env bash
# `make train-grpo MODEL=wan`: video RL (Flow-GRPO) on a tiny Wan 2.1 generated locally (once):
# its transformer trained under DeepSpeed ZeRO-3 on 2 CPU processes (one per GPU on a CUDA host),
# 4 prompts x 4 clips of 5 frames per round, each prompt's group spread over the ranks. The
# reward is an image reward scored through 8 of each clip's frames (here all 5) and averaged:
# the python function diffusers_zero3.demo.rewards:redness with the weight -1 (clips less red;
# the tiny random VAE decodes its latents to about 0.115 of redness, a ceiling it barely rises
# above, and well below it), beside a judge of whole clips sharded over the ranks: a tiny random
# UnifiedReward Qwen2.5-VL (diffusers_zero3.demo.judges) where the 7 B one goes, its grade logged
# each round with the weight 0.001 (it judges nothing). The mean reward per round is printed and
# plotted to rewards.png, each reward's to its own curve.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/default}
SETTINGS=$($PYTHON -m diffusers_zero3.runtime.launch)
eval "$SETTINGS"
if [ ! -f "$OUT/tiny-wan/model_index.json" ]; then
  $PYTHON -c "import sys; from diffusers_zero3.demo import save_tiny_pipeline; from diffusers_zero3.families import WAN; save_tiny_pipeline(WAN, sys.argv[1])" "$OUT/tiny-wan"
fi
if [ ! -f "$OUT/tiny-video-judge/config.json" ]; then
  $PYTHON -c "import sys; from diffusers_zero3.demo.judges import save_tiny_video_judge; save_tiny_video_judge(sys.argv[1])" "$OUT/tiny-video-judge"
fi
$PYTHON -m accelerate.commands.launch --config_file "$CONFIG" --num_processes "$NUM_PROCESSES" \
  scripts/train_grpo.py \
  --pretrained_model_name_or_path "$OUT/tiny-wan" \
  --prompts "a red circle" "a blue square" "a green circle" "a yellow square" \
  --reward diffusers_zero3.demo.rewards:redness=-1 --reward_frames 8 \
  --reward unifiedreward_video=0.001 --reward_model unifiedreward_video="$OUT/tiny-video-judge" \
  --objective grpo --group_size 4 --num_frames 5 \
  --output_dir "$OUT/grpo-wan-run" \
  --resolution 32 --num_inference_steps 6 --sample_batch_size 8 --train_batch_size 16 \
  --max_train_steps 16 --learning_rate 3e-2 \
  --checkpointing_steps 8 --checkpoints_total_limit 1 \
  --seed 0 "$@"
