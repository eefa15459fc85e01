"""The embedded default's editing pairs (``make train MODEL=kontext``): a folder of pairs in the
layout ``data.pairs`` reads (``NAME.png`` target, ``NAME_source.png``, ``NAME.txt``)."""

from __future__ import annotations

import os
import random
from pathlib import Path


def write_edit_pairs(
    folder: str | os.PathLike,
    num_pairs: int = 64,
    size: int = 32,
    seed: int = 0,
    sizes: list[tuple[int, int]] | None = None,
) -> Path:
    """Write a pair folder of recolourings: the source is one coloured shape, the target the same
    shape at the same place in another colour, the instruction "make the circle blue". Images
    are ``size`` x ``size``, or take their (width, height) in turn from ``sizes`` (landscape and
    portrait pairs, for aspect-ratio buckets)."""
    from . import COLOURS, SHAPES, shape_image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    colours = sorted(COLOURS)
    for i in range(num_pairs):
        shape = rng.choice(SHAPES)
        source, target = rng.sample(colours, 2)
        width, height = sizes[i % len(sizes)] if sizes else (size, size)
        state = rng.getstate()  # the same geometry for both images of the pair
        shape_image(source, shape, height, rng, width=width).save(folder / f"{i:05d}_source.png")
        rng.setstate(state)
        shape_image(target, shape, height, rng, width=width).save(folder / f"{i:05d}.png")
        (folder / f"{i:05d}.txt").write_text(f"make the {shape} {target}\n")
    return folder
