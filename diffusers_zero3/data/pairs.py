"""Instruction-editing pairs: source image(s) + instruction -> target image (Flux.1 Kontext).

Two ways to give them:

- **Columns** of a ``--dataset_name`` / ``--train_data_dir`` dataset (an imagefolder with
  ``metadata.jsonl``, or parquet/json/csv): the target in ``--image_column``, the source(s) in
  ``--source_image_column`` (default ``source_image``), the instruction in
  ``--edit_prompt_column`` (default: ``--caption_column``). A source cell is one image (or
  image path), or a **list** of them for several sources per row; every row has the same
  number of sources. Relative paths resolve against the dataset's folder.
- **A folder of pairs** (``--train_data_dir`` without a ``metadata.*`` file), DreamBooth-style:
  ``NAME.png`` (the target; any image extension), ``NAME_source.png`` (its source) or
  ``NAME_source_0.png``, ``NAME_source_1.png``, ... (several, in that order), and ``NAME.txt``
  (the instruction). A target without its source or its ``.txt``, or a source without its
  target, is one ``DataError`` naming the file.

``PairedImageDataset`` crops and flips the sources exactly as their target (each source
resized to the target's resized size first, as ``train_dreambooth_lora_flux_kontext.py``'s
``paired_transform`` does), so with aspect-ratio buckets (assigned by the target) every source
lands in its target's bucket. Items carry ``source_pixel_values`` ``(K, 3, H, W)``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from .images import IMAGE_PATH_EXTENSIONS, CropInfo, ImageCaptionDataset, load_image_caption_dataset

SOURCE_COLUMN = "source_image"  # --source_image_column's default, and a pair folder's column
_SOURCE_NAME = re.compile(r"^(?P<name>.+)_source(?:_(?P<k>\d+))?$")
_METADATA = ("metadata.jsonl", "metadata.json", "metadata.csv", "metadata.parquet")


def is_pair_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a folder of pairs (no ``metadata.*`` file for ``imagefolder``)."""
    return Path(folder).is_dir() and not any((Path(folder) / m).exists() for m in _METADATA)


def gives_edit_pairs(
    source_image_column: str | None,
    edit_prompt_column: str | None,
    dataset_name: str | None,
    train_data_dir: str | None,
) -> bool:
    """Whether a run's data flags give editing pairs, for a family that trains text-to-image
    and editing with one pipeline class (Flux.2): ``--source_image_column`` or
    ``--edit_prompt_column`` given, or a ``--train_data_dir`` pair folder holding at least one
    ``NAME_source`` image."""
    if source_image_column is not None or edit_prompt_column is not None:
        return True
    if dataset_name is not None or train_data_dir is None or not is_pair_folder(train_data_dir):
        return False
    return any(
        p.suffix.lower() in IMAGE_PATH_EXTENSIONS and _SOURCE_NAME.match(p.stem)
        for p in Path(train_data_dir).iterdir()
    )


