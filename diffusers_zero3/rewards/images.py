"""Image preprocessing of the built-in rewards on tensors, and the packed rows a reward model
takes from ``ParallelReward``.

Every built-in takes the images as a float tensor ``[B, 3, H, W]`` in ``[0, 1]`` on the
accelerator's device (what a VAE decode gives after ``(x / 2 + 0.5).clamp(0, 1)``) and does its
processor's work on that tensor, on its device: no PIL round trip, no copy to the host, and a
graph from the scores back to the pixels (for a differentiable reward).

The resize is torch's bicubic with ``antialias=True``, the kernel torch ported from Pillow
(``a = -0.5``, support widened when shrinking), clamped to ``[0, 1]`` as Pillow's 8-bit result
is: transformers' PIL processors resize a uint8 image with Pillow's bicubic. The two agree to
about one 8-bit level where a resize happens; at the processor's own size nothing is resized
and the pixels are the processor's to float rounding.

``ParallelReward`` splits one tensor into micro-batches and casts a floating one to the reward
model's dtype (fp32 for the built-ins whatever the run's dtype; the ``vlm`` judge and a
``module:Class`` model in the run's, bf16 in a bf16 run). A reward whose model needs tokens beside the pixels packs
them into that tensor (``pack_rows``): each integer as three base-256 digits, which every float
format here holds exactly (bf16 holds integers up to 256), so a row keeps its tokens through
the cast, through the micro-batch split, and when it is borrowed by a rank with no samples as
the dummy of a padding call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# OpenAI CLIP's normalisation (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD), the default of
# CLIP's and Qwen2-VL's image processors.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_DIGITS = 3  # base-256 digits per packed integer: 0 <= value < 2**24
_BASE = 256


def check_images(images: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` unless ``images`` is a float tensor ``[B, 3, H, W]``.

    Args:
        images: the batch a reward is called with.
        name: the reward's name, for the message.
    """
    if not torch.is_tensor(images) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(
            f"reward '{name}' takes images as a float tensor [B, 3, H, W] in [0, 1], got {shape}"
        )
    if not images.is_floating_point():
        raise ValueError(f"reward '{name}' takes float images in [0, 1], got dtype {images.dtype}")


def check_prompts(
    name: str, samples: torch.Tensor, prompts: Sequence[str] | None, noun: str = "image"
) -> list[str]:
    """``prompts`` as a list, or ``ValueError`` unless there is one prompt per sample.

    Args:
        name: the reward's name, for the message.
        samples: the batch a reward is called with (images or clips).
        prompts: the prompts it was given.
        noun: what one sample is, for the message (``image``, ``clip``).
    """
    if prompts is None or len(prompts) != len(samples):
        got = "no prompts" if prompts is None else f"{len(prompts)} prompts"
        raise ValueError(f"reward '{name}' needs one prompt per {noun}: got {len(samples)} {noun}s and {got}")
    return list(prompts)


def resize_bicubic(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``images`` resized to ``height x width`` as Pillow's bicubic does (see the module
    docstring); the images themselves when they already have that size.

    Args:
        images: ``[B, C, H, W]`` floats in ``[0, 1]``.
        height: the output height.
        width: the output width.

    Returns:
        ``[B, C, height, width]`` in ``[0, 1]``, float32.
    """
    images = images.float()
    if tuple(images.shape[-2:]) == (height, width):
        return images
    out = F.interpolate(images, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp(0.0, 1.0)


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(images - mean) / std`` per channel, on the images' device."""
    m = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - m) / s


def _edge_pair(value: Any) -> tuple[int, int] | None:
    """``(height, width)`` of a processor's ``crop_size`` (a dict or an int), None if unset."""
    if value is None:
        return None
    if isinstance(value, int):
        return value, value
    return int(value["height"]), int(value["width"])


