"""Image-caption data through ``datasets``, with image transforms in PIL/numpy (no torchvision).

Randomness (crop position, flip, which caption of several) is drawn from a generator seeded
by ``(seed, epoch, row)``, so a resumed run sees exactly the samples it would have seen.
Unreadable or corrupt images are **skipped**: the row is replaced by the next readable row,
a warning names the row, and ``skipped_rows`` counts them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from ..runtime.distributed import logger


def load_image_caption_dataset(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_data_dir: str | None = None,
    cache_dir: str | None = None,
    split: str = "train",
):
    """Load the ``split`` split (default ``train``) of a hub/local dataset (a local folder of
    parquet/json/csv files too), or an ``imagefolder`` directory.

    ``train_data_dir`` follows diffusers' layout: images plus a ``metadata.jsonl`` whose
    ``file_name`` column names them and whose other columns (e.g. ``text``) hold captions.
    """
    import datasets

    if dataset_name is None and train_data_dir is None:
        raise DataError("give --dataset_name or --train_data_dir")
    try:
        if dataset_name is not None:
            ds = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir)
        else:
            import os

            if not os.path.isdir(train_data_dir):
                raise DataError(f"--train_data_dir {train_data_dir!r} is not a directory")
            ds = datasets.load_dataset("imagefolder", data_dir=train_data_dir, cache_dir=cache_dir)
    except (FileNotFoundError, ValueError, ConnectionError) as e:  # datasets' "no data files", bad names
        if isinstance(e, DataError):
            raise
        name = dataset_name or train_data_dir
        raise DataError(f"cannot load the dataset {name!r}: {e}") from e
    if split not in ds:
        raise DataError(f"dataset has no {split!r} split (splits: {sorted(ds)})")
    return ds[split]


def resolve_columns(dataset, image_column: str | None, caption_column: str | None) -> tuple[str, str]:
    """The image and caption column names, defaulting to the first two columns as upstream."""
    names = list(dataset.column_names)
    image_column = image_column or names[0]
    caption_column = caption_column or (names[1] if len(names) > 1 else None)
    for flag, col in (("--image_column", image_column), ("--caption_column", caption_column)):
        if col not in names:
            raise DataError(f"{flag} value {col!r} is not a dataset column; columns are: {', '.join(names)}")
    return image_column, caption_column


def check_image_column(dataset, image_column: str) -> None:
    """Raise ``DataError`` unless ``image_column`` holds images (a ``datasets.Image`` feature).

    A column of strings (paths, captions) would otherwise fail on every row, one by one.
    """
    import datasets

    feature = dataset.features.get(image_column)
    if not isinstance(feature, datasets.Image):
        kind = getattr(feature, "dtype", type(feature).__name__)
        raise DataError(
            f"--image_column {image_column!r} holds {kind} values, not images; "
            f"pick the column of images (columns: {', '.join(dataset.column_names)})"
        )


def check_enough_rows(num_rows: int, num_processes: int, batch_size: int) -> None:
    """Raise ``DataError`` when the data cannot fill one batch on every process."""
    if num_rows == 0:
        raise DataError("the dataset is empty (after --max_train_samples)")
    if num_rows < num_processes * batch_size:
        raise DataError(
            f"the dataset has {num_rows} rows, fewer than processes x --train_batch_size = "
            f"{num_processes} x {batch_size} = {num_processes * batch_size}; lower the batch size or add data"
        )


def is_readable_image(dataset, index: int, image_column: str) -> bool:
    """True when row ``index``'s image decodes (``datasets`` decodes on access, and a corrupt
    file raises one of several errors there or in ``load``)."""
    try:
        dataset[index][image_column].load()
        return True
    except Exception:
        return False


def pick_caption(caption: Any, rng: random.Random | None) -> str:
    """One caption string: a random one of several when training (``rng``), else the first."""
    if isinstance(caption, str):
        return caption
    if isinstance(caption, (list, tuple, np.ndarray)) and len(caption) > 0:
        return str(rng.choice(list(caption)) if rng is not None else caption[0])
    raise DataError(f"caption should be a string or a list of strings, got {type(caption).__name__}")


@dataclass(frozen=True)
class CropInfo:
    """Where a training crop came from, as SDXL's micro-conditioning records it.

    ``original_size`` is the image's (height, width) before resizing; ``crop_top_left`` is
    the crop's (top, left) in the resized image, measured in the flipped image when the crop
    was flipped (diffusers' SDXL script flips before it crops, so its coordinates are in the
    flipped frame); ``flipped`` says whether it was.
    """

    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool
    resized_size: tuple[int, int]  # (height, width) after the shorter side was resized

    def mirrored(self, resolution: int) -> CropInfo:
        """The same crop seen in the horizontally flipped resized image."""
        top, left = self.crop_top_left
        mirrored_left = self.resized_size[1] - left - resolution
        return CropInfo(self.original_size, (top, mirrored_left), not self.flipped, self.resized_size)


def transform_image_with_crop(
    image, resolution: int, center_crop: bool, random_flip: bool, rng: random.Random
) -> tuple[torch.Tensor, CropInfo]:
    """``transform_image``, and where the crop came from (``CropInfo``)."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    scale = resolution / min(w, h)
    nw, nh = max(resolution, round(w * scale)), max(resolution, round(h * scale))
    image = image.resize((nw, nh), Image.BILINEAR)
    if center_crop:
        left, top = (nw - resolution) // 2, (nh - resolution) // 2
    else:
        left, top = rng.randint(0, nw - resolution), rng.randint(0, nh - resolution)
    image = image.crop((left, top, left + resolution, top + resolution))
    info = CropInfo((h, w), (top, left), False, (nh, nw))
    if random_flip and rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
        info = info.mirrored(resolution)  # the same crop, seen in the flipped image
    arr = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous(), info


