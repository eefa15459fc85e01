"""HPSv2 / HPSv2.1 (Wu et al. 2023, tgxs002/HPSv2) as a ``transformers.CLIPModel``, without
open_clip.

The authors' ``hpsv2/img_score.py`` scores an (image, prompt) pair with an open_clip ViT-H-14
whose weights are their checkpoint (``torch.load(cp)['state_dict']``, hub repo ``xswu/HPSv2``,
``HPS_v2_compressed.pt`` for v2.0, their default, or ``HPS_v2.1_compressed.pt``):
``image_features @ text_features.T`` of ``encode_image`` / ``encode_text`` L2-normalised (the
model's forward with ``output_dict=True``), its diagonal: the cosine of the two embeddings,
without ``logit_scale``.

Its image transform is ``create_model_and_transforms(..., light_augmentation=True)``'s
``preprocess_val`` (their ``open_clip/transform.py``): ``ToTensor``, then ``ResizeMaxSize``
(the longest edge to the model's image size, 224, torchvision's bicubic on the float tensor,
the other edge ``round(edge * scale)``, then zero padding to a square, the odd pixel on the
bottom / right), then OpenAI CLIP's mean / std: not the shortest-edge resize and centre crop of
open_clip's usual eval transform, and not expressible as a CLIP processor config.
``hps_pixel_values`` does the same on the image tensor, on its device: torch's antialiased
bicubic is what torchvision's tensor ``resize`` calls (``antialias=True``, its default since
torchvision 0.17), unclamped as torchvision leaves a float tensor. One difference: an image
whose longest edge is already 224 but not square is padded here; the authors' transform
leaves it as it is and their model then refuses it.

The prompt goes through open_clip's ``SimpleTokenizer``, which ``CLIPTokenizer`` (the
tokenizer of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``) equals: the same BPE, ``<|endoftext|>``
the highest id, which both towers pool at (open_clip by ``argmax`` of the ids).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..families.published import CLIP_VIT_H14
from .builtin import ClipTextImageReward
from .images import CLIP_MEAN, CLIP_STD, ClipImageConfig, check_images

# the checkpoint files of the hub repo xswu/HPSv2 (hpsv2/utils.py's hps_version_map)
HPS_CHECKPOINTS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
HPS_DEFAULT_VERSION = "v2.0"  # img_score.py's score(..., hps_version="v2.0")
# where the tokenizer comes from when the model folder has none (open_clip's ViT-H-14 BPE)
HPS_TOKENIZER = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")


def vit_h14_config() -> Any:
    """The ``CLIPConfig`` of open_clip's ``ViT-H-14`` (``model_configs/ViT-H-14.json``: embed
    1024; vision 32 layers of width 1280, head width 80, patch 14 at 224; text 24 layers of
    width 1024, 16 heads, 77 positions, 49408 tokens; MLP ratio 4, exact GELU, LayerNorm eps
    1e-5), as ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``'s ``config.json`` gives it: the planner's
    ``families.published.CLIP_VIT_H14``."""
    from transformers import CLIPConfig

    return CLIPConfig(**copy.deepcopy(CLIP_VIT_H14))


# ------------------------------------------------------------------ open_clip -> CLIPModel

# open_clip's (OpenAI CLIP's) names outside the residual blocks -> CLIPModel's; None: transposed
_TOP_LEVEL = {
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
}
# [width, embed_dim] matrices that x is multiplied by on the right: nn.Linear weights transposed
_PROJECTIONS = {"text_projection": "text_projection.weight", "visual.proj": "visual_projection.weight"}
# one residual block's names -> CLIPEncoderLayer's (the fused in_proj is split below)
_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_BLOCK_KEY = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)$")


def _convert_block_key(key: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The CLIPModel entries of one residual-block entry (None: not one)."""
    match = _BLOCK_KEY.match(key)
    if match is None:
        return None
    visual, index, module, kind = match.groups()
    prefix = f"{'vision_model' if visual else 'text_model'}.encoder.layers.{index}."
    if module in _BLOCK:
        return {f"{prefix}{_BLOCK[module]}.{kind}": value}
    return None