@dataclass(frozen=True)
class ClipImageConfig:
    """What ``CLIPImageProcessor`` does to an image: resize the shortest edge to
    ``shortest_edge`` (or to ``height x width``), crop the centre, normalise.

    Attributes:
        shortest_edge: the shortest edge after the resize (None: ``resize_to`` or no resize).
        resize_to: ``(height, width)`` of a processor whose ``size`` is a fixed size.
        crop: ``(height, width)`` of the centre crop (None: no crop).
        mean: per-channel mean.
        std: per-channel standard deviation.
        do_normalize: whether to normalise.
    """

    shortest_edge: int | None = 224
    resize_to: tuple[int, int] | None = None
    crop: tuple[int, int] | None = (224, 224)
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    do_normalize: bool = True

    @classmethod
    def from_processor_dict(cls, cfg: Mapping[str, Any]) -> ClipImageConfig:
        """From a CLIP image processor's ``preprocessor_config.json`` (as a dict)."""
        size = cfg.get("size", {"shortest_edge": 224}) if cfg.get("do_resize", True) else None
        shortest = resize_to = None
        if isinstance(size, int):
            shortest = size
        elif isinstance(size, Mapping) and "shortest_edge" in size:
            shortest = int(size["shortest_edge"])
        elif isinstance(size, Mapping):
            resize_to = (int(size["height"]), int(size["width"]))
        crop = _edge_pair(cfg.get("crop_size", 224)) if cfg.get("do_center_crop", True) else None
        return cls(
            shortest_edge=shortest,
            resize_to=resize_to,
            crop=crop,
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
            std=tuple(cfg.get("image_std", CLIP_STD)),
            do_normalize=cfg.get("do_normalize", True),
        )

    def to_processor_dict(self) -> dict[str, Any]:
        """A ``preprocessor_config.json`` (as a dict) of a CLIP image processor doing these steps."""
        size = {"shortest_edge": self.shortest_edge} if self.shortest_edge is not None else None
        if self.resize_to is not None:
            size = {"height": self.resize_to[0], "width": self.resize_to[1]}
        crop = {"height": self.crop[0], "width": self.crop[1]} if self.crop is not None else None
        return {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": size is not None,
            "size": size,
            "resample": 3,  # bicubic
            "do_center_crop": crop is not None,
            "crop_size": crop,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": self.do_normalize,
            "image_mean": list(self.mean),
            "image_std": list(self.std),
            "do_convert_rgb": True,
        }

    def output_size(self) -> tuple[int, int] | None:
        """``(height, width)`` of every processed image, when fixed."""
        return self.crop or self.resize_to


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """The size transformers' ``get_resize_output_image_size(default_to_square=False)`` gives:
    the short edge ``shortest_edge``, the long one ``int(shortest_edge * long / short)``."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The centre ``height x width`` of ``images``, with transformers' offsets
    (``(H - height) // 2``); raises ``ValueError`` for images smaller than the crop (the
    processor would pad them: resize them first)."""
    h, w = images.shape[-2:]
    if h < height or w < width:
        raise ValueError(f"cannot crop {height}x{width} out of {h}x{w} images")
    top, left = (h - height) // 2, (w - width) // 2
    return images[..., top : top + height, left : left + width]


def clip_pixel_values(images: torch.Tensor, cfg: ClipImageConfig) -> torch.Tensor:
    """CLIP's ``pixel_values`` of ``images`` (``[B, 3, H, W]`` in ``[0, 1]``), float32, on
    their device: ``CLIPImageProcessor``'s resize, centre crop and normalisation."""
    x = images.float()
    if cfg.shortest_edge is not None:
        x = resize_bicubic(x, *shortest_edge_size(x.shape[-2], x.shape[-1], cfg.shortest_edge))
    elif cfg.resize_to is not None:
        x = resize_bicubic(x, *cfg.resize_to)
    if cfg.crop is not None:
        x = center_crop(x, *cfg.crop)
    return normalize(x, cfg.mean, cfg.std) if cfg.do_normalize else x


