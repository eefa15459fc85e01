#!/usr/bin/env python
"""Diffusion-DPO (Wallace et al., 2023) for SD 1.x/2.x and SDXL under DeepSpeed ZeRO-3, with
the reference denoiser as a ZeRO-3 inference engine.

The flags of diffusers' ``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py``
(and its SDXL variant) under the same names: ``--beta_dpo``, ``--loss_type``
(sigmoid/hinge/ipo), ``--rank`` (default 4), ``--dataset_name`` (a hub id or a local folder
of parquet files with Pick-a-Pic's ``jpg_0``, ``jpg_1``, ``label_0``, ``caption``; ties are
dropped), ``--dataset_split_name``, plus every flag of ``scripts/train_text_to_image.py``
(placements of the frozen models, EMA, checkpoints, validation, bad-input errors).

* ``--rank N`` (default 4, as upstream) trains LoRA adapters; the reference is the base
  denoiser with the adapters disabled (no second model), and the output is
  ``pytorch_lora_weights.safetensors``.
* ``--rank 0`` trains the whole denoiser; the reference is a separate frozen copy placed by
  ``--reference_placement`` (``replicate``, ``shard``: a ZeRO-3 inference engine holding 1/N
  per rank, or ``offload``). The output is a pipeline folder.

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 8 \\
        scripts/train_dpo.py --pretrained_model_name_or_path PIPE --dataset_name PAIRS \\
        --rank 0 --reference_placement shard --beta_dpo 2500 --output_dir out

Implicit accuracy, the implicit rewards of the chosen and rejected images and their margin,
and both denoisers' errors are logged every step (log and TensorBoard).
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

from __future__ import annotations

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

from diffusers_zero3.recipes.dpo import DPOSettings, DPOTrainer
from diffusers_zero3.training.job import run_trainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(lambda: DPOTrainer(DPOSettings.parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
