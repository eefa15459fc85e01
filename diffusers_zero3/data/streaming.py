"""Streamed image-caption data (``--streaming``): rows read as training goes, never downloaded
or decoded up front, resumed exactly on any number of processes.

``datasets`` streams a hub dataset, a local folder of parquet shards, a folder of webdataset
``.tar`` shards or an imagefolder. An epoch's order is the stream shuffled with a buffer
(``--shuffle_buffer_size``; the shards' order and the buffer's draws seeded by ``(seed,
epoch)``): one order, whatever the number of processes. It is cut into global batches of
``processes x --train_batch_size`` rows, each dealt out to the ranks as accelerate's
``IterableDatasetShard`` does (rank r takes rows ``r*b .. r*b+b-1`` of each), so a run on 2
processes of 2 and one on 1 of 4 train the same batches.

Every rank reads every row's bytes, but decodes only its own: the image column is read
undecoded and ``StreamedExamples`` (the loader's ``collate_fn``, in its workers) decodes and
crops the rank's rows. Where an epoch stands is one number, the rows consumed
(``StreamedRows.position_after``), which a checkpoint stores: a resume on any number of
processes skips that many rows of the epoch's order (reading, not decoding them) and goes on
at the first unseen one. A row that does not decode is replaced by another row of its
micro-batch and named in a warning.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import torch

from ..errors import DataError
from .images import (
    IMAGE_ROWS_SAMPLED,
    ImageCaptionDataset,
    collate,
    image_column_layout,
    image_path_root,
    resolve_struct_paths,
    unstored_image_paths,
)

logger = logging.getLogger("diffusers_zero3.data.streaming")


def load_streamed_dataset(
    dataset_name: str | None,
    dataset_config_name: str | None = None,
    train_data_dir: str | None = None,
    cache_dir: str | None = None,
    split: str = "train",
):
    """The ``split`` of a hub or local dataset (``--dataset_name``: parquet or webdataset
    shards, ...) or an imagefolder (``--train_data_dir``) as a ``datasets.IterableDataset``."""
    import os

    import datasets

    try:
        if dataset_name is not None:
            streams = datasets.load_dataset(
                dataset_name, dataset_config_name, cache_dir=cache_dir, streaming=True
            )
        elif train_data_dir is not None and os.path.isdir(train_data_dir):
            streams = datasets.load_dataset("imagefolder", data_dir=train_data_dir, streaming=True)
        else:
            raise DataError(
                f"--streaming needs --dataset_name or a --train_data_dir folder, got {train_data_dir!r}"
            )
    except (FileNotFoundError, ValueError, ConnectionError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"cannot stream the dataset {dataset_name or train_data_dir!r}: {e}") from e
    if split not in streams:
        raise DataError(f"dataset has no {split!r} split (splits: {sorted(streams)})")
    return streams[split]


def prepare_streamed_image_column(source, image_column: str, folder: str | None = None):
    """``source`` (a ``datasets.IterableDataset``) with ``image_column`` holding images, as
    ``images.prepare_image_column`` makes a loaded dataset's; raises ``DataError`` naming the
    column and what it holds when it cannot.

    The column's layout (``images.image_column_layout``: ``datasets`` Images; ``struct<bytes,
    path>``, image bytes or image paths as pyarrow, pandas or img2dataset write them, without
    ``datasets``' feature metadata) is told from its declared type and its first rows (read, not
    decoded). Relative paths are joined to ``folder`` (``--dataset_name`` or
    ``--train_data_dir``) lazily, row by row as the stream is read.

    Example: a folder of parquet shards written by ``pyarrow.parquet.write_table`` with a
    ``jpg`` column of JPEG bytes: ``prepare_streamed_image_column(stream, "jpg", folder)`` is
    the stream with ``jpg`` as ``datasets.Image()``.
    """
    import datasets

    feature = (source.features or {}).get(image_column)
    if isinstance(feature, datasets.Image):
        return source
    sample = [row[image_column] for row in itertools.islice(source, IMAGE_ROWS_SAMPLED)]
    layout = image_column_layout(feature, sample, image_column, source.column_names or [image_column])
    paths = unstored_image_paths(layout, sample)
    root = image_path_root(image_column, paths, folder)
    # every layout read undecoded is {"bytes", "path"}: one resolution of the relative paths for all
    source = source.cast_column(image_column, datasets.Image(decode=False))
    if root is not None and paths:
        source = source.map(resolve_struct_paths(image_column, root), batched=True, features=source.features)
    return source.cast_column(image_column, datasets.Image())


class StreamedRows(torch.utils.data.IterableDataset):
    """The rows of a streamed dataset in an epoch's order, each with its position ``index``.

    ``source`` is a ``datasets.IterableDataset``; ``image_column`` is read undecoded
    (``{"bytes", "path"}``). Yields ``{"row": row, "index": k}`` for the epoch's rows from its
    start (or from ``start_at``'s position), whole global batches of ``global_batch`` rows
    (the rest of an epoch is dropped). Iterate it in the main process: inside a loader worker
    ``datasets`` would give each worker some of the shards (another order);
    ``StreamedExamples`` decodes in threads instead. ``skipped_rows`` is filled by the
    ``StreamedExamples`` given it (the rows are decoded there): the trainer's summary reads it
    as it reads a map-style dataset's.
    """

    def __init__(
        self, source, image_column: str, *, global_batch: int, seed: int = 0, shuffle_buffer_size: int = 1000
    ):
        import datasets

        self.source = source.cast_column(image_column, datasets.Image(decode=False))
        self.image_column = image_column
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle_buffer_size = shuffle_buffer_size
        self.epoch = 0
        self.resumed: dict[int, int] = {}  # epoch -> rows of it consumed before this run resumed it
        self.skipped_rows: set = set()  # (epoch, position) of rows StreamedExamples could not read

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, epoch: int, rows: int) -> None:
        """Make ``epoch`` begin after its first ``rows`` rows (a resume)."""
        self.resumed = {epoch: rows}

    def position_after(self, epoch: int, global_batches: int) -> int:
        """Rows of ``epoch`` consumed after ``global_batches`` global batches of this run (from
        the resumed position when the run resumed that epoch): what a checkpoint stores."""
        return self.resumed.get(epoch, 0) + global_batches * self.global_batch

    def order(self, epoch: int):
        """The epoch's stream: shuffled (shards and buffer) from ``(seed, epoch)``."""
        stream = self.source
        if self.shuffle_buffer_size > 0:
            stream = stream.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer_size)
            stream.set_epoch(epoch)
        return stream

    def __iter__(self) -> Iterator[dict]:
        start = self.resumed.get(self.epoch, 0)
        # The first ``start`` rows are read and dropped here: datasets' own skip() on a shuffled
        # stream stops shuffling the shards' order, which would make another order than the epoch's.
        stream = itertools.islice(self.order(self.epoch), start, None)
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("StreamedRows is read in the main process (streamed_loader's num_workers=0)")
        group: list[dict] = []
        for k, row in enumerate(stream, start=start):
            group.append({"row": row, "index": k})
            if len(group) == self.global_batch:
                yield from group
                group = []


