"""The embedded default: tiny SD, SDXL, SD3 and Flux.1-architecture pipelines and a captioned
shapes dataset, all generated locally (no model hub, no network; tokenizers written here).

The pipeline has the real classes (``UNet2DConditionModel``, ``AutoencoderKL``,
``CLIPTextModel``, ``CLIPTokenizer``, ``DDPMScheduler``) built small from configs, and is saved
as an ordinary diffusers folder, so every loading path the package has (``from_pretrained``
of a folder) is exercised on it.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 30),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 40),
}
SHAPES = ("circle", "square")
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 / CLIP byte-level alphabet: every byte maps to a printable unicode character.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def write_clip_tokenizer(folder: str | os.PathLike) -> Path:
    """Write a byte-level CLIP tokenizer (no merges) to ``folder`` and return the path.

    Every byte is a token (with and without the ``</w>`` end-of-word suffix), so any text
    tokenizes; with an empty merges file words become sequences of characters.
    """
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + list(SPECIAL_TOKENS)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    tok.save_pretrained(folder)
    return folder


def _local_clip_tokenizer(folder: Path):
    """A byte-level ``CLIPTokenizer`` written under ``folder`` and read back (the folder it
    was written to is removed: the pipeline saves its own copy)."""
    import shutil

    from transformers import CLIPTokenizer

    tok_dir = write_clip_tokenizer(folder / "_tokenizer_tmp")
    try:
        return CLIPTokenizer.from_pretrained(tok_dir)
    finally:
        shutil.rmtree(tok_dir)


def tiny_component_configs(
    width: int = 32, text_layers: int = 2, cross_dim: int | None = None
) -> dict[str, dict]:
    """Configs of a tiny SD-style UNet, VAE and CLIP text encoder.

    ``width`` scales every model (32 gives a pipeline of about 1M parameters that trains on a
    CPU in seconds; 256 gives tens of millions, for benchmarks).
    """
    cross_dim = cross_dim or width
    vocab_size = 256 * 2 + len(SPECIAL_TOKENS)
    return {
        "unet": dict(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(width, width * 2),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=cross_dim,
            attention_head_dim=max(1, width // 8),
            norm_num_groups=min(32, width // 2),
        ),
        "vae": dict(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(width, width * 2),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=min(32, width // 2),
            sample_size=32,
        ),
        "text_encoder": dict(
            vocab_size=vocab_size,
            hidden_size=cross_dim,
            intermediate_size=cross_dim * 2,
            num_hidden_layers=text_layers,
            num_attention_heads=max(1, cross_dim // 16),
            max_position_embeddings=77,
            bos_token_id=vocab_size - 2,
            eos_token_id=vocab_size - 1,
            pad_token_id=vocab_size - 1,
        ),
    }


def build_tiny_components(
    seed: int = 0, width: int = 32, text_layers: int = 2, cross_dim: int | None = None
) -> dict:
    """Build the tiny UNet, VAE and text encoder (whole, ordinary modules) from configs."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from .zero3 import zero3_init_disabled

    cfg = tiny_component_configs(width, text_layers, cross_dim)
    with zero3_init_disabled():
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**cfg["unet"])
        vae = AutoencoderKL(**cfg["vae"])
        text_encoder = CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"]))
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder}


