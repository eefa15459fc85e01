"""ImageReward (Xu et al. 2023, THUDM/ImageReward) on transformers' BLIP classes.

The authors' model (``ImageReward/ImageReward.py`` of the ``image-reward`` package): a BLIP
whose ViT (``blip.visual_encoder``, ViT-L/16 at 224 px) encodes the image and whose BERT text
encoder (``blip.text_encoder``, ``med.py``'s ``BertModel`` with a cross-attention to the image
tokens in every layer) reads the prompt; the text encoder's first-token ([CLS]) feature goes
through an MLP head (``mlp``), and the reward is ``(mlp - mean) / std`` with the published
constants (``REWARD_MEAN``, ``REWARD_STD``). ``ImageReward.score`` tokenizes the prompt with
``padding='max_length', truncation=True, max_length=35`` and preprocesses the image with
torchvision's ``Resize(224, BICUBIC)``, ``CenterCrop(224)``, ``ToTensor()`` and CLIP's
``Normalize``.

Here the ViT is a ``transformers.BlipVisionModel`` and the text encoder a
``transformers.BlipTextModel`` (cross-attention layers: ``is_decoder=True`` in its config,
run as an encoder); the published state dict is renamed to theirs at load time
(``convert_state_dict``). Neither the ``image-reward`` package nor timm or fairscale is
imported. The image preprocessing runs on the images' tensor and device
(``blip_pixel_values``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .builtin import AestheticHead
from .images import (
    CLIP_MEAN,
    CLIP_STD,
    check_images,
    check_prompts,
    normalize,
    pack_rows,
    resize_bicubic,
    shortest_edge_size,
    unpack_rows,
)

WEIGHTS_FILE = "ImageReward.pt"  # the published state dict of the whole ImageReward module
MED_CONFIG_FILE = "med_config.json"  # the published BERT (text encoder) config
BERT_TOKENIZER = "bert-base-uncased"  # what BLIP's init_tokenizer loads
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json")
PROMPT_MAX_LENGTH = 35  # ImageReward.score: padding='max_length', truncation=True, max_length=35
# ImageReward.__init__: the MLP output's mean and standard deviation
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
VISION_HEAD_DIM = 64  # BLIP's ViTs: base 768 / 12 heads, large 1024 / 16 heads
VISION_LAYER_NORM_EPS = 1e-6  # vit.py: partial(nn.LayerNorm, eps=1e-6)

# the published state dict's prefixes
_VISION_PREFIX = "blip.visual_encoder."
_TEXT_PREFIX = "blip.text_encoder."
_HEAD_PREFIX = "mlp."
_VISION_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK = re.compile(
    r"blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
)
_VISION_BLOCK_PARTS = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


# ``ImageReward.py``'s ``MLP`` is LAION's aesthetic head to the module names (linear layers and
# dropouts; its ReLUs are commented out there): the published ``mlp.*`` weights load into it.
ImageRewardHead = AestheticHead


# ------------------------------------------------------------------ preprocessing


def torchvision_center_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """The centre ``size x size`` of ``images`` with torchvision's ``CenterCrop`` offsets
    (``int(round((H - size) / 2))``, Python's rounding: half to even), which differ by one
    pixel from transformers' ``(H - size) // 2`` where ``H - size`` is odd and its half rounds
    up. The images must be at least ``size`` on both sides (``blip_pixel_values`` resizes
    them so)."""
    h, w = images.shape[-2:]
    if h < size or w < size:
        raise ValueError(f"cannot crop {size}x{size} out of {h}x{w} images")
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return images[..., top : top + size, left : left + size]


def blip_pixel_values(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """ImageReward's ``_transform(size)`` on ``images`` (``[B, 3, H, W]`` in ``[0, 1]``), on
    their device: the short side resized to ``size`` (bicubic, as Pillow's; see
    ``images.resize_bicubic``), the centre ``size x size`` (torchvision's offsets), CLIP's
    mean and std. Returns float32 ``[B, 3, size, size]``."""
    x = resize_bicubic(images, *shortest_edge_size(images.shape[-2], images.shape[-1], size))
    return normalize(torchvision_center_crop(x, size), CLIP_MEAN, CLIP_STD)


# ------------------------------------------------------------------ the published checkpoint


def convert_vision_key(key: str) -> str | None:
    """The ``BlipVisionModel`` name of a ``vit.py`` ``VisionTransformer`` key (without the
    ``blip.visual_encoder.`` prefix); None for a key it has no counterpart of."""
    if key in _VISION_TOP:
        return _VISION_TOP[key]
    match = _VISION_BLOCK.fullmatch(key)
    if match is None:
        return None
    layer, part, kind = match.groups()
    return f"encoder.layers.{layer}.{_VISION_BLOCK_PARTS[part]}.{kind}"


def convert_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Split and rename the published ``ImageReward.pt`` for our modules.

    Returns:
        ``{"vision": ..., "text": ..., "head": ...}``: the ``BlipVisionModel``,
        ``BlipTextModel`` and ``ImageRewardHead`` state dicts. BLIP's contrastive projections
        (``blip.vision_proj``, ``blip.text_proj``), the text encoder's ``position_ids`` buffer
        and any other key are left out: the authors load with ``strict=False`` and their
        score reads none of them. A key missing here is reported by ``load_state_dict``.

    Raises:
        ValueError: for a ViT key of no known counterpart (a ViT other than BLIP's).
    """
    out: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "text": {}, "head": {}}
    for key, value in state.items():
        if key.startswith(_VISION_PREFIX):
            name = convert_vision_key(key[len(_VISION_PREFIX) :])
            if name is None:
                raise ValueError(f"{WEIGHTS_FILE}: no BlipVisionModel counterpart of {key!r}")
            out["vision"][name] = value
        elif key.startswith(_TEXT_PREFIX) and not key.endswith("embeddings.position_ids"):
            out["text"][key[len(_TEXT_PREFIX) :]] = value
        elif key.startswith(_HEAD_PREFIX):
            out["head"][key[len(_HEAD_PREFIX) :]] = value
    return out


def vision_config(state: Mapping[str, torch.Tensor]) -> Any:
    """A ``BlipVisionConfig`` of the converted ViT weights: width, depth, MLP width, patch size
    and image size read from their shapes; heads ``width / 64`` (BLIP's ViTs); vit.py's
    LayerNorm eps and exact GELU."""
    from transformers import BlipVisionConfig

    width = int(state["embeddings.class_embedding"].shape[-1])
    patch = int(state["embeddings.patch_embedding.weight"].shape[-1])
    grid = math.isqrt(int(state["embeddings.position_embedding"].shape[1]) - 1)
    layers = len({k.split(".")[2] for k in state if k.startswith("encoder.layers.")})
    if width % VISION_HEAD_DIM:
        raise ValueError(
            f"{WEIGHTS_FILE}: a ViT width of {width} is not a multiple of BLIP's head size {VISION_HEAD_DIM}"
        )
    return BlipVisionConfig(
        hidden_size=width,
        intermediate_size=int(state["encoder.layers.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=layers,
        num_attention_heads=width // VISION_HEAD_DIM,
        image_size=grid * patch,
        patch_size=patch,
        hidden_act="gelu",
        layer_norm_eps=VISION_LAYER_NORM_EPS,
    )


def text_config(med: Mapping[str, Any], encoder_width: int) -> Any:
    """A ``BlipTextConfig`` of ``med_config.json``, its cross-attention reading image tokens of
    ``encoder_width`` (BLIP_Pretrain sets ``encoder_width`` to the ViT's width, over the
    file's value). ``is_decoder=True`` builds the cross-attention layers; the model is run as
    an encoder (``is_decoder=False`` in the forward), as ``med.py`` runs it."""
    from transformers import BlipTextConfig

    if med.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"{MED_CONFIG_FILE}: position_embedding_type {med['position_embedding_type']!r} is not supported"
        )
    if not med.get("add_cross_attention", False):
        raise ValueError(f"{MED_CONFIG_FILE}: ImageReward's text encoder needs add_cross_attention: true")
    return BlipTextConfig(
        vocab_size=med["vocab_size"],
        hidden_size=med["hidden_size"],
        encoder_hidden_size=encoder_width,
        intermediate_size=med["intermediate_size"],
        num_hidden_layers=med["num_hidden_layers"],
        num_attention_heads=med["num_attention_heads"],
        max_position_embeddings=med["max_position_embeddings"],
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12),
        hidden_dropout_prob=med.get("hidden_dropout_prob", 0.0),
        attention_probs_dropout_prob=med.get("attention_probs_dropout_prob", 0.0),
        pad_token_id=med.get("pad_token_id", 0),
        is_decoder=True,
        use_cache=False,
    )


def _load_module(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``model.load_state_dict(state, strict=True, assign=True)`` (the model built on the meta
    device), a mismatch as a ``ValueError``."""
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{WEIGHTS_FILE}: the {what} weights do not fit: {' '.join(str(e).split())}") from e


def _resolve_files(path: str | os.PathLike) -> tuple[Path, Path, str]:
    """``(weights, med_config, tokenizer source)`` of a local folder or hub id (see
    ``ImageRewardModel.from_pretrained``)."""
    folder = Path(path)
    if folder.is_dir():
        missing = [f for f in (WEIGHTS_FILE, MED_CONFIG_FILE) if not (folder / f).is_file()]
        if missing:
            raise ValueError(
                f"imagereward folder {folder} has no {' and no '.join(missing)} (it needs the published"
                f" {WEIGHTS_FILE} and {MED_CONFIG_FILE} of THUDM/ImageReward)"
            )
        has_tokenizer = any((folder / f).is_file() for f in TOKENIZER_FILES)
        return (
            folder / WEIGHTS_FILE,
            folder / MED_CONFIG_FILE,
            str(folder) if has_tokenizer else BERT_TOKENIZER,
        )
    if folder.exists():
        raise ValueError(
            f"imagereward weights {folder} is a file: give the folder holding {WEIGHTS_FILE} and {MED_CONFIG_FILE}"
        )
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError, RepositoryNotFoundError

    files = []
    for name in (WEIGHTS_FILE, MED_CONFIG_FILE):
        try:
            files.append(Path(hf_hub_download(str(path), name)))
        except (EntryNotFoundError, HFValidationError, RepositoryNotFoundError) as e:
            raise ValueError(
                f"imagereward weights {str(path)!r}: no folder here, and no {name} on the hub under that id"
                f" ({type(e).__name__})"
            ) from e
    return files[0], files[1], BERT_TOKENIZER


def load_blip_tokenizer(source: str | os.PathLike) -> Any:
    """BLIP's ``init_tokenizer``: ``BertTokenizer`` of ``source`` (bert-base-uncased's files)
    with ``[DEC]`` added as the bos token and ``[ENC]`` as an additional special token (ids
    30522 and 30523 on bert-base-uncased's vocab; already there when ``source`` was saved from
    BLIP's tokenizer)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(str(source))
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


# ------------------------------------------------------------------ the reward


class ImageRewardModel(nn.Module):
    """ImageReward's score of each (image, prompt) pair.

    Rows (``preprocess``): the prompt's token ids and attention mask (padded to 35 tokens) and
    the pixels, packed by ``images.pack_rows``. The forward runs the vision model, the text
    model (cross-attending to every image token) and the head, each through its own forward
    (so that a ZeRO-3 engine gathers their parameters).

    Args:
        vision: the ViT, a ``BlipVisionModel``.
        text: the text encoder, a ``BlipTextModel`` with cross-attention layers and no pooler.
        head: the MLP head.
        tokenizer: BLIP's tokenizer (``load_blip_tokenizer``).
        mean: the published mean of the head's output.
        std: the published standard deviation of the head's output.
    """

    name = "imagereward"

    def __init__(
        self,
        vision: nn.Module,
        text: nn.Module,
        head: ImageRewardHead,
        tokenizer: Any,
        mean: float = REWARD_MEAN,
        std: float = REWARD_STD,
    ):
        super().__init__()
        self.vision, self.text, self.head = vision, text, head
        self.tokenizer = tokenizer
        self.mean, self.std = float(mean), float(std)
        self.image_size = int(vision.config.image_size)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None) -> ImageRewardModel:
        """Load ImageReward from a local folder or a hub id (``THUDM/ImageReward``).

        The folder (or hub repository)::

            ImageReward.pt      the published state dict of the authors' whole ImageReward module
            med_config.json     the published text-encoder config (BLIP's med_config)
            vocab.txt ...       optional: bert-base-uncased's tokenizer files (vocab.txt,
                                tokenizer.json or tokenizer_config.json); without them (and
                                always for a hub id) the tokenizer is ``bert-base-uncased``
                                from the hub

        The tokenizer gets BLIP's added tokens (``load_blip_tokenizer``). The modules are built
        on the meta device and take the converted weights as they are (no random init of
        ~450 M parameters), in ``dtype`` (default: torch's default dtype, float32, as the
        authors' module).

        Raises:
            ValueError: a folder without ``ImageReward.pt`` or ``med_config.json`` (naming
                what is missing), an id that is neither a folder nor on the hub, or weights
                that do not fit the config.

        Not a collective; load inside ``zero3_init_disabled()`` to get the model whole.
        """
        from transformers import BlipTextModel, BlipVisionModel

        weights, med_file, tokenizer_source = _resolve_files(path)
        dtype = dtype or torch.get_default_dtype()
        state = torch.load(weights, map_location="cpu", weights_only=True)
        parts = {k: {n: t.to(dtype) for n, t in v.items()} for k, v in convert_state_dict(state).items()}
        del state
        missing = [p for p in ("vision", "text", "head") if not parts[p]]
        if missing:
            raise ValueError(
                f"{weights}: no {', '.join(missing)} weights (blip.visual_encoder.*, blip.text_encoder.*, mlp.*)"
            )
        vcfg = vision_config(parts["vision"])
        tcfg = text_config(json.loads(Path(med_file).read_text()), vcfg.hidden_size)
        with torch.device("meta"):
            vision = BlipVisionModel(vcfg)
            text = BlipTextModel(tcfg, add_pooling_layer=False)
            head = ImageRewardHead(int(parts["head"]["layers.0.weight"].shape[1]))
        _load_module(vision, parts["vision"], "vision (blip.visual_encoder)")
        _load_module(text, parts["text"], "text encoder (blip.text_encoder)")
        _load_module(head, parts["head"], "head (mlp)")
        # a non-persistent buffer, not in the weights: still on the meta device
        device = text.embeddings.word_embeddings.weight.device
        positions = torch.arange(tcfg.max_position_embeddings, device=device)
        text.embeddings.position_ids = positions.expand((1, -1))
        model = cls(vision, text, head, load_blip_tokenizer(tokenizer_source))
        return model.eval()

    def preprocess(self, images: torch.Tensor, prompts: Sequence[str] | None) -> torch.Tensor:
        """Packed rows ``[B, D]`` of ``images`` (float ``[B, 3, H, W]`` in ``[0, 1]``, on the
        accelerator's device) and ``prompts``, on the images' device."""
        check_images(images, self.name)
        check_prompts(self.name, images, prompts)
        if not len(images):
            return torch.zeros(0, 1, device=images.device)
        text = self.tokenizer(
            list(prompts),
            padding="max_length",
            truncation=True,
            max_length=PROMPT_MAX_LENGTH,
            return_tensors="pt",
        )
        ints = torch.cat([text["input_ids"], text["attention_mask"]], dim=1)
        pixels = blip_pixel_values(images, self.image_size)
        return pack_rows(ints, pixels.reshape(len(images), -1))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` (float32) of packed rows (``preprocess``):
        ``(head(text_encoder(prompt, image_tokens)[:, 0]) - mean) / std``."""
        ints, floats = unpack_rows(rows)
        length = ints.shape[1] // 2
        pixels = floats.reshape(len(rows), 3, self.image_size, self.image_size)
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        features = self.text(
            input_ids=ints[:, :length],
            attention_mask=ints[:, length:],
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
            is_decoder=False,
        ).last_hidden_state[:, 0]
        return (self.head(features).squeeze(-1).float() - self.mean) / self.std
