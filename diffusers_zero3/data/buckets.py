"""Aspect-ratio buckets: each image trained at its own shape, each micro-batch of one shape.

``--use_aspect_ratio_buckets`` with ``--aspect_ratio_buckets "h1,w1;h2,w2;..."`` (diffusers'
flags), or without the list the buckets ``default_buckets`` makes from ``--resolution``:
shapes of about ``resolution**2`` pixels at common aspect ratios, each side a multiple of what
the family's latents need. ``assign_buckets`` gives each image the bucket nearest its aspect
ratio among those that fit inside it (an image is not upscaled when a bucket of its shape
fits), else the nearest ratio overall. The image is then resized to cover the bucket and
cropped to it (``images.transform_image_with_crop``).

``BucketBatchSampler`` orders an epoch so that every rank draws the same bucket at the same
step (a global batch of ``processes x batch`` samples comes from one bucket, then is dealt out
to the ranks): the ranks' work is balanced and a family's per-shape computations (packing,
position ids, SDXL's target size) see one shape per batch. Each bucket's rows run in one
order across epochs (a new permutation each pass), so rows that do not fill a global batch are
trained in the next epoch, and a bucket smaller than one global batch every few epochs. The
order depends only on the seed; where a run stands is the rows consumed per bucket
(``BucketPosition``), which any number of processes can continue from: no row repeats before
its bucket's pass ends and none is skipped.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import DataError

Bucket = tuple[int, int]  # (height, width) in pixels
NO_BUCKET = -1  # a row whose image cannot be read: in no bucket, never drawn

# Height:width ratios of the default buckets (square, 4:3, 3:2, 16:9, 2:1, 5:2 and their
# portraits): the shapes photographs, screens and posters come in.
DEFAULT_RATIOS = (1.0, 3 / 4, 4 / 3, 2 / 3, 3 / 2, 9 / 16, 16 / 9, 1 / 2, 2.0, 2 / 5, 5 / 2)


def parse_buckets(spec: str, multiple: int = 1) -> list[Bucket]:
    """``"h1,w1;h2,w2;..."`` (``--aspect_ratio_buckets``) as a list of ``(height, width)``.

    Raises ``DataError`` naming the entry that is not two positive integers, or whose sides are
    not multiples of ``multiple`` (what the family's VAE and latent packing need)."""
    buckets: list[Bucket] = []
    for entry in (e.strip() for e in spec.split(";")):
        if not entry:
            continue
        parts = [p.strip() for p in entry.split(",")]
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise DataError(
                f"--aspect_ratio_buckets entry {entry!r} is not 'height,width' (two positive integers)"
            )
        h, w = int(parts[0]), int(parts[1])
        if h % multiple or w % multiple:
            raise DataError(
                f"--aspect_ratio_buckets entry {entry!r}: height and width must be multiples of {multiple} "
                "for this model"
            )
        if (h, w) not in buckets:
            buckets.append((h, w))
    if not buckets:
        raise DataError(f"--aspect_ratio_buckets {spec!r} names no bucket")
    return buckets


def default_buckets(resolution: int, multiple: int, ratios: Sequence[float] = DEFAULT_RATIOS) -> list[Bucket]:
    """Buckets of about ``resolution x resolution`` pixels at ``ratios`` (height / width), each
    side rounded to a multiple of ``multiple``; the square ``(resolution, resolution)`` first."""
    buckets: list[Bucket] = []
    for ratio in ratios:
        h = max(multiple, round(resolution * math.sqrt(ratio) / multiple) * multiple)
        w = max(multiple, round(resolution / math.sqrt(ratio) / multiple) * multiple)
        if (h, w) not in buckets:
            buckets.append((h, w))
    return buckets


def nearest_bucket(height: int, width: int, buckets: Sequence[Bucket]) -> int:
    """The index of the bucket for an image of ``height x width``: the nearest aspect ratio
    (in log space, so 1:2 and 2:1 are equally far from square) among the buckets that fit
    inside the image, else among all; ties go to the larger bucket, then the earlier one."""
    fitting = [i for i, (h, w) in enumerate(buckets) if h <= height and w <= width]
    candidates = fitting or range(len(buckets))
    ratio = math.log(height / width)
    return min(
        candidates,
        key=lambda i: (
            round(abs(math.log(buckets[i][0] / buckets[i][1]) - ratio), 9),
            -buckets[i][0] * buckets[i][1],
            i,
        ),
    )


# EXIF orientations that turn an image a quarter (transpose, 90 degrees, transverse, 270):
# ``ImageOps.exif_transpose``, which ``datasets`` applies when it decodes, swaps their sides.
ORIENTATION_TAG = 0x0112
QUARTER_TURNS = (5, 6, 7, 8)
# PNG chunks that can carry an orientation (eXIf; XMP in iTXt; ImageMagick's raw exif profile in
# tEXt/zTXt): PIL reads those after the pixels only when it decodes them.
_PNG_ORIENTATION_CHUNKS = (b"eXIf", b"iTXt", b"tEXt", b"zTXt")


def _png_orientation_after_pixels(source) -> bool:
    """True when the PNG ``source`` (a path or bytes) has a chunk that may carry an orientation
    after its first IDAT. Walks the chunk headers; nothing is decompressed."""
    import struct

    with open(source, "rb") if isinstance(source, str) else io.BytesIO(source) as f:
        f.seek(8)  # the signature
        pixels = False
        while len(head := f.read(8)) == 8:
            length, kind = struct.unpack(">I4s", head)
            if kind == b"IEND":
                break
            if kind == b"IDAT":
                pixels = True
            elif pixels and kind in _PNG_ORIENTATION_CHUNKS:
                return True
            f.seek(length + 4, io.SEEK_CUR)  # the data and its CRC
    return False


def _orientation(image, source=None) -> int | None:
    """The EXIF orientation ``datasets`` will apply to ``image`` (PIL's ``getexif``, which also
    reads an XMP ``tiff:Orientation``), from its header when it was opened from ``source`` and
    not decoded: a PNG's ``getexif`` would decode the pixels to reach chunks after them, so it is
    asked only when such a chunk exists."""
    from PIL import Image, PngImagePlugin

    if (
        source is not None
        and isinstance(image, PngImagePlugin.PngImageFile)
        and "exif" not in image.info
        and not _png_orientation_after_pixels(source)
    ):
        return Image.Image.getexif(image).get(ORIENTATION_TAG)  # the header's chunks, without a load
    return image.getexif().get(ORIENTATION_TAG)


def image_size(value) -> tuple[int, int] | None:
    """``(height, width)`` of an image as ``datasets`` decodes it, from an image as it stores it
    undecoded (``{"bytes", "path"}``: the header only, the pixels not decoded) or a PIL image;
    None when it cannot be read.

    The size is the one after ``ImageOps.exif_transpose`` (which ``datasets`` applies): a photo
    stored 4000 x 3000 with EXIF orientation 6 (a phone held upright) is 3000 wide, 4000 high.

    Example: ``image_size({"bytes": jpeg_stored_80_wide_40_high_orientation_6, "path": None})``
    is ``(80, 40)``.
    """
    from PIL import Image

    try:
        if hasattr(value, "size") and not isinstance(value, dict):
            # a PIL image: one datasets decoded is transposed already (its orientation removed)
            width, height = value.size
            orientation = _orientation(value)
        else:
            data = value.get("bytes")
            source = data or value.get("path")
            if source is None:
                return None
            with Image.open(io.BytesIO(data) if data else source) as image:
                width, height = image.size
                orientation = _orientation(image, source)
        return (width, height) if orientation in QUARTER_TURNS else (height, width)
    except Exception:  # PIL raises several types for a file that is not an image
        return None


def image_sizes(
    dataset, image_column: str, rows: Sequence[int] | None = None
) -> list[tuple[int, int] | None]:
    """``(height, width)`` of each row's image (``rows``, default all), from the file headers
    without decoding the pixels; None for an image that cannot be read."""
    import datasets

    if isinstance(dataset, datasets.Dataset):
        dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    rows = range(len(dataset)) if rows is None else rows
    return [image_size(dataset[int(i)][image_column]) for i in rows]


def assign_buckets(sizes: Sequence[tuple[int, int] | None], buckets: Sequence[Bucket]) -> list[int]:
    """The bucket index of each image size (``NO_BUCKET`` for an unreadable image)."""
    return [NO_BUCKET if s is None else nearest_bucket(s[0], s[1], buckets) for s in sizes]


@dataclass
class BucketPosition:
    """Where a ``BucketBatchSampler`` stands: in ``epoch``, ``consumed[b]`` rows of bucket
    ``b``'s order (which runs on across epochs, one pass after another) are trained. What a
    checkpoint records to resume exactly, on any number of processes."""

    epoch: int = 0
    consumed: dict[int, int] = field(default_factory=dict)

    def to_state(self) -> dict:
        return {"epoch": self.epoch, "bucket_position": {str(b): n for b, n in sorted(self.consumed.items())}}

    @classmethod
    def from_state(cls, state: dict) -> BucketPosition:
        """The position a checkpoint's state holds. ``ValueError`` for the older layout
        (``bucket_consumed``: counts within an epoch whose remainders were dropped)."""
        if "bucket_position" not in state:
            raise ValueError(
                "the checkpoint records its bucket position in an older layout (before a bucket's "
                "remainder went on into the next epoch): it cannot be continued exactly"
            )
        return cls(int(state["epoch"]), {int(b): int(n) for b, n in state["bucket_position"].items()})


class BucketBatchSampler:
    """Batches of dataset rows, each of one bucket, for ``num_processes`` ranks in turn.

    Yields the batches of every rank, rank 0's first, for one global batch after another (the
    order ``accelerate``'s ``BatchSamplerShard`` deals out: batch ``k`` to rank ``k % N``).

    Each bucket's rows form one order across epochs: pass ``k`` over the bucket is a
    permutation seeded by ``(seed, k, bucket)``, and pass ``k + 1`` follows it. A global batch
    takes the next ``num_processes x batch_size`` rows of one bucket's order, possibly across
    the end of a pass. In epoch ``e`` a bucket of ``n`` rows gives as many global batches as
    keep its position at most ``(e + 1) x n``: its rows that do not fill a global batch go on
    into the next epoch, so every row is trained, also in a bucket smaller than one global
    batch (trained every few epochs; such a global batch may hold a row twice). The bucket of
    each global batch is drawn with probability proportional to the global batches it has left
    in the epoch, from a generator seeded by ``(seed, epoch, position)``.

    ``set_epoch(e)`` selects the epoch; ``start_at(position)`` makes the run continue from it
    (a resume: ``position.epoch`` from there, later epochs after it); ``position_after(epoch,
    k, start)`` is where ``k`` global batches of that epoch lead. None of these depend on the
    number of processes except through the global batch size, so a position written by one run
    is continued by another of any size: each bucket's order goes on at its first unseen row.
    """

    drop_last = True

    def __init__(self, row_buckets: Sequence[int], batch_size: int, num_processes: int = 1, seed: int = 0):
        self.batch_size = batch_size  # per process, as accelerate's BatchSamplerShard reads it
        self.num_processes = num_processes
        self.seed = seed
        self.epoch = 0
        self._start: BucketPosition | None = None
        self.rows: dict[int, list[int]] = {}
        for row, bucket in enumerate(row_buckets):
            if bucket != NO_BUCKET:
                self.rows.setdefault(int(bucket), []).append(row)
        if not self.rows:
            raise DataError("no readable image to bucket")
        self._orders: dict[tuple[int, int], list[int]] = {}

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_processes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, position: BucketPosition) -> None:
        """Continue from ``position``: its epoch from there, and every later epoch after it."""
        self._start = position

    def _order(self, bucket: int, cycle: int) -> list[int]:
        """Pass ``cycle`` over ``bucket``'s rows (the pass in the seed: each pass its own order)."""
        key = (bucket, cycle)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.rows):  # only the last few passes are read again
                self._orders.clear()
            rows = list(self.rows[bucket])
            random.Random(f"{self.seed}-{cycle}-bucket-{bucket}").shuffle(rows)
            self._orders[key] = rows
        return self._orders[key]

    def _rows_of(self, bucket: int, begin: int, end: int) -> list[int]:
        """Positions ``begin`` to ``end`` of ``bucket``'s order across passes."""
        n = len(self.rows[bucket])
        return [self._order(bucket, k // n)[k % n] for k in range(begin, end)]

    def _left(self, epoch: int, bucket: int, position: int) -> int:
        """The global batches ``bucket`` still gives ``epoch`` from ``position`` in its order."""
        return max(0, ((epoch + 1) * len(self.rows[bucket]) - position) // self.global_batch)

    def _epoch_start(self, epoch: int, start: BucketPosition | None) -> dict[int, int]:
        """Each bucket's position where ``epoch`` begins (or where ``start`` has it, in
        ``start``'s epoch), every earlier epoch run to its end after ``start``."""
        if start is None or start.epoch > epoch:
            # from the beginning every epoch ends at whole global batches: the closed form
            size = self.global_batch
            return {b: epoch * len(r) // size * size for b, r in self.rows.items()}
        positions = {b: start.consumed.get(b, 0) for b in self.rows}
        for e in range(start.epoch, epoch):
            positions = {b: p + self._left(e, b, p) * self.global_batch for b, p in positions.items()}
        return positions

    def _draws(self, epoch: int, positions: dict[int, int]) -> Iterator[int]:
        """The bucket of each next global batch of ``epoch`` from ``positions`` on (updated)."""
        while True:
            left = {b: self._left(epoch, b, positions[b]) for b in sorted(self.rows)}
            left = {b: n for b, n in left.items() if n > 0}
            if not left:
                return
            rng = random.Random(f"{self.seed}-{epoch}-draw-{sum(positions.values())}")
            bucket = rng.choices(list(left), weights=list(left.values()))[0]
            positions[bucket] += self.global_batch
            yield bucket

    def global_batches(
        self, epoch: int, start: BucketPosition | None = None
    ) -> Iterator[tuple[int, list[int]]]:
        """``(bucket, rows)`` of each global batch of ``epoch``, from ``start`` on (default the
        position ``start_at`` gave)."""
        positions = self._epoch_start(epoch, start or self._start)
        for bucket in self._draws(epoch, positions):
            end = positions[bucket]
            yield bucket, self._rows_of(bucket, end - self.global_batch, end)

    def position_after(
        self, epoch: int, global_batches: int, start: BucketPosition | None = None
    ) -> BucketPosition:
        """Where ``global_batches`` global batches of ``epoch`` (from ``start``, default the
        position ``start_at`` gave) lead; the next epoch's start when they end it."""
        positions = self._epoch_start(epoch, start or self._start)
        draws = self._draws(epoch, positions)
        for _ in range(global_batches):
            if next(draws, None) is None:
                break
        if next(self._draws(epoch, dict(positions)), None) is None:
            return BucketPosition(epoch + 1, positions)
        return BucketPosition(epoch, positions)

    def batches_in_epoch(self, epoch: int) -> int:
        """Global batches ``epoch`` gives (from the ``start_at`` position in its epoch)."""
        positions = self._epoch_start(epoch, self._start)
        return sum(self._left(epoch, b, p) for b, p in positions.items())

    def min_batches_per_epoch(self) -> int:
        """Global batches every whole epoch gives at least: each bucket's whole global batches
        (its remainder from the epoch before only adds)."""
        return sum(len(r) // self.global_batch for r in self.rows.values())

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batch_size
        for _, rows in self.global_batches(self.epoch):
            for rank in range(self.num_processes):
                yield rows[rank * b : (rank + 1) * b]

    def __len__(self) -> int:
        """Batches of the current epoch, all ranks' together."""
        return self.batches_in_epoch(self.epoch) * self.num_processes

    def bucket_counts(self) -> dict[int, int]:
        """Readable rows per bucket."""
        return {b: len(r) for b, r in sorted(self.rows.items())}


def bucket_rows(dataset, image_column: str, buckets: Sequence[Bucket]) -> list[int]:
    """Each row's bucket index (``NO_BUCKET`` for an image that cannot be read), every rank
    reading the headers of its own share of the rows. Collective: call on every rank."""
    from ..runtime.distributed import all_gather_object, get_rank, get_world_size

    rank, world = get_rank(), get_world_size()
    per_rank = -(-len(dataset) // world)
    mine = range(rank * per_rank, min(len(dataset), (rank + 1) * per_rank))
    shares = all_gather_object(assign_buckets(image_sizes(dataset, image_column, mine), buckets))
    return [b for share in shares for b in share]


def describe_buckets(
    buckets: Sequence[tuple[int, ...]], row_buckets: Sequence[int], global_batch: int
) -> str:
    """One log line: images (clips, for ``(frames, height, width)`` buckets) per bucket, and how
    many of them the first epoch trains (whole global batches of ``global_batch``; each
    bucket's remainder goes on into the next epoch, ``BucketBatchSampler``)."""
    counts = {i: 0 for i in range(len(buckets))}
    for b in row_buckets:
        if b != NO_BUCKET:
            counts[b] += 1
    video = len(buckets[0]) == 3
    noun = "clips" if video else "images"
    used = [f"{'x'.join(map(str, b))}: {counts[i]}" for i, b in enumerate(buckets) if counts[i]]
    trained = sum(n // global_batch * global_batch for n in counts.values())
    unreadable = sum(1 for b in row_buckets if b == NO_BUCKET)
    return (
        f"aspect-ratio buckets ({'frames x ' if video else ''}height x width: {noun}): {', '.join(used)}; "
        f"{trained} of {len(row_buckets)} {noun} per epoch in batches of {global_batch}"
        + (
            ", a bucket's remainder carried to the next epoch"
            if trained < len(row_buckets) - unreadable
            else ""
        )
        + (f"; {unreadable} unreadable" if unreadable else "")
    )
