"""SD3 (``StableDiffusion3Pipeline``): the penultimate hidden states of CLIP-L and CLIP-G,
concatenated and zero-padded to T5's width, then T5's states appended along the sequence;
pooled = both CLIPs' projected outputs, concatenated; an MMDiT transformer trained with flow
matching (logit-normal timesteps by default, as diffusers' SD3 scripts)."""

from __future__ import annotations

import torch

from .base import Family, TextEncoderSpec
from .common import SequenceLengthValidation, run_args
from .published import CLIP_BIGG, CLIP_L, T5_XXL, VAE_16, published_config


def clip_hidden_and_pooled(encoder, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CLIP encoder with projection: (penultimate hidden states, projected pooled output)."""
    out = encoder(input_ids, output_hidden_states=True, return_dict=False)
    return out[-1][-2], out[0]


class StableDiffusion3(SequenceLengthValidation, Family):
    """SD3: CLIP-L and CLIP-G states padded to T5's width, T5's appended; pooled CLIPs."""

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        if name == "text_encoder_3":
            return {"t5_embeds": encoder(input_ids, return_dict=False)[0]}
        hidden, pooled = clip_hidden_and_pooled(encoder, input_ids)
        k = 1 if name == "text_encoder" else 2
        return {f"prompt_embeds_{k}": hidden, f"pooled_{k}": pooled}

    def conditioning(self, outputs):
        clip = torch.cat([outputs["prompt_embeds_1"], outputs["prompt_embeds_2"]], dim=-1)
        t5 = outputs["t5_embeds"]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "encoder_hidden_states": torch.cat([clip, t5.to(clip.dtype)], dim=-2),
            "pooled_projections": torch.cat([outputs["pooled_1"], outputs["pooled_2"]], dim=-1),
        }

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        return denoiser(
            hidden_states=noisy_latents,
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            return_dict=False,
        )[0]

    def published(self):
        transformer = published_config("sd3/transformer")
        components = self.published_parts(transformer, CLIP_L, CLIP_BIGG, T5_XXL, vae=VAE_16)
        return self.published_as(
            components, ("stabilityai/stable-diffusion-3-medium-diffusers", "SD3 medium")
        )


SD3 = StableDiffusion3(
    name="sd3",
    title="SD3",
    default_run_args=run_args(
        text_encoder="replicate",
        text_encoder_2="replicate",
        text_encoder_3="cache",
        vae="cache",
        max_sequence_length=32,
    ),
    pipeline_class="StableDiffusion3Pipeline",
    text_encoders=(
        TextEncoderSpec("text_encoder", "CLIPTextModelWithProjection", "tokenizer", "input_ids"),
        TextEncoderSpec("text_encoder_2", "CLIPTextModelWithProjection", "tokenizer_2", "input_ids_2"),
        TextEncoderSpec(
            "text_encoder_3", "T5EncoderModel", "tokenizer_3", "input_ids_3", uses_max_sequence_length=True
        ),
    ),
    denoiser_class="SD3Transformer2DModel",
    default_max_sequence_length=77,  # diffusers' train_dreambooth_sd3.py
    default_weighting_scheme="logit_normal",
    lora_target_modules=(  # train_dreambooth_lora_sd3.py
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ),  # fmt: skip
)
