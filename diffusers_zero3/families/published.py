"""Published configs of components that several families share (CLIP-L, OpenCLIP bigG,
T5-XXL, the SD VAEs, Qwen3-4B and -8B, Qwen3-VL-4B and -8B), for the planner's
carried pipelines: only the keys that set parameter shapes (the others keep their library
defaults, which equal the published ones for shapes).

``shrink(config, **sizes)`` derives a config from another with the same keys (a smaller model
of the same structure: Qwen3-VL-4B from -8B here, every tiny pipeline's models in
``diffusers_zero3.demo``). A family's ``published_parts`` and ``published_as`` (``base.Family``)
turn these configs into its ``PublishedConfig``s."""

from __future__ import annotations

import copy


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


CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
)
CLIP_BIGG = dict(
    CLIP_L,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    projection_dim=1280,
    hidden_act="gelu",
)
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)
# T5 v1.1's encoder keys that umT5 (Wan's text encoder) and ByT5 (HunyuanVideo 1.5's glyph encoder)
# share: 64-wide heads, gated-GELU feed-forward, untied embeddings
T5_V11_ENCODER = dict(
    d_kv=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    tie_word_embeddings=False,
)
VAE_SD = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
)
VAE_16 = dict(VAE_SD, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
_QWEN3 = dict(  # the Qwen3 LLMs' shared keys (36 layers of 32 query heads of 128 for 4B and 8B)
    vocab_size=151936,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-06,
    rope_theta=1000000,
    attention_bias=False,
)
# Qwen/Qwen3-4B (Z-Image's and FLUX.2 [klein] 4B's text encoder): tied embeddings
QWEN3_4B = dict(_QWEN3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
QWEN3_8B = dict(_QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)  # klein 9B's
QWEN3_VL_8B = dict(  # Qwen/Qwen3-VL-8B-Instruct (Ideogram 4 and NucleusMoE-Image's text encoder)
    text_config=dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
        rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        rope_theta=5000000,
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
    ),
    tie_word_embeddings=False,
)
QWEN3_VL_4B = shrink(  # Qwen/Qwen3-VL-4B-Instruct (Krea 2's text encoder): tied embeddings
    QWEN3_VL_8B,
    text_config=dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
    vision_config=dict(
        depth=24,
        hidden_size=1024,
        intermediate_size=4096,
        out_hidden_size=2560,
        deepstack_visual_indexes=[5, 11, 17],
    ),
    tie_word_embeddings=True,
)

# The reward models the planner sizes by name (``placement.rl_plan``: ``--reward pickscore``,
# ``--reward vlm:qwen2-vl-7b``): their published configs, the keys that set parameter shapes.
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K's config.json, which yuvalkirstain/PickScore_v1 shares and
# open_clip's ViT-H-14 (HPSv2's) gives (``rewards.hps.vit_h14_config``): 986 M parameters.
CLIP_VIT_H14 = dict(
    text_config=dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_attention_heads=16,
        num_hidden_layers=24,
        max_position_embeddings=77,
        vocab_size=49408,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        projection_dim=1024,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=49407,
    ),
    vision_config=dict(
        hidden_size=1280,
        intermediate_size=5120,
        num_attention_heads=16,
        num_hidden_layers=32,
        image_size=224,
        patch_size=14,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        projection_dim=1024,
    ),
    projection_dim=1024,
)
CLIP_VIT_L14 = dict(  # openai/clip-vit-large-patch14 (CLIP-L's text tower is SD's text encoder): 428 M
    text_config=CLIP_L,
    vision_config=dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_attention_heads=16,
        num_hidden_layers=24,
        image_size=224,
        patch_size=14,
        hidden_act="quick_gelu",
        projection_dim=768,
    ),
    projection_dim=768,
)
# THUDM/ImageReward: BLIP's ViT-L/16 at 224 px (``BLIP_Pretrain(vit="large")``) and the text
# encoder of its med_config.json (BERT-base with a cross-attention to the image tokens in every
# layer, 30524 tokens: bert-base-uncased's and BLIP's [DEC] and [ENC])
BLIP_VIT_L16 = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=224,
    patch_size=16,
    hidden_act="gelu",
    layer_norm_eps=1e-6,
)
IMAGEREWARD_TEXT = dict(  # as rewards.imagereward.text_config builds it from med_config.json
    vocab_size=30524,
    hidden_size=768,
    encoder_hidden_size=1024,  # the ViT's width (BLIP_Pretrain sets encoder_width to it)
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=512,
    is_decoder=True,  # builds the cross-attention layers
)
REWARD_HEAD = (768, 1024, 128, 64, 16, 1)  # the MLP of ImageReward and of LAION's aesthetic predictor
QWEN2_VL_7B = dict(  # Qwen/Qwen2-VL-7B-Instruct (HPSv3's base): 8.29 B
    text_config=dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
    vision_config=dict(
        depth=32,
        embed_dim=1280,
        mlp_ratio=4,
        num_heads=16,
        hidden_size=3584,  # the merger's output: the language model's width
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
        hidden_act="quick_gelu",
    ),
    tie_word_embeddings=False,
)
