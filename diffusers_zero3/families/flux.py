"""Flux.1 (``FluxPipeline``): CLIP-L's pooled output as ``pooled_projections``, T5's hidden
states as ``encoder_hidden_states``; 2x2-packed latents with ``img_ids``/``txt_ids``, the
timestep as sigma, and a guidance value when the transformer has ``guidance_embeds``; flow
matching; latents shifted and scaled by the VAE's factors."""

from __future__ import annotations

import torch

from .base import Family, TextEncoderSpec
from .common import GuidedValidation, run_args
from .published import CLIP_L, T5_XXL, VAE_16, published_config


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """Flux's 2x2 patches: (N, C, H, W) -> (N, H/2 * W/2, 4C), as ``FluxPipeline`` packs."""
    n, c, h, w = latents.shape
    return (
        latents.view(n, c, h // 2, 2, w // 2, 2)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(n, (h // 2) * (w // 2), c * 4)
    )


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of ``pack_latents`` for latents of ``height`` x ``width``."""
    n, _, c4 = packed.shape
    c = c4 // 4
    return (
        packed.view(n, height // 2, width // 2, c, 2, 2)
        .permute(0, 3, 1, 4, 2, 5)
        .reshape(n, c, height, width)
    )


def latent_image_ids(height: int, width: int, device=None, dtype=None) -> torch.Tensor:
    """Flux's rotary position ids of the packed latents, (H/2 * W/2, 3): (0, row, column)."""
    ids = torch.zeros(height // 2, width // 2, 3, device=device)
    ids[..., 1] = torch.arange(height // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(width // 2, device=device)[None, :]
    return ids.reshape(-1, 3).to(dtype=dtype)


def guidance_values(denoiser, n: int, guidance_scale: float | None, device) -> torch.Tensor | None:
    """The guidance input of a guidance-distilled transformer (``config.guidance_embeds``): the
    scale for every sample (1.0 when none is given); None for a transformer without it."""
    config = getattr(denoiser, "module", denoiser).config
    if not config.guidance_embeds:
        return None
    return torch.full((n,), float(guidance_scale or 1.0), device=device)


class Flux(GuidedValidation, Family):
    """Flux.1: CLIP's pooled output and T5's states; packed latents with position ids."""

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        if name == "text_encoder_2":
            return {"encoder_hidden_states": encoder(input_ids, return_dict=False)[0]}
        return {"pooled_projections": encoder(input_ids, output_hidden_states=False, return_dict=False)[1]}

    def conditioning(self, outputs):
        return {
            "encoder_hidden_states": outputs["encoder_hidden_states"],
            "pooled_projections": outputs["pooled_projections"],
        }

    def latent_multiple(self, vae_config):
        return 2 * super().latent_multiple(vae_config)

    def sampling_sigmas(self, steps):
        """``FluxPipeline``'s ``numpy.linspace(1, 1 / steps, steps)``."""
        import numpy

        return numpy.linspace(1.0, 1 / steps, steps).tolist()

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        n, _, h, w = noisy_latents.shape
        states = cond["encoder_hidden_states"]
        packed = denoiser(
            hidden_states=pack_latents(noisy_latents),
            timestep=timesteps / 1000,
            guidance=guidance_values(denoiser, n, guidance_scale, noisy_latents.device),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=states,
            txt_ids=torch.zeros(states.shape[1], 3, device=states.device, dtype=states.dtype),
            img_ids=latent_image_ids(h, w, noisy_latents.device, noisy_latents.dtype),
            return_dict=False,
        )[0]
        return unpack_latents(packed, h, w)

    def published(self):
        transformer = published_config("flux/transformer")
        components = self.published_parts(transformer, CLIP_L, T5_XXL, vae=VAE_16)
        return self.published_as(components, ("black-forest-labs/FLUX.1-dev", "FLUX.1 [dev]"))


FLUX_LORA_TARGETS = (  # train_dreambooth_lora_flux.py
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
FLUX = Flux(
    name="flux",
    title="Flux.1",
    default_run_args=run_args(
        text_encoder="replicate", text_encoder_2="shard", vae="replicate", max_sequence_length=32
    ),
    pipeline_class="FluxPipeline",
    text_encoders=(
        TextEncoderSpec("text_encoder", "CLIPTextModel", "tokenizer", "input_ids"),
        TextEncoderSpec(
            "text_encoder_2", "T5EncoderModel", "tokenizer_2", "input_ids_2", uses_max_sequence_length=True
        ),
    ),
    denoiser_class="FluxTransformer2DModel",
    default_max_sequence_length=512,  # diffusers' train_dreambooth_flux.py
    lora_target_modules=FLUX_LORA_TARGETS,
)
