"""A complete custom reward loop: each rank samples its own number of images (zero included),
a sharded reward model scores them on every rank, and the loss trains a ZeRO-3 UNet. Run:

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 2 \\
        examples/custom_reward_loop.py SD_PIPELINE_FOLDER REWARD_MODEL_FOLDER
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

import torch
from diffusers import DDPMScheduler

from diffusers_zero3 import ParallelReward, build_accelerator, get_rank, log_rank_zero, zero3_init_disabled
from diffusers_zero3.demo import RednessRewardModel
from diffusers_zero3.families import SD
from diffusers_zero3.placement.frozen_inputs import place_frozen_models
from diffusers_zero3.runtime.distributed import exit_after_teardown
from diffusers_zero3.training.job import load_trainable_denoiser


def main(source: str, reward_dir: str, steps: int = 3) -> None:
    accelerator = build_accelerator()
    tokenizers = SD.load_tokenizers(source)
    scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler")
    unet = load_trainable_denoiser(accelerator, source, SD)
    if accelerator.state.deepspeed_plugin is not None:  # no dataloader to read the micro batch from
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    unet, optimizer = accelerator.prepare(unet, torch.optim.AdamW(unet.parameters(), lr=1e-4))
    frozen = place_frozen_models(accelerator, SD, source, {"text_encoder": "shard"})
    text_encoder, vae = frozen.models["text_encoder"], frozen.models["vae"]
    with zero3_init_disabled():  # loaded whole, then sharded as a ZeRO-3 inference engine
        reward_model = RednessRewardModel.from_pretrained(reward_dir)
    # forward receives images in [-1, 1], (n, 3, H, W); prompts reach it only through preprocess=.
    reward = ParallelReward(reward_model, accelerator=accelerator, placement="shard", differentiable=True)

    for step in range(steps):
        n = (step + get_rank()) % 3  # uneven per rank: 0, 1 or 2 samples, zero included
        # The zero-sample rule: every rank calls every partitioned model (the UNet engine, the
        # sharded encoder) equally often, and CLIP/UNet attention cannot run an empty batch, so
        # a rank with no sample of its own generates one dummy and drops it before the reward.
        prompts = ["a red circle"] * max(n, 1)
        with torch.no_grad():
            states = text_encoder(SD.tokenize(tokenizers, prompts)["input_ids"].to(accelerator.device))[0]
        latents = torch.randn(len(prompts), 4, 16, 16, device=accelerator.device)
        t = torch.full((len(prompts),), 500, device=accelerator.device)
        eps = unet(latents, t, states).sample
        x0 = scheduler.step(eps, 500, latents).pred_original_sample
        images = vae.decode(x0 / vae.config.scaling_factor).sample[:n]  # this rank's n samples
        rewards = reward(images, prompts[:n])  # every rank calls it, n == 0 included
        loss = -rewards.sum() / max(len(rewards), 1)  # any ordinary loss, zero samples included
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        log_rank_zero(
            f"step {step + 1} reward on rank 0: {rewards.detach().mean().item() if n else float('nan'):.4f}"
        )
    exit_after_teardown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