def _convert_in_proj(key: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """``attn.in_proj_weight`` / ``in_proj_bias`` (q, k, v stacked on dim 0) as the three
    projections of ``CLIPAttention`` (None: not one)."""
    match = re.match(r"^(visual\.)?transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)$", key)
    if match is None:
        return None
    visual, index, kind = match.groups()
    prefix = f"{'vision_model' if visual else 'text_model'}.encoder.layers.{index}.self_attn."
    q, k, v = value.chunk(3, dim=0)
    return {f"{prefix}q_proj.{kind}": q, f"{prefix}k_proj.{kind}": k, f"{prefix}v_proj.{kind}": v}


def _listed(items: Sequence[str], limit: int = 8) -> str:
    """The first ``limit`` of ``items``, comma-separated, and how many more there are."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def open_clip_to_clip_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``transformers.CLIPModel`` state dict of an open_clip (OpenAI-layout) CLIP's.

    Args:
        state: an open_clip ``CLIP.state_dict()`` (what HPSv2's ``checkpoint['state_dict']`` is).

    Returns:
        The same tensors under CLIPModel's names (the projections transposed, each fused
        attention input projection split into q, k, v).

    Raises:
        ValueError: naming the keys that have no CLIPModel counterpart (another architecture,
            e.g. a custom text tower, or a prefix such as ``module.``).
    """
    out: dict[str, torch.Tensor] = {}
    unconverted = []
    for key, value in state.items():
        if key in _TOP_LEVEL:
            out[_TOP_LEVEL[key]] = value
        elif key in _PROJECTIONS:
            out[_PROJECTIONS[key]] = value.t().contiguous()
        else:
            converted = _convert_in_proj(key, value) or _convert_block_key(key, value)
            if converted is None:
                unconverted.append(key)
            else:
                out.update(converted)
    if unconverted:
        raise ValueError(
            f"the HPSv2 checkpoint has keys that do not convert to a CLIPModel (not open_clip's"
            f" OpenAI-layout CLIP): {_listed(unconverted)}"
        )
    return out


def check_clip_state_dict(state: Mapping[str, torch.Tensor], config: Any) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the parameters of a ``CLIPModel`` of
    ``config``, each of its shape (checked against the model built on the meta device)."""
    from transformers import CLIPModel

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in CLIPModel(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k} {tuple(state[k].shape)} (the config's {expected[k]})"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listed(unexpected)}")
    if shapes:
        problems.append(f"shapes {_listed(shapes, 4)}")
    if problems:
        raise ValueError(
            "the HPSv2 checkpoint does not fit the CLIP config (ViT-H-14 unless the folder has a"
            f" config.json): {'; '.join(problems)}"
        )


# ------------------------------------------------------------------ images


def resize_longest_and_pad(images: torch.Tensor, size: int) -> torch.Tensor:
    """HPSv2's ``ResizeMaxSize(size, fill=0)`` on ``[B, C, H, W]`` floats: the longest edge
    resized to ``size`` (torchvision's tensor bicubic: torch's with ``antialias=True``, not
    clamped), the other to ``round(edge * scale)``, then zeros around it to ``size x size``
    (``pad // 2`` on the top / left, the rest on the bottom / right).

    Returns:
        ``[B, C, size, size]`` float32 on the images' device.
    """
    x = images.float()
    h, w = x.shape[-2:]
    scale = size / float(max(h, w))
    if scale != 1.0:
        new_h, new_w = round(h * scale), round(w * scale)
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    pad_h, pad_w = size - x.shape[-2], size - x.shape[-1]
    return F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)


# ------------------------------------------------------------------ the reward


class HPSv2(ClipTextImageReward):
    """HPSv2: ``cos(text_embedding, image_embedding)`` per pair of an open_clip ViT-H-14
    fine-tuned on human preferences (``img_score.py``: the diagonal of
    ``image_features @ text_features.T`` of normalised features, no ``logit_scale``).

    Rows as ``ClipTextImageReward``'s; the pixels are HPSv2's (``resize_longest_and_pad``, then
    the OpenAI mean / std: ``image_config`` is a centre crop of the model's image size, a
    no-op on the padded square, and the normalisation).

    Args:
        clip: the converted CLIP model.
        tokenizer: its ``CLIPTokenizer``.
        mean: per-channel mean (OpenAI CLIP's, as the authors' transform).
        std: per-channel standard deviation.
    """

    name = "hpsv2"

    def __init__(
        self,
        clip: torch.nn.Module,
        tokenizer: Any,
        mean: Sequence[float] = CLIP_MEAN,
        std: Sequence[float] = CLIP_STD,
    ):
        size = int(clip.config.vision_config.image_size)
        image_config = ClipImageConfig(
            shortest_edge=None, crop=(size, size), mean=tuple(mean), std=tuple(std)
        )
        super().__init__(clip, tokenizer, image_config)
        self.image_size = size

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None) -> HPSv2:
        """Load HPSv2 from a folder, a checkpoint file or a hub id.

        ``path`` is one of:

        * a folder holding ``HPS_v2_compressed.pt`` or ``HPS_v2.1_compressed.pt`` (one of
          them: the published format, ``{'state_dict': open_clip CLIP state dict}``), and
          optionally ``config.json`` (a ``CLIPConfig``; default ``vit_h14_config()``) and a
          ``CLIPTokenizer``'s files (default the tokenizer of
          ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, open_clip's BPE);
        * that checkpoint file itself (its folder read for the optional files);
        * a hub id: ``xswu/HPSv2`` (HPSv2.0, ``HPS_v2_compressed.pt``, the authors' default)
          or ``xswu/HPSv2/HPS_v2.1_compressed.pt`` (a file of the repo: HPSv2.1).

        Not a collective; load inside ``zero3_init_disabled()`` to get the model whole.

        Raises:
            ValueError: no checkpoint (or two) in the folder, no ``state_dict`` in it, keys
                that do not convert, or a config that does not fit them.
        """
        from transformers import AutoTokenizer, CLIPConfig, CLIPModel

        checkpoint, folder = resolve_checkpoint(path)
        state = load_open_clip_state(checkpoint)
        converted = open_clip_to_clip_state_dict(state)
        has_config = folder is not None and (folder / "config.json").is_file()
        config = CLIPConfig.from_pretrained(folder) if has_config else vit_h14_config()
        check_clip_state_dict(converted, config)
        # float32 unless asked: img_score.py's weights are float32 (under autocast), whatever the file's
        clip = CLIPModel.from_pretrained(
            None, config=config, state_dict=converted, dtype=dtype or torch.float32
        )
        has_tokenizer = folder is not None and any((folder / f).is_file() for f in _TOKENIZER_FILES)
        tokenizer_path = folder if has_tokenizer else HPS_TOKENIZER
        return cls(clip.eval(), AutoTokenizer.from_pretrained(tokenizer_path))

    def preprocess(self, images: torch.Tensor, prompts: Sequence[str] | None) -> torch.Tensor:
        """Packed rows ``[B, D]`` of ``images`` (float ``[B, 3, H, W]`` in ``[0, 1]``, on the
        accelerator's device) and ``prompts``, on the images' device."""
        check_images(images, self.name)
        if len(images):
            images = resize_longest_and_pad(images, self.image_size)
        return super().preprocess(images, prompts)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` of packed rows (``preprocess``): cosines in ``[-1, 1]``."""
        out = self.clip_output(rows)
        return (out.image_embeds * out.text_embeds).sum(-1)


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """``(checkpoint file, folder of the optional files or None)`` of ``from_pretrained``'s
    ``path`` (a folder, a checkpoint file, ``owner/repo`` or ``owner/repo/file.pt`` on the hub).

    Raises:
        ValueError: a folder with no published checkpoint name, or with both.
    """
    local = Path(path)
    names = tuple(HPS_CHECKPOINTS.values())
    if local.is_dir():
        found = [name for name in names if (local / name).is_file()]
        if len(found) != 1:
            other = sorted(p.name for p in local.glob("*.pt"))
            what = "both" if found else f"neither (its *.pt: {', '.join(other) or 'none'})"
            raise ValueError(
                f"hpsv2 reward folder {local} must hold one checkpoint, {' or '.join(names)}; it holds {what}"
                + (": pass the checkpoint file itself" if found else "")
            )
        return local / found[0], local
    if local.is_file():
        return local, local.parent
    parts = str(path).split("/")
    if len(parts) in (2, 3) and all(parts) and not str(path).startswith((".", "/", "~")):
        filename = parts[2] if len(parts) == 3 else HPS_CHECKPOINTS[HPS_DEFAULT_VERSION]
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download("/".join(parts[:2]), filename)), None
    raise ValueError(
        f"hpsv2 reward weights {path!r}: not a folder, a checkpoint file, or a hub id (xswu/HPSv2 or"
        f" xswu/HPSv2/{HPS_CHECKPOINTS['v2.1']})"
    )


def load_open_clip_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """``torch.load(checkpoint)['state_dict']`` (on the CPU, tensors only), as ``img_score.py``
    reads it; ``ValueError`` when it has no ``state_dict``."""
    loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = loaded.get("state_dict") if isinstance(loaded, Mapping) else None
    if not isinstance(state, Mapping):
        keys = ", ".join(map(str, list(loaded)[:5])) if isinstance(loaded, Mapping) else type(loaded).__name__
        raise ValueError(
            f"HPSv2 checkpoint {checkpoint} has no 'state_dict' (the published format is"
            f" {{'state_dict': open_clip state dict}}); it holds {keys}"
        )
    return dict(state)
