"""--streaming: an epoch's order independent of the number of processes and loader workers,
resumed at the first unseen row, rows decoded per rank (an unreadable one replaced), webdataset
shards; and end to end, a streamed run resumed on another number of processes equal to the
uninterrupted one."""

from __future__ import annotations

import io
import re
import shutil

import pytest
import torch

from diffusers_zero3.data.images import ImageCaptionDataset
from diffusers_zero3.data.pixels import RowsToPixels
from diffusers_zero3.data.streaming import (
    StreamedExamples,
    StreamedRows,
    load_streamed_dataset,
    streamed_loader,
)
from tests.distributed_harness import accelerate_launch, run_launcher, step_values


@pytest.fixture(autouse=True)
def _no_shutdown_sleep(monkeypatch):
    """datasets sleeps 5 s whenever a stream read with threads ends (its workaround for
    apache/arrow#45214, at interpreter shutdown); these tests end a dozen streams."""
    import datasets

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def _png(colour, size=(24, 16), corrupt=False) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()[:30] if corrupt else buf.getvalue()


def _parquet_shards(folder, rows=24, shards=3, corrupt=()):
    """``rows`` images in ``shards`` parquet files (a stream of several shards: their order is
    shuffled per epoch too); image i is coloured (i, 0, 0)."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    per = rows // shards
    for s in range(shards):
        ids = range(s * per, (s + 1) * per)
        ds = datasets.Dataset.from_dict(
            {"image": [{"bytes": _png((i * 9, 0, 0), corrupt=i in corrupt), "path": None} for i in ids],
             "text": [f"row {i}" for i in ids]},
            features=features,
        )  # fmt: skip
        ds.to_parquet(str(folder / f"train-{s:05d}-of-{shards:05d}.parquet"))
    return folder


def _row_ids(items) -> list[int]:
    return [int(item["row"]["text"].split()[1]) for item in items]


def _shard_of(rows: StreamedRows, processes: int, batch: int, rank: int) -> list[dict]:
    """What one rank's prepared loader gets: accelerate's IterableDatasetShard over the rows."""
    from accelerate.data_loader import IterableDatasetShard

    shard = IterableDatasetShard(
        rows, batch_size=batch, drop_last=True, num_processes=processes, process_index=rank
    )
    loader = torch.utils.data.DataLoader(shard, batch_size=batch, collate_fn=list)
    return [item for b in loader for item in b]


@pytest.mark.unit
def test_an_epochs_order_is_the_same_on_any_number_of_processes(tmp_path):
    source = load_streamed_dataset(str(_parquet_shards(tmp_path / "data")))
    rows = StreamedRows(source, "image", global_batch=4, seed=3, shuffle_buffer_size=8)
    whole = _row_ids(_shard_of(rows, 1, 4, 0))
    assert sorted(whole) == list(range(24)) and whole != list(range(24))  # every row once, shuffled
    two = [_row_ids(_shard_of(rows, 2, 2, r)) for r in range(2)]
    dealt = [i for k in range(0, 12, 2) for r in range(2) for i in two[r][k : k + 2]]
    assert dealt == whole  # 2 ranks of 2: each global batch of 4 dealt out, rank 0's half first
    rows.set_epoch(1)
    assert _row_ids(_shard_of(rows, 1, 4, 0)) != whole  # another epoch, another order
    assert [item["index"] for item in _shard_of(rows, 1, 4, 0)] == list(range(24))  # positions in the epoch


@pytest.mark.unit
def test_a_resumed_epoch_goes_on_at_the_first_unseen_row(tmp_path):
    source = load_streamed_dataset(str(_parquet_shards(tmp_path / "data")))
    full = StreamedRows(source, "image", global_batch=4, seed=1, shuffle_buffer_size=6)
    full.set_epoch(2)
    order = _row_ids(_shard_of(full, 1, 4, 0))
    resumed = StreamedRows(source, "image", global_batch=6, seed=1, shuffle_buffer_size=6)  # 3 processes x 2
    resumed.start_at(2, full.position_after(2, 3))  # 3 global batches of 4 were trained
    assert resumed.position_after(2, 1) == 18
    resumed.set_epoch(2)
    ranks = [_shard_of(resumed, 3, 2, r) for r in range(3)]
    # each global batch of 6 dealt out, rank 0's 2 rows first: put back in the order trained
    dealt = [item for k in range(0, len(ranks[0]), 2) for r in range(3) for item in ranks[r][k : k + 2]]
    assert _row_ids(dealt) == order[12:]  # the uninterrupted epoch's rows, in its order
    assert [item["index"] for item in dealt] == list(range(12, 24))  # at the positions it trains them
    resumed.set_epoch(3)  # the next epoch starts from its beginning
    assert len(_shard_of(resumed, 1, 6, 0)) == 24


@pytest.mark.unit
def test_each_rank_decodes_its_rows_and_an_unreadable_one_is_replaced(tmp_path, caplog):
    source = load_streamed_dataset(str(_parquet_shards(tmp_path / "data", rows=8, shards=1, corrupt={5})))
    rows = StreamedRows(source, "image", global_batch=4, seed=0, shuffle_buffer_size=0)
    items = _shard_of(rows, 1, 4, 0)
    assert isinstance(items[0]["row"]["image"], dict)  # undecoded bytes until the collate
    examples = ImageCaptionDataset(
        [],
        RowsToPixels(
            resolution=16,
            random_flip=True,
            seed=0,
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 2, dtype=torch.long)},
        ),
    )
    collate = StreamedExamples(examples, "image", threads=2)
    batch = collate(items[4:8])  # rows 4..7, row 5 corrupt
    assert batch["pixel_values"].shape == (4, 3, 16, 16)
    assert batch["index"].tolist() == [4, 6, 6, 7]  # row 5 stood in for by a readable row of its batch
    assert "skipping streamed row 5: unreadable image" in caplog.text
    assert collate.skipped_rows == {(0, 5)}  # counted for the end-of-run summary
    red = (batch["pixel_values"][:, 0, 0, 0] + 1) * 127.5
    assert red.round().tolist() == [36.0, 54.0, 54.0, 63.0]  # the rows' own colours, decoded
    loader = streamed_loader(rows, collate, batch_size=4)
    assert [b["index"].tolist() for b in loader][0] == [0, 1, 2, 3]


@pytest.mark.unit
def test_webdataset_shards_stream_with_their_extension_columns(tmp_path):
    import tarfile

    folder = tmp_path / "wds"
    folder.mkdir()
    for s in range(2):
        with tarfile.open(folder / f"shard-{s:05d}.tar", "w") as tar:
            for i in range(3):
                for ext, data in (("png", _png((50 * i, 0, 0))), ("txt", f"a red square {s}-{i}".encode())):
                    info = tarfile.TarInfo(f"{s:02d}{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    source = load_streamed_dataset(str(folder))
    rows = StreamedRows(source, "png", global_batch=2, seed=0, shuffle_buffer_size=4)
    items = _shard_of(rows, 1, 2, 0)
    assert len(items) == 6 and {it["row"]["txt"] for it in items} == {
        f"a red square {s}-{i}" for s in range(2) for i in range(3)
    }


@pytest.mark.e2e
def test_a_streamed_run_resumed_on_another_number_of_processes_equals_the_uninterrupted_one(
    default_data, tmp_path
):
    """2 ranks of 2 for 4 steps (checkpoint at 2), then from checkpoint-2 on 1 process of 4: the
    same global batches, each sample's own noise, the optimizer state re-cut: steps 3-4 repeat."""
    pipe, _, _ = default_data
    data = _parquet_shards(tmp_path / "data", rows=24, shards=3)
    common = ["--pretrained_model_name_or_path", pipe, "--dataset_name", str(data), "--streaming",
              "--shuffle_buffer_size", "8", "--resolution", "16", "--random_flip", "--max_train_steps", "4",
              "--checkpointing_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3",
              "--report_to", "none"]  # fmt: skip
    out = tmp_path / "n2"
    _, log = run_launcher([*accelerate_launch("scripts/train_text_to_image.py"), *common, "--train_batch_size", "2",
                           "--output_dir", str(out)], timeout=400)  # fmt: skip
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    assert "streaming" in log and "3 shard(s)" in log
    # each rank decodes its own rows: 4 steps x 2, and the micro-batch the loader reads ahead
    # (accelerate's dispatcher had rank 0 decode every row and rank 1 none)
    decoded = re.search(r"streamed rows decoded per rank: (\d+), (\d+)", log)
    assert decoded and [int(n) for n in decoded.groups()] == [10, 10], log[-3000:]
    resumed = tmp_path / "n1"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    _, log1 = run_launcher([*accelerate_launch("scripts/train_text_to_image.py", num_processes=1), *common,
                            "--train_batch_size", "4", "--output_dir", str(resumed),
                            "--resume_from_checkpoint", "latest"], timeout=400)  # fmt: skip
    again = step_values(log1)
    assert sorted(again) == [3, 4], log1[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=1e-5), (step, again, losses)
