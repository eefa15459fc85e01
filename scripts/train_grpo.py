#!/usr/bin/env python
"""Online RL (Flow-GRPO, DiffusionNFT) of a flow-matching pipeline under DeepSpeed ZeRO-3.

Each round every rank samples its share of ``--group_size`` images per prompt with Flow-GRPO's
SDE, scores them with the rewards (built-in reward models sharded as ZeRO-3 inference engines
and called on every rank in lockstep; ``module:function`` rewards on each rank's own images),
normalises the rewards within each prompt's group over every rank, and trains the denoiser
(a ZeRO-3 engine, or LoRA adapters on it with ``--rank``) with the clipped policy-gradient
loss (``--objective grpo``) or DiffusionNFT's (``--objective nft``).

    accelerate launch --config_file configs/accelerate_zero3.yaml scripts/train_grpo.py \\
        --pretrained_model_name_or_path PIPE --prompts "a red circle" "a blue square" \\
        --reward diffusers_zero3.demo.rewards:redness --reward pickscore=0.5 \\
        --reward_model pickscore=yuvalkirstain/PickScore_v1 --rank 8 --output_dir out

``make train-grpo`` runs it on the embedded default (a tiny SD3 pipeline and a redness reward)
on 2 CPU ranks; the mean reward rises over the run.
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer
from diffusers_zero3.training.job import run_trainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(lambda: GRPOTrainer(GRPOSettings.parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
