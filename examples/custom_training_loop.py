"""A complete custom ZeRO-3 fine-tuning loop (any family: SD, SDXL, SD3, Flux, ...): load,
place, prepare, train, EMA, save, sample. Run on N ranks:

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 2 \\
        examples/custom_training_loop.py PIPELINE_FOLDER IMAGEFOLDER OUTPUT_DIR
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

import torch
from diffusers import DiffusionPipeline

from diffusers_zero3 import ShardedEMA, build_accelerator, is_main_process, log_rank_zero
from diffusers_zero3.data.images import ImageCaptionDataset, collate, load_image_caption_dataset
from diffusers_zero3.data.pixels import RowsToPixels
from diffusers_zero3.families import detect_family
from diffusers_zero3.families.objectives import ObjectiveSettings
from diffusers_zero3.placement.frozen_inputs import place_frozen_models
from diffusers_zero3.runtime.distributed import exit_after_teardown
from diffusers_zero3.state.pipeline_io import save_final_pipeline
from diffusers_zero3.training.job import load_trainable_denoiser


def main(source: str, data_dir: str, output_dir: str, steps: int = 4) -> None:
    accelerator = build_accelerator()  # every rank; CPU (gloo) or GPU
    family = detect_family(source)  # from model_index.json
    tokenizers = family.load_tokenizers(source)
    scheduler = family.noise_scheduler_class().from_pretrained(source, subfolder="scheduler")
    unet = load_trainable_denoiser(accelerator, source, family)  # straight into ZeRO-3 partitions

    dataset = load_image_caption_dataset(train_data_dir=data_dir)
    data = ImageCaptionDataset(
        dataset,
        RowsToPixels(
            resolution=32, center_crop=True, tokenize=lambda captions: family.tokenize(tokenizers, captions)
        ),
    )
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate)

    # The order matters: 1. accelerator.prepare (its backward drives the first engine prepared),
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    # 2. the frozen models, each its own placement (here a ZeRO-3 inference engine),
    frozen = place_frozen_models(accelerator, family, source, {"text_encoder": "shard"})
    # 3. the EMA, of the prepared engine (its step() takes no argument).
    ema = ShardedEMA(unet, decay=0.99)

    step = 0
    while step < steps:
        for batch in loader:
            latents, cond, _ = frozen(batch, accelerator.device)  # every rank, every batch
            # The family's objective (DDPM or flow matching) and denoiser call, one signature.
            loss = family.loss(unet, scheduler, latents, cond, ObjectiveSettings())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            ema.step()
            step += 1
            log_rank_zero(f"step {step} loss {loss.item():.4f}")
            if step == steps:
                break

    # Every rank: the EMA weights are streamed from the partitions into a complete pipeline.
    save_final_pipeline(source, output_dir, unet, ema=ema, denoiser_name=family.denoiser)
    if is_main_process():  # a plain from_pretrained on one rank alone is fine
        pipe = DiffusionPipeline.from_pretrained(output_dir)
        pipe("a red circle", num_inference_steps=2, height=32, width=32).images[0].save(
            f"{output_dir}/sample.png"
        )
    exit_after_teardown()  # every rank, last


if __name__ == "__main__":
    main(*sys.argv[1:4])
