"""Reward functions of the embedded defaults, as ``module:function`` rewards
(``--reward diffusers_zero3.demo.rewards:redness``): plain functions ``fn(images, prompts) ->
scores`` of images ``[B, 3, H, W]`` in ``[0, 1]``, or ``fn(images, prompts, metadata) ->
scores`` when they read each prompt's metadata (one dict per image, ``{}`` where a prompt has
none: ``rewards.specs.function_takes_metadata``)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def redness(images: torch.Tensor, prompts: Sequence[str] | None = None) -> torch.Tensor:
    """How red each image is: ``mean(R - (G + B) / 2)`` over its pixels, in ``[-1, 1]`` for images
    in ``[0, 1]`` (the colour term of ``demo.RednessRewardModel``). Float32 ``[B]`` on the
    images' device; the prompts are ignored.

    Example:
        >>> redness(torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1).expand(1, 3, 4, 4))
        tensor([1.])
    """
    images = images.float()
    return (images[:, 0] - 0.5 * (images[:, 1] + images[:, 2])).mean(dim=(1, 2))


# GenEval's ten colour names (its "colors" and "color_attr" tasks) at their CSS / X11 RGB values.
NAMED_COLOURS: dict[str, tuple[float, float, float]] = {
    name: (r / 255, g / 255, b / 255)
    for name, (r, g, b) in {
        "red": (255, 0, 0),
        "orange": (255, 165, 0),
        "yellow": (255, 255, 0),
        "green": (0, 128, 0),
        "blue": (0, 0, 255),
        "purple": (128, 0, 128),
        "pink": (255, 192, 203),
        "brown": (165, 42, 42),
        "black": (0, 0, 0),
        "white": (255, 255, 255),
    }.items()
}


def colour_named(metadata: Mapping[str, Any], prompt: str | None) -> str | None:
    """The colour a sample asks for: ``metadata["color"]``, else the first ``"color"`` of a
    GenEval ``metadata["include"]`` list (``[{"class": "car", "count": 1, "color": "red"}]``),
    else the first word of ``prompt`` that is one of ``NAMED_COLOURS``; None when there is none
    (or it is not one of them).

    Example:
        >>> colour_named({}, "a photo of a blue bench and a red car")
        'blue'
        >>> colour_named({"include": [{"class": "car", "count": 1, "color": "red"}]}, "a car")
        'red'
    """
    named = metadata.get("color")
    if named is None:
        named = next(
            (o["color"] for o in metadata.get("include") or () if isinstance(o, Mapping) and "color" in o),
            None,
        )
    if named is None and prompt:
        named = next((w for w in re.findall(r"[a-z]+", prompt.lower()) if w in NAMED_COLOURS), None)
    named = str(named).lower() if named is not None else None
    return named if named in NAMED_COLOURS else None


def named_colour(
    images: torch.Tensor, prompts: Sequence[str] | None, metadata: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """A GenEval-style colour check: 1 where the image's mean colour is closest (Euclidean, in
    RGB) to the colour its sample names, of GenEval's ten (``NAMED_COLOURS``), else 0. The
    colour named is ``colour_named(metadata[i], prompts[i])``: the metadata's ``"color"``, a
    GenEval ``"include"`` entry's, or the prompt's first colour word; a sample naming none scores
    0. Deterministic; float32 ``[B]`` on the images' device.

    Use it as ``--reward diffusers_zero3.demo.rewards:named_colour``; its third parameter makes
    the trainer pass each prompt's metadata.

    Example:
        >>> red = torch.tensor([0.9, 0.1, 0.1]).view(1, 3, 1, 1).expand(2, 3, 4, 4)
        >>> named_colour(red, ["a red car", "a car"], [{}, {"color": "blue"}])
        tensor([1., 0.])
    """
    n = len(images)
    if len(metadata) != n or (prompts is not None and len(prompts) != n):
        got = f"{len(metadata)} metadata entries" + (
            f", {len(prompts)} prompts" if prompts is not None else ""
        )
        raise ValueError(f"named_colour: got {n} images but {got}")
    palette = torch.tensor(list(NAMED_COLOURS.values()), dtype=torch.float32, device=images.device)
    mean = images.detach().float().mean(dim=(2, 3))  # [B, 3]
    nearest = torch.cdist(mean, palette).argmin(dim=1).tolist()  # first of equals: deterministic
    names = list(NAMED_COLOURS)
    scores = [
        float(names[k] == colour_named(m, prompts[i] if prompts is not None else None))
        for i, (k, m) in enumerate(zip(nearest, metadata))
    ]
    return torch.tensor(scores, dtype=torch.float32, device=images.device)