def save_tiny_pipeline(
    folder: str | os.PathLike, seed: int = 0, width: int = 32, text_layers: int = 2
) -> Path:
    """Save a tiny ``StableDiffusionPipeline`` folder (fp32 safetensors) and return its path.

    Not a collective: call it on one rank (or before launching) and share the folder.
    """
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    folder = Path(folder)
    parts = build_tiny_components(seed, width, text_layers)
    tokenizer = _local_clip_tokenizer(folder)
    scheduler = DDPMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        num_train_timesteps=1000,
        steps_offset=1,
        clip_sample=False,
    )
    pipe = StableDiffusionPipeline(
        unet=parts["unet"],
        vae=parts["vae"],
        text_encoder=parts["text_encoder"],
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_sdxl_pipeline(folder: str | os.PathLike, seed: int = 0, width: int = 32) -> Path:
    """Save a tiny ``StableDiffusionXLPipeline`` folder (fp32 safetensors) and return its path.

    The real SDXL layout: a ``text_time`` UNet conditioned on two CLIP encoders (the second
    with a projection, whose pooled output is ``text_embeds``), two tokenizers, a VAE and an
    Euler scheduler, with the shapes of diffusers' own SDXL pipeline tests. Not a collective.
    """
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from .zero3 import zero3_init_disabled

    folder = Path(folder)
    cfg = tiny_component_configs(width)
    text_cfg = {**cfg["text_encoder"], "hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4}
    time_dim, proj_dim = 8, 32
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
        vae = AutoencoderKL(**cfg["vae"])
        text_encoder = CLIPTextModel(CLIPTextConfig(**text_cfg))
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**text_cfg, projection_dim=proj_dim))
    tokenizer = _local_clip_tokenizer(folder)
    scheduler = EulerDiscreteScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


T5_WORDS = ("a", "an", "the", "of", "photo", "picture", "shape", *COLOURS, *SHAPES)


def write_t5_tokenizer(folder: str | os.PathLike, model_max_length: int = 512) -> Path:
    """Write a small unigram T5 tokenizer to ``folder`` and return the path.

    The vocabulary is T5's three special tokens, every lowercase letter, digit and common
    punctuation mark (alone and with the ``▁`` word-start marker, so any ASCII text
    tokenizes), upper-case letters, and whole words for the default captions.
    """
    import string

    from transformers import T5TokenizerFast

    folder = Path(folder)
    chars = string.ascii_lowercase + string.digits + ",.!?'-:;()"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + c, -3.0) for c in chars]
    pieces += [(c, -4.0) for c in chars + string.ascii_uppercase]
    pieces += [("\u2581" + w, -1.0) for w in T5_WORDS]
    tok = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
    tok.save_pretrained(folder)
    return folder


def _local_t5_tokenizer(folder: Path):
    import shutil

    from transformers import AutoTokenizer

    tok_dir = write_t5_tokenizer(folder / "_t5_tokenizer_tmp")
    try:
        return AutoTokenizer.from_pretrained(tok_dir)
    finally:
        shutil.rmtree(tok_dir)


def _tiny_t5_encoder(d_model: int, vocab_size: int, layers: int = 2):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_kv=8,
            d_ff=d_model * 2,
            num_layers=layers,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def _tiny_clip_config(projection_dim: int = 32) -> dict:
    cfg = tiny_component_configs(32)["text_encoder"]
    return {
        **cfg,
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_attention_heads": 4,
        "projection_dim": projection_dim,
    }


def _flow_vae(latent_channels: int, width: int = 32):
    from diffusers import AutoencoderKL

    cfg = tiny_component_configs(width)["vae"]
    return AutoencoderKL(
        **{**cfg, "latent_channels": latent_channels},
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )


