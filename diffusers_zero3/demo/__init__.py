"""The embedded default: tiny pipelines of every family and a captioned shapes dataset, all
generated locally (no model hub, no network; tokenizers written here), plus the preference
dataset and the reward model of the DPO and reward runs. These are fixtures of the tests, the
benchmarks and ``make train``; the families (``diffusers_zero3.families``) hold none of them.

Each family's tiny pipeline (``pipelines.py``: ``save_tiny_pipeline(family, folder)``) has the
real classes built small from configs, with tokenizers written locally (``tokenizers.py``), and
is saved as an ordinary diffusers folder, so every loading path the package has
(``from_pretrained`` of a folder) is exercised on it. ``python -m diffusers_zero3.demo`` writes
a default run's pipeline and data (``__main__.py``).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from ..families import FAMILY_NAMES, family_named
from .pipelines import (
    TINY_PIPELINES,
    UNET_SHAPES,
    build_tiny_components,
    llama_folder_of,
    save_tiny_pipeline,
    save_tiny_sd_pipeline,
    tiny_component_configs,
)
from .tokenizers import write_clip_tokenizer, write_t5_tokenizer

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 30),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 40),
}
SHAPES = ("circle", "square")


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


def write_instance_images(
    dataset: str | os.PathLike, folder: str | os.PathLike, caption: str = "a red circle", count: int = 4
) -> Path:
    """Copy the first ``count`` images of a shapes dataset with ``caption`` into ``folder``:
    DreamBooth's instance images (``make train-dreambooth``)."""
    import shutil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (Path(dataset) / "metadata.jsonl").read_text().splitlines()]
    chosen = [r["file_name"] for r in rows if r["text"] == caption][:count]
    if len(chosen) < count:
        raise ValueError(f"{dataset} has {len(chosen)} images of {caption!r}, fewer than {count}")
    for name in chosen:
        shutil.copy(Path(dataset) / name, folder / name)
    return folder


def png_value(image) -> dict:
    """A PIL image as a ``datasets.Image`` value: its PNG bytes."""
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def write_controlnet_dataset(
    folder: str | os.PathLike, num_images: int = 32, size: int = 32, seed: int = 0
) -> Path:
    """Write a ControlNet dataset (one parquet file, fill50k's columns ``image``,
    ``conditioning_image``, ``text``) and return its folder: a coloured shape, its mask (white
    shape on black: what the ControlNet learns to follow) and a caption; plus one mask PNG per
    shape, ``<folder>-masks/<shape>.png``, for --validation_image."""
    import datasets

    folder = Path(folder)
    masks = folder.with_name(folder.name + "-masks")
    for f in (folder, masks):
        f.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = {"image": [], "conditioning_image": [], "text": []}

    for i in range(num_images):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        state = random.Random(f"{seed}-{i}")
        image = shape_image(colour, shape, size, random.Random(f"{seed}-{i}"))
        mask = (
            shape_image("red", shape, size, state)
            .convert("L")
            .point(lambda v: 255 if v < 200 else 0)
            .convert("RGB")
        )
        rows["image"].append(png_value(image))
        rows["conditioning_image"].append(png_value(mask))
        rows["text"].append(f"a {colour} {shape}")
        if not (masks / f"{shape}.png").exists():
            mask.save(masks / f"{shape}.png")
    features = datasets.Features(
        {"image": datasets.Image(), "conditioning_image": datasets.Image(), "text": datasets.Value("string")}
    )
    datasets.Dataset.from_dict(rows, features=features).to_parquet(
        str(folder / "train-00000-of-00001.parquet")
    )
    return folder


def write_masked_shapes_dataset(
    folder: str | os.PathLike,
    num_images: int = 8,
    sizes: list[tuple[int, int]] | None = None,
    seed: int = 0,
) -> Path:
    """Write a dataset of coloured shapes with loss masks (one parquet file: ``image``, ``mask``
    and ``text`` columns) and return its folder: each mask is white on its image's shape and
    black on the background (``--mask_column mask`` trains on the shapes alone). Images take
    their (width, height) in turn from ``sizes`` (default landscape 48 x 32 and portrait 32 x 48:
    aspect-ratio buckets)."""
    import datasets

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = sizes or [(48, 32), (32, 48)]
    rng = random.Random(seed)
    rows = {"image": [], "mask": [], "text": []}

    for i in range(num_images):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        width, height = sizes[i % len(sizes)]
        image = shape_image(colour, shape, height, random.Random(f"{seed}-{i}"), width=width)
        mask = image.convert("L").point(lambda v: 0 if v == 235 else 255)  # the background is (235, 235, 235)
        rows["image"].append(png_value(image))
        rows["mask"].append(png_value(mask))
        rows["text"].append(f"a {colour} {shape}")
    features = datasets.Features(
        {"image": datasets.Image(), "mask": datasets.Image(), "text": datasets.Value("string")}
    )
    datasets.Dataset.from_dict(rows, features=features).to_parquet(
        str(folder / "train-00000-of-00001.parquet")
    )
    return folder


