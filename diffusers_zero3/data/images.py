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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import DataError
from ..runtime.distributed import logger
from ..runtime.notices import local_dataset_progress_off

if TYPE_CHECKING:
    from .pixels import RowsToPixels


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
    import contextlib
    import os

    import datasets

    if dataset_name is None and train_data_dir is None:
        raise DataError("give --dataset_name or --train_data_dir")
    # a local folder is read, not downloaded: no "Downloading data" bar for it
    local = train_data_dir is not None if dataset_name is None else os.path.isdir(dataset_name)
    try:
        with local_dataset_progress_off() if local else contextlib.nullcontext():
            if dataset_name is not None:
                ds = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir)
            else:
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

    A column of strings (paths, captions) would otherwise fail on every row, one by one;
    ``prepare_image_column`` makes images of the columns that hold them in another layout.
    """
    import datasets

    feature = dataset.features.get(image_column)
    if not isinstance(feature, datasets.Image):
        raise _not_images(image_column, _held(feature), dataset.column_names)


# What a column of image paths holds: strings with one of these endings (any case).
IMAGE_PATH_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
IMAGE_ROWS_SAMPLED = 100  # the rows that decide what an image column holds
_HEADERS_SAMPLED = 8  # the rows of image bytes whose headers are read to tell images from other bytes
# The layouts an image column comes in (``image_column_layout``).
IMAGE_LAYOUTS = ("image", "struct", "bytes", "paths")
_BINARY = ("binary", "large_binary")
_STRINGS = ("string", "large_string")


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


def _is_image_bytes(value: Any) -> bool:
    """True when ``value`` is bytes whose header PIL reads as an image (nothing is decoded)."""
    import io

    from PIL import Image

    if not isinstance(value, (bytes, bytearray, memoryview)):
        return False
    try:
        with Image.open(io.BytesIO(bytes(value))):
            return True
    except Exception:  # PIL raises several types for bytes that are not an image
        return False


def _held(feature: Any) -> str:
    """What a column of ``feature`` holds, in the words of an error."""
    if feature is None:
        return "values of an undeclared type"
    if isinstance(feature, dict):
        return f"struct<{', '.join(feature)}> values"
    return f"{getattr(feature, 'dtype', type(feature).__name__)} values"


def _not_images(column: str, held: str, columns: Sequence[str]) -> DataError:
    return DataError(
        f"--image_column {column!r} holds {held}, not images (an image column holds datasets Images, "
        f"{{bytes, path}} structs, image bytes or image file paths); pick the column of images "
        f"(columns: {', '.join(columns)})"
    )


def _struct_feature(feature: Any) -> bool:
    """``struct<bytes, path>`` as ``datasets`` stores an image, read without its feature
    metadata (pyarrow, pandas): a ``bytes`` field, binary (or null, every row naming its file
    in a string ``path`` instead), and at most that ``path`` field besides."""
    import datasets

    if not isinstance(feature, dict) or set(feature) - {"bytes", "path"}:
        return False
    dtypes = {k: v.dtype for k, v in feature.items() if isinstance(v, datasets.Value)}
    bytes_dtype, path_dtype = dtypes.get("bytes"), dtypes.get("path")
    return bytes_dtype in _BINARY or (bytes_dtype == "null" and path_dtype in _STRINGS)


def image_column_layout(feature: Any, sample: Sequence[Any], column: str, columns: Sequence[str]) -> str:
    """The layout of the image column ``column``, one of ``IMAGE_LAYOUTS``, from its feature
    and the values of its first rows ``sample``; ``DataError`` naming the column and what it
    holds for any other column.

    - ``"image"``: a ``datasets.Image`` feature (what ``datasets`` writes, with its metadata);
    - ``"struct"``: ``struct<bytes, path>`` without that metadata (pyarrow, pandas);
    - ``"bytes"``: encoded images as binary values (img2dataset's ``jpg``);
    - ``"paths"``: strings ending in an image extension.

    Bytes must open as an image in one of the first rows: a binary column of something else
    (arrays, latents) is refused here, not row by row.

    Example: a ``pyarrow`` table's ``jpg`` column of JPEG bytes is ``Value("binary")``:
    ``image_column_layout(Value("binary"), [jpeg_bytes], "jpg", ["jpg", "txt"]) == "bytes"``.
    """
    import datasets

    present = [v for v in sample if v is not None]
    if isinstance(feature, datasets.Image):
        return "image"
    if _struct_feature(feature):
        held = [v["bytes"] for v in present if v.get("bytes") is not None][:_HEADERS_SAMPLED]
        if held and not any(_is_image_bytes(v) for v in held):
            first = f"none of the first {len(held)} opens as an image"
            raise _not_images(column, f"{{bytes, path}} structs of other bytes ({first})", columns)
        return "struct"
    if isinstance(feature, datasets.Value) and feature.dtype in _BINARY:
        if not any(_is_image_bytes(v) for v in present[:_HEADERS_SAMPLED]):
            first = f"none of the first {min(len(present), _HEADERS_SAMPLED)} opens as an image"
            raise _not_images(column, f"binary values ({first})", columns)
        return "bytes"
    if isinstance(feature, datasets.Value) and feature.dtype in _STRINGS:
        if present and all(_is_image_path(v) for v in present):
            return "paths"
    raise _not_images(column, _held(feature), columns)


def image_path_root(column: str, paths: Sequence[Any], folder: str | None) -> str | None:
    """The folder that relative image ``paths`` (the first rows' local paths of an image
    column) resolve against: ``folder`` as an absolute path when it is a local directory, else
    None. ``DataError`` when a path is relative and there is no such folder (a hub dataset),
    or when none of the paths exists (a wrong folder, not a few missing files)."""
    import os

    relative = [v for v in paths if _is_relative_path(v)]
    root = os.path.abspath(folder) if folder is not None and os.path.isdir(folder) else None
    if relative and root is None:
        where = f"{folder!r} is not a local folder" if folder is not None else "no folder was given"
        raise DataError(
            f"--image_column {column!r} holds relative image paths (e.g. {relative[0]!r}) "
            f"and {where} to resolve them against"
        )
    local = [_resolve_image_path(v, root) for v in paths if "://" not in v]
    if local and not any(os.path.exists(v) for v in local):
        raise DataError(
            f"--image_column {column!r} holds image paths, and none of the first {len(local)} "
            f"exists (e.g. {local[0]!r})"
        )
    return root


def unstored_image_paths(layout: str, sample: Sequence[Any]) -> list[str]:
    """The paths the column's first rows name for images it does not hold the bytes of."""
    if layout == "paths":
        return [v for v in sample if v is not None]
    if layout == "struct":
        return [v["path"] for v in sample if v is not None and v.get("bytes") is None and v.get("path")]
    return []


def _resolve_struct_path(value: dict | None, root: str) -> dict | None:
    """An undecoded image (``{"bytes", "path"}``) whose relative path, when it has no bytes
    (the path is what is read), is joined to ``root``."""
    if value is None or value.get("bytes") is not None:
        return value
    return {**value, "path": _resolve_image_path(value["path"], root)}


def resolve_struct_paths(column: str, root: str) -> Callable[[dict], dict]:
    """A batched ``map`` function: each undecoded image of ``column`` without bytes has its
    relative ``path`` joined to ``root``."""
    return lambda batch: {column: [_resolve_struct_path(v, root) for v in batch[column]]}


def prepare_image_column(dataset, image_column: str, folder: str | None = None):
    """``dataset`` with ``image_column`` holding images; raises ``DataError`` when it cannot.

    A column of images is returned as is. The other layouts of ``image_column_layout``
    (parquet files written by pyarrow, pandas or img2dataset, without ``datasets``' feature
    metadata) are cast to ``datasets.Image()``: ``struct<bytes, path>``, image bytes, and image
    paths (strings ending in an image extension), each relative path (of a path column, or of
    a struct without bytes) first resolved against ``folder``: the ``--dataset_name`` or
    ``--train_data_dir`` the data was loaded from, not the working directory. Absolute paths
    and URLs are kept. A path that does not exist is found when its row is read, and skipped
    and counted like a corrupt image; when none of the first rows' local paths exists (a wrong
    folder) it is a ``DataError`` at once. Any other column (captions given as
    ``--image_column``) is a ``DataError`` naming the column and what it holds. Relative paths
    with a ``folder`` that is not a local directory (a hub dataset) are a ``DataError``:
    nothing to resolve them against.

    Example: ``data/train.parquet`` with ``image`` = ``"images/a.png"`` and ``folder="data"``
    gives rows whose ``image`` is the PIL image of ``data/images/a.png`` (its absolute path).
    """
    import datasets

    feature = dataset.features.get(image_column)
    if isinstance(feature, datasets.Image):
        return dataset
    sample = dataset[:IMAGE_ROWS_SAMPLED][image_column]
    layout = image_column_layout(feature, sample, image_column, dataset.column_names)
    root = image_path_root(image_column, unstored_image_paths(layout, sample), folder)
    if layout == "paths" and root is not None:
        dataset = dataset.map(
            lambda batch: {image_column: [_resolve_image_path(p, root) for p in batch[image_column]]},
            batched=True,
            desc=f"resolving the image paths of {image_column!r} against {root}",
        )
    elif layout == "struct" and root is not None and unstored_image_paths(layout, sample):
        dataset = dataset.cast_column(image_column, datasets.Image(decode=False)).map(
            resolve_struct_paths(image_column, root),
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
    ``"original_size"`` and ``"crop_top_left"`` (SDXL's micro-conditioning) with the images,
    read as ``pixels`` (a ``data.pixels.RowsToPixels``) says: its columns, size, crop, flip,
    seed, resize filter, buckets, loss-mask column, caption dropout and tokenizer call.

    ``pixels.tokenize`` maps captions to a dict of token-id tensors (a family's ``tokenize``,
    for several text encoders: ``input_ids``, ``input_ids_2``); without it ``tokenizer`` gives
    ``input_ids``. ``pixels.empty_prompt_probability`` replaces a caption by ``""`` that often
    (``--proportion_empty_prompts``), drawn per row and epoch like the other randomness.

    ``set_epoch(e)`` changes the random crops/flips/captions deterministically. With
    ``pixels.live_pixels`` False images are not decoded (training from a latent cache); then
    ``unreadable_rows`` (the rows a cache skipped) are skipped as if they failed to decode.

    With aspect-ratio buckets (``pixels.buckets``: ``(height, width)`` shapes,
    ``pixels.row_buckets``: each row's bucket index, ``buckets.NO_BUCKET`` for an unreadable
    one) a row is cropped to its bucket, and a row that fails to decode is replaced by the next
    readable row of the same bucket (a batch keeps one shape). Items then carry
    ``target_size``, the crop's shape. ``pixels.interpolation`` is the resize filter
    (``--image_interpolation_mode``). ``pixels.mask_column`` names a column of loss masks
    (``transform_mask``: cropped and flipped as the image), given as ``loss_mask`` ``(1, H, W)``.

    Example:
        >>> rows = ImageCaptionDataset(ds, RowsToPixels(resolution=512, center_crop=True, tokenize=tokenize))
        >>> rows[0]["pixel_values"].shape
        torch.Size([3, 512, 512])
    """

    def __init__(self, dataset, pixels: RowsToPixels, *, tokenizer=None, unreadable_rows: Sequence[int] = ()):
        image_column, caption_column, buckets, row_buckets = (
            pixels.image_column, pixels.caption_column, pixels.buckets, pixels.row_buckets,
        )  # fmt: skip
        if (buckets is None) != (row_buckets is None):
            raise ValueError("give buckets and row_buckets together")
        if not pixels.live_pixels and image_column in getattr(dataset, "features", {}):
            import datasets

            # training from a latent cache reads captions alone: the images are not decoded
            dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
        self.dataset = dataset
        self.buckets = list(buckets) if buckets is not None else None
        self.row_buckets = list(row_buckets) if row_buckets is not None else None
        self.interpolation = pixels.interpolation
        self.mask_column = pixels.mask_column
        self.tokenizer = tokenizer
        self.image_column, self.caption_column = image_column, caption_column
        self.resolution, self.center_crop, self.random_flip = (
            pixels.resolution,
            pixels.center_crop,
            pixels.random_flip,
        )
        self.seed, self.epoch = pixels.seed, 0
        self.with_images = pixels.live_pixels
        self.skipped_rows: set[int] = set()
        self.unreadable_rows = set(unreadable_rows)
        self._tokenize = pixels.tokenize
        self.empty_prompt_probability = pixels.empty_prompt_probability

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