class StreamedExamples:
    """The loader's ``collate_fn`` for ``StreamedRows``: decodes this rank's rows and makes
    them training examples as ``ImageCaptionDataset`` does (crop, flip, caption, empty prompt,
    tokens; random draws from ``(seed, epoch, index)``), then stacks them (``images.collate``).

    ``examples`` is an ``ImageCaptionDataset`` (over no rows) that holds the transform's
    settings; the trainer sets its epoch with the rows' (``set_epoch`` on both). With
    ``threads`` > 0 the rows are decoded and cropped in that many threads (PIL releases the GIL
    while it decodes and resizes).
    """

    def __init__(
        self,
        examples: ImageCaptionDataset,
        image_column: str,
        threads: int = 0,
        skipped_rows: set | None = None,
    ):
        self.examples = examples
        self.image_column = image_column
        self.threads = threads
        self._pool = None
        # (epoch, position) of each unreadable row, for the end-of-run count: give StreamedRows'
        # skipped_rows to share it (the collate runs in the main process)
        self.skipped_rows = skipped_rows if skipped_rows is not None else set()
        self.decoded_rows = 0  # rows this process decoded (its share of each global batch)

    def _map(self, fn, items: list) -> list:
        if self.threads <= 0:
            return [fn(item) for item in items]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="decode")
        return list(self._pool.map(fn, items))

    def _decoded(self, item: dict) -> dict | None:
        import datasets

        row = dict(item["row"])
        self.decoded_rows += 1
        try:
            row[self.image_column] = datasets.Image().decode_example(row[self.image_column])
            row[self.image_column].load()
        except Exception as e:  # PIL raises several types for a corrupt file
            logger.warning(
                "skipping streamed row %d: unreadable image (%s: %s)", item["index"], type(e).__name__, e
            )
            self.skipped_rows.add((self.examples.epoch, item["index"]))
            return None
        return row

    def __call__(self, items: list[dict]) -> dict:
        rows = self._map(self._decoded, items)
        readable = [i for i, row in enumerate(rows) if row is not None]
        if not readable:
            raise DataError(
                f"no readable image in a micro-batch of {len(items)} streamed rows "
                f"(positions {[item['index'] for item in items]})"
            )
        stand_ins = [i if rows[i] is not None else readable[i % len(readable)] for i in range(len(items))]
        return collate(self._map(lambda j: self.examples.example(items[j]["index"], rows[j]), stand_ins))


def streamed_loader(
    rows: StreamedRows, examples: StreamedExamples, batch_size: int, pin_memory: bool = False
) -> torch.utils.data.DataLoader:
    """A DataLoader of ``rows`` in micro-batches of ``batch_size``, decoded by ``examples``
    (in the main process: ``--dataloader_num_workers`` are its decoding threads), pinned with
    ``pin_memory`` (a CUDA host: ``loading.loader_settings``). Deal each global batch out to
    the ranks with ``runtime.context_parallel.group_loader`` (accelerate's
    ``IterableDatasetShard``: each rank decodes its own rows), not with ``accelerator.prepare``,
    whose dispatcher has rank 0 read and decode every row, then broadcast them."""
    return torch.utils.data.DataLoader(
        rows, batch_size=batch_size, collate_fn=examples, drop_last=True, pin_memory=pin_memory
    )