# ------------------------------------------------------------------ Qwen2-VL


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Qwen2-VL's resize rule (transformers' ``qwen2_vl`` image processor): both edges
    multiples of ``factor``, the area within ``[min_pixels, max_pixels]``, the aspect ratio
    kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLImageConfig:
    """What Qwen2-VL's (and Qwen2.5-VL's) image processor does to an image.

    Attributes:
        patch_size: the vision tower's spatial patch size (14 published).
        merge_size: patches merged into one language-model token per side (2).
        temporal_patch_size: frames per patch (2: a still image is repeated).
        min_pixels: the least area after the resize.
        max_pixels: the largest area after the resize.
        mean: per-channel mean.
        std: per-channel standard deviation.
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_processor_dict(cls, cfg: Mapping[str, Any]) -> QwenVLImageConfig:
        """From a Qwen2-VL image processor's ``preprocessor_config.json`` (as a dict)."""
        size = cfg.get("size") or {}
        return cls(
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)),
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
            std=tuple(cfg.get("image_std", CLIP_STD)),
        )


def qwen_vl_patches(images: torch.Tensor, cfg: QwenVLImageConfig) -> tuple[torch.Tensor, int, int]:
    """Qwen2-VL's flattened patches of ``images`` (``[B, 3, H, W]`` in ``[0, 1]``), on their
    device: ``smart_resize``, normalisation, and the processor's patch layout.

    Returns:
        ``(patches, grid_h, grid_w)``: ``patches`` is ``[B, grid_h * grid_w, 3 * T * P * P]``
        float32 (``T`` the temporal patch size, ``P`` the patch size), each image's rows in
        the order the processor's ``pixel_values`` has them (``grid_t`` is 1).
    """
    b, c, h, w = images.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    rh, rw = smart_resize(h, w, factor=p * m, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    x = normalize(resize_bicubic(images, rh, rw), cfg.mean, cfg.std)
    gh, gw = rh // p, rw // p
    x = x.reshape(b, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # (B, gh/m, gw/m, m, m, C, P, P)
    x = x.unsqueeze(6).expand(*x.shape[:6], t, p, p)  # the still image repeated over T frames
    return x.reshape(b, gh * gw, c * t * p * p), gh, gw


# ------------------------------------------------------------------ packed rows


def pack_rows(ints: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
    """One float32 row per sample holding ``ints`` exactly and ``floats`` (in their graph).

    Layout: the number of integers, then each integer, as ``_DIGITS`` base-256 digits, then the
    floats. Every digit is an integer below 256, which bf16, fp16 and fp32 all hold exactly.

    Args:
        ints: ``[B, I]`` integers in ``[0, 2**24)`` (token ids, masks, grid sizes).
        floats: ``[B, F]`` (pixels).

    Returns:
        ``[B, _DIGITS * (I + 1) + F]`` float32 on ``floats``' device.
    """
    if ints.numel() and (int(ints.min()) < 0 or int(ints.max()) >= _BASE**_DIGITS):
        raise ValueError(
            f"packed integers must lie in [0, {_BASE**_DIGITS}), got [{int(ints.min())}, {int(ints.max())}]"
        )
    b = floats.shape[0]
    ints = ints.to(device=floats.device, dtype=torch.long).reshape(b, -1)
    header = torch.full((b, 1), ints.shape[1], dtype=torch.long, device=floats.device)
    values = torch.cat([header, ints], dim=1)
    powers = _BASE ** torch.arange(_DIGITS - 1, -1, -1, device=floats.device)
    digits = (values.unsqueeze(-1) // powers) % _BASE  # [B, I + 1, _DIGITS], most significant first
    return torch.cat([digits.reshape(b, -1).float(), floats.float().reshape(b, -1)], dim=1)


def unpack_rows(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(ints [B, I] long, floats [B, F])`` of rows made by ``pack_rows`` (the floats in
    ``packed``'s dtype and graph)."""
    b = packed.shape[0]
    powers = _BASE ** torch.arange(_DIGITS - 1, -1, -1, device=packed.device)
    count = int((packed[0, :_DIGITS].detach().round().long() * powers).sum()) if b else 0
    n = _DIGITS * (count + 1)
    digits = packed[:, _DIGITS:n].detach().round().long().reshape(b, count, _DIGITS)
    return (digits * powers).sum(-1), packed[:, n:]
