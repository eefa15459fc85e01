"""SDXL (``StableDiffusionXLPipeline``): the penultimate hidden states of CLIP-L and OpenCLIP
bigG, concatenated; the second encoder's pooled (projected) output as ``text_embeds``;
``time_ids`` per image (original size, crop corner, target size); the VAE in fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import TextEncoderSpec
from .common import run_args
from .published import CLIP_BIGG, CLIP_L, VAE_SD, published_config
from .sd import StableDiffusion


def time_ids(
    original_size: torch.Tensor,
    crop_top_left: torch.Tensor,
    resolution: int | tuple[int, int] | torch.Tensor,
) -> torch.Tensor:
    """SDXL's micro-conditioning, one row per image: original (h, w), crop top-left (y, x)
    and target (h, w), as diffusers' SDXL training script and pipeline build it; on the device
    of ``original_size`` (a prepared data loader's batch is on the accelerator's device).
    ``resolution`` is the target of every image (a side, or ``(h, w)``), or one row per image
    (aspect-ratio buckets: each crop's own shape)."""
    if torch.is_tensor(resolution):
        target_t = resolution.to(original_size.device, torch.float32).reshape(-1, 2)
    else:
        target = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
        target_t = torch.tensor(target, dtype=torch.float32, device=original_size.device)
    target_t = target_t.expand(original_size.shape[0], 2)
    return torch.cat([original_size.float(), crop_top_left.to(original_size.device).float(), target_t], dim=1)


@dataclass(frozen=True)
class StableDiffusionXL(StableDiffusion):
    """SDXL: the penultimate hidden states of CLIP-L and OpenCLIP-bigG, concatenated; the
    second encoder's pooled (projected) output as ``text_embeds``; ``time_ids`` per image."""

    controlnet_pipeline_class: ClassVar[str | None] = "StableDiffusionXLControlNetPipeline"

    # StableDiffusionXLPipeline's registered value (model_index.json; detect_family reads it):
    # zeros, or the empty prompt's states, as CFG's negative conditioning in validation's pipeline
    registered_config: ClassVar[tuple[str, ...]] = ("force_zeros_for_empty_prompt",)
    force_zeros_for_empty_prompt: bool = True

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        out = encoder(input_ids, output_hidden_states=True, return_dict=False)
        hidden = out[-1][-2]  # hidden_states, penultimate layer
        if name == "text_encoder_2":
            return {"prompt_embeds_2": hidden, "text_embeds": out[0]}
        return {"prompt_embeds_1": hidden}

    def conditioning(self, outputs):
        return {
            "encoder_hidden_states": torch.cat(
                [outputs["prompt_embeds_1"], outputs["prompt_embeds_2"]], dim=-1
            ),
            "text_embeds": outputs["text_embeds"],
        }

    def unet_kwargs(self, cond):
        return {"added_cond_kwargs": {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]}}

    def published(self):
        unet = published_config("sdxl/unet")
        components = self.published_parts(unet, CLIP_L, CLIP_BIGG, vae=VAE_SD)
        return self.published_as(components, ("stabilityai/stable-diffusion-xl-base-1.0", "SDXL base 1.0"))


SDXL = StableDiffusionXL(
    name="sdxl",
    title="SDXL",
    default_run_args=run_args(text_encoder="replicate", text_encoder_2="shard", vae="cache"),
    pipeline_class="StableDiffusionXLPipeline",
    text_encoders=(
        TextEncoderSpec("text_encoder", "CLIPTextModel", "tokenizer", "input_ids"),
        TextEncoderSpec("text_encoder_2", "CLIPTextModelWithProjection", "tokenizer_2", "input_ids_2"),
    ),
    denoiser="unet",
    flow_matching=False,
    vae_in_fp32=True,
    uses_time_ids=True,
    supports_dream=False,  # diffusers' SDXL script has no DREAM
    pipeline_kwargs=(("add_watermarker", False),),
)
