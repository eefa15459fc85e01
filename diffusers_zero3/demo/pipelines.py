"""Every family's tiny pipeline: the real classes built small from configs, with locally
written tokenizers (``tokenizers.py``), saved as an ordinary diffusers folder (fp32
safetensors), so that every loading path of the package (``from_pretrained`` of a folder) runs
on it. They are the tests' and the default runs' fixtures, kept out of the families (a family
holds what differs between real pipelines: ``diffusers_zero3.families``).

``save_tiny_pipeline(family, folder, seed=0)`` saves the tiny pipeline of any family, by its
short name in ``TINY_PIPELINES``; a family without one there fails ``tests/test_demo.py`` by
name. Each builder is seeded (the same seed gives the same files) and is not a collective:
call it on one rank (or before launching) and share the folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ..families import (
    FLUX,
    FLUX2,
    FLUX2_KLEIN,
    KREA2,
    QWENIMAGE,
    SD,
    SD3,
    SDXL,
    WAN,
    WAN22,
    WAN22_5B,
    ZIMAGE,
    Family,
    flux2,
    ideogram4,
    krea2,
    nucleusmoe,
    qwenimage,
    zimage,
)
from ..families.flux2 import FLUX2_SCHEDULER, MISTRAL_SMALL_3_24B
from ..families.hidream import TRAINING_SHIFT
from ..families.ideogram4 import ACTIVATION_LAYERS, IDEOGRAM4
from ..families.krea2 import KREA2_SCHEDULER, TEXT_ENCODER_SELECT_LAYERS
from ..families.nucleusmoe import NUCLEUSMOE, NUCLEUSMOE_SCHEDULER
from ..families.published import CLIP_L, QWEN3_4B, QWEN3_VL_4B, QWEN3_VL_8B, T5_XXL, shrink
from ..families.qwenimage import QWEN_IMAGE_SCHEDULER
from ..families.wan import WAN_SCHEDULER, Wan
from ..families.zimage import ZIMAGE_TURBO_SCHEDULER
from ..runtime.zero3 import zero3_init_disabled
from .tokenizers import (
    CLIP_VOCAB_SIZE,
    local_clip_tokenizer,
    local_t5_tokenizer,
    read_back,
    write_ideogram4_tokenizer,
    write_krea2_tokenizer,
    write_llama3_tokenizer,
    write_mistral3_tokenizer,
    write_nucleusmoe_tokenizer,
    write_qwen3_tokenizer,
    write_qwenimage_edit_tokenizer,
    write_qwenimage_tokenizer,
    write_umt5_tokenizer,
    write_zimage_tokenizer,
)

# -------------------------------------------------------------------------------- shared tiny models

# A tiny model is its published config shrunk (``families.published.shrink``: the published keys,
# small sizes), with the ids of the locally written tokenizer beside it.

# The tiny LLMs' widths (Qwen3, Qwen3-VL's text model, Mistral 3's): 16, two query heads of 8
# sharing one key/value head.
TINY_LLM = dict(
    hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8
)


def save_pipeline(
    family: Family, folder: Path, denoiser, vae, text_encoders: dict, tokenizers: dict, scheduler
) -> Path:
    """``family.pipeline`` of these modules saved to ``folder`` (fp32 safetensors); the folder."""
    family.pipeline(denoiser, vae, text_encoders, tokenizers, scheduler).save_pretrained(
        folder, safe_serialization=True
    )
    return folder


def save_one_encoder_pipeline(
    family: Family, folder: Path, denoiser, vae, text_encoder, tokenizer, scheduler: dict
) -> Path:
    """``save_pipeline`` of a family prompted through one encoder (``families.common.llm_text_encoder``:
    ``text_encoder`` and its tokenizer or processor) with a ``FlowMatchEulerDiscreteScheduler`` of
    the ``scheduler`` config; the folder."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**scheduler)
    return save_pipeline(
        family, folder, denoiser, vae, {"text_encoder": text_encoder}, {"text_encoder": tokenizer}, scheduler
    )


def tiny_clip_config(hidden_size: int = 32, projection_dim: int = 32, layers: int = 2) -> dict:
    """CLIP-L's text config shrunk, for the byte-level CLIP tokenizer."""
    clip = shrink(
        CLIP_L,
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=37,
        num_hidden_layers=layers,
        num_attention_heads=4,
        projection_dim=projection_dim,
    )
    return dict(
        clip,
        bos_token_id=CLIP_VOCAB_SIZE - 2,
        eos_token_id=CLIP_VOCAB_SIZE - 1,
        pad_token_id=CLIP_VOCAB_SIZE - 1,
    )


def tiny_t5_config(d_model: int, vocab_size: int, layers: int = 2) -> dict:
    """T5-XXL's config shrunk (T5 v1.1: gated-gelu, the encoder alone; umT5 has its structure):
    ``d_model`` wide, four heads of 8, eight relative-position buckets."""
    t5 = shrink(
        T5_XXL,
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=d_model * 2,
        num_layers=layers,
        num_heads=4,
    )
    return dict(t5, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1)


