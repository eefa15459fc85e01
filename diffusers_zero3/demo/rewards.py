"""Reward functions of the embedded defaults, as ``module:function`` rewards
(``--reward diffusers_zero3.demo.rewards:redness``): plain functions ``fn(images, prompts) ->
scores`` of images ``[B, 3, H, W]`` in ``[0, 1]``."""

from __future__ import annotations

from collections.abc import Sequence

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
