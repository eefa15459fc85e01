"""SD 1.x / 2.x (``StableDiffusionPipeline``): one CLIP text encoder, its last hidden state;
a UNet trained with DDPM noise prediction; latents scaled by the VAE's ``scaling_factor``."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import Family, TextEncoderSpec
from .common import run_args
from .published import CLIP_L, VAE_SD, published_config


class StableDiffusion(Family):
    """SD 1.x / 2.x: one CLIP text encoder, its last hidden state."""

    controlnet_pipeline_class: ClassVar[str | None] = "StableDiffusionControlNetPipeline"

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        # The pipeline passes no mask unless the encoder's config asks for one (SD 1.x/2.x do not).
        return {"encoder_hidden_states": encoder(input_ids, return_dict=False)[0]}

    def conditioning(self, outputs):
        return {"encoder_hidden_states": outputs["encoder_hidden_states"]}

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None, **unet_kwargs):
        """The UNet call; ``unet_kwargs`` (a ControlNet's ``down_block_additional_residuals``
        and ``mid_block_additional_residual``) go to it as they are."""
        return denoiser(
            noisy_latents,
            timesteps,
            cond["encoder_hidden_states"],
            return_dict=False,
            **self.unet_kwargs(cond),
            **unet_kwargs,
        )[0]

    def unet_kwargs(self, cond: dict[str, torch.Tensor]) -> dict:
        """Keyword arguments of the UNet call beyond (latents, timesteps, hidden states)."""
        return {}

    def published(self):
        unet = published_config("sd/unet")
        components = self.published_parts(unet, CLIP_L, vae=VAE_SD)
        return self.published_as(components, ("runwayml/stable-diffusion-v1-5", "SD 1.5"))


SD = StableDiffusion(
    name="sd",
    title="SD 1.x / 2.x",
    default_run_args=run_args(text_encoder="shard", vae="replicate"),
    pipeline_class="StableDiffusionPipeline",
    text_encoders=(TextEncoderSpec("text_encoder", "CLIPTextModel", "tokenizer", "input_ids"),),
    denoiser="unet",
    flow_matching=False,
    supports_dream=True,
    pipeline_kwargs=(
        ("safety_checker", None),
        ("feature_extractor", None),
        ("requires_safety_checker", False),
    ),
)
