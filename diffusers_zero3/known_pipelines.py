"""The published configs' dimensions of four pipelines, for ``python -m diffusers_zero3.plan``
where there is no hub: Stable Diffusion 1.5, SDXL base 1.0, SD3 medium and FLUX.1 [dev].

Each entry gives the pipeline class (``model_index.json``'s ``_class_name``) and, per
component folder, the library, the class and the config keys that set parameter shapes (the
other keys keep their library defaults, which equal the published ones for shapes). A plan
builds these on the meta device, so the parameter counts are exact.
"""

from __future__ import annotations

_CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
)
_CLIP_BIGG = dict(
    vocab_size=49408,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    max_position_embeddings=77,
    projection_dim=1280,
    hidden_act="gelu",
)
_T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)
_VAE_SD = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
)
_VAE_16 = dict(_VAE_SD, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)

KNOWN_PIPELINES: dict[str, dict] = {
    "runwayml/stable-diffusion-v1-5": {
        "title": "SD 1.5",
        "_class_name": "StableDiffusionPipeline",
        "components": {
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
            "text_encoder": ("transformers", "CLIPTextModel", _CLIP_L),
            "vae": ("diffusers", "AutoencoderKL", _VAE_SD),
        },
    },
    "stabilityai/stable-diffusion-xl-base-1.0": {
        "title": "SDXL base 1.0",
        "_class_name": "StableDiffusionXLPipeline",
        "components": {
            "unet": (
                "diffusers",
                "UNet2DConditionModel",
                dict(
                    sample_size=128,
                    in_channels=4,
                    out_channels=4,
                    layers_per_block=2,
                    block_out_channels=[320, 640, 1280],
                    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                    cross_attention_dim=2048,
                    attention_head_dim=[5, 10, 20],
                    transformer_layers_per_block=[1, 2, 10],
                    use_linear_projection=True,
                    addition_embed_type="text_time",
                    addition_time_embed_dim=256,
                    projection_class_embeddings_input_dim=2816,
                ),
            ),
            "text_encoder": ("transformers", "CLIPTextModel", _CLIP_L),
            "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", _CLIP_BIGG),
            "vae": ("diffusers", "AutoencoderKL", _VAE_SD),
        },
    },
    "stabilityai/stable-diffusion-3-medium-diffusers": {
        "title": "SD3 medium",
        "_class_name": "StableDiffusion3Pipeline",
        "components": {
            "transformer": (
                "diffusers",
                "SD3Transformer2DModel",
                dict(
                    sample_size=128,
                    patch_size=2,
                    in_channels=16,
                    num_layers=24,
                    attention_head_dim=64,
                    num_attention_heads=24,
                    joint_attention_dim=4096,
                    caption_projection_dim=1536,
                    pooled_projection_dim=2048,
                    out_channels=16,
                    pos_embed_max_size=192,
                ),
            ),
            "text_encoder": ("transformers", "CLIPTextModelWithProjection", _CLIP_L),
            "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", _CLIP_BIGG),
            "text_encoder_3": ("transformers", "T5EncoderModel", _T5_XXL),
            "vae": ("diffusers", "AutoencoderKL", _VAE_16),
        },
    },
    "black-forest-labs/FLUX.1-dev": {
        "title": "FLUX.1 [dev]",
        "_class_name": "FluxPipeline",
        "components": {
            "transformer": (
                "diffusers",
                "FluxTransformer2DModel",
                dict(
                    patch_size=1,
                    in_channels=64,
                    num_layers=19,
                    num_single_layers=38,
                    attention_head_dim=128,
                    num_attention_heads=24,
                    joint_attention_dim=4096,
                    pooled_projection_dim=768,
                    guidance_embeds=True,
                    axes_dims_rope=[16, 56, 56],
                ),
            ),
            "text_encoder": ("transformers", "CLIPTextModel", _CLIP_L),
            "text_encoder_2": ("transformers", "T5EncoderModel", _T5_XXL),
            "vae": ("diffusers", "AutoencoderKL", _VAE_16),
        },
    },
}