def tiny_t5_encoder(d_model: int, vocab_size: int, layers: int = 2):
    """A tiny ``T5EncoderModel`` (``tiny_t5_config``)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**tiny_t5_config(d_model, vocab_size, layers)))


def tiny_llm_config(published: dict, vocab_size: int, **sizes) -> dict:
    """An LLM's ``published`` (text) config at ``TINY_LLM``'s widths with ``vocab_size`` tokens and
    2048 positions; ``sizes`` set more (``num_hidden_layers``: else the published depth)."""
    return shrink(
        published, **{**TINY_LLM, "vocab_size": vocab_size, "max_position_embeddings": 2048, **sizes}
    )


def qwen_token_ids(tid) -> dict[str, int]:
    """A Qwen config's BOS and EOS ids from its tokenizer's ``convert_tokens_to_ids``."""
    return {"bos_token_id": tid("<|endoftext|>"), "eos_token_id": tid("<|im_end|>")}


def vl_token_ids(tid) -> dict[str, int]:
    """A Qwen VL config's image/video token ids from its tokenizer's ``convert_tokens_to_ids``."""
    return {
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "vision_start_token_id": tid("<|vision_start|>"),
        "vision_end_token_id": tid("<|vision_end|>"),
    }


def tiny_qwen3_vl_config(published: dict, tokenizer) -> dict:
    """A Qwen3-VL config (``QWEN3_VL_4B``, ``QWEN3_VL_8B``) shrunk: its 36 decoder layers (the
    published taps stay intermediate layers) at ``TINY_LLM``'s widths with interleaved mRoPE, a
    2-block vision tower; ``tokenizer``'s ids."""
    tid = tokenizer.convert_tokens_to_ids
    config = shrink(
        published,
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=TINY_LLM["hidden_size"],
            num_position_embeddings=64,
            deepstack_visual_indexes=[1],
        ),
    )
    text = tiny_llm_config(
        published["text_config"], len(tokenizer), rope_scaling=dict(mrope_section=[2, 1, 1])
    )
    return dict(config, text_config=dict(text, **qwen_token_ids(tid)), **vl_token_ids(tid))


def tiny_qwen25_vl_text_config(tokenizer, layers: int) -> dict:
    """Qwen2.5-VL-7B's text config shrunk to the width of diffusers' Qwen-Image pipeline tests (16,
    two heads of 8, mRoPE sections 1, 1, 2) with ``layers`` layers; ``tokenizer``'s ids."""
    text = shrink(
        qwenimage.PUBLISHED_TEXT_ENCODER["text_config"],
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_scaling=dict(mrope_section=[1, 1, 2]),
    )
    return dict(text, **qwen_token_ids(tokenizer.convert_tokens_to_ids))


def tiny_vae_config(width: int = 32, latent_channels: int = 4) -> dict:
    """A tiny ``AutoencoderKL`` config: two blocks (8x8 latents of 32 px images... x2 down)."""
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(width, width * 2),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=min(32, width // 2),
        sample_size=32,
    )


