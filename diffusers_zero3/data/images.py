"""Image-caption data through ``datasets``, with image transforms in PIL/numpy (no torchvision).

Randomness (crop position, flip, which caption of several) is drawn from a generator seeded
by ``(seed, epoch, row)``, so a resumed run sees exactly the samples it would have seen.
Unreadable or corrupt images are **skipped**: the row is replaced by the next readable row,
a warning names the row, and ``skipped_rows`` counts them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
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
    ``file_name`` column names them and whose other columns (e.g. ``text``) hold captions. A
    column of image paths (a parquet/json/csv folder's, relative to the folder) stays strings
    here: ``prepare_image_column`` makes it images.
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


def resolve_columns(
    names: Sequence[str], image_column: str | None, caption_column: str | None
) -> tuple[str, str]:
    """The image and caption column names among a dataset's column ``names``, defaulting to
    the first two columns as upstream."""
    names = list(names)
    image_column = image_column or names[0]
    caption_column = caption_column or (names[1] if len(names) > 1 else None)
    for flag, col in (("--image_column", image_column), ("--caption_column", caption_column)):
        if col not in names:
            raise DataError(f"{flag} value {col!r} is not a dataset column; columns are: {', '.join(names)}")
    return image_column, caption_column


def check_image_column(dataset, image_column: str) -> None:
    """Raise ``DataError`` unless ``image_column`` holds images (a ``datasets.Image`` feature).

    A column of strings (paths, captions) would otherwise fail on every row, one by one; a
    column of image paths becomes images with ``prepare_image_column``.
    """
    import datasets

    feature = dataset.features.get(image_column)
    if not isinstance(feature, datasets.Image):
        kind = getattr(feature, "dtype", type(feature).__name__)
        raise DataError(
            f"--image_column {image_column!r} holds {kind} values, not images; "
            f"pick the column of images (columns: {', '.join(dataset.column_names)})"
        )


# What a column of image paths holds: strings with one of these endings (any case).
IMAGE_PATH_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_PATHS_SAMPLED = 100  # the rows that decide whether a string column holds image paths


def _is_image_path(value: Any) -> bool:
    import os

    return isinstance(value, str) and os.path.splitext(value)[1].lower() in IMAGE_PATH_EXTENSIONS


def _is_relative_path(value: Any) -> bool:
    import os

    return isinstance(value, str) and "://" not in value and not os.path.isabs(value)


def _resolve_image_path(path: Any, root: str) -> Any:
    """``path`` joined to ``root`` when relative; absolute paths, URLs and None as they are."""
    import os

    return os.path.join(root, path) if _is_relative_path(path) else path


def prepare_image_column(dataset, image_column: str, folder: str | None = None):
    """``dataset`` with ``image_column`` holding images; raises ``DataError`` when it cannot.

    A column of images is returned as is. A column of image paths (strings ending in an image
    extension, as parquet/json/csv files written by other tools hold them) is cast to
    ``datasets.Image()``, each relative path first resolved against ``folder``: the
    ``--dataset_name`` or ``--train_data_dir`` the data was loaded from, not the working
    directory. Absolute paths and URLs are kept. A path that does not exist is found when its
    row is read, and skipped and counted like a corrupt image; when none of the first rows'
    local paths exists (a wrong folder) it is a ``DataError`` at once. Any other column (captions given
    as ``--image_column``) gets ``check_image_column``'s error. Relative paths with a ``folder``
    that is not a local directory (a hub dataset) are a ``DataError``: nothing to resolve them
    against.

    Example: ``data/train.parquet`` with ``image`` = ``"images/a.png"`` and ``folder="data"``
    gives rows whose ``image`` is the PIL image of ``data/images/a.png`` (its absolute path).
    """
    import os

    import datasets

    feature = dataset.features.get(image_column)
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        sample = [v for v in dataset[:_PATHS_SAMPLED][image_column] if v is not None]
        if sample and all(_is_image_path(v) for v in sample):
            relative = [v for v in sample if _is_relative_path(v)]
            root = os.path.abspath(folder) if folder is not None and os.path.isdir(folder) else None
            if relative and root is None:
                where = f"{folder!r} is not a local folder" if folder is not None else "no folder was given"
                raise DataError(
                    f"--image_column {image_column!r} holds relative image paths (e.g. {relative[0]!r}) "
                    f"and {where} to resolve them against"
                )
            local = [_resolve_image_path(v, root) for v in sample if "://" not in v]
            if local and not any(os.path.exists(v) for v in local):  # a wrong folder, not a few missing files
                raise DataError(
                    f"--image_column {image_column!r} holds image paths, and none of the first {len(local)} "
                    f"exists (e.g. {local[0]!r})"
                )
            if root is not None:
                dataset = dataset.map(
                    lambda batch: {image_column: [_resolve_image_path(p, root) for p in batch[image_column]]},
                    batched=True,
                    desc=f"resolving the image paths of {image_column!r} against {root}",
                )
            dataset = dataset.cast_column(image_column, datasets.Image())
    check_image_column(dataset, image_column)
    return dataset


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


# PIL's resampling filters by the names of diffusers' --image_interpolation_mode (torchvision's
# InterpolationMode names, lower-cased; torchvision resizes a PIL image with these same filters).
INTERPOLATION_MODES = {
    "nearest": "NEAREST",
    "nearest_exact": "NEAREST",
    "bilinear": "BILINEAR",
    "bicubic": "BICUBIC",
    "box": "BOX",
    "hamming": "HAMMING",
    "lanczos": "LANCZOS",
}


def resample_filter(mode: str):
    """The PIL resampling filter of an ``--image_interpolation_mode`` name."""
    from PIL import Image

    if mode not in INTERPOLATION_MODES:
        raise DataError(f"--image_interpolation_mode {mode!r} is not one of {', '.join(INTERPOLATION_MODES)}")
    return getattr(Image.Resampling, INTERPOLATION_MODES[mode])


def target_size(size: int | tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` of a training crop: ``--resolution`` squared, or a bucket's shape."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


@dataclass(frozen=True)
class CropInfo:
    """Where a training crop came from, as SDXL's micro-conditioning records it.

    ``original_size`` is the image's (height, width) before resizing; ``crop_top_left`` is
    the crop's (top, left) in the resized image, measured in the flipped image when the crop
    was flipped (diffusers' SDXL script flips before it crops, so its coordinates are in the
    flipped frame); ``flipped`` says whether it was; ``target_size`` is the crop's own
    (height, width): ``--resolution`` squared, or its aspect-ratio bucket.
    """

    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool
    resized_size: tuple[int, int]  # (height, width) after the image was resized to cover the crop
    target_size: tuple[int, int]

    def mirrored(self) -> CropInfo:
        """The same crop seen in the horizontally flipped resized image."""
        top, left = self.crop_top_left
        mirrored_left = self.resized_size[1] - left - self.target_size[1]
        return CropInfo(
            self.original_size, (top, mirrored_left), not self.flipped, self.resized_size, self.target_size
        )


def transform_image_with_crop(
    image,
    resolution: int | tuple[int, int],
    center_crop: bool,
    random_flip: bool,
    rng: random.Random,
    interpolation: str = "bilinear",
) -> tuple[torch.Tensor, CropInfo]:
    """``transform_image``, and where the crop came from (``CropInfo``).

    ``resolution`` is a side (a square crop) or a ``(height, width)`` bucket: the image is
    resized to cover it (the shorter side, relative to the bucket's, to its size) and cropped."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    th, tw = target_size(resolution)
    scale = max(th / h, tw / w)
    nw, nh = max(tw, round(w * scale)), max(th, round(h * scale))
    image = image.resize((nw, nh), resample_filter(interpolation))
    if center_crop:
        left, top = (nw - tw) // 2, (nh - th) // 2
    else:
        left, top = rng.randint(0, nw - tw), rng.randint(0, nh - th)
    image = image.crop((left, top, left + tw, top + th))
    info = CropInfo((h, w), (top, left), False, (nh, nw), (th, tw))
    if random_flip and rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
        info = info.mirrored()  # the same crop, seen in the flipped image
    arr = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous(), info


def transform_image(
    image,
    resolution: int | tuple[int, int],
    center_crop: bool,
    random_flip: bool,
    rng: random.Random,
    interpolation: str = "bilinear",
) -> torch.Tensor:
    """Resize (shorter side to ``resolution``, ``interpolation`` as upstream's
    ``--image_interpolation_mode``, default bilinear), crop, maybe flip; CHW float in [-1, 1].

    The same steps as diffusers' torchvision pipeline (Resize, CenterCrop/RandomCrop,
    RandomHorizontalFlip, ToTensor, Normalize([0.5], [0.5])).
    """
    return transform_image_with_crop(image, resolution, center_crop, random_flip, rng, interpolation)[0]


def transform_mask(mask, crop: CropInfo) -> torch.Tensor:
    """A loss mask (``--mask_column``: a grayscale image, white trains and black is ignored)
    taken through the geometry its image took (``crop``: resize, crop, flip): ``(1, H, W)``
    floats in [0, 1]. A mask of another size than its image is first resized to it."""
    from PIL import Image

    mask = mask.convert("L")
    original = (crop.original_size[1], crop.original_size[0])
    if mask.size != original:
        mask = mask.resize(original, Image.BILINEAR)
    mask = mask.resize((crop.resized_size[1], crop.resized_size[0]), Image.BILINEAR)
    if crop.flipped:  # the crop's corner is measured in the flipped image
        mask = mask.transpose(Image.FLIP_LEFT_RIGHT)
    top, left = crop.crop_top_left
    th, tw = crop.target_size
    mask = mask.crop((left, top, left + tw, top + th))
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0).unsqueeze(0)


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

    With aspect-ratio buckets (``buckets``: ``(height, width)`` shapes, ``row_buckets``: each
    row's bucket index, ``buckets.NO_BUCKET`` for an unreadable one) a row is cropped to its
    bucket, and a row that fails to decode is replaced by the next readable row of the same
    bucket (a batch keeps one shape). Items then carry ``target_size``, the crop's shape.
    ``interpolation`` is the resize filter (``--image_interpolation_mode``). ``mask_column``
    names a column of loss masks (``transform_mask``: cropped and flipped as the image), given
    as ``loss_mask`` ``(1, H, W)``.
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
        buckets: Sequence[tuple[int, int]] | None = None,
        row_buckets: Sequence[int] | None = None,
        interpolation: str = "bilinear",
        mask_column: str | None = None,
    ):
        if (buckets is None) != (row_buckets is None):
            raise ValueError("give buckets and row_buckets together")
        if not with_images and image_column in getattr(dataset, "features", {}):
            import datasets

            # training from a latent cache reads captions alone: the images are not decoded
            dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
        self.dataset = dataset
        self.buckets = list(buckets) if buckets is not None else None
        self.row_buckets = list(row_buckets) if row_buckets is not None else None
        self.interpolation = interpolation
        self.mask_column = mask_column
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

    def crop_size(self, index: int) -> tuple[int, int]:
        """``(height, width)`` row ``index`` is cropped to: its bucket, or the resolution."""
        if self.buckets is None:
            return target_size(self.resolution)
        return self.buckets[self.row_buckets[index]]

    def _candidates(self, index: int) -> Iterator[int]:
        """Rows to read for ``index``: itself, then the next ones (of its bucket, with buckets)."""
        n = len(self.dataset)
        for offset in range(n):
            i = (index + offset) % n
            if self.row_buckets is None or self.row_buckets[i] == self.row_buckets[index]:
                yield i

    def _readable_row(self, index: int) -> tuple[int, dict]:
        for i in self._candidates(index):
            try:
                if i in self.unreadable_rows:
                    raise DataError("skipped when the frozen-model cache was built")
                row = self.dataset[i]
                if self.with_images:
                    row[self.image_column].load()
                    if self.mask_column is not None:
                        row[self.mask_column].load()
                return i, row
            except Exception as e:  # PIL raises several types for a corrupt file
                if i not in self.skipped_rows:
                    self.skipped_rows.add(i)
                    logger.warning("skipping row %d: unreadable image (%s: %s)", i, type(e).__name__, e)
        raise DataError("no readable image in the dataset")

    def __getitem__(self, index: int) -> dict:
        return self.example(*self._readable_row(index))

    def example(self, i: int, row: dict) -> dict:
        """The training example of row ``i`` (its contents ``row``, images decoded): caption
        or the empty prompt, tokens, and the crop, with this epoch's draws for row ``i``."""
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
                row[self.image_column], self.crop_size(i), self.center_crop, self.random_flip, rng,
                self.interpolation,
            )  # fmt: skip
            item["pixel_values"] = pixels
            # CPU: data-loader side, like the pixels; accelerate's prepared loader moves the batch
            item["original_size"] = torch.tensor(crop.original_size)
            item["crop_top_left"] = torch.tensor(crop.crop_top_left)  # CPU: as original_size
            item["target_size"] = torch.tensor(crop.target_size)  # CPU: as original_size
            if self.mask_column is not None:
                item["loss_mask"] = transform_mask(row[self.mask_column], crop)
            item.update(self.paired_items(row, crop))
        return item

    def paired_items(self, row: dict, crop: CropInfo) -> dict:
        """Items of the row's other images taken through its image's geometry ``crop`` (none
        here; ``pairs.PairedImageDataset`` gives an editing pair's sources)."""
        return {}


def collate(examples: list[dict]) -> dict:
    """Stack a list of ``ImageCaptionDataset`` items into a batch (every key)."""
    batch = {}
    for key, value in examples[0].items():
        if torch.is_tensor(value):
            batch[key] = torch.stack([e[key] for e in examples]).contiguous()
        else:
            batch[key] = torch.tensor([e[key] for e in examples])  # CPU: collate, on the loader's side
    return batch
