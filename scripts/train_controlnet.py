"""ControlNet training under DeepSpeed ZeRO-3, with diffusers' ``train_controlnet*.py`` flags.

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 8 \\
        scripts/train_controlnet.py --pretrained_model_name_or_path PIPELINE \\
        --dataset_name fusing/fill50k --conditioning_image_column conditioning_image \\
        --unet_placement shard --validation_image cond.png --validation_prompt "a red circle" \\
        --output_dir out

SD 1.x/2.x and SDXL pipelines: the ControlNet is the trained ZeRO-3 engine (from the UNet's
weights, or --controlnet_model_name_or_path), the UNet is frozen and placed with
--unet_placement replicate|shard|offload (see diffusers_zero3.recipes.controlnet); the output is
OUTPUT_DIR/controlnet.
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

from diffusers_zero3.recipes.controlnet import ControlNetSettings, ControlNetTrainer
from diffusers_zero3.training.job import run_trainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(lambda: ControlNetTrainer(ControlNetSettings.parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
