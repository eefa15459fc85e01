"""SD 1.x / 2.x (``StableDiffusionPipeline``): one CLIP text encoder, its last hidden state;
a UNet trained with DDPM noise prediction; latents scaled by the VAE's ``scaling_factor``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .base import Family, PublishedConfig, TextEncoderSpec
from .published import CLIP_L, VAE_SD
from .tiny import CLIP_VOCAB_SIZE, local_clip_tokenizer, tiny_vae_config


class StableDiffusion(Family):
    """SD 1.x / 2.x: one CLIP text encoder, its last hidden state."""

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

    def save_tiny_pipeline(self, folder, seed=0):
        return save_tiny_pipeline(folder, seed)

    def published(self):
        return (
            PublishedConfig(
                "runwayml/stable-diffusion-v1-5",
                "SD 1.5",
                self.pipeline_class,
                {
                    "unet": (
                        "diffusers",
                        "UNet2DConditionModel",
                        dict(
                            sample_size=64,
                            in_channels=4,
                            out_channels=4,
                            layers_per_block=2,
                            block_out_channels=[320, 640, 1280, 1280],
                            down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
                            cross_attention_dim=768,
                            attention_head_dim=8,
                        ),
                    ),
                    "text_encoder": ("transformers", "CLIPTextModel", CLIP_L),
                    "vae": ("diffusers", "AutoencoderKL", VAE_SD),
                },
            ),
        )


SD = StableDiffusion(
    name="sd",
    title="SD 1.x / 2.x",
    default_run_args=("--text_encoder_placement", "shard", "--vae_placement", "replicate"),
    pipeline_class="StableDiffusionPipeline",
    text_encoders=(TextEncoderSpec("text_encoder", "CLIPTextModel", "tokenizer", "input_ids"),),
    pipeline_kwargs=(
        ("safety_checker", None),
        ("feature_extractor", None),
        ("requires_safety_checker", False),
    ),
)


# -------------------------------------------------------------------------------- tiny pipeline


# UNet layouts for tiny pipelines. "tiny" is the smallest that trains (116 modules with
# parameters); "sd15" and "sdxl" have the block structure of the published UNets at any width,
# hence their number of parameter tensors and of modules holding parameters (what ZeRO-3's
# per-module hooks and collectives scale with): SD 1.5's 686 tensors in 391 modules, and
# SDXL's 1,676 in 1,048 (the published SDXL UNet's 1,680 in 1,050 less its two-layer
# ``add_embedding``, which takes SDXL's time ids that an SD pipeline does not pass).
UNET_SHAPES = ("tiny", "sd15", "sdxl")


def _unet_config(width: int, cross_dim: int, shape: str) -> dict:
    common = dict(sample_size=16, in_channels=4, out_channels=4, cross_attention_dim=cross_dim)
    groups = min(32, width // 2)
    if shape == "tiny":
        return dict(
            common,
            layers_per_block=1,
            block_out_channels=(width, width * 2),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=max(1, width // 8),
            norm_num_groups=groups,
        )
    if shape == "sd15":  # runwayml/stable-diffusion-v1-5's unet/config.json at width 320
        return dict(
            common,
            layers_per_block=2,
            block_out_channels=(width, width * 2, width * 4, width * 4),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            attention_head_dim=8,
            norm_num_groups=groups,
        )
    if shape == "sdxl":  # stable-diffusion-xl-base-1.0's unet/config.json at width 320
        return dict(
            common,
            layers_per_block=2,
            block_out_channels=(width, width * 2, width * 4),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(1, 2, 4),
            norm_num_groups=groups,
        )
    raise ValueError(f"unknown UNet shape {shape!r}: one of {', '.join(UNET_SHAPES)}")


def tiny_component_configs(
    width: int = 32, text_layers: int = 2, cross_dim: int | None = None, unet_shape: str = "tiny"
) -> dict[str, dict]:
    """Configs of a tiny SD-style UNet, VAE and CLIP text encoder.

    ``width`` scales every model (32 gives a pipeline of about 1M parameters that trains on a
    CPU in seconds; 256 gives tens of millions, for benchmarks). ``unet_shape`` picks the
    UNet's layout (``UNET_SHAPES``): ``"sd15"`` and ``"sdxl"`` have the module counts of
    the published UNets.
    """
    cross_dim = cross_dim or width
    return {
        "unet": _unet_config(width, cross_dim, unet_shape),
        "vae": tiny_vae_config(width),
        "text_encoder": dict(
            vocab_size=CLIP_VOCAB_SIZE,
            hidden_size=cross_dim,
            intermediate_size=cross_dim * 2,
            num_hidden_layers=text_layers,
            num_attention_heads=max(1, cross_dim // 16),
            max_position_embeddings=77,
            bos_token_id=CLIP_VOCAB_SIZE - 2,
            eos_token_id=CLIP_VOCAB_SIZE - 1,
            pad_token_id=CLIP_VOCAB_SIZE - 1,
        ),
    }


def build_tiny_components(
    seed: int = 0,
    width: int = 32,
    text_layers: int = 2,
    cross_dim: int | None = None,
    unet_shape: str = "tiny",
) -> dict:
    """Build the tiny UNet, VAE and text encoder (whole, ordinary modules) from configs."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ..runtime.zero3 import zero3_init_disabled

    cfg = tiny_component_configs(width, text_layers, cross_dim, unet_shape)
    with zero3_init_disabled():
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**cfg["unet"])
        vae = AutoencoderKL(**cfg["vae"])
        text_encoder = CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"]))
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder}


def sd_scheduler():
    """SD 1.5's ``DDPMScheduler`` settings."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        num_train_timesteps=1000,
        steps_offset=1,
        clip_sample=False,
    )


def save_tiny_pipeline(
    folder: str | os.PathLike, seed: int = 0, width: int = 32, text_layers: int = 2, unet_shape: str = "tiny"
) -> Path:
    """Save a tiny ``StableDiffusionPipeline`` folder (fp32 safetensors) and return its path.

    Not a collective: call it on one rank (or before launching) and share the folder.
    """
    folder = Path(folder)
    parts = build_tiny_components(seed, width, text_layers, unet_shape=unet_shape)
    pipe = SD.pipeline(
        parts["unet"],
        parts["vae"],
        {"text_encoder": parts["text_encoder"]},
        {"text_encoder": local_clip_tokenizer(folder)},
        sd_scheduler(),
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder
