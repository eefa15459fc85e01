"""Published configs of components that several families share (CLIP-L, OpenCLIP bigG,
T5-XXL, the SD VAEs, Qwen3-VL-8B), for the planner's carried pipelines: only the keys that set parameter
shapes (the others keep their library defaults, which equal the published ones for shapes)."""

from __future__ import annotations

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
    vocab_size=49408,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    max_position_embeddings=77,
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
