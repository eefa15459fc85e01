"""A custom loop with two trained models, each its own ZeRO-3 engine and optimizer (an SD UNet
and its text encoder, whose output conditions the UNet: DreamBooth's case): build both, cut the
graph between them, run each engine's own backward, step, save. Run on N ranks:

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 2 \\
        examples/custom_two_model_loop.py SD_PIPELINE_FOLDER IMAGEFOLDER OUTPUT_DIR
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

import sys

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

import torch

from diffusers_zero3 import build_accelerator, log_rank_zero
from diffusers_zero3.data.images import ImageCaptionDataset, collate, load_image_caption_dataset
from diffusers_zero3.data.pixels import RowsToPixels
from diffusers_zero3.families import detect_family
from diffusers_zero3.families.objectives import ObjectiveSettings
from diffusers_zero3.placement.frozen_inputs import place_frozen_models
from diffusers_zero3.runtime.distributed import exit_after_teardown
from diffusers_zero3.state.pipeline_io import save_final_pipeline
from diffusers_zero3.state.pretrained import load_pretrained_zero3
from diffusers_zero3.training.job import load_trainable_denoiser
from diffusers_zero3.training.parts import (
    backward_parts,
    cut_outputs,
    prepare_extra_part,
    prepare_first_part,
    step_part,
)


def main(source: str, data_dir: str, output_dir: str, steps: int = 4) -> None:
    accelerator = build_accelerator()  # every rank
    family = detect_family(source)  # SD: one CLIP text encoder
    tokenizers = family.load_tokenizers(source)
    scheduler = family.noise_scheduler_class().from_pretrained(source, subfolder="scheduler")
    unet = load_trainable_denoiser(accelerator, source, family)  # straight into ZeRO-3 partitions
    text_encoder = load_pretrained_zero3(
        family.component_class("text_encoder"), source, "text_encoder", accelerator=accelerator
    )
    text_encoder.train().requires_grad_(True)

    dataset = load_image_caption_dataset(train_data_dir=data_dir)
    data = ImageCaptionDataset(
        dataset,
        RowsToPixels(
            resolution=32, center_crop=True, tokenize=lambda captions: family.tokenize(tokenizers, captions)
        ),
    )
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate)

    # 1. The first trained model through accelerate: its backward is accelerate's.
    unet_optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    unet, loader = prepare_first_part(
        accelerator, "unet", unet, unet_optimizer, dataloader=loader, max_grad_norm=1.0
    )
    # 2. The second: an engine of its own (under ZeRO-3), its own optimizer, schedule, clipping.
    te_optimizer = torch.optim.AdamW(text_encoder.parameters(), lr=5e-5)
    te_schedule = torch.optim.lr_scheduler.LambdaLR(te_optimizer, lambda step: 1.0)
    te = prepare_extra_part(accelerator, "text_encoder", text_encoder, te_optimizer, te_schedule,
                            first_engine=unet.engine, max_grad_norm=1.0)  # fmt: skip
    # 3. The frozen VAE, placed; the text encoder is "trained": its outputs come from the loop.
    frozen = place_frozen_models(accelerator, family, source, {"text_encoder": "trained", "vae": "replicate"})

    step = 0
    while step < steps:
        for batch in loader:  # every rank, every batch
            outputs = family.encode_texts({"text_encoder": te}, batch)  # with the encoder's graph
            cut, kept = cut_outputs(outputs) if te.own_engine else (outputs, {})  # the UNet sees a leaf
            latents, cond, _ = frozen(batch, accelerator.device, trained_outputs=cut)
            loss = family.loss(unet, scheduler, latents, cond, ObjectiveSettings())
            # the UNet's engine through accelerate, then the text encoder's own engine from the
            # gradient at the cut (the UNet's fp16 loss scale divided out)
            backward_parts(accelerator, loss, unet, [(te, kept, cut)])
            step_part(te, accelerator, sync=True)
            step_part(unet, accelerator, sync=True)  # under ZeRO-3 accelerate's backward stepped it
            step += 1
            log_rank_zero(f"step {step} loss {loss.item():.4f}")
            if step == steps:
                break

    # Every rank: both trained models are streamed from their partitions into one pipeline.
    save_final_pipeline(source, output_dir, unet.engine, denoiser_name=family.denoiser,
                        trained={"text_encoder": (te.engine, None)})  # fmt: skip
    exit_after_teardown()  # every rank, last


if __name__ == "__main__":
    main(*sys.argv[1:4])
