"""Validation images and the final pipeline folder of a text-to-image run."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from .checkpoint import publish_folder, save_pretrained_zero3
from .distributed import barrier, is_main_process


@torch.no_grad()
def generate_validation_images(
    unet: torch.nn.Module,
    vae: torch.nn.Module,
    text_encoder: torch.nn.Module,
    tokenizer,
    scheduler,
    prompts: list[str],
    *,
    resolution: int,
    num_inference_steps: int = 20,
    seed: int = 0,
) -> list:
    """One image per prompt from the current weights. Collective: call on every rank.

    Every rank runs the same prompts with the same seed, so partitioned models (the UNet
    engine, sharded frozen engines) are called the same number of times on every rank; all
    ranks get the same images, and one of them writes.
    """
    from diffusers import StableDiffusionPipeline

    unet_was_training = unet.training
    unet.eval()
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    device = next(unet.parameters()).device
    images = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(device=device).manual_seed(seed + i)
        out = pipe(
            prompt,
            num_inference_steps=num_inference_steps,
            generator=generator,
            height=resolution,
            width=resolution,
        )
        images.append(out.images[0])
    unet.train(unet_was_training)
    return images


def image_grid(images: list, cols: int | None = None):
    """Paste PIL images of one size into a grid (one row when ``cols`` is None)."""
    from PIL import Image

    cols = cols or len(images)
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img, ((i % cols) * w, (i // cols) * h))
    return grid


def model_card(base_model: str, dataset: str, args: dict, validation_prompts: list[str] | None) -> str:
    """A README.md for the output pipeline folder."""
    hyper = "\n".join(
        f"- {k}: {args[k]}" for k in sorted(args) if args[k] is not None and not k.startswith("hub_")
    )
    prompts = "\n".join(f"- {p}" for p in validation_prompts or [])
    return f"""---
library_name: diffusers
base_model: {base_model}
tags: [stable-diffusion, text-to-image, diffusers, deepspeed-zero3]
---

# Text-to-image fine-tune of {base_model}

Fine-tuned with `diffusers_zero3` (DeepSpeed ZeRO-3) on `{dataset}`.

```python
from diffusers import StableDiffusionPipeline

pipe = StableDiffusionPipeline.from_pretrained("path/to/this/folder")
image = pipe("{(validation_prompts or ["a photo"])[0]}").images[0]
```

## Validation prompts
{prompts or "- (none)"}

## Training arguments
{hyper}
"""


def save_final_pipeline(
    source_folder: str | os.PathLike,
    output_dir: str | os.PathLike,
    unet,
    *,
    ema=None,
    readme: str = "",
) -> None:
    """Write the trained pipeline into ``output_dir``. Collective: call on every rank.

    The UNet (the EMA average when ``ema`` is given) is streamed from its partitions by
    ``save_pretrained_zero3``: no rank builds the whole model. Every other component of the
    source pipeline (text encoder, VAE, tokenizer, scheduler, ...) is unchanged and copied
    from ``source_folder``. Each component folder is published atomically and
    ``model_index.json`` is written last, so a folder that has one is complete.
    """
    out = Path(output_dir)
    source = Path(source_folder)
    if is_main_process():
        (out / "model_index.json").unlink(missing_ok=True)
    barrier()
    if ema is not None:
        ema.save_pretrained(out / "unet")
    else:
        save_pretrained_zero3(unet, out / "unet")
    if is_main_process():
        index = json.loads((source / "model_index.json").read_text())
        for name, value in index.items():
            if name.startswith("_") or name == "unet" or not isinstance(value, list) or value[0] is None:
                continue
            if (source / name).is_dir():
                with publish_folder(out / name) as tmp:
                    shutil.copytree(source / name, tmp, dirs_exist_ok=True)
        if readme:
            (out / "README.md").write_text(readme)
        tmp_index = out / ".model_index.json.tmp"
        tmp_index.write_text(json.dumps(index, indent=2))
        os.replace(tmp_index, out / "model_index.json")
    barrier()
