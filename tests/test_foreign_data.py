"""Image columns as other tools write them: parquet files from ``pyarrow.parquet.write_table``
(no ``datasets`` feature metadata) whose image column is ``struct<bytes, path>``, raw image
bytes (img2dataset's ``jpg``) or file paths (relative to the dataset's folder, or absolute),
beside the ``datasets`` Image feature. Each layout loads and streams (``--streaming``), and
the decoded pixels equal the source images; a column holding none of these is one error that
names it and what it holds, streamed or not."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from diffusers_zero3.data.images import (
    ImageCaptionDataset,
    collate,
    load_image_caption_dataset,
    prepare_image_column,
)
from diffusers_zero3.data.pixels import RowsToPixels
from diffusers_zero3.data.streaming import (
    StreamedExamples,
    StreamedRows,
    load_streamed_dataset,
    prepare_streamed_image_column,
)
from diffusers_zero3.errors import DataError

pytestmark = pytest.mark.unit

SIDE = 8  # the images are SIDE x SIDE and trained at that resolution: the crop is the whole image
ROWS = 4


def _sources() -> list[np.ndarray]:
    """Distinct noise images (every pixel differs between them), as the source to compare to."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8) for _ in range(ROWS)]


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _write(folder, layout: str, sources: list[np.ndarray]) -> str:
    """``folder/train.parquet`` holding ``sources`` in ``layout``, written by pyarrow (by
    ``datasets`` for the ``image`` layout, which is its own); returns the image column's name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    captions = [f"row {i}" for i in range(ROWS)]
    if layout == "image":
        import datasets

        features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
        rows = {"image": [{"bytes": _png(a), "path": None} for a in sources], "text": captions}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / "train.parquet"))
        return "image"
    if layout == "struct":  # as datasets stores an image, with its original file name
        column, values = (
            "image",
            [{"bytes": _png(a), "path": f"photo-{i}.png"} for i, a in enumerate(sources)],
        )
    elif layout == "struct_paths":  # the struct naming files beside the parquet, no bytes
        (folder / "images").mkdir()
        for i, a in enumerate(sources):
            (folder / "images" / f"{i}.png").write_bytes(_png(a))
        column, values = "image", [{"bytes": None, "path": f"images/{i}.png"} for i in range(ROWS)]
    elif layout == "bytes":  # img2dataset's column of encoded images
        column, values = "jpg", [_png(a) for a in sources]
    elif layout == "paths":  # relative to the folder, the last one absolute
        (folder / "images").mkdir()
        for i, a in enumerate(sources):
            (folder / "images" / f"{i}.png").write_bytes(_png(a))
        values = [f"images/{i}.png" for i in range(ROWS - 1)] + [str(folder / "images" / f"{ROWS - 1}.png")]
        column = "image"
    table = pa.Table.from_pylist([{column: v, "text": c} for v, c in zip(values, captions)])
    assert (
        table.schema.metadata is None or b"huggingface" not in table.schema.metadata
    )  # no datasets metadata
    pq.write_table(table, folder / "train.parquet")
    return column


LAYOUTS = ["image", "struct", "struct_paths", "bytes", "paths"]


def _examples(column: str, dataset=()) -> ImageCaptionDataset:
    return ImageCaptionDataset(
        dataset,
        RowsToPixels(
            image_column=column,
            resolution=SIDE,
            center_crop=True,
            seed=0,
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 1, dtype=torch.long)},
        ),
    )


def _expected_pixels(sources) -> torch.Tensor:
    return torch.from_numpy(np.stack(sources).astype(np.float32) / 127.5 - 1.0).permute(0, 3, 1, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_image_layout_loads_with_the_source_pixels(tmp_path, monkeypatch, layout):
    sources = _sources()
    folder = tmp_path / "data"
    column = _write(folder, layout, sources)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the dataset folder, not here
    ds = prepare_image_column(load_image_caption_dataset("data"), column, "data")
    monkeypatch.chdir(tmp_path / "elsewhere")  # decoded from elsewhere: the paths were resolved
    for i, source in enumerate(sources):
        np.testing.assert_array_equal(np.asarray(ds[i][column].convert("RGB")), source)
    examples = _examples(column, ds)
    batch = collate([examples[i] for i in range(ROWS)])
    assert batch["index"].tolist() == list(range(ROWS)) and not examples.skipped_rows
    torch.testing.assert_close(batch["pixel_values"], _expected_pixels(sources), rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_image_layout_streams_with_the_source_pixels(tmp_path, monkeypatch, layout):
    sources = _sources()
    folder = tmp_path / "data"
    column = _write(folder, layout, sources)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    source = prepare_streamed_image_column(load_streamed_dataset("data"), column, "data")
    monkeypatch.chdir(tmp_path / "elsewhere")  # rows are read lazily, the paths already resolved
    rows = StreamedRows(source, column, global_batch=ROWS, seed=0, shuffle_buffer_size=0)
    items = list(rows)
    assert [it["index"] for it in items] == list(range(ROWS))
    collate_fn = StreamedExamples(_examples(column), column)
    batch = collate_fn(items)
    assert not collate_fn.skipped_rows
    assert [int(it["row"]["text"].split()[1]) for it in items] == list(range(ROWS))
    torch.testing.assert_close(batch["pixel_values"], _expected_pixels(sources), rtol=0, atol=1e-6)


def test_a_column_without_images_is_one_error_naming_it_streamed_or_not(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    folder.mkdir()
    rows = [
        {"image": {"bytes": _png(a), "path": None}, "text": f"a caption {i}", "n": i,
         "npy": np.full(4, i, np.float32).tobytes(), "blob": {"bytes": b"\x00" * 16, "path": None}}
        for i, a in enumerate(_sources())
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    cases = {
        "text": "holds string values, not images",
        "n": "holds int64 values, not images",
        "npy": r"holds binary values \(none of the first 4 opens as an image\), not images",
        "blob": r"holds \{bytes, path\} structs of other bytes \(none of the first 4 opens as an image\), not images",
    }
    ds = load_image_caption_dataset(str(folder))
    stream = load_streamed_dataset(str(folder))
    for column, words in cases.items():
        for load in (lambda c: prepare_image_column(ds, c, str(folder)),
                     lambda c: prepare_streamed_image_column(stream, c, str(folder))):  # fmt: skip
            expected = f"--image_column {column!r} {words}.*columns: image, text, n"
            with pytest.raises(DataError, match=expected):
                load(column)
    # the same file's struct column of images is images, both ways
    assert prepare_image_column(ds, "image", str(folder))[0]["image"].size == (SIDE, SIDE)
    streamed = prepare_streamed_image_column(stream, "image", str(folder))
    assert next(iter(streamed))["image"].size == (SIDE, SIDE)
