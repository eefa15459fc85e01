#!/usr/bin/env python
"""Fine-tune the denoiser of a Stable Diffusion (1.x/2.x), SDXL, SD3 or Flux.1 pipeline under
DeepSpeed ZeRO-3, beside frozen text encoders (T5-XXL included) and a VAE.

A drop-in for diffusers' ``examples/text_to_image/train_text_to_image.py`` and
``train_text_to_image_sdxl.py`` (same flags), with the flow-matching flags of its SD3 and
Flux scripts (``--weighting_scheme``, ``--guidance_scale``, ``--max_sequence_length``); the
family is detected from the pipeline's ``model_index.json``. It runs the whole way under ZeRO-3:

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 8 \\
        scripts/train_text_to_image.py --pretrained_model_name_or_path PIPE \\
        --dataset_name DATA --use_ema --checkpointing_steps 500 --output_dir out \\
        --text_encoder_placement shard --vae_placement replicate

also as one plain ``python`` process without DeepSpeed, and on CPU-only hosts (gloo).
``make train`` runs it on the embedded default (a tiny generated pipeline and dataset).

What differs from upstream, and why:
* the denoiser (UNet or transformer) is loaded straight into ZeRO-3 partitions and saved by
  streaming them (no rank ever holds it whole), instead of ``from_pretrained`` +
  ``save_pretrained`` of placeholders;
* frozen models are placed one by one (``--text_encoder_placement``,
  ``--text_encoder_2_placement``, ``--text_encoder_3_placement``, ``--vae_placement``); a
  sharded or cached T5 is read straight into partitions; upstream's
  ``zero3_init_context_manager(enable=False)`` no longer keeps them whole;
* ``--use_ema`` averages each rank's partition (``ShardedEMA``) instead of a full copy;
* ``--rank N`` trains peft LoRA adapters on the partitioned, frozen denoiser (the optimizer
  holds the adapters alone) and writes ``pytorch_lora_weights.safetensors`` gathered from the
  partitions, in diffusers' format for the pipeline class;
* every collective (checkpoint save, final save, validation) runs on every rank;
* checkpoints are atomic and resume the exact trajectory (RNG, data position, EMA).
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

from __future__ import annotations

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

from diffusers_zero3.recipes.text_to_image import TextToImageTrainer
from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings
from diffusers_zero3.training.job import run_trainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(lambda: TextToImageTrainer(TextToImageSettings.parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
