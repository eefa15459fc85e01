"""DreamBooth fine-tuning under DeepSpeed ZeRO-3, with diffusers' ``train_dreambooth*.py`` flags.

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 8 \\
        scripts/train_dreambooth.py --pretrained_model_name_or_path PIPELINE \\
        --instance_data_dir dog --instance_prompt "a photo of sks dog" \\
        --with_prior_preservation --class_data_dir dogs --class_prompt "a photo of a dog" \\
        --train_text_encoder --text_encoder_lr 5e-6 --output_dir out

SD 1.x/2.x, SDXL and Flux.1 pipelines; ``--train_text_encoder`` trains the text encoder(s)
(SDXL: both CLIPs; Flux: CLIP) as ZeRO-3 engines of their own beside the denoiser's, and
``--rank`` trains LoRA adapters on all of them (see diffusers_zero3.recipes.dreambooth).
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

from diffusers_zero3.recipes.dreambooth import DreamBoothSettings, DreamBoothTrainer
from diffusers_zero3.training.job import run_trainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(lambda: DreamBoothTrainer(DreamBoothSettings.parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