def tiny_flow_vae(
    latent_channels: int, width: int = 32, scaling_factor: float = 1.5035, shift_factor: float = 0.0609
):
    """A tiny ``AutoencoderKL`` as the SD3, Flux.1, Z-Image and HiDream VAEs: no quant convs, a
    shift factor (the tiny SD3's and Flux.1's by default; Z-Image and HiDream give Flux.1's
    published 0.3611 and 0.1159)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        **tiny_vae_config(width, latent_channels),
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    )


# -------------------------------------------------------------------------------- SD 1.x / 2.x


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


def save_tiny_sd_pipeline(
    folder: str | os.PathLike, seed: int = 0, width: int = 32, text_layers: int = 2, unet_shape: str = "tiny"
) -> Path:
    """Save a tiny ``StableDiffusionPipeline`` folder (fp32 safetensors) and return its path.

    Not a collective: call it on one rank (or before launching) and share the folder.
    """
    folder = Path(folder)
    parts = build_tiny_components(seed, width, text_layers, unet_shape=unet_shape)
    return save_pipeline(
        SD,
        folder,
        parts["unet"],
        parts["vae"],
        {"text_encoder": parts["text_encoder"]},
        {"text_encoder": local_clip_tokenizer(folder)},
        sd_scheduler(),
    )


# -------------------------------------------------------------------------------- SDXL


def save_tiny_sdxl_pipeline(folder: str | os.PathLike, seed: int = 0, width: int = 32) -> Path:
    """Save a tiny ``StableDiffusionXLPipeline`` folder (fp32 safetensors) and return its path.

    The real SDXL layout: a ``text_time`` UNet conditioned on two CLIP encoders (the second
    with a projection, whose pooled output is ``text_embeds``), two tokenizers, a VAE and an
    Euler scheduler, with the shapes of diffusers' own SDXL pipeline tests. Not a collective.
    """
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    folder = Path(folder)
    text_cfg = tiny_clip_config()
    time_dim, proj_dim = 8, text_cfg["projection_dim"]
    with zero3_init_disabled():
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(width, width * 2),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            transformer_layers_per_block=(1, 2),
            projection_class_embeddings_input_dim=6 * time_dim + proj_dim,
            cross_attention_dim=2 * text_cfg["hidden_size"],
            norm_num_groups=min(32, width // 2),
        )
        vae = AutoencoderKL(**tiny_vae_config(width))
        text_encoder = CLIPTextModel(CLIPTextConfig(**text_cfg))
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**text_cfg))
    tokenizer = local_clip_tokenizer(folder)
    scheduler = EulerDiscreteScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        timestep_spacing="leading",
    )
    return save_pipeline(
        SDXL,
        folder,
        unet,
        vae,
        {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2},
        {"text_encoder": tokenizer, "text_encoder_2": tokenizer},
        scheduler,
    )


# -------------------------------------------------------------------------------- SD3


def save_tiny_sd3_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``StableDiffusion3Pipeline`` folder (fp32 safetensors) and return its path.

    SD3's layout with small shapes: an ``SD3Transformer2DModel`` conditioned on two CLIP
    encoders with projections (pooled outputs concatenated) and a T5 encoder
    (``text_encoder_3``, whose width the CLIP states are padded to), a VAE with
    ``shift_factor`` and a flow-matching Euler scheduler. Not a collective.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    folder = Path(folder)
    t5_width = 64  # >= the two CLIP widths together (32 + 32), as in SD3 (2048 <= 4096)
    t5_tokenizer = local_t5_tokenizer(folder)
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=16,
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=t5_width,
            pooled_projection_dim=64,
            pos_embed_max_size=32,
        )
        text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**tiny_clip_config()))
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**tiny_clip_config()))
        text_encoder_3 = tiny_t5_encoder(t5_width, len(t5_tokenizer))
        vae = tiny_flow_vae(4)
    clip_tokenizer = local_clip_tokenizer(folder)
    return save_pipeline(
        SD3,
        folder,
        transformer,
        vae,
        {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2, "text_encoder_3": text_encoder_3},
        {"text_encoder": clip_tokenizer, "text_encoder_2": clip_tokenizer, "text_encoder_3": t5_tokenizer},
        FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


# -------------------------------------------------------------------------------- Flux.1


def save_tiny_flux_pipeline(folder: str | os.PathLike, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """Save a tiny ``FluxPipeline`` folder (fp32 safetensors) and return its path.

    Flux.1's layout with small shapes: a ``FluxTransformer2DModel`` (double- and single-stream
    blocks, 2x2-packed latents, rotary ``img_ids``/``txt_ids``, guidance embedding when
    ``guidance_embeds``) conditioned on CLIP's pooled output and a T5 encoder's hidden states
    (``text_encoder_2``, with a locally written unigram tokenizer), a 16-channel-latent VAE
    with ``shift_factor`` and a flow-matching Euler scheduler. Not a collective.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    folder = Path(folder)
    t5_tokenizer = local_t5_tokenizer(folder)
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16 * 4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 4, 8),
        )
        text_encoder = CLIPTextModel(CLIPTextConfig(**tiny_clip_config()))
        text_encoder_2 = tiny_t5_encoder(32, len(t5_tokenizer))
        vae = tiny_flow_vae(16)
    return save_pipeline(
        FLUX,
        folder,
        transformer,
        vae,
        {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2},
        {"text_encoder": local_clip_tokenizer(folder), "text_encoder_2": t5_tokenizer},
        FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def save_tiny_kontext_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``FluxKontextPipeline`` folder: the tiny Flux.1 pipeline's parts
    (``save_tiny_flux_pipeline``, guidance-distilled as Kontext [dev]; byte-identical weights)
    under Kontext's pipeline class, and beside it ``<folder>-source.png`` (a red circle, 32 px):
    the source image of the default run's validation edits (``--validation_image``). Not a
    collective."""
    import shutil
    import tempfile

    from diffusers import FluxKontextPipeline

    from . import shape_image

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shape_image("red", "circle").save(f"{folder}-source.png")
    with tempfile.TemporaryDirectory(dir=folder.parent if folder.parent.is_dir() else None) as tmp:
        flux = save_tiny_flux_pipeline(Path(tmp) / "flux", seed)
        FluxKontextPipeline.from_pretrained(flux).save_pretrained(folder, safe_serialization=True)
        for name in ("tokenizer", "tokenizer_2"):  # the locally written tokenizer files as they are
            shutil.copytree(flux / name, folder / name, dirs_exist_ok=True)
    return folder


# -------------------------------------------------------------------------------- Qwen-Image


def tiny_qwenimage_vae():
    """Qwen-Image's VAE (``AutoencoderKLQwenImage``, also Krea 2's) at 4x downsampling, with
    per-channel statistics that are not 0 and 1 (so that a missing normalisation shows). Build it
    inside ``zero3_init_disabled()``."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[-0.25, 0.1, 0.4, -0.05],
        latents_std=[1.5, 0.75, 1.25, 2.0],
    )


def tiny_qwenimage_transformer():
    """Qwen-Image's transformer shrunk to diffusers' pipeline tests' (2 blocks, 3 heads of 16)
    for 4 latent channels in 2x2 patches. Build it inside ``zero3_init_disabled()``."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        **shrink(
            qwenimage.PUBLISHED_TRANSFORMER,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=3,
            joint_attention_dim=16,
            axes_dims_rope=(8, 4, 4),
        )
    )


def tiny_qwen25_vl_config(tokenizer) -> dict:
    """Qwen-Image's Qwen2.5-VL-7B config shrunk to diffusers' pipeline tests' (2 text layers,
    ``tiny_qwen25_vl_text_config``; a 2-block vision tower with the published patching: 14 px
    patches, 2x2 merges); ``tokenizer``'s ids."""
    config = shrink(
        qwenimage.PUBLISHED_TEXT_ENCODER,
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=16,
            fullatt_block_indexes=[1],
        ),
    )
    text = tiny_qwen25_vl_text_config(tokenizer, layers=2)
    return dict(config, text_config=text, **vl_token_ids(tokenizer.convert_tokens_to_ids))


def tiny_qwenimage_models(seed: int, tokenizer) -> tuple:
    """``(transformer, vae, text_encoder)`` of the tiny Qwen-Image (and Qwen-Image-Edit), seeded
    ``seed``: ``tiny_qwenimage_transformer``, ``tiny_qwenimage_vae`` and a Qwen2.5-VL of
    ``tiny_qwen25_vl_config`` for ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = tiny_qwenimage_transformer()
        vae = tiny_qwenimage_vae()
        config = Qwen2_5_VLConfig(**tiny_qwen25_vl_config(tokenizer))
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return transformer, vae, text_encoder


def save_tiny_qwenimage_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``QwenImagePipeline`` folder (fp32 safetensors) and return its path.

    The shapes of diffusers' Qwen-Image pipeline tests (a 2-block transformer, a 2-layer
    Qwen2.5-VL with a 2-block vision tower), a smaller 4x-downsampling VAE with per-channel
    statistics that are not 0 and 1 (so that a missing normalisation shows), the published
    scheduler, and a locally written tokenizer. Not a collective.
    """

    folder = Path(folder)
    tokenizer = read_back(write_qwenimage_tokenizer, folder)
    transformer, vae, text_encoder = tiny_qwenimage_models(seed, tokenizer)
    return save_one_encoder_pipeline(
        QWENIMAGE, folder, transformer, vae, text_encoder, tokenizer, QWEN_IMAGE_SCHEDULER
    )