VARIED_SIZES = [(32, 32), (48, 32), (32, 40), (56, 40), (40, 64)]
MODELS = tuple(FAMILY_NAMES)


def training_data_folder(model: str, varied: bool = False) -> str:
    """The name of ``model``'s default training data under the demo's folder, as
    ``prepare_default`` writes it: editing pairs (``edits``, ``edits-varied``), images of varied
    sizes (``shapes-varied``: SDXL, or any image family with ``varied``), clips of moving shapes
    (``shapes-videos``; ``shapes-videos-audio`` with a tone each for a family that reads the
    clips' sound), else ``shapes``. The one place the make targets, smoke cases and tests ask."""
    family = family_named(model)
    if family.edits:
        return "edits-varied" if varied else "edits"
    if family.video:
        return "shapes-videos-audio" if family.sound else "shapes-videos"
    return "shapes-varied" if model == "sdxl" or varied else "shapes"


def prepare_default(
    folder: str | os.PathLike, num_images: int = 64, model: str = "sd", varied: bool = False
) -> tuple[Path, Path]:
    """Create (once) the default runs' pipeline, dataset and reward model under ``folder``.

    Returns the pipeline and dataset paths; the reward model is ``folder/redness-reward``
    (``model="sd"`` only). ``model`` is a family's short name (``MODELS``): its tiny pipeline
    is ``folder/tiny-<model>``. SDXL trains on a dataset of varied image sizes
    (``shapes-varied``, for its size and crop conditioning), the video families (Wan) on clips
    of moving shapes (``shapes-videos``), the others on ``shapes``; with ``varied`` an image
    family trains on ``shapes-varied`` too (landscape and portrait images, for aspect-ratio
    buckets: ``make train BUCKETS=1``).
    """
    folder = Path(folder)
    family = family_named(model)
    if family.edits:  # a folder of editing pairs (data.pairs' layout)
        from .edits import write_edit_pairs

        pipe, data = folder / f"tiny-{model}", folder / training_data_folder(model, varied)
        if not (data / f"{num_images - 1:05d}.txt").exists():
            write_edit_pairs(data, num_pairs=num_images, sizes=VARIED_SIZES if varied else None)
    elif (model == "sdxl" or varied) and not family.video:
        pipe, data = folder / f"tiny-{model}", folder / training_data_folder(model, varied)
        if not (data / "metadata.jsonl").exists():
            write_shapes_dataset(data, num_images=num_images, sizes=VARIED_SIZES)
    elif family.video:  # clips of moving shapes (mp4), 9 frames each
        from ..data.video import ShapeTones, write_shapes_videos

        # LTX-2: clips with a tone per colour at the audio VAE's default rate, the last one silent
        sound = family.audio_spec({}) if family.sound else None
        pipe, data = folder / f"tiny-{model}", folder / training_data_folder(model, varied)
        if not (data / "metadata.jsonl").exists():
            n = min(num_images, 16)
            tones = ShapeTones(sound.sample_rate, silent=(n - 1,)) if sound else None
            write_shapes_videos(data, num_clips=n, frames=9, size=32, tones=tones)
    else:
        pipe, data = folder / f"tiny-{model}", folder / training_data_folder(model, varied)
        if not (data / "metadata.jsonl").exists():
            write_shapes_dataset(data, num_images=num_images)
    if not (pipe / "model_index.json").exists():
        save_tiny_pipeline(family, pipe)
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
            rows[column].append(png_value(image)["bytes"])
        rows["label_0"].append(label)
        rows["caption"].append(f"a {colour} {shape}")
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    return folder


def _reward_model_class():
    from diffusers import ModelMixin
    from diffusers.configuration_utils import ConfigMixin, register_to_config

    class RednessRewardModel(ModelMixin, ConfigMixin):
        """A small reward model that scores how red an image is (NCHW images in [0, 1], as the
        reward registry and ``train_reward.py`` pass them; any range works, the score scales with it).

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
    from ..runtime.zero3 import zero3_init_disabled

    with zero3_init_disabled():
        torch.manual_seed(seed)
        model = __getattr__("RednessRewardModel")(hidden=hidden, layers=layers)
    model.save_pretrained(folder)
    return Path(folder)


__all__ = [
    "COLOURS",
    "MODELS",
    "SHAPES",
    "TINY_PIPELINES",
    "UNET_SHAPES",
    "VARIED_SIZES",
    "build_tiny_components",
    "llama_folder_of",
    "prepare_default",
    "save_reward_model",
    "save_tiny_pipeline",
    "save_tiny_sd_pipeline",
    "shape_image",
    "tiny_component_configs",
    "write_clip_tokenizer",
    "write_controlnet_dataset",
    "write_instance_images",
    "write_preference_dataset",
    "write_shapes_dataset",
    "write_t5_tokenizer",
]
