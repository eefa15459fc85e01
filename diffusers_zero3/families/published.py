"""Published configs of components that several families share (CLIP-L, OpenCLIP bigG,
T5-XXL, the SD VAEs, Qwen3-4B and -8B, Qwen3-VL-4B and -8B) and of the reward models the planner
sizes, for the planner's carried pipelines: only the keys that set parameter shapes (the others
keep their library defaults, which equal the published ones for shapes).

The configs are data, one JSON file per published ``config.json`` under ``published/`` beside
this module (a family's own under ``published/<family>/``), read by ``published_config``; the
modules keep them as dicts under their names (``CLIP_L`` here, ``flux2.PUBLISHED_TRANSFORMER_DEV``),
with their provenance in a comment beside the line that reads the file. Sequences are lists,
as ``from_pretrained`` gives them.

``shrink(config, **sizes)`` derives a config from another with the same keys (a smaller model
of the same structure: every tiny pipeline's models in ``diffusers_zero3.demo``). A family's
``published_parts`` and ``published_as`` (``base.Family``) turn these configs into its
``PublishedConfig``s."""

from __future__ import annotations

import copy
import json
from importlib import resources


def published_config(name: str) -> dict:
    """The published config ``name``: ``published/<name>.json`` beside this module, read anew
    each call (a fresh dict: the caller may change it). ``name`` is the file's path under
    ``published/`` without ``.json``, ``/``-separated.

    Example: ``published_config("flux2/transformer_dev")["num_single_layers"]`` is 48, and
    ``published_config("clip_vit_l14")["text_config"]`` is ``CLIP_L``'s keys.

    Raises:
        FileNotFoundError: no such file (a misspelt name).
    """
    path = resources.files(__package__).joinpath("published")
    *folders, stem = name.split("/")
    for folder in folders:
        path = path.joinpath(folder)
    return json.loads(path.joinpath(f"{stem}.json").read_text(encoding="utf-8"))


def shrink(config: dict, **sizes) -> dict:
    """A copy of ``config`` with ``sizes`` set: a dict given for a key whose value is a dict
    sets keys of that dict (``text_config=dict(hidden_size=16)`` keeps the other text keys).
    Every key set must be one ``config`` has (the structure is kept), so a misspelt size fails
    here rather than falling back to a library default."""
    unknown = sorted(set(sizes) - set(config))
    if unknown:
        raise KeyError(f"shrink sets only the config's own keys: it has no {', '.join(unknown)}")
    shrunk = copy.deepcopy(config)
    for key, value in sizes.items():
        if isinstance(value, dict) and isinstance(config[key], dict):
            value = shrink(config[key], **value)
        shrunk[key] = value
    return shrunk


# openai/clip-vit-large-patch14 (428 M; the planner's clip_score and aesthetic rewards): its text
# tower, CLIP-L, is SD's text encoder (SDXL's and SD3's first, Flux.1's pooled one)
CLIP_VIT_L14 = published_config("clip_vit_l14")
CLIP_L = CLIP_VIT_L14["text_config"]
CLIP_BIGG = published_config("clip_bigg")  # OpenCLIP ViT-bigG-14's text tower (SDXL's and SD3's second)
T5_XXL = published_config("t5_xxl")  # google/t5-v1_1-xxl's encoder (SD3's, Flux.1's, HiDream's)
# T5 v1.1's encoder keys that umT5 (Wan's text encoder) and ByT5 (HunyuanVideo 1.5's glyph encoder)
# share: 64-wide heads, gated-GELU feed-forward, untied embeddings
T5_V11_ENCODER = published_config("t5_v11_encoder")
VAE_SD = published_config("vae_sd")  # SD 1.x/2.x's and SDXL's AutoencoderKL
VAE_16 = published_config("vae_16")  # SD3's and Flux.1's: 16 latent channels, no quant convs
# The Qwen3 LLMs: 36 layers of 32 query heads of 128 for 4B and 8B
QWEN3_4B = published_config("qwen3_4b")  # Qwen/Qwen3-4B (Z-Image's, FLUX.2 [klein] 4B's): tied embeddings
QWEN3_8B = published_config("qwen3_8b")  # Qwen/Qwen3-8B (FLUX.2 [klein] 9B's)
# Qwen/Qwen3-VL-8B-Instruct (Ideogram 4 and NucleusMoE-Image's text encoder)
QWEN3_VL_8B = published_config("qwen3_vl_8b")
QWEN3_VL_4B = published_config("qwen3_vl_4b")  # Qwen/Qwen3-VL-4B-Instruct (Krea 2's): tied embeddings

# The reward models the planner sizes by name (``placement.rl_plan``: ``--reward pickscore``,
# ``--reward vlm:qwen2-vl-7b``): their published configs, the keys that set parameter shapes.
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K's config.json, which yuvalkirstain/PickScore_v1 shares and
# open_clip's ViT-H-14 (HPSv2's) gives (``rewards.hps.vit_h14_config``): 986 M parameters.
CLIP_VIT_H14 = published_config("clip_vit_h14")
# THUDM/ImageReward: BLIP's ViT-L/16 at 224 px (``BLIP_Pretrain(vit="large")``) and the text
# encoder of its med_config.json (BERT-base with a cross-attention to the image tokens in every
# layer, 30524 tokens: bert-base-uncased's and BLIP's [DEC] and [ENC])
BLIP_VIT_L16 = published_config("blip_vit_l16")
# as rewards.imagereward.text_config builds it from med_config.json: encoder_hidden_size is the
# ViT's width (BLIP_Pretrain sets encoder_width to it), is_decoder builds the cross-attention layers
IMAGEREWARD_TEXT = published_config("imagereward_text")
REWARD_HEAD = (768, 1024, 128, 64, 16, 1)  # the MLP of ImageReward and of LAION's aesthetic predictor
# Qwen/Qwen2-VL-7B-Instruct (HPSv3's base): 8.29 B; the vision config's hidden_size is the merger's
# output, the language model's width
QWEN2_VL_7B = published_config("qwen2_vl_7b")