def save_tiny_qwenimage_edit_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``QwenImageEditPlusPipeline`` folder (fp32 safetensors) and return its path.

    The tiny Qwen-Image's shapes (``save_tiny_qwenimage_pipeline``: a 2-block transformer, a
    2-layer Qwen2.5-VL whose 2-block vision tower runs here, with the published patching: 14 px
    patches, 2x2 merges), a locally written tokenizer for the edit template, and as
    ``processor`` Qwen2-VL's image processor (PIL backend) with that tokenizer
    (``Qwen2VLImageTextProcessor``: no torchvision). Beside it ``<folder>-source.png`` (a red
    circle, 32 px): the source image of the default run's validation edits. Not a collective.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..families import QWENIMAGE_EDIT
    from ..families import qwenimage_edit as edit
    from . import shape_image

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shape_image("red", "circle").save(f"{folder}-source.png")
    tokenizer = read_back(write_qwenimage_edit_tokenizer, folder)
    processor = getattr(edit, edit.PROCESSOR_CLASS)(
        image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer
    )
    transformer, vae, text_encoder = tiny_qwenimage_models(seed, tokenizer)
    return save_one_encoder_pipeline(
        QWENIMAGE_EDIT, folder, transformer, vae, text_encoder, processor, QWEN_IMAGE_SCHEDULER
    )


# -------------------------------------------------------------------------------- Z-Image


def save_tiny_zimage_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``ZImagePipeline`` folder (fp32 safetensors) and return its path.

    The transformer of diffusers' Z-Image pipeline tests (2 blocks and 1 refiner block of each
    kind, pad tokens of ones) with a caption RoPE axis long enough for 512-token prompts, a
    3-layer ``Qwen3Model`` (so ``hidden_states[-2]`` is neither the first nor the last layer's
    output), a 16-channel-latent VAE with Z-Image's scale and shift, Turbo's scheduler and a
    locally written tokenizer. Not a collective.
    """
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    folder = Path(folder)
    tokenizer = read_back(write_zimage_tokenizer, folder)
    tid = tokenizer.convert_tokens_to_ids
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            **shrink(
                zimage.PUBLISHED_TRANSFORMER,
                dim=32,
                n_layers=2,
                n_refiner_layers=1,
                n_heads=2,
                n_kv_heads=2,
                cap_feat_dim=TINY_LLM["hidden_size"],
                axes_dims=[8, 4, 4],
                axes_lens=[1024, 32, 32],  # caption positions 1..ceil32(L), then the image: L up to 512 fits
            )
        )
        with torch.no_grad():  # as diffusers' test: pad tokens that are not zero
            transformer.x_pad_token.fill_(1.0)
            transformer.cap_pad_token.fill_(1.0)
        vae = tiny_flow_vae(16, width=16, scaling_factor=0.3611, shift_factor=0.1159)
        config = tiny_llm_config(QWEN3_4B, len(tokenizer), num_hidden_layers=3, max_position_embeddings=1024)
        text_encoder = Qwen3Model(Qwen3Config(**config, **qwen_token_ids(tid))).eval()
    return save_one_encoder_pipeline(
        ZIMAGE, folder, transformer, vae, text_encoder, tokenizer, ZIMAGE_TURBO_SCHEDULER
    )


# -------------------------------------------------------------------------------- Krea 2


def save_tiny_krea2_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``Krea2Pipeline`` folder (fp32 safetensors) and return its path.

    The published structure at tiny widths: a ``Qwen3VLModel`` with Qwen3-VL-4B's 36 decoder
    layers (so the pipeline's default twelve taps, ``hidden_states[2], [5], ..., [35]``, are
    the ones read: neither the embeddings nor the last layer), grouped-query attention and
    interleaved mRoPE, a 2-block vision tower; a 2-block transformer with twelve text layers
    and the published two layer-wise and two refiner text-fusion blocks, grouped-query
    attention; Qwen-Image's VAE small (4x downsampling) with per-channel statistics that are
    not 0 and 1 (so that a missing normalisation shows); Krea 2's scheduler; a locally written
    tokenizer. Not a collective.
    """
    from diffusers import Krea2Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLModel

    folder = Path(folder)
    tokenizer = read_back(write_krea2_tokenizer, folder)
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = Krea2Transformer2DModel(
            **shrink(
                krea2.PUBLISHED_TRANSFORMER,
                in_channels=16,  # 4 latent channels in 2x2 patches
                num_layers=2,
                attention_head_dim=8,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=32,
                timestep_embed_dim=16,
                text_hidden_dim=TINY_LLM["hidden_size"],
                num_text_layers=len(TEXT_ENCODER_SELECT_LAYERS),
                text_num_attention_heads=2,
                text_num_key_value_heads=1,
                text_intermediate_size=32,
                axes_dims_rope=(4, 2, 2),
            )
        )
        vae = tiny_qwenimage_vae()
        text_encoder = Qwen3VLModel(Qwen3VLConfig(**tiny_qwen3_vl_config(QWEN3_VL_4B, tokenizer))).eval()
    return save_one_encoder_pipeline(
        KREA2, folder, transformer, vae, text_encoder, tokenizer, KREA2_SCHEDULER
    )