def transform_image(
    image, resolution: int, center_crop: bool, random_flip: bool, rng: random.Random
) -> torch.Tensor:
    """Resize (shorter side to ``resolution``, bilinear), crop, maybe flip; CHW float in [-1, 1].

    The same steps as diffusers' torchvision pipeline (Resize, CenterCrop/RandomCrop,
    RandomHorizontalFlip, ToTensor, Normalize([0.5], [0.5])).
    """
    return transform_image_with_crop(image, resolution, center_crop, random_flip, rng)[0]


class SeededRows(torch.utils.data.Dataset):
    """A dataset over the rows of ``self.dataset`` whose random draws (crop, flip, empty
    prompt, clip start) come from ``(self.seed, epoch, row index)``: the same whichever rank
    reads a row and however many there are, and what a cache built at epoch 0 read."""

    dataset: Any
    seed: int
    epoch: int

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Select the random draws of ``epoch``."""
        self.epoch = epoch

    def _rng(self, index: int, epoch: int | None = None) -> random.Random:
        """Row ``index``'s draws at ``epoch`` (default: the current one)."""
        return random.Random(f"{self.seed}-{self.epoch if epoch is None else epoch}-{index}")


class ImageCaptionDataset(SeededRows):
    """Rows of a ``datasets`` dataset as ``{"pixel_values", "input_ids", "index"}``, plus
    ``"original_size"`` and ``"crop_top_left"`` (SDXL's micro-conditioning) with the images.

    ``tokenize`` maps captions to a dict of token-id tensors (a family's ``tokenize``, for
    several text encoders: ``input_ids``, ``input_ids_2``); by default ``tokenizer`` gives
    ``input_ids``. ``empty_prompt_probability`` replaces a caption by ``""`` that often
    (``--proportion_empty_prompts``), drawn per row and epoch like the other randomness.

    ``set_epoch(e)`` changes the random crops/flips/captions deterministically. With
    ``with_images=False`` images are not decoded (training from a latent cache); then
    ``unreadable_rows`` (the rows a cache skipped) are skipped as if they failed to decode.
    """

    def __init__(
        self,
        dataset,
        tokenizer,
        image_column: str,
        caption_column: str,
        resolution: int,
        center_crop: bool = False,
        random_flip: bool = False,
        seed: int = 0,
        with_images: bool = True,
        unreadable_rows: Sequence[int] = (),
        tokenize: Callable[[list[str]], dict[str, torch.Tensor]] | None = None,
        empty_prompt_probability: float = 0.0,
    ):
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.image_column, self.caption_column = image_column, caption_column
        self.resolution, self.center_crop, self.random_flip = resolution, center_crop, random_flip
        self.seed, self.epoch = seed, 0
        self.with_images = with_images
        self.skipped_rows: set[int] = set()
        self.unreadable_rows = set(unreadable_rows)
        self._tokenize = tokenize
        self.empty_prompt_probability = empty_prompt_probability

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        """Token ids padded to the tokenizer's max length, as upstream."""
        return self.tokenizer(
            list(captions),
            max_length=self.tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).input_ids

    def _readable_row(self, index: int) -> tuple[int, dict]:
        for offset in range(len(self.dataset)):
            i = (index + offset) % len(self.dataset)
            try:
                if i in self.unreadable_rows:
                    raise DataError("skipped when the frozen-model cache was built")
                row = self.dataset[i]
                if self.with_images:
                    row[self.image_column].load()
                return i, row
            except Exception as e:  # PIL raises several types for a corrupt file
                if i not in self.skipped_rows:
                    self.skipped_rows.add(i)
                    logger.warning("skipping row %d: unreadable image (%s: %s)", i, type(e).__name__, e)
        raise DataError("no readable image in the dataset")

    def __getitem__(self, index: int) -> dict:
        i, row = self._readable_row(index)
        rng = self._rng(i)
        caption = pick_caption(row[self.caption_column], rng)
        if self.empty_prompt_probability and random.Random(f"{self.seed}-{self.epoch}-{i}-empty").random() < (
            self.empty_prompt_probability
        ):
            caption = ""
        if self._tokenize is not None:
            item = {k: v[0] for k, v in self._tokenize([caption]).items()}
        else:
            item = {"input_ids": self.tokenize([caption])[0]}
        item["index"] = i
        if self.with_images:
            pixels, crop = transform_image_with_crop(
                row[self.image_column], self.resolution, self.center_crop, self.random_flip, rng
            )
            item["pixel_values"] = pixels
            # CPU: data-loader side, like the pixels; accelerate's prepared loader moves the batch
            item["original_size"] = torch.tensor(crop.original_size)
            item["crop_top_left"] = torch.tensor(crop.crop_top_left)  # CPU: as original_size
        return item


def collate(examples: list[dict]) -> dict:
    """Stack a list of ``ImageCaptionDataset`` items into a batch (every key)."""
    batch = {}
    for key, value in examples[0].items():
        if torch.is_tensor(value):
            batch[key] = torch.stack([e[key] for e in examples]).contiguous()
        else:
            batch[key] = torch.tensor([e[key] for e in examples])  # CPU: collate, on the loader's side
    return batch