def save_tiny_flux_pipeline(folder: str | os.PathLike, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """Save a tiny ``FluxPipeline`` folder (fp32 safetensors) and return its path.

    Flux.1's layout with small shapes: a ``FluxTransformer2DModel`` (double- and single-stream
    blocks, 2x2-packed latents, rotary ``img_ids``/``txt_ids``, guidance embedding when
    ``guidance_embeds``) conditioned on CLIP's pooled output and a T5 encoder's hidden states
    (``text_encoder_2``, with a locally written unigram tokenizer), a 16-channel-latent VAE
    with ``shift_factor`` and a flow-matching Euler scheduler. Not a collective.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from .zero3 import zero3_init_disabled

    folder = Path(folder)
    t5_tokenizer = _local_t5_tokenizer(folder)
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
        text_encoder = CLIPTextModel(CLIPTextConfig(**_tiny_clip_config()))
        text_encoder_2 = _tiny_t5_encoder(32, len(t5_tokenizer))
        vae = _flow_vae(16)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_local_clip_tokenizer(folder),
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_sd3_pipeline(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny ``StableDiffusion3Pipeline`` folder (fp32 safetensors) and return its path.

    SD3's layout with small shapes: an ``SD3Transformer2DModel`` conditioned on two CLIP
    encoders with projections (pooled outputs concatenated) and a T5 encoder
    (``text_encoder_3``, whose width the CLIP states are padded to), a VAE with
    ``shift_factor`` and a flow-matching Euler scheduler. Not a collective.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from .zero3 import zero3_init_disabled

    folder = Path(folder)
    t5_width = 64  # >= the two CLIP widths together (32 + 32), as in SD3 (2048 <= 4096)
    t5_tokenizer = _local_t5_tokenizer(folder)
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
        text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**_tiny_clip_config()))
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**_tiny_clip_config()))
        text_encoder_3 = _tiny_t5_encoder(t5_width, len(t5_tokenizer))
        vae = _flow_vae(4)
    clip_tokenizer = _local_clip_tokenizer(folder)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def shape_image(
    colour: str, shape: str, size: int = 32, rng: random.Random | None = None, width: int | None = None
):
    """A ``width`` (default ``size``) x ``size`` RGB PIL image of one coloured shape on a light
    background."""
    from PIL import Image, ImageDraw

    rng = rng or random.Random(0)
    width = width or size
    img = Image.new("RGB", (width, size), (235, 235, 235))
    draw = ImageDraw.Draw(img)
    r = rng.randint(min(width, size) // 4, min(width, size) // 3)
    cx, cy = rng.randint(r, width - r), rng.randint(r, size - r)
    box = (cx - r, cy - r, cx + r, cy + r)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
    return img


def write_shapes_dataset(
    folder: str | os.PathLike,
    num_images: int = 64,
    size: int = 32,
    seed: int = 0,
    sizes: list[tuple[int, int]] | None = None,
) -> Path:
    """Write an ``imagefolder`` dataset of coloured shapes with ``metadata.jsonl`` captions.

    Captions read like "a red circle"; the folder loads with
    ``datasets.load_dataset("imagefolder", data_dir=folder)`` (columns ``image`` and ``text``).
    Images are ``size`` x ``size``, or take their (width, height) in turn from ``sizes``
    (varied sizes exercise SDXL's size and crop conditioning).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(num_images):
        colour = rng.choice(sorted(COLOURS))
        shape = rng.choice(SHAPES)
        name = f"{i:05d}.png"
        width, height = sizes[i % len(sizes)] if sizes else (size, size)
        shape_image(colour, shape, height, rng, width=width).save(folder / name)
        rows.append({"file_name": name, "text": f"a {colour} {shape}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


VARIED_SIZES = [(32, 32), (48, 32), (32, 40), (56, 40), (40, 64)]


TINY_PIPELINES = {
    "sdxl": save_tiny_sdxl_pipeline,
    "flux": save_tiny_flux_pipeline,
    "sd3": save_tiny_sd3_pipeline,
}
MODELS = ("sd", *TINY_PIPELINES)


def prepare_default(folder: str | os.PathLike, num_images: int = 64, model: str = "sd") -> tuple[Path, Path]:
    """Create (once) the default runs' pipeline, dataset and reward model under ``folder``.

    Returns the pipeline and dataset paths; the reward model is ``folder/redness-reward``.
    ``model="sdxl"`` makes a tiny SDXL pipeline (``tiny-sdxl``) and a dataset of varied image
    sizes (``shapes-varied``) instead; ``"flux"`` and ``"sd3"`` make tiny Flux.1 and SD3
    pipelines (``tiny-flux``, ``tiny-sd3``) beside the shapes dataset.
    """
    folder = Path(folder)
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if model == "sdxl":
        pipe, data = folder / "tiny-sdxl", folder / "shapes-varied"
        if not (data / "metadata.jsonl").exists():
            write_shapes_dataset(data, num_images=num_images, sizes=VARIED_SIZES)
    else:
        pipe, data = folder / f"tiny-{model}", folder / "shapes"
        if not (data / "metadata.jsonl").exists():
            write_shapes_dataset(data, num_images=num_images)
    if not (pipe / "model_index.json").exists():
        TINY_PIPELINES.get(model, save_tiny_pipeline)(pipe)
    reward = folder / "redness-reward"
    if model == "sd" and not (reward / "config.json").exists():
        save_reward_model(reward)
    return pipe, data


def write_preference_dataset(
    folder: str | os.PathLike, num_pairs: int = 64, seed: int = 0, ties: int = 4
) -> Path:
    """Write a Pick-a-Pic-style preference dataset (one parquet file) and return its folder.

    Each pair is a caption ("a red circle") with an image that matches it and one of the
    same shape in a wrong colour; ``label_0`` says which of ``jpg_0``/``jpg_1`` (PNG bytes)
    is the matching one, at random. ``ties`` more rows have ``label_0`` 0.5 (dropped by
    training, as upstream). Loads with ``datasets.load_dataset(folder)``.
    """
    import io

    import datasets

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = {"jpg_0": [], "jpg_1": [], "label_0": [], "caption": []}
    for i in range(num_pairs + ties):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        wrong = rng.choice([c for c in sorted(COLOURS) if c != colour])
        good, bad = (shape_image(c, shape, 32, random.Random(f"{seed}-{i}")) for c in (colour, wrong))
        label = 0.5 if i >= num_pairs else float(rng.random() < 0.5)
        first, second = (good, bad) if label != 0 else (bad, good)
        for column, image in (("jpg_0", first), ("jpg_1", second)):
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            rows[column].append(buf.getvalue())
        rows["label_0"].append(label)
        rows["caption"].append(f"a {colour} {shape}")
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    return folder


def _reward_model_class():
    from diffusers import ModelMixin
    from diffusers.configuration_utils import ConfigMixin, register_to_config

    class RednessRewardModel(ModelMixin, ConfigMixin):
        """A small reward model that scores how red an image is (images in [-1, 1], NCHW).

        ``redness = mean(R - (G + B) / 2)`` plus ``feature_scale`` times a learned-looking
        term from a small conv net (random weights), so that the model has parameters worth
        sharding while its score stays visible. Saves and loads like any diffusers model.
        """

        @register_to_config
        def __init__(self, hidden: int = 64, layers: int = 3, feature_scale: float = 0.1):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, hidden, 3, padding=1)
            self.blocks = torch.nn.ModuleList(
                torch.nn.Conv2d(hidden, hidden, 3, padding=1) for _ in range(layers)
            )
            self.head = torch.nn.Linear(hidden, 1)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            redness = (images[:, 0] - 0.5 * (images[:, 1] + images[:, 2])).mean(dim=(1, 2))
            h = torch.nn.functional.silu(self.stem(images))
            for block in self.blocks:
                h = torch.nn.functional.silu(block(h))
            features = torch.tanh(self.head(h.mean(dim=(2, 3)))).squeeze(-1)
            return redness.float() + self.config.feature_scale * features.float()

    return RednessRewardModel


def __getattr__(name: str):
    # Built on first use, so that importing this module does not import diffusers.
    if name == "RednessRewardModel":
        cls = _reward_model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def save_reward_model(folder: str | os.PathLike, seed: int = 0, hidden: int = 64, layers: int = 3) -> Path:
    """Save a ``RednessRewardModel`` (random conv weights from ``seed``) to ``folder``."""
    from .zero3 import zero3_init_disabled

    with zero3_init_disabled():
        torch.manual_seed(seed)
        model = __getattr__("RednessRewardModel")(hidden=hidden, layers=layers)
    model.save_pretrained(folder)
    return Path(folder)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Generate the embedded default's pipeline and data.")
    parser.add_argument("folder", nargs="?", default="outputs/default")
    parser.add_argument("--model", default="sd", choices=MODELS)
    parser.add_argument(
        "--preferences", action="store_true", help="also a preference dataset (make train-dpo)"
    )
    cli = parser.parse_args()
    p, d = prepare_default(cli.folder, model=cli.model)
    print(f"pipeline: {p}\ndataset: {d}")
    if cli.preferences and not (Path(cli.folder) / "preferences").exists():
        print(f"preferences: {write_preference_dataset(Path(cli.folder) / 'preferences')}")