# -------------------------------------------------------------------------------- NucleusMoE-Image


def save_tiny_nucleusmoe_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``NucleusMoEImagePipeline`` folder (fp32 safetensors) and return its path.

    The published structure at tiny widths: a ``Qwen3VLForConditionalGeneration`` with
    Qwen3-VL-8B's 36 decoder layers (so the pipeline's ``hidden_states[-8]`` is neither the
    embeddings nor the last layer), grouped-query attention and interleaved mRoPE, a 2-block
    vision tower; a 5-block transformer whose first three blocks are dense (SwiGLU of width 128)
    and last two a mixture of 4 experts (expert-choice routing, capacity factor 2: every expert
    takes 8 of the 16 tokens of a 32 px image), grouped-query attention; Qwen-Image's VAE small (4x
    downsampling) with per-channel statistics that are not 0 and 1; Qwen-Image's scheduler; a
    locally written tokenizer with Qwen3-VL's chat template as the ``processor`` (the published
    ``Qwen3VLProcessor`` needs torchvision; the pipeline only renders and tokenizes text with
    it). Not a collective.
    """
    from diffusers import NucleusMoEImageTransformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    folder = Path(folder)
    tokenizer = read_back(write_nucleusmoe_tokenizer, folder)
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = NucleusMoEImageTransformer2DModel(
            **shrink(
                nucleusmoe.PUBLISHED_TRANSFORMER,
                in_channels=16,  # 4 latent channels in 2x2 patches
                out_channels=4,
                num_layers=5,
                attention_head_dim=8,
                num_attention_heads=4,
                num_key_value_heads=2,
                joint_attention_dim=TINY_LLM["hidden_size"],
                axes_dims_rope=(4, 2, 2),
                mlp_ratio=6.0,  # the dense blocks' SwiGLU: int(32 * 6 * 2 / 3) // 128 * 128 = 128 (0 at 4.0)
                num_experts=4,
                moe_intermediate_dim=16,
                capacity_factors=[0.0, 0.0, 0.0, 2.0, 2.0],
            )
        )
        for block in transformer.transformer_blocks:  # the packed experts are torch.empty at __init__
            if block.moe_enabled:
                for weight in block.img_mlp.experts.parameters():
                    torch.nn.init.normal_(weight, std=0.25)
        vae = tiny_qwenimage_vae()
        config = Qwen3VLConfig(**tiny_qwen3_vl_config(QWEN3_VL_8B, tokenizer))
        text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    return save_one_encoder_pipeline(
        NUCLEUSMOE, folder, transformer, vae, text_encoder, tokenizer, NUCLEUSMOE_SCHEDULER
    )


# -------------------------------------------------------------------------------- HiDream-I1


# diffusers tests/pipelines/hidream_image/test_pipeline_hidream.py's tiny transformer
HIDREAM_TRANSFORMER = dict(
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    caption_channels=[32, 16],  # the tiny T5's d_model, the tiny Llama's hidden size
    text_emb_dim=64,  # the two tiny CLIPs' projections
    num_routed_experts=4,
    num_activated_experts=2,
    axes_dims_rope=(4, 2, 2),
    max_resolution=(32, 32),  # latent pixels: 256 patches, up to 64 px images
    llama_layers=(0, 1),
)


def llama_folder_of(folder: str | os.PathLike) -> Path:
    """Where ``save_tiny_hidream_pipeline`` puts the tiny Llama of the pipeline ``folder``."""
    return Path(str(folder) + "-llama")


def save_tiny_hidream_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``HiDreamImagePipeline`` folder (fp32 safetensors) and return its path.

    As the published repos, the folder has no Llama (``text_encoder_4`` and ``tokenizer_4``
    are null in model_index.json, so loading needs them given): the tiny ``LlamaForCausalLM``
    and its tokenizer are saved at the root of ``<folder>-llama``, as a Llama hub repo. The
    transformer is diffusers' test config (an MoE of 4 experts in each of its 2 blocks); two
    CLIPs with projection and 248 positions (first-EOS pooling), a gated-gelu T5, a 2-layer
    Llama, a Flux-like VAE (no quant convs, 2x downsampling, HiDream's scale and shift) and
    the training scheduler (Euler, shift 3.0). Not a collective.
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        HiDreamImagePipeline,
        HiDreamImageTransformer2DModel,
    )
    from transformers import (
        AutoTokenizer,
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        LlamaConfig,
        LlamaForCausalLM,
    )

    folder = Path(folder)
    llama_folder = llama_folder_of(folder)
    clip_tokenizer = local_clip_tokenizer(folder)
    t5_tokenizer = local_t5_tokenizer(folder)
    llama_tokenizer = AutoTokenizer.from_pretrained(write_llama3_tokenizer(llama_folder))
    clip_config = CLIPTextConfig(**dict(tiny_clip_config(), max_position_embeddings=248))
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = HiDreamImageTransformer2DModel(**HIDREAM_TRANSFORMER)
        text_encoder = CLIPTextModelWithProjection(clip_config)
        text_encoder_2 = CLIPTextModelWithProjection(clip_config)
        text_encoder_3 = tiny_t5_encoder(32, len(t5_tokenizer))
        text_encoder_4 = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(llama_tokenizer),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=2048,
                rope_theta=500000.0,
                bos_token_id=llama_tokenizer.bos_token_id,
                eos_token_id=llama_tokenizer.eos_token_id,
                tie_word_embeddings=False,
            )
        )
        vae = tiny_flow_vae(4, width=16, scaling_factor=0.3611, shift_factor=0.1159)
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=TRAINING_SHIFT),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
        text_encoder_4=None,
        tokenizer_4=None,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    text_encoder_4.save_pretrained(llama_folder, safe_serialization=True)
    return folder


# -------------------------------------------------------------------------------- Flux.2


def tiny_flux2_vae(seed: int, block_out_channels: tuple[int, ...] = (8, 16)):
    """Flux.2's VAE (``AutoencoderKLFlux2``) with one block per ``block_out_channels`` (2x down
    between them: 2x by default), 4 latent channels (16 patchified), batch-norm statistics that
    are not 0 and 1 (so that a missing normalisation shows). Seeds ``seed``, then builds it."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * len(block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(block_out_channels),
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
    )
    # Statistics that are not 0 and 1 make a missing normalisation show.
    generator = torch.Generator().manual_seed(seed + 1)  # CPU: the tiny VAE is built there and saved
    with torch.no_grad():
        # CPU: as the generator
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.num_features, generator=generator))
        # CPU: as the generator
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.num_features, generator=generator))
    return vae


