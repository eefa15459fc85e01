"""How a dataset row becomes training pixels and token ids, as one typed object.

``RowsToPixels`` holds the settings that every reader of the rows must apply alike: the size
(``resolution``, or each row's aspect-ratio bucket), the crop, the flip, the resize filter,
the seed of the per-row draws, the columns (image, caption, loss mask), the caption dropout
and the tokenizer call. It is built once from the settings (``from_settings``), completed
with what the data says (``with_rows``: the columns found, the buckets and each row's
bucket), and handed to the datasets (``image_dataset``), to the frozen-output cache
(``placement.cache.precompute_frozen_outputs``: its crops must be the live ones, and its key
records these settings) and to ``FrozenInputs`` (the flips and sizes of cached latents).

Example:
    >>> pixels = RowsToPixels(resolution=64, center_crop=True)
    >>> pixels.with_rows("img", "caption").image_column
    'img'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .images import ImageCaptionDataset
from .pairs import PairedImageDataset


@dataclass(frozen=True)
class RowsToPixels:
    """How a row becomes training pixels and token ids (see the module doc).

    ``resolution``: the square side of each crop (a video's clips take their own size);
    ``center_crop``: crop the centre, else a random crop drawn per row and epoch from
    ``seed``; ``random_flip``: mirror half of the rows (a cache keeps both orientations);
    ``interpolation``: the resize filter (``--image_interpolation_mode``); ``image_column``,
    ``caption_column`` and ``mask_column`` (loss masks, or None); ``buckets`` (``(height,
    width)``, or ``(frames, height, width)`` for clips) and ``row_buckets`` (each row's index
    into them, ``buckets.NO_BUCKET`` for an unreadable one), given together or not at all;
    ``empty_prompt_probability``: the caption dropout; ``tokenize``: captions to token ids
    (None where nothing is tokenized, e.g. a cache of latents alone); ``live_pixels`` False:
    the VAE's latents are cached, so the rows decode no image."""

    resolution: int = 512
    center_crop: bool = False
    random_flip: bool = False
    interpolation: str = "bilinear"
    seed: int = 0
    image_column: str = "image"
    caption_column: str = "text"
    mask_column: str | None = None
    buckets: Sequence[tuple[int, ...]] | None = None
    row_buckets: Sequence[int] | None = None
    empty_prompt_probability: float = 0.0
    tokenize: Callable[[list[str]], dict] | None = None
    live_pixels: bool = True

    @classmethod
    def from_settings(
        cls, args, tokenize: Callable[[list[str]], dict] | None = None, live_pixels: bool = True
    ) -> RowsToPixels:
        """From a ``TextToImageSettings`` (or a subclass's): ``--resolution``,
        ``--center_crop``, ``--random_flip``, ``--image_interpolation_mode``, ``--seed``,
        ``--mask_column`` and ``--proportion_empty_prompts``; the columns and buckets come
        with the data (``with_rows``)."""
        return cls(
            resolution=args.resolution,
            center_crop=args.center_crop,
            random_flip=args.random_flip,
            interpolation=args.image_interpolation_mode,
            seed=args.seed or 0,
            mask_column=args.mask_column,
            empty_prompt_probability=args.proportion_empty_prompts,
            tokenize=tokenize,
            live_pixels=live_pixels,
        )

    def with_rows(
        self,
        image_column: str,
        caption_column: str,
        buckets: Sequence[tuple[int, ...]] | None = None,
        row_buckets: Sequence[int] | None = None,
    ) -> RowsToPixels:
        """These settings for the rows of one dataset: its columns, its buckets and each row's."""
        return replace(
            self,
            image_column=image_column,
            caption_column=caption_column,
            buckets=buckets,
            row_buckets=row_buckets,
        )

    def crop_size(self, row: int) -> int | tuple[int, ...]:
        """Row ``row``'s crop: its bucket's shape, or ``resolution`` (square)."""
        return self.buckets[self.row_buckets[row]] if self.row_buckets is not None else self.resolution

    def image_dataset(self, dataset, **pairs) -> ImageCaptionDataset:
        """An ``ImageCaptionDataset`` of ``dataset`` read with these settings (a
        ``PairedImageDataset`` given ``source_column=`` and ``source_root=``: ``pairs``)."""
        dataset_class = PairedImageDataset if "source_column" in pairs else ImageCaptionDataset
        return dataset_class(dataset, self, **pairs)
