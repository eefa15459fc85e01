#!/usr/bin/env python
"""Reward fine-tuning of a Stable Diffusion UNet under DeepSpeed ZeRO-3 (AlignProp / DRaFT-K).

Every rank samples its own prompts, runs the DDIM sampler (the last K denoising steps with
gradients), decodes with the VAE, and scores the images with a reward model that is itself
sharded as a ZeRO-3 inference engine (``ParallelReward``, called on every rank in lockstep).
The loss ``-mean(reward)`` is backpropagated through the reward model, the VAE decode and
the last K UNet calls into the UNet, a ZeRO-3 engine.

    accelerate launch --config_file configs/accelerate_zero3.yaml scripts/train_reward.py \\
        --pretrained_model_name_or_path PIPE --reward_model_name_or_path REWARD \\
        --prompts "a red circle" "a blue square" --output_dir out

``make train-reward`` runs it on the embedded default (a tiny pipeline and a reward model
that scores how red an image is) on 2 CPU ranks; the mean reward rises over the run.
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

from diffusers_zero3.recipes.reward import RewardSettings, RewardTrainer
from diffusers_zero3.training.job import run_trainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(lambda: RewardTrainer(RewardSettings.parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