def _flux2_transformer(seed: int, published: dict):
    """A published Flux.2 transformer shrunk to 1+1 blocks (its guidance embedding kept), reading
    three stacked states of a ``TINY_LLM``."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    return Flux2Transformer2DModel(
        **shrink(
            published,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=3 * TINY_LLM["hidden_size"],
            axes_dims_rope=(4, 4, 4, 4),
        )
    )


def save_tiny_flux2_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``Flux2Pipeline`` folder (fp32 safetensors) and return its path: a 1+1-block
    guidance-embedded transformer, a 31-layer Mistral 3 VLM (a 1-layer Pixtral tower that never
    runs) with a locally written tokenizer saved as a plain tokenizer (a ``PixtralProcessor``
    needs torchvision), the VAE of ``tiny_flux2_vae`` and FLUX.2's scheduler. Not a collective."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    folder = Path(folder)
    tokenizer = read_back(write_mistral3_tokenizer, folder)
    tid = tokenizer.convert_tokens_to_ids
    ids = dict(bos_token_id=tid("<s>"), eos_token_id=tid("</s>"), pad_token_id=None)  # no pad, as published
    # 31 layers: the default stacked layers (10, 20, 30) are intermediate states before the final norm
    text = tiny_llm_config(MISTRAL_SMALL_3_24B["text_config"], len(tokenizer), num_hidden_layers=31)
    vision = shrink(
        MISTRAL_SMALL_3_24B["vision_config"],
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        head_dim=8,
        image_size=16,
        patch_size=8,
    )
    config = shrink(MISTRAL_SMALL_3_24B, image_token_index=tid("[IMG]"), spatial_merge_size=1)
    with zero3_init_disabled():
        transformer = _flux2_transformer(seed, flux2.PUBLISHED_TRANSFORMER_DEV)
        vae = tiny_flux2_vae(seed)
        config = Mistral3Config(
            **dict(
                config, text_config=dict(text, **ids), vision_config=dict(vision, hidden_act="silu"), **ids
            )
        )
        torch.manual_seed(seed)
        text_encoder = Mistral3ForConditionalGeneration(config).eval()
    return save_one_encoder_pipeline(
        FLUX2, folder, transformer, vae, text_encoder, tokenizer, FLUX2_SCHEDULER
    )


def save_tiny_flux2_klein_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``Flux2KleinPipeline`` folder (fp32 safetensors, a base model: not
    ``is_distilled``) and return its path: a 1+1-block transformer without guidance embedding,
    a 28-layer Qwen3 (tied embeddings, as Qwen3-4B) with a locally written tokenizer, the VAE
    of ``tiny_flux2_vae`` and FLUX.2's scheduler. Not a collective."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    tokenizer = read_back(write_qwen3_tokenizer, folder)
    with zero3_init_disabled():
        transformer = _flux2_transformer(seed, flux2.PUBLISHED_TRANSFORMER_KLEIN_4B)
        vae = tiny_flux2_vae(seed)
        # 28 layers: the default stacked layers (9, 18, 27) are intermediate states before the final norm
        config = Qwen3Config(
            **tiny_llm_config(QWEN3_4B, len(tokenizer), num_hidden_layers=28),
            pad_token_id=None,  # as published
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(config).eval()
    return save_one_encoder_pipeline(
        FLUX2_KLEIN, folder, transformer, vae, text_encoder, tokenizer, FLUX2_SCHEDULER
    )


# -------------------------------------------------------------------------------- Wan


WAN_LATENTS_MEAN = [-0.25, 0.1, 0.4, -0.05, 0.3, -0.6, 0.15, 0.0]
WAN_LATENTS_STD = [1.5, 0.75, 1.25, 2.0, 0.5, 1.1, 0.9, 1.7]


def tiny_wan_components(family: Wan, vocab_size: int, seed: int = 0) -> dict:
    """The tiny models of ``family``: diffusers' Wan pipeline-test transformer (2 blocks, 2
    heads of 12) on a tiny causal VAE of the published structure (8x spatial, 4x temporal;
    TI2V-5B: Wan 2.2's residual VAE with 2x2 patchify, 16x spatial) with per-channel statistics
    that are not 0 and 1, and a 2-layer umT5; two experts for Wan 2.2 A14B (seeds differ)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    z_dim = len(WAN_LATENTS_MEAN)
    with zero3_init_disabled():
        torch.manual_seed(seed)
        if family.expand_timesteps:
            vae = AutoencoderKLWan(
                base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
                latents_mean=WAN_LATENTS_MEAN, latents_std=WAN_LATENTS_STD,
            )  # fmt: skip
        else:
            vae = AutoencoderKLWan(
                base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True], latents_mean=WAN_LATENTS_MEAN,
                latents_std=WAN_LATENTS_STD,
            )  # fmt: skip
        experts = {}
        for i, name in enumerate(family.experts):
            torch.manual_seed(seed + 1 + i)
            experts[name] = WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z_dim,
                out_channels=z_dim, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
            )  # fmt: skip
        torch.manual_seed(seed + 10)
        config = UMT5Config(**tiny_t5_config(32, vocab_size), decoder_start_token_id=0)  # T5 v1.1's structure
        text_encoder = UMT5EncoderModel(config).eval()
    return {"vae": vae, "text_encoder": text_encoder, **experts}


