"""Image datasets written by other tools: a local folder of parquet files whose image column holds
paths relative to the folder. The paths resolve against the folder (not the working directory),
the column becomes images, a missing file is skipped like a corrupt image, and a caption column
given as the image column still gets a clear error."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.unit

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}


def _tokenize(captions):
    return {"input_ids": torch.tensor([[len(c)] for c in captions])}


def _parquet_folder(folder, names, absolute=()):
    """``folder/train.parquet`` listing ``images/<name>.png`` (written unless its name starts with
    ``missing``) and the absolute paths ``absolute``, captioned by their names."""
    import datasets
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    for name in names:
        if not name.startswith("missing"):
            Image.new("RGB", (8, 8), COLOURS[name]).save(folder / "images" / f"{name}.png")
    paths = [f"images/{n}.png" for n in names] + [str(p) for p in absolute]
    captions = [f"a {n} square" for n in names] + [f"an image at {p}" for p in absolute]
    datasets.Dataset.from_dict({"image": paths, "text": captions}).to_parquet(str(folder / "train.parquet"))
    return folder


def test_relative_image_paths_in_a_parquet_folder_load_and_decode(tmp_path, monkeypatch):
    import datasets
    from PIL import Image

    from diffusers_zero3.data.images import (
        ImageCaptionDataset,
        load_image_caption_dataset,
        prepare_image_column,
    )
    from diffusers_zero3.data.pixels import RowsToPixels

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    Image.new("RGB", (8, 8), COLOURS["green"]).save(elsewhere / "green.png")
    _parquet_folder(tmp_path / "data", ["red", "blue"], absolute=[elsewhere / "green.png"])
    monkeypatch.chdir(tmp_path)  # --dataset_name data: a folder relative to the working directory
    ds = load_image_caption_dataset("data")
    assert ds.features["image"] == datasets.Value("string")
    ds = prepare_image_column(ds, "image", "data")
    assert isinstance(ds.features["image"], datasets.Image)
    monkeypatch.chdir(elsewhere)  # resolved once, against the folder: the working directory no longer matters
    assert [ds[i]["image"].getpixel((0, 0)) for i in range(3)] == [
        COLOURS["red"],
        COLOURS["blue"],
        COLOURS["green"],  # an absolute path is kept
    ]
    items = ImageCaptionDataset(ds, RowsToPixels(resolution=8, tokenize=_tokenize))
    item = items[1]
    assert item["pixel_values"].shape == (3, 8, 8) and item["index"] == 1 and not items.skipped_rows
    blue = torch.tensor(COLOURS["blue"], dtype=torch.float32) / 127.5 - 1
    torch.testing.assert_close(item["pixel_values"].mean(dim=(1, 2)), blue, atol=2e-2, rtol=0)
    # a column of images is returned as it is
    assert prepare_image_column(ds, "image", "data") is ds


def test_a_missing_image_file_is_skipped_and_counted(tmp_path, caplog):
    from diffusers_zero3.data.images import (
        ImageCaptionDataset,
        is_readable_image,
        load_image_caption_dataset,
        prepare_image_column,
    )
    from diffusers_zero3.data.pixels import RowsToPixels

    folder = _parquet_folder(tmp_path / "data", ["red", "missing", "blue"])
    ds = prepare_image_column(load_image_caption_dataset(str(folder)), "image", str(folder))
    assert [is_readable_image(ds, i, "image") for i in range(3)] == [True, False, True]  # the cache's check
    items = ImageCaptionDataset(ds, RowsToPixels(resolution=8, tokenize=_tokenize))
    with caplog.at_level(logging.WARNING, logger="diffusers_zero3"):
        assert [items[i]["index"] for i in range(3)] == [0, 2, 2]  # the skipped row: the next readable one
    assert items.skipped_rows == {1}
    assert sum("skipping row 1: unreadable image" in r.getMessage() for r in caplog.records) == 1


def test_a_caption_column_as_the_image_column_is_still_an_error(tmp_path):
    import datasets

    from diffusers_zero3.data.images import DataError, load_image_caption_dataset, prepare_image_column

    folder = _parquet_folder(tmp_path / "data", ["red", "blue"])
    ds = load_image_caption_dataset(str(folder))
    with pytest.raises(DataError, match="--image_column 'text' holds string values, not images"):
        prepare_image_column(ds, "text", str(folder))
    # relative paths of a dataset that is not a local folder (a hub dataset): nothing to resolve against
    with pytest.raises(DataError, match="relative image paths .*'images/red.png'.* not a local folder"):
        prepare_image_column(ds, "image", "someone/a-hub-dataset")
    # absolute paths need no folder
    absolute = datasets.Dataset.from_dict({"image": [str(folder / "images" / "red.png")], "text": ["a"]})
    assert prepare_image_column(absolute, "image")[0]["image"].getpixel((0, 0)) == COLOURS["red"]