def read_pair_folder(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The pairs of a pair folder: ``{"name", "image", "sources", "text"}`` per target, sorted by
    name (absolute paths; ``sources`` in their order). Raises ``DataError`` naming the first
    target without its source or ``.txt``, or source without its target."""
    folder = Path(folder)
    targets, sources = {}, {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.suffix.lower() not in IMAGE_PATH_EXTENSIONS:
            continue
        match = _SOURCE_NAME.match(path.stem)
        if match:
            k = int(match["k"]) if match["k"] is not None else -1
            sources.setdefault(match["name"], []).append((k, path))
        else:
            targets[path.stem] = path
    for name, paths in sorted(sources.items()):
        if name not in targets:
            raise DataError(
                f"pair folder {folder}: {paths[0][1].name} has no target image {name}.png (or .jpg, ...)"
            )
    pairs = []
    for name, image in sorted(targets.items()):
        if name not in sources:
            raise DataError(
                f"pair folder {folder}: {image.name} has no source image {name}_source.png (or .jpg, ...)"
            )
        text = folder / f"{name}.txt"
        if not text.is_file():
            raise DataError(f"pair folder {folder}: {image.name} has no instruction file {text.name}")
        ordered = [str(p.resolve()) for _, p in sorted(sources[name])]
        pairs.append({"name": name, "image": str(image.resolve()), "sources": ordered,
                      "text": text.read_text().strip()})  # fmt: skip
    if not pairs:
        raise DataError(f"pair folder {folder} holds no pair (NAME.png + NAME_source.png + NAME.txt)")
    counts = {len(p["sources"]) for p in pairs}
    if len(counts) > 1:
        raise DataError(f"pair folder {folder}: every target needs as many sources; found {sorted(counts)}")
    return pairs


def load_edit_dataset(
    dataset_name: str | None,
    dataset_config_name: str | None,
    train_data_dir: str | None,
    cache_dir: str | None,
    image_column: str = "image",
    source_column: str = SOURCE_COLUMN,
    caption_column: str = "text",
):
    """The editing pairs as a ``datasets.Dataset``: a pair folder (``read_pair_folder``) with
    columns ``image_column`` (target paths), ``source_column`` (lists of source paths) and
    ``caption_column``; otherwise ``images.load_image_caption_dataset``'s dataset as it is."""
    import datasets

    if dataset_name is None and train_data_dir is not None and is_pair_folder(train_data_dir):
        pairs = read_pair_folder(train_data_dir)
        return datasets.Dataset.from_dict(
            {
                image_column: [p["image"] for p in pairs],
                source_column: [p["sources"] for p in pairs],
                caption_column: [p["text"] for p in pairs],
            }
        )
    return load_image_caption_dataset(dataset_name, dataset_config_name, train_data_dir, cache_dir)


def _cells(dataset, column: str) -> list:
    """The column's cells without decoding images (an Image feature read as its dicts)."""
    import datasets

    feature = dataset.features[column]
    if isinstance(feature, datasets.Image):
        return dataset.cast_column(column, datasets.Image(decode=False))[column]
    if isinstance(feature, (datasets.Sequence, datasets.List)) and isinstance(
        feature.feature, datasets.Image
    ):
        return dataset.cast_column(column, datasets.List(datasets.Image(decode=False)))[column]
    return dataset[column]


def check_source_column(dataset, column: str, folder: str | None = None) -> int:
    """The number of source images per row of ``column`` (one image or path per cell, or a list
    of them); raises ``DataError`` for a column that is not there, holds something else, has
    rows with different numbers of sources, or names local files that do not exist (a pair whose
    files are missing: the count and the first of them)."""
    if column not in dataset.column_names:
        raise DataError(
            f"--source_image_column {column!r} is not a dataset column; columns are: {', '.join(dataset.column_names)}"
        )
    cells = _cells(dataset, column)
    counts, missing, root = set(), [], None
    if folder is not None and os.path.isdir(folder):
        root = os.path.abspath(folder)
    for row, cell in enumerate(cells):
        values = list(cell) if isinstance(cell, (list, tuple)) else [cell]
        counts.add(len(values))
        for value in values:
            if isinstance(value, str):
                if os.path.splitext(value)[1].lower() not in IMAGE_PATH_EXTENSIONS:
                    raise DataError(
                        f"--source_image_column {column!r}, row {row}: {value!r} is not an image path"
                    )
                path = resolve_path(value, root)
                if "://" not in path and not os.path.exists(path):
                    missing.append(path)
            elif not (isinstance(value, dict) or hasattr(value, "convert")):
                raise DataError(
                    f"--source_image_column {column!r}, row {row}: holds {type(value).__name__}, not an image"
                )
    if len(counts) > 1 or 0 in counts:
        raise DataError(
            f"--source_image_column {column!r}: every row needs the same number of source images (found "
            f"{sorted(counts)})"
        )
    if missing:
        raise DataError(f"{len(missing)} source image(s) missing, e.g. {missing[0]!r}")
    return counts.pop()


def resolve_path(path: str, root: str | None) -> str:
    """``path`` joined to ``root`` when relative (URLs and absolute paths as they are)."""
    if root is not None and "://" not in path and not os.path.isabs(path):
        return os.path.join(root, path)
    return path


def open_image(value, root: str | None = None):
    """A PIL image of a source cell's value: a decoded image, ``datasets``' undecoded dict, or
    a path."""
    import io

    from PIL import Image

    if hasattr(value, "convert"):
        return value
    if isinstance(value, dict):
        return Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else Image.open(value["path"])
    return Image.open(resolve_path(value, root))


def transform_like(image, crop: CropInfo, interpolation: str = "bilinear") -> torch.Tensor:
    """An image taken through another image's geometry ``crop``: resized to the size that one
    was resized to (whatever its own size), flipped as it was, cropped at the same place; CHW
    float in [-1, 1]. For the target itself it gives the target's own pixels."""
    from PIL import Image

    from .images import resample_filter

    image = image.convert("RGB").resize(
        (crop.resized_size[1], crop.resized_size[0]), resample_filter(interpolation)
    )
    if crop.flipped:  # the crop's corner is measured in the flipped image
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    top, left = crop.crop_top_left
    th, tw = crop.target_size
    image = image.crop((left, top, left + tw, top + th))
    arr = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class PairedImageDataset(ImageCaptionDataset):
    """``ImageCaptionDataset`` items of the targets with their sources: ``source_pixel_values``
    ``(K, 3, H, W)``, each source cropped and flipped as its target (``transform_like``).

    ``source_column`` holds one source per row or a list of them (``check_source_column``);
    relative paths resolve against ``source_root``.
    """

    def __init__(self, *args, source_column: str = SOURCE_COLUMN, source_root: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.source_column, self.source_root = source_column, source_root

    def paired_items(self, row: dict, crop: CropInfo) -> dict:
        cell = row[self.source_column]
        values = list(cell) if isinstance(cell, (list, tuple)) else [cell]
        try:
            sources = [
                transform_like(open_image(v, self.source_root), crop, self.interpolation) for v in values
            ]
        except OSError as e:
            raise DataError(f"cannot read a source image of a pair ({type(e).__name__}: {e})") from e
        return {"source_pixel_values": torch.stack(sources)}