def save_tiny_wan_pipeline(family: Wan, folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``WanPipeline`` folder of ``family`` (fp32 safetensors; Wan 2.2 A14B with
    both experts and ``boundary_ratio``, TI2V-5B with ``expand_timesteps``), the published UniPC
    scheduler and a locally written umT5 tokenizer, and return its path. Not a collective."""
    from diffusers import UniPCMultistepScheduler

    folder = Path(folder)
    tokenizer = read_back(write_umt5_tokenizer, folder)
    parts = tiny_wan_components(family, len(tokenizer), seed)
    scheduler = UniPCMultistepScheduler(
        **dict(WAN_SCHEDULER, flow_shift=5.0 if family.expand_timesteps else 3.0)
    )
    return save_pipeline(
        family,
        folder,
        {name: parts[name] for name in family.experts},
        parts["vae"],
        {"text_encoder": parts["text_encoder"]},
        {"text_encoder": tokenizer},
        scheduler,
    )


# -------------------------------------------------------------------------------- Ideogram 4


def save_tiny_ideogram4_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``Ideogram4Pipeline`` folder (fp32 safetensors) and return its path.

    The published structure at tiny widths: a ``Qwen3VLModel`` with Qwen3-VL-8B's 36 decoder
    layers (so the thirteen taps are the published layers, the last one the final decoder
    layer before the norm), interleaved mRoPE, a 2-block vision tower; two 2-block transformers
    of the same shapes and different weights (``transformer``, ``unconditional_transformer``);
    Flux.2's VAE small but with the published 8x downsampling (the sigma density's
    resolution-aware mean reads 16 px per token) and batch-norm statistics that are not 0 and
    1; the default ``FlowMatchEulerDiscreteScheduler``; a locally written tokenizer. No
    ``prompt_enhancer_head`` (optional). Not a collective.
    """
    from diffusers import Ideogram4Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLModel

    folder = Path(folder)
    tokenizer = read_back(write_ideogram4_tokenizer, folder)
    transformer_config = shrink(
        ideogram4.PUBLISHED_TRANSFORMER,
        in_channels=16,  # 4 latent channels in 2x2 patches
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        intermediate_size=32,
        adaln_dim=16,
        llm_features_dim=len(ACTIVATION_LAYERS) * TINY_LLM["hidden_size"],
        mrope_section=(2, 1, 1),
    )
    with zero3_init_disabled():
        denoisers = []
        for i in range(2):
            torch.manual_seed(seed + i)
            denoisers.append(Ideogram4Transformer2DModel(**transformer_config))
        vae = tiny_flux2_vae(seed, block_out_channels=(8, 8, 8, 8))  # the published 8x downsampling
        config = Qwen3VLConfig(**tiny_qwen3_vl_config(QWEN3_VL_8B, tokenizer))
        torch.manual_seed(seed)
        text_encoder = Qwen3VLModel(config).eval()
    return save_one_encoder_pipeline(
        IDEOGRAM4,
        folder,
        {"transformer": denoisers[0], "unconditional_transformer": denoisers[1]},
        vae,
        text_encoder,
        tokenizer,
        {},
    )


# -------------------------------------------------------------------------------- HunyuanVideo 1.5


def save_tiny_hunyuanvideo15_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``HunyuanVideo15Pipeline`` folder (fp32 safetensors) and return its path: a
    2-block transformer (2 heads of 8, rope 2/2/4) on 4 latent channels (9 input channels:
    latents, condition latents, mask), a 3-layer Qwen2.5-VL text model (``hidden_states[-3]`` is
    then a middle layer's), a 2-layer ByT5-shaped T5 encoder on ``ByT5Tokenizer``'s 384 ids, a
    video VAE of the published structure at 8x spatial and 4x temporal compression with a
    scaling factor that is not 1, the published t2v scheduler (shift 5) and guider (CFG 6), and
    a locally written Qwen2.5-VL tokenizer whose template prefix is the 108 dropped tokens. Not
    a collective."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from ..families.hunyuanvideo15 import HUNYUANVIDEO15
    from .tokenizers import write_byt5_tokenizer, write_hunyuanvideo15_tokenizer

    folder = Path(folder)
    tokenizer = read_back(write_hunyuanvideo15_tokenizer, folder)
    tokenizer_2 = read_back(write_byt5_tokenizer, folder)
    tid = tokenizer.convert_tokens_to_ids
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=12,
            rope_axes_dim=(2, 2, 4), target_size=32, task_type="t2v",
        )  # fmt: skip
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1, spatial_compression_ratio=8,
            temporal_compression_ratio=4, downsample_match_channel=False, upsample_match_channel=False,
            scaling_factor=0.75,
        )  # fmt: skip
        torch.manual_seed(seed + 2)
        config = Qwen2_5_VLTextConfig(
            **tiny_qwen25_vl_text_config(tokenizer, layers=3),
            pad_token_id=tid("<|endoftext|>"),
        )
        text_encoder = Qwen2_5_VLTextModel(config).eval()
        torch.manual_seed(seed + 3)
        text_encoder_2 = tiny_t5_encoder(32, len(tokenizer_2)).eval()
    return save_pipeline(
        HUNYUANVIDEO15,
        folder,
        transformer,
        vae,
        {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2},
        {"text_encoder": tokenizer, "text_encoder_2": tokenizer_2},
        FlowMatchEulerDiscreteScheduler(shift=5.0),
    )


