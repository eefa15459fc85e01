"""A trainer's data side: which rows it trains on, in which order, and where a checkpoint says
the order stands.

``TrainingData`` holds the rows (a map-style dataset of images, clips, editing pairs or a
trainer's own pairs; or a stream), their loader, the aspect-ratio buckets, and the position a
checkpoint saves and a resume restores (batches of the epoch, rows of a stream, samples per
bucket: the last two resumable on any number of processes). The loaders below build it from a
``TextToImageSettings``; a trainer with data of its own (DreamBooth's instance and class
pairs, DPO's preference pairs) builds one from its dataset.

From a row to latents: ``load_image_rows`` / ``load_clip_rows`` / ``load_streamed_rows`` here
choose the rows; each row becomes pixels and token ids in its dataset by the job's one
``data.pixels.RowsToPixels`` (a video clip: ``data.video.VideoCaptionDataset`` reads its frames,
``ClipSampling`` says which); the batch's pixels become latents in
``placement.frozen_inputs.FrozenInputs`` (the VAE live, or read from the frozen cache).

Every method runs on every rank alike; those that read image headers (buckets) are collective.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.buckets import (
    NO_BUCKET,
    BucketBatchSampler,
    BucketPosition,
    bucket_rows,
    default_buckets,
    describe_buckets,
    parse_buckets,
)
from ..data.images import (
    check_enough_rows,
    collate,
    load_image_caption_dataset,
    prepare_image_column,
    resolve_columns,
)
from ..data.loading import LoaderSettings
from ..data.pairs import SOURCE_COLUMN, check_source_column, load_edit_dataset
from ..data.pixels import RowsToPixels
from ..data.streaming import (
    StreamedExamples,
    StreamedRows,
    load_streamed_dataset,
    prepare_streamed_image_column,
    streamed_loader,
)
from ..errors import ArgumentError, DataError
from ..placement.frozen_inputs import component_folder
from ..runtime.distributed import log_rank_zero
from ..state.pretrained import CheckpointError
from .schedule import batches_to_skip, epochs_to_run, resume_position

logger = logging.getLogger("diffusers_zero3.training.data")


@dataclass
class TrainingData:
    """The rows a trainer trains on, their loader and their position (see the module doc).

    ``rows`` is what the loader reads (a map-style dataset with ``set_epoch`` and
    ``skipped_rows``, or ``StreamedRows``); ``dataset`` the ``datasets.Dataset`` a frozen
    cache encodes (None for a stream); ``data_processes`` the ranks that take different
    samples (all of them, or the context-parallel groups)."""

    rows: Any
    dataset: Any
    image_column: str
    caption_column: str
    batch_size: int
    data_processes: int
    seed: int = 0
    collate_fn: Callable = collate
    streaming: bool = False
    buckets: list[tuple[int, ...]] | None = None  # --use_aspect_ratio_buckets: (height, width) or (f, h, w)
    bucket_sampler: BucketBatchSampler | None = None
    bucket_start: BucketPosition | None = None  # the position a resumed epoch continues from
    resume_batches: int = 0  # micro-batches of the resumed epoch already trained
    row_buckets: list[int] | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ the loader

    def loader(self, loading: LoaderSettings) -> torch.utils.data.DataLoader:
        """The loader of one rank's micro-batches: a stream's rows in order (deal them out per
        rank with ``group_loader``), one bucket per global batch, or the shuffled rows."""
        if self.streaming:
            return streamed_loader(self.rows, self.collate_fn, self.batch_size, pin_memory=loading.pin_memory)
        if self.bucket_sampler is not None:
            return torch.utils.data.DataLoader(
                self.rows,
                batch_sampler=self.bucket_sampler,
                collate_fn=self.collate_fn,
                num_workers=loading.num_workers,
                pin_memory=loading.pin_memory,
            )
        return torch.utils.data.DataLoader(
            self.rows,
            shuffle=True,
            collate_fn=self.collate_fn,
            batch_size=self.batch_size,
            num_workers=loading.num_workers,
            pin_memory=loading.pin_memory,
            generator=torch.Generator().manual_seed(self.seed),  # CPU: the sampler shuffles there
        )

    def set_epoch(self, epoch: int) -> None:
        """The crops, flips, caption dropout and order of ``epoch``."""
        self.rows.set_epoch(epoch)
        if self.bucket_sampler is not None:
            self.bucket_sampler.set_epoch(epoch)
        if isinstance(self.collate_fn, StreamedExamples):
            self.collate_fn.examples.set_epoch(epoch)

    def epochs_to_run(
        self, first_epoch: int, global_step: int, max_train_steps: int, loader, accumulation: int
    ) -> range:
        """The epochs from ``first_epoch`` (a resume's) to ``max_train_steps``, counted from the
        steps left and this run's epoch length (``schedule.epochs_to_run``; ``loader`` this
        rank's: a stream's has no length)."""
        if self.streaming:  # epochs end when the stream does, each one step at least (else DataError)
            return range(first_epoch, first_epoch + 1 + max_train_steps - global_step)
        if self.bucket_sampler is not None:  # global batches = each rank's batches
            first = self.bucket_sampler.batches_in_epoch(first_epoch)  # from the resumed position
            per_epoch = self.bucket_sampler.min_batches_per_epoch()
        else:
            per_epoch = len(loader)
            first = max(0, per_epoch - self.resume_batches)
        return epochs_to_run(first_epoch, global_step, max_train_steps, first, per_epoch, accumulation)

    # ------------------------------------------------------------------ checkpoints

    def position(self, epoch: int, done_in_epoch: int, loader) -> dict:
        """The checkpoint's data state after ``done_in_epoch`` micro-batches of ``epoch`` of
        ``loader`` (this rank's)."""
        if self.streaming:  # rows of the epoch's order consumed: resumable on any N
            rows = self.rows.position_after(epoch, done_in_epoch)
            state = {"epoch": epoch, "batches_in_epoch": 0, "stream_rows": rows}
        elif self.bucket_sampler is not None:  # samples consumed per bucket: resumable on any N
            # the resumed position applies to its own epoch alone (position_after checks)
            position = self.bucket_sampler.position_after(epoch, done_in_epoch, self.bucket_start)
            state = {**position.to_state(), "batches_in_epoch": 0, "buckets": [list(b) for b in self.buckets]}
        else:
            state = resume_position(epoch, done_in_epoch, len(loader))
        return {**state, "train_batch_size": self.batch_size, "data_parallel_size": self.data_processes}

    def check_resumable(self, state: dict) -> None:
        """``CheckpointError`` (one line) when this data cannot continue from ``state``: another
        streaming or bucket setting, other buckets, or batches that do not fill this run's steps.
        Before anything is loaded."""
        step = state["global_step"]
        if ("stream_rows" in state) != self.streaming:
            with_streaming = "with" if "stream_rows" in state else "without"
            raise CheckpointError(
                f"the checkpoint at step {step} was trained {with_streaming} --streaming: resume it the same way"
            )
        if self.streaming:
            return  # rows consumed: resumable on any number of processes
        bucketed = "bucket_position" in state or "bucket_consumed" in state  # the latter: older
        if bucketed != (self.bucket_sampler is not None):
            with_buckets = "with" if bucketed else "without"
            raise CheckpointError(
                f"the checkpoint at step {step} was trained {with_buckets} --use_aspect_ratio_buckets: "
                "resume it the same way"
            )
        if self.bucket_sampler is not None:
            if [list(b) for b in self.buckets] != state.get("buckets"):
                raise CheckpointError(
                    f"the checkpoint at step {step} was trained with the buckets {state.get('buckets')}, not "
                    f"{[list(b) for b in self.buckets]}: give the same --aspect_ratio_buckets and --resolution"
                )
            try:
                BucketPosition.from_state(state)
            except ValueError as e:
                raise CheckpointError(f"cannot resume from step {step}: {e}") from e
            return  # a bucket position resumes on any number of processes
        try:
            batches_to_skip(data_state(state), self.data_processes, self.batch_size)
        except ValueError as e:
            raise CheckpointError(f"cannot resume from step {step}: {e}") from e

    def resume(self, state: dict, path: str | os.PathLike) -> None:
        """Continue the checkpoint's epoch (``state``, of the checkpoint at ``path``) at its
        first unseen row (stream), sample of each bucket, or batch (``resume_batches``);
        ``check_resumable`` passed. Logs a resharding to another number of processes."""
        epoch = state["epoch"]
        if self.streaming:
            self.rows.start_at(epoch, int(state["stream_rows"]))
        elif self.bucket_sampler is not None:
            self.bucket_start = BucketPosition.from_state(state)
            self.bucket_sampler.start_at(self.bucket_start)
        else:
            self.resume_batches = batches_to_skip(data_state(state), self.data_processes, self.batch_size)
        if int(data_state(state)["world_size"]) != self.data_processes:
            log_rank_zero(
                f"{path} was written by {state['world_size']} processes; resharded for {self.data_processes} "
                f"(batch {self.resume_batches} of epoch {epoch} next)"
            )

    # ------------------------------------------------------------------ the end of an epoch, of the run

    def check_epoch_gave_batches(self, epoch: int, batches: int) -> None:
        """``DataError`` when ``epoch`` gave no batch (a stream shorter than a global batch)."""
        if batches == 0:
            raise DataError(
                f"epoch {epoch} of the data gave no batch: it holds fewer rows than processes x "
                f"--train_batch_size = {self.data_processes * self.batch_size}"
            )

    def log_end(self, accelerator) -> None:
        """The rows each rank decoded (a stream) and the unreadable rows skipped. Collective."""
        if isinstance(self.collate_fn, StreamedExamples):
            decoded = accelerator.gather(
                torch.tensor([self.collate_fn.decoded_rows], device=accelerator.device)
            ).tolist()
            log_rank_zero(f"streamed rows decoded per rank: {', '.join(str(n) for n in decoded)}")
        skipped = len(self.rows.skipped_rows)
        if skipped:
            logger.warning(
                "skipped %d unreadable image row(s) on rank %d", skipped, accelerator.process_index
            )


def data_state(state: dict) -> dict:
    """A checkpoint's state with ``world_size`` the processes that took different samples
    (``data_parallel_size`` where it was written under context parallelism)."""
    return {**state, "world_size": state.get("data_parallel_size", state["world_size"])}


# -------------------------------------------------------------------------------- building it


def select_rows(dataset, args, data_processes: int):
    """``--max_train_samples`` rows of ``dataset`` (shuffled by the seed), checked to give every
    process a batch."""
    if args.max_train_samples is not None:
        dataset = dataset.shuffle(seed=args.seed or 0).select(
            range(min(args.max_train_samples, len(dataset)))
        )
    check_enough_rows(len(dataset), data_processes, args.train_batch_size)
    return dataset


def bucket_sampler(
    row_buckets: list[int], buckets: list, args, data_processes: int, video: bool
) -> BucketBatchSampler:
    """The sampler that draws one bucket per global batch, logged; ``DataError`` when no bucket
    fills a global batch."""
    sampler = BucketBatchSampler(row_buckets, args.train_batch_size, data_processes, seed=args.seed or 0)
    log_rank_zero(describe_buckets(buckets, row_buckets, sampler.global_batch))
    if sampler.min_batches_per_epoch() == 0:
        raise DataError(
            f"no aspect-ratio bucket holds processes x --train_batch_size = {sampler.global_batch} "
            f"{'clips' if video else 'images'}: lower the batch size, use fewer buckets, or add data"
        )
    return sampler


def load_image_rows(
    args, family, pixels: RowsToPixels, data_processes: int, vae_config: dict
) -> TrainingData:
    """An image family's rows (``datasets`` folder or Hub dataset; an editing family's
    (source, instruction) -> target pairs), with ``--mask_column``, ``--max_train_samples`` and
    ``--use_aspect_ratio_buckets``. Collective (buckets read each rank's share of headers)."""
    where = args.dataset_name or args.train_data_dir
    caption = args.edit_prompt_column or args.caption_column
    if family.edits:  # (source image(s), instruction) -> target pairs: data/pairs.py
        source_column = args.source_image_column or SOURCE_COLUMN
        ds = load_edit_dataset(
            args.dataset_name, args.dataset_config_name, args.train_data_dir, args.cache_dir,
            args.image_column, source_column, caption,
        )  # fmt: skip
    else:
        ds = load_image_caption_dataset(
            args.dataset_name, args.dataset_config_name, args.train_data_dir, args.cache_dir
        )
    image_column, caption_column = resolve_columns(ds.column_names, args.image_column, caption)
    ds = prepare_image_column(ds, image_column, where)
    pairs = {}
    if family.edits:
        pairs = {
            "source_column": source_column,
            "source_root": where if where and os.path.isdir(where) else None,
        }
        count = check_source_column(ds, pairs["source_column"], pairs["source_root"])
        log_rank_zero(f"editing pairs: {count} source image(s) per target, column {pairs['source_column']!r}")
    if args.mask_column is not None:
        if args.mask_column not in ds.column_names:
            raise DataError(
                f"--mask_column {args.mask_column!r} is not a dataset column; columns are: {', '.join(ds.column_names)}"
            )
        ds = prepare_image_column(ds, args.mask_column, where)
        log_rank_zero(f"loss masks: column {args.mask_column!r}, averaged down to the latents")
    ds = select_rows(ds, args, data_processes)
    data = TrainingData(
        None, ds, image_column, caption_column, args.train_batch_size, data_processes, seed=args.seed or 0
    )
    if args.use_aspect_ratio_buckets:
        multiple = family.latent_multiple(vae_config)
        try:
            if args.aspect_ratio_buckets:
                data.buckets = parse_buckets(args.aspect_ratio_buckets, multiple)
            else:
                data.buckets = default_buckets(args.resolution, multiple)
        except DataError as e:
            raise ArgumentError(str(e)) from e
        data.row_buckets = bucket_rows(ds, image_column, data.buckets)
        data.bucket_sampler = bucket_sampler(
            data.row_buckets, data.buckets, args, data_processes, video=False
        )
    data.rows = pixels.with_rows(image_column, caption_column, data.buckets, data.row_buckets).image_dataset(
        ds, **pairs
    )
    if data.row_buckets is not None:
        data.rows.skipped_rows.update(i for i, b in enumerate(data.row_buckets) if b == NO_BUCKET)
    return data


def load_streamed_rows(args, pixels: RowsToPixels, data_processes: int, threads: int) -> TrainingData:
    """``--streaming``: the rows in each epoch's shuffled order (``streaming.StreamedRows``),
    decoded per rank by the loader's ``collate_fn`` (``streaming.StreamedExamples``) on
    ``threads`` threads."""
    where = args.dataset_name or args.train_data_dir
    source = load_streamed_dataset(
        args.dataset_name, args.dataset_config_name, args.train_data_dir, args.cache_dir
    )
    columns = source.column_names or list(next(iter(source)))
    image_column, caption_column = resolve_columns(columns, args.image_column, args.caption_column)
    # datasets Images, or struct<bytes, path> / image bytes / image paths as other tools write them
    source = prepare_streamed_image_column(source, image_column, where)
    if args.max_train_samples is not None:
        source = source.take(args.max_train_samples)
    rows = StreamedRows(
        source, image_column, global_batch=args.train_batch_size * data_processes,
        seed=args.seed or 0, shuffle_buffer_size=args.shuffle_buffer_size,
    )  # fmt: skip
    examples = pixels.with_rows(image_column, caption_column).image_dataset([])
    decode = StreamedExamples(examples, image_column, threads=threads, skipped_rows=rows.skipped_rows)
    log_rank_zero(
        f"streaming {where} ({source.n_shards} shard(s)), shuffle buffer {args.shuffle_buffer_size} rows"
    )
    # nothing to cache from: --streaming refuses the cache placement
    return TrainingData(
        rows, None, image_column, caption_column, args.train_batch_size, data_processes,
        seed=args.seed or 0, collate_fn=decode, streaming=True,
    )  # fmt: skip


def audio_of_clips(family, source: str | os.PathLike, component_sources: dict) -> dict:
    """``{"audio": AudioSpec}`` for a family that trains on the clips' sound (LTX-2: the audio
    VAE's rate, channels and mel bins), else nothing."""
    if not family.sound:
        return {}
    folder = component_folder(source, component_sources, "audio_vae")
    config = family.component_class("audio_vae").load_config(folder)
    log_rank_zero(f"audio: each clip's sound at {config['sample_rate']} Hz, {config['mel_bins']} mel bins")
    return {"audio": family.audio_spec(config)}


def load_clip_rows(
    args, family, pixels: RowsToPixels, data_processes: int, vae_config: dict, audio: dict
) -> TrainingData:
    """A video family's clips (a folder with ``metadata.jsonl``), ``--mask_column`` clips, and
    ``--use_aspect_ratio_buckets`` as ``(frames, height, width)`` buckets (``bucket_clips``);
    ``audio`` is ``audio_of_clips``'. Collective (buckets probe each rank's share of headers)."""
    from ..data.video import ClipSampling, VideoCaptionDataset, load_video_caption_dataset

    ds = load_video_caption_dataset(args.train_data_dir, args.caption_column)
    if args.max_train_samples is not None:
        raise ArgumentError(
            "--max_train_samples applies to image datasets; use a folder of the clips to train on"
        )
    check_enough_rows(len(ds), data_processes, args.train_batch_size)
    try:
        pixels = pixels.with_rows("video", args.caption_column)
        clips = VideoCaptionDataset(ds, pixels, ClipSampling.from_settings(args), **audio)
    except ValueError as e:
        raise ArgumentError(str(e)) from e
    if args.mask_column is not None:
        if args.mask_column not in ds.column_names:
            raise DataError(
                f"--mask_column {args.mask_column!r} is not a column of the metadata; columns are: "
                f"{', '.join(ds.column_names)}"
            )
        log_rank_zero(
            f"loss masks: the clips named in column {args.mask_column!r}, averaged down to the latents"
        )
    data = TrainingData(clips, ds, "video", args.caption_column, args.train_batch_size, data_processes,
                        seed=args.seed or 0)  # fmt: skip
    if args.use_aspect_ratio_buckets:
        bucket_clips(data, args, family, vae_config)
    return data


def bucket_clips(data: TrainingData, args, family, vae_config: dict) -> None:
    """``--use_aspect_ratio_buckets`` for a video family: ``(frames, height, width)`` buckets
    (``--aspect_ratio_buckets "f,h,w;..."``, or ``"h,w"`` at ``--num_frames``; by default
    ``--height`` x ``--width``'s area at common ratios), each checked against the VAE; each
    clip in the longest bucket it holds, at the nearest ratio (collective: every rank probes
    its share of the clips' headers)."""
    from ..data.video import bucket_clips as clip_buckets
    from ..data.video import check_video_shape, parse_video_buckets

    try:
        if args.aspect_ratio_buckets:
            buckets = parse_video_buckets(args.aspect_ratio_buckets, args.num_frames)
        else:
            side = round(math.sqrt(args.height * args.width))
            spatial = default_buckets(side, family.latent_multiple(vae_config))
            buckets = [(args.num_frames, h, w) for h, w in spatial]
        for frames, height, width in buckets:
            check_video_shape(frames, height, width, family, vae_config)
    except ValueError as e:  # DataError too
        raise ArgumentError(f"--aspect_ratio_buckets: {e}") from e
    clips = data.rows
    data.buckets, data.row_buckets = buckets, clip_buckets(clips, buckets)
    clips.set_buckets(buckets, data.row_buckets)
    clips.skipped_rows.update(i for i, b in enumerate(data.row_buckets) if b == NO_BUCKET)
    data.bucket_sampler = bucket_sampler(data.row_buckets, buckets, args, data.data_processes, video=True)


# -------------------------------------------------------------------------------- checks before loading


def check_data_flags(args, family, image_caption_rows: bool, trainer: str) -> None:
    """``--use_aspect_ratio_buckets``, ``--mask_column``, ``--streaming`` and
    ``--validation_image`` where this trainer (``image_caption_rows``: it reads
    ``ImageCaptionDataset`` rows) and family take them; one error line otherwise, before
    anything loads."""
    given = [flag for flag, on in (("--use_aspect_ratio_buckets", args.use_aspect_ratio_buckets),
                                   ("--mask_column", args.mask_column is not None),
                                   ("--streaming", args.streaming)) if on]  # fmt: skip
    if args.streaming:
        if args.max_train_steps is None:
            raise ArgumentError(
                "--streaming needs --max_train_steps (a stream has no length to count epochs by)"
            )
        if given[0] != "--streaming":
            raise ArgumentError(f"{given[0]} with --streaming is not supported yet")
    if family.edits and image_caption_rows and (args.streaming or args.context_parallel_size > 1):
        flag = "--streaming" if args.streaming else "--context_parallel_size"
        raise ArgumentError(f"{flag} is not supported for editing pairs ({family.title}) yet")
    sources = args.validation_image if image_caption_rows else None  # ControlNet's are its own
    if sources:
        if not family.edits:
            raise ArgumentError(
                f"--validation_image is the source image of an editing family's validation; a "
                f"{family.pipeline_class} generates from --validation_prompts alone"
            )
        prompts = args.validation_prompts or []  # --validation_prompt joined them (args.resolve)
        if prompts and len(sources) not in (1, len(prompts)):
            raise ArgumentError(
                "give one --validation_image for every --validation_prompts, or one per prompt"
            )
        for path in sources:
            if not os.path.isfile(path):
                raise ArgumentError(f"--validation_image {path!r} is not a file")
        least = family.least_source_side  # Flux.2's pipelines refuse smaller images
        if min(args.width or args.resolution, args.height or args.resolution) < least:
            raise ArgumentError(
                f"--validation_image: {family.pipeline_class} takes source images of {least} px a side "
                f"or more, and validation resizes them to the training size: train at {least} px or more, "
                "or validate without --validation_image"
            )
    if given and not image_caption_rows:
        raise ArgumentError(f"{given[0]} is not supported by {trainer} yet")


def check_video_flags(args, family, vae_config: dict, trained_folders: tuple[str, ...]) -> None:
    """``--num_frames`` (default 81), ``--height`` and ``--width`` (default ``--resolution``)
    that the family's VAE can encode, filled in on ``args``; one error line otherwise."""
    from ..data.video import check_video_shape

    args.num_frames = args.num_frames or 81
    args.height, args.width = args.height or args.resolution, args.width or args.resolution
    try:
        check_video_shape(args.num_frames, args.height, args.width, family, vae_config)
    except ValueError as e:
        raise ArgumentError(str(e)) from e
    if args.rank is not None and len(trained_folders) > 1:
        raise ArgumentError("--rank with --train_experts both: train LoRA adapters on one expert at a time")
    if family.sound and args.context_parallel_size > 1:
        raise ArgumentError(
            f"--context_parallel_size with {family.title}: its audio stream is not split yet; train with 1"
        )


def validation_sources(args, reads_pairs: bool) -> list | None:
    """An editing family's source image of each validation prompt (``--validation_image``:
    one for all, or one per prompt), at the training size; None without them."""
    from PIL import Image

    paths, n = args.validation_image, len(args.validation_prompts or [])
    if not (reads_pairs and paths):
        return None
    size = (args.width or args.resolution, args.height or args.resolution)
    images = [Image.open(p).convert("RGB").resize(size, Image.BICUBIC) for p in paths]
    return images * n if len(images) == 1 else images