# -------------------------------------------------------------------------------- LTX-2


def save_tiny_ltx2_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``LTX2Pipeline`` folder (fp32 safetensors) and return its path: a 2-block
    audio-video transformer (video 2 heads of 8 on 4 latent channels, audio 2 heads of 4 on 2 x 2
    packed audio channels), a 3-layer Gemma 3 (its stacked states: 4 x 16 features a token) with a
    one-block vision tower, one-layer connectors, a video VAE at 4x spatial and 2x temporal
    compression with latent statistics and a scaling factor that are not trivial, an audio VAE
    on 8 mel bins (stereo; 4x in time and in mel, as published) with statistics that are not trivial, a vocoder that upsamples 160x
    (the mel hop: audio as long as its clip), the default scheduler and a locally written Gemma
    tokenizer. Not a collective."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from ..families.ltx2 import LTX2
    from .tokenizers import write_gemma3_tokenizer

    folder = Path(folder)
    tokenizer = read_back(write_gemma3_tokenizer, folder)
    tid = tokenizer.convert_tokens_to_ids
    with zero3_init_disabled():
        torch.manual_seed(seed)
        transformer = LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, vae_scale_factors=(2, 4, 4), audio_in_channels=4, audio_out_channels=4,
            audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
            caption_channels=16, rope_type="split",
        )  # fmt: skip
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
            layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
            upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=2,
            patch_size_t=1, encoder_causal=True, decoder_causal=False, scaling_factor=0.8,
        )  # fmt: skip
        vae.latents_mean.copy_(torch.linspace(-0.2, 0.3, 4))  # CPU: the VAE is built there, then saved
        vae.latents_std.copy_(torch.linspace(0.6, 1.5, 4))  # CPU: as above
        torch.manual_seed(seed + 2)
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, in_channels=2, resolution=32,
            latent_channels=2, mel_bins=8,
        )  # fmt: skip
        audio_vae.latents_mean.copy_(torch.linspace(-0.1, 0.2, 4))  # CPU: built there, then saved
        audio_vae.latents_std.copy_(torch.linspace(0.7, 1.3, 4))  # CPU: as above
        torch.manual_seed(seed + 3)
        vocoder = LTX2Vocoder(
            in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[16, 8, 10],
            upsample_factors=[8, 4, 5], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            output_sampling_rate=16000,
        )  # fmt: skip
        torch.manual_seed(seed + 4)
        connectors = LTX2TextConnectors(
            caption_channels=16, text_proj_in_factor=4, video_connector_num_attention_heads=4,
            video_connector_attention_head_dim=4, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
            audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type="split",
        )  # fmt: skip
        torch.manual_seed(seed + 5)
        text_encoder = Gemma3ForConditionalGeneration(
            Gemma3Config(
                text_config=dict(
                    vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                    sliding_window=8, pad_token_id=tid("<pad>"), bos_token_id=tid("<bos>"), eos_token_id=tid("<eos>"),
                ),
                vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=16, patch_size=4),
                mm_tokens_per_image=4, image_token_index=tid("<image_soft_token>"),
                boi_token_index=tid("<start_of_image>"), eoi_token_index=tid("<end_of_image>"),
            )
        ).eval()  # fmt: skip
    return save_pipeline(
        LTX2,
        folder,
        transformer,
        vae,
        {"text_encoder": text_encoder, "connectors": connectors, "audio_vae": audio_vae, "vocoder": vocoder},
        {"text_encoder": tokenizer},
        FlowMatchEulerDiscreteScheduler(),
    )


# -------------------------------------------------------------------------------- by family

# Every family's tiny pipeline, by short name: ``builder(folder, seed)``.
TINY_PIPELINES: dict[str, Callable[[str | os.PathLike, int], Path]] = {
    "sd": save_tiny_sd_pipeline,
    "sdxl": save_tiny_sdxl_pipeline,
    "sd3": save_tiny_sd3_pipeline,
    "flux": save_tiny_flux_pipeline,
    "qwenimage": save_tiny_qwenimage_pipeline,
    "zimage": save_tiny_zimage_pipeline,
    "hidream": save_tiny_hidream_pipeline,
    "flux2": save_tiny_flux2_pipeline,
    "flux2-klein": save_tiny_flux2_klein_pipeline,
    "wan": partial(save_tiny_wan_pipeline, WAN),
    "wan22": partial(save_tiny_wan_pipeline, WAN22),
    "wan22_5b": partial(save_tiny_wan_pipeline, WAN22_5B),
    "krea2": save_tiny_krea2_pipeline,
    "kontext": save_tiny_kontext_pipeline,
    "nucleusmoe": save_tiny_nucleusmoe_pipeline,
    "ideogram4": save_tiny_ideogram4_pipeline,
    "qwenimage-edit": save_tiny_qwenimage_edit_pipeline,
    "hunyuanvideo15": save_tiny_hunyuanvideo15_pipeline,
    "ltx2": save_tiny_ltx2_pipeline,
}


def save_tiny_pipeline(family: Family, folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save the tiny pipeline of ``family`` (its builder in ``TINY_PIPELINES``) to ``folder``
    and return the folder. Not a collective: call it on one rank and share the folder.
    Building one imports diffusers' pipeline modules: ``quiet_library_notices`` first."""
    from ..runtime.notices import quiet_library_notices

    quiet_library_notices()
    if family.name not in TINY_PIPELINES:
        raise NotImplementedError(
            f"{family.name} has no tiny pipeline: add one to demo.pipelines.TINY_PIPELINES"
        )
    return TINY_PIPELINES[family.name](folder, seed)
