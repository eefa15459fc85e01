"""Video-caption data: clips decoded with PyAV, cut to ``--num_frames``, one crop and flip per clip.

A dataset is a folder in the layout of ``datasets``' ``videofolder``: video files (``.mp4``,
``.webm``, ``.mkv``, ...) and a ``metadata.jsonl`` or ``metadata.csv`` whose ``file_name`` column
names them (relative to the folder) and whose other columns (e.g. ``text``) hold captions. A
``file_name`` may also name a folder of frame images (one clip, frames in file-name order; an
optional ``fps`` column gives its frame rate). The other columns stay as written, whatever their
names (a tool's own ``video`` or ``frames`` column too): the resolved clip is a row's ``clip``
attribute, never a column. Decoding is PyAV's (the ``av`` wheel ships its own FFmpeg libraries;
no system FFmpeg, and no torchcodec, which ``datasets``' own ``Video`` feature needs).

Frames are taken every ``frame_stride`` source frames, or at ``fps`` frames per second, from
the clip's start (or from a random start: ``random_start``). Randomness (start, crop, flip,
caption) is drawn from ``(seed, epoch, row)`` as in ``data.ImageCaptionDataset``, and one crop
and one flip hold for every frame of a clip. A clip that does not decode, or has fewer frames
than asked, is skipped like a corrupt image: the row is replaced by the next readable one, a
warning names it, and ``skipped_rows`` counts it.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..runtime.distributed import logger
from .buckets import NO_BUCKET, nearest_bucket
from .images import DataError, SeededRows, pick_caption

if TYPE_CHECKING:
    from .pixels import RowsToPixels

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v", ".gif")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")


class ClipError(ValueError):
    """One clip cannot be used (does not decode, too short): the row is skipped."""


# -------------------------------------------------------------------------------- the folder


class VideoRow(dict):
    """One metadata row: its columns exactly as written (``file_name`` and any others, a user's
    own ``video`` column included) and ``clip``, the clip's absolute path (a video file or a
    folder of frames) resolved from ``file_name`` against the dataset folder.

    The path is an attribute, not a column, so no column of the user's can shadow it and any
    column can hold the captions."""

    def __init__(self, columns: dict, clip: Path):
        super().__init__(columns)
        self.clip = clip


class VideoRows(Sequence):
    """The rows of a video folder's metadata (``VideoRow``: the columns as written, and ``clip``)."""

    def __init__(self, rows: list[dict], folder: Path):
        self.rows, self.folder = rows, folder

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, str):  # a column, as a datasets dataset gives it (the cache reads captions so)
            return [row.get(index) for row in self.rows]
        return self.rows[index]

    @property
    def column_names(self) -> list[str]:
        """The metadata's columns as written (``file_name`` included)."""
        return list(self.rows[0]) if self.rows else []


def _read_metadata(path: Path) -> list[dict]:
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path} ({type(e).__name__}: {e})") from e


def load_video_caption_dataset(folder: str | os.PathLike, caption_column: str | None = "text") -> VideoRows:
    """The clips of a video folder with their captions (see the module doc for the layout).

    Raises ``DataError`` for a folder that is missing, has no (or two) metadata files, a
    metadata file without ``file_name`` or ``caption_column``, or no rows. A row whose file is
    missing stays: it is skipped and counted when read, like a corrupt clip. A relative
    ``file_name`` resolves against ``folder`` (not the working directory); an absolute one is kept.
    """
    if not Path(folder).is_dir():
        raise DataError(f"--train_data_dir {str(folder)!r} is not a directory")
    folder = Path(folder).absolute()
    found = [folder / name for name in METADATA_FILES if (folder / name).is_file()]
    if not found:
        raise DataError(
            f"{folder} has no metadata.jsonl or metadata.csv: a video folder names its clips (video files "
            "or folders of frames) in a file_name column beside their captions"
        )
    if len(found) > 1:
        raise DataError(f"{folder} has both metadata.jsonl and metadata.csv: keep one")
    rows = []
    for i, record in enumerate(_read_metadata(found[0])):
        if "file_name" not in record:
            raise DataError(f"{found[0]} row {i} has no file_name column (columns: {', '.join(record)})")
        if caption_column is not None and caption_column not in record:
            raise DataError(
                f"--caption_column {caption_column!r} is not a column of {found[0]}; columns are: "
                f"{', '.join(record)}"
            )
        rows.append(VideoRow(record, folder / str(record["file_name"])))
    if not rows:
        raise DataError(f"{found[0]} lists no clips")
    return VideoRows(rows, folder)


# -------------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class ClipSource:
    """One clip's frames: a video file (decoded with PyAV) or a folder of frame images."""

    path: Path
    fps: float | None = None  # a frame folder's rate (its metadata's fps column)

    @property
    def is_frame_folder(self) -> bool:
        return self.path.is_dir()

    def frame_files(self) -> list[Path]:
        files = sorted(p for p in self.path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
        if not files:
            raise ClipError(f"{self.path} holds no frame images ({', '.join(IMAGE_EXTENSIONS)})")
        return files

    def probe(self) -> tuple[int, float | None]:
        """``(frames, frames per second)`` from the container's header (a frame folder: its
        files and ``fps``). A header's count can be wrong or missing (0): ``read`` then finds
        the clip short."""
        if self.is_frame_folder:
            return len(self.frame_files()), self.fps
        import av

        try:
            with av.open(str(self.path)) as container:
                stream = container.streams.video[0]
                rate = float(stream.average_rate) if stream.average_rate else None
                frames = stream.frames
                if not frames and stream.duration and stream.time_base and rate:
                    frames = int(round(float(stream.duration * stream.time_base) * rate))
                if not frames and container.duration and rate:
                    frames = int(round(container.duration / 1_000_000 * rate))
                return int(frames or 0), rate
        except (av.error.FFmpegError, ValueError, IndexError, OSError, RuntimeError) as e:
            raise ClipError(f"cannot open {self.path.name} ({type(e).__name__}: {e})") from e

    def size(self) -> tuple[int, int]:
        """The frames' ``(height, width)``: the stream's header (a frame folder: its first file).
        ``ClipError`` when it cannot be read."""
        if self.is_frame_folder:
            from PIL import Image

            try:
                with Image.open(self.frame_files()[0]) as img:
                    return img.height, img.width
            except OSError as e:
                raise ClipError(f"cannot read {self.path.name} ({type(e).__name__}: {e})") from e
        import av

        try:
            with av.open(str(self.path)) as container:
                stream = container.streams.video[0]
                return int(stream.codec_context.height), int(stream.codec_context.width)
        except (av.error.FFmpegError, ValueError, IndexError, OSError, RuntimeError) as e:
            raise ClipError(f"cannot open {self.path.name} ({type(e).__name__}: {e})") from e

    def read(self, indices: list[int]) -> np.ndarray:
        """The frames at ``indices`` (ascending) as uint8 RGB ``(F, H, W, 3)``; decoding stops
        after the last one. Raises ``ClipError`` when the clip ends first or does not decode."""
        wanted = sorted(set(indices))
        frames: dict[int, np.ndarray] = {}
        if self.is_frame_folder:
            from PIL import Image

            files = self.frame_files()
            if wanted[-1] >= len(files):
                raise ClipError(f"{self.path.name} has {len(files)} frames, frame {wanted[-1]} asked")
            try:
                for i in wanted:
                    with Image.open(files[i]) as img:
                        frames[i] = np.asarray(img.convert("RGB"))
            except OSError as e:
                raise ClipError(f"cannot read {files[i].name} ({type(e).__name__}: {e})") from e
        else:
            import av

            try:
                with av.open(str(self.path)) as container:
                    for i, frame in enumerate(container.decode(video=0)):
                        if i in wanted:
                            frames[i] = frame.to_ndarray(format="rgb24")
                        if i >= wanted[-1]:
                            break
            except (av.error.FFmpegError, ValueError, IndexError, OSError, RuntimeError) as e:
                raise ClipError(f"cannot decode {self.path.name} ({type(e).__name__}: {e})") from e
            if len(frames) < len(wanted):
                raise ClipError(
                    f"{self.path.name} ends after {len(frames)} of the frames asked (frame {wanted[-1]})"
                )
        shapes = {f.shape for f in frames.values()}
        if len(shapes) != 1:
            raise ClipError(f"{self.path.name} has frames of several sizes: {sorted(shapes)}")
        return np.stack([frames[i] for i in indices])


def frame_step(source_fps: float | None, frame_stride: int = 1, fps: float | None = None) -> float:
    """Source frames between two taken frames: ``frame_stride``, or ``source_fps / fps`` for
    ``--fps`` (which needs the clip's rate)."""
    if fps is None:
        return float(frame_stride)
    if not source_fps:
        raise ClipError("the clip has no frame rate for --fps (a frame folder takes an fps column)")
    return source_fps / fps


def frame_indices(num_frames: int, step: float, start: int = 0) -> list[int]:
    """Source frame indices of ``num_frames`` frames ``step`` apart from ``start`` (rounded to
    the nearest frame for a fractional step; never the same frame twice)."""
    indices = [start + int(round(k * step)) for k in range(num_frames)]
    if len(set(indices)) != len(indices):
        raise ClipError(f"--fps asks for more frames per second than the clip has (step {step:.3f})")
    return indices


# -------------------------------------------------------------------------------- transforms


@dataclass(frozen=True)
class ClipCrop:
    """Where a clip's crop came from: the frames' (height, width), their size after resizing,
    the crop's (top, left) in the resized frames, and whether the clip was flipped."""

    original_size: tuple[int, int]
    resized_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool


def transform_clip(
    frames: np.ndarray, height: int, width: int, center_crop: bool, random_flip: bool, rng: random.Random
) -> tuple[torch.Tensor, ClipCrop]:
    """Resize every frame so that it covers ``height`` x ``width`` (bilinear), crop it there, flip
    it or not, the same crop and flip for every frame (drawn once: crop, then flip, as
    ``data.transform_image``); ``(3, F, height, width)`` floats in [-1, 1]."""
    from PIL import Image

    h, w = frames.shape[1:3]
    scale = max(height / h, width / w)
    nh, nw = max(height, round(h * scale)), max(width, round(w * scale))
    if center_crop:
        top, left = (nh - height) // 2, (nw - width) // 2
    else:
        top, left = rng.randint(0, nh - height), rng.randint(0, nw - width)
    flipped = bool(random_flip and rng.random() < 0.5)
    out = []
    for frame in frames:
        image = Image.fromarray(frame)
        if (nw, nh) != (w, h):
            image = image.resize((nw, nh), Image.BILINEAR)
        image = image.crop((left, top, left + width, top + height))
        if flipped:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        out.append(np.asarray(image, dtype=np.float32))
    arr = np.stack(out) / 127.5 - 1.0  # (F, H, W, 3)
    pixels = torch.from_numpy(arr).permute(3, 0, 1, 2).contiguous()
    return pixels, ClipCrop((h, w), (nh, nw), (top, left), flipped)


def check_video_shape(num_frames: int, height: int, width: int, family, vae_config: dict) -> None:
    """Raise ``ValueError`` naming the flag unless ``--num_frames`` x ``--height`` x ``--width``
    fit the family's VAE: ``1 + k * frame_multiple`` frames (Wan: 1 + 4k, e.g. 81) and sides a
    multiple of ``latent_multiple`` (Wan 2.1: 16; Wan 2.2 TI2V-5B: 32). A family without a
    temporal rule (an image family) takes one frame."""
    if num_frames < 1:
        raise ValueError(f"--num_frames must be at least 1, got {num_frames}")
    m = family.frame_multiple(vae_config)
    title = family.title or family.pipeline_class
    if m is None:
        if num_frames != 1:
            raise ValueError(f"--num_frames {num_frames}: {title} is an image family (one frame)")
    else:
        if (num_frames - 1) % m:
            lower = (num_frames - 1) // m * m + 1
            raise ValueError(
                f"--num_frames {num_frames} does not fit {title}'s VAE, which encodes the first frame "
                f"alone and then {m} frames per latent frame: use 1 + {m}k frames, e.g. {lower} or {lower + m}"
            )
    multiple = family.latent_multiple(vae_config)
    for flag, value in (("--height", height), ("--width", width)):
        if value < multiple or value % multiple:
            lower = max(multiple, value // multiple * multiple)
            raise ValueError(
                f"{flag} {value} must be a multiple of {multiple} for {title} (the VAE's spatial compression "
                f"times the transformer's 2x2 patches), e.g. {lower} or {lower + multiple}"
            )


# -------------------------------------------------------------------------------- the dataset


@dataclass(frozen=True)
class ClipSampling:
    """How a clip's frames are taken (``VideoCaptionDataset``): ``num_frames`` frames
    ``frame_stride`` source frames apart, or at ``fps`` frames per second; from frame 0, or
    from a random start (``random_start``); resized to cover ``height`` x ``width`` (default:
    the pixels' ``resolution`` square). ``video_column`` names a column of clip paths (default:
    each row's ``clip``, as ``load_video_caption_dataset`` gives it).

    Example:
        >>> ClipSampling(num_frames=81, height=480, width=832, fps=16)
    """

    num_frames: int
    height: int | None = None
    width: int | None = None
    frame_stride: int = 1
    fps: float | None = None
    random_start: bool = False
    video_column: str | None = None

    @classmethod
    def from_settings(cls, args) -> ClipSampling:
        """From a ``TextToImageSettings``: ``--num_frames``, ``--height``, ``--width``,
        ``--frame_stride`` and ``--fps``."""
        return cls(args.num_frames, args.height, args.width, frame_stride=args.frame_stride, fps=args.fps)


class VideoCaptionDataset(SeededRows):
    """Rows of a video folder (``load_video_caption_dataset``) as ``{"pixel_values": (3, F, H, W)
    in [-1, 1], <token ids and masks>, "index"}``.

    ``pixels`` (a ``data.pixels.RowsToPixels``) says how a row is read: ``pixels.tokenize`` maps
    captions to a dict of token-id tensors (a family's ``tokenize`` with its tokenizers), and
    its crop, flip, seed, caption column, caption dropout and loss-mask column apply to each
    clip. ``clip`` (a ``ClipSampling``) says which frames: each clip gives ``num_frames`` frames
    ``frame_stride`` source frames apart, or at ``fps`` frames per second; from frame 0, or from
    a random start (``random_start``); resized to cover ``height`` x ``width`` (default
    ``pixels.resolution`` square), cropped (centre, or random) and maybe flipped, once per clip.
    ``set_epoch(e)`` changes the draws deterministically. Clips that fail to decode or are too
    short are skipped (``skipped_rows``); with ``pixels.live_pixels`` False nothing is decoded
    (training from a latent cache) and ``unreadable_rows`` are skipped as if they failed. Each
    row's clip is its ``clip`` (the rows of ``load_video_caption_dataset``), or the path in
    ``clip.video_column`` when given.

    With buckets (``set_buckets``: ``(frames, height, width)`` shapes and each row's index into
    them, from ``bucket_clips``) a row's clip takes its bucket's frames and size, and a row that
    fails is replaced by the next usable row of the same bucket.

    With ``audio`` (a ``data.audio.AudioSpec``: LTX-2) a row also holds its clip's sound:
    ``"audio_mel"`` ``(channels, T, n_mels)`` float32, the log-mel spectrogram of the clip's span
    (from its first taken frame, ``num_frames / frame_rate`` seconds; ``T`` as
    ``AudioSpec.mel_frames``), ``"has_audio"`` (0-dim bool: False, and zeros, for a clip
    without an audio stream or a frame folder) and ``"frame_rate"`` (0-dim float: the source's
    rate over the frame step; 24 where unknown). Clips at different rates without ``fps`` give
    spectrograms of different lengths: they batch only one to a batch.
    """

    def __init__(
        self,
        dataset,
        pixels: RowsToPixels,
        clip: ClipSampling,
        *,
        unreadable_rows: Sequence[int] = (),
        audio=None,
    ):
        num_frames, frame_stride, fps = clip.num_frames, clip.frame_stride, clip.fps
        if frame_stride < 1:
            raise ValueError(f"--frame_stride must be at least 1, got {frame_stride}")
        if fps is not None and fps <= 0:
            raise ValueError(f"--fps must be positive, got {fps}")
        if fps is not None and frame_stride != 1:
            raise ValueError("give --frame_stride or --fps, not both")
        self.dataset = dataset
        self._tokenize = pixels.tokenize
        self.num_frames = num_frames
        self.height = clip.height or pixels.resolution
        self.width = clip.width or pixels.resolution
        if not self.height or not self.width:
            raise ValueError("give a resolution, or a height and a width")
        self.frame_stride, self.fps, self.random_start = frame_stride, fps, clip.random_start
        self.center_crop, self.random_flip = pixels.center_crop, pixels.random_flip
        self.seed, self.epoch = pixels.seed, 0
        self.video_column, self.caption_column = clip.video_column, pixels.caption_column
        self.with_videos = pixels.live_pixels
        self.unreadable_rows = set(unreadable_rows)
        self.empty_prompt_probability = pixels.empty_prompt_probability
        self.skipped_rows: set[int] = set()
        self.buckets: list[tuple[int, int, int]] | None = None
        self.row_buckets: list[int] | None = None
        self.mask_column = pixels.mask_column
        self.audio = audio

    def mask_source(self, row: dict) -> ClipSource:
        """A row's loss-mask clip (``mask_column``: a video file or frame folder, relative to the
        dataset's folder)."""
        path = Path(row[self.mask_column])
        folder = getattr(self.dataset, "folder", None)
        return ClipSource(path if path.is_absolute() or folder is None else Path(folder) / path)

    def set_buckets(self, buckets: Sequence[tuple[int, int, int]], row_buckets: Sequence[int]) -> None:
        """Train each row at its bucket's ``(frames, height, width)`` (``bucket_clips``)."""
        self.buckets, self.row_buckets = [tuple(b) for b in buckets], list(row_buckets)

    def shape_of(self, index: int) -> tuple[int, int, int]:
        """``(frames, height, width)`` of row ``index``'s clip: its bucket's, or the flags'."""
        if self.buckets is None:
            return self.num_frames, self.height, self.width
        if self.row_buckets[index] == NO_BUCKET:
            raise ClipError("its clip could not be probed when the buckets were made")
        return self.buckets[self.row_buckets[index]]

    def probe(self, row: dict) -> tuple[int, float | None, int, int]:
        """``(frames, frames per second, height, width)`` of a row's clip from its header,
        without decoding; ``ClipError`` when it cannot be read."""
        source = self.source(row)
        if not source.path.exists():
            raise ClipError(f"{source.path} does not exist")
        return (*source.probe(), *source.size())

    def fits(self, total: int, rate: float | None, num_frames: int) -> bool:
        """Whether a clip of ``total`` frames at ``rate`` holds ``num_frames`` taken frames (a
        header without a count, 0, is taken to: reading finds a short clip, as without buckets)."""
        if not total:
            return True
        try:
            return frame_indices(num_frames, frame_step(rate, self.frame_stride, self.fps))[-1] < total
        except ClipError:
            return False

    def source(self, row: dict) -> ClipSource:
        """A row's clip: its resolved ``clip`` (a ``VideoRow``), or with ``video_column`` the path
        in that column (rows of plain dicts)."""
        path = row.clip if self.video_column is None else row[self.video_column]
        fps = row.get("fps")
        return ClipSource(Path(path), float(fps) if fps not in (None, "") else None)

    def clip_frames(self, row: dict, rng: random.Random, num_frames: int | None = None) -> np.ndarray:
        """The ``num_frames`` (default ``self.num_frames``) frames of one row's clip (uint8
        ``(F, H, W, 3)``); ``ClipError`` when it does not decode or is too short."""
        return self._clip(row, rng, num_frames)[0]

    def _clip(
        self, row: dict, rng: random.Random, num_frames: int | None = None
    ) -> tuple[np.ndarray, list[int]]:
        """``clip_frames``, and the source frame indices they were taken at."""
        num_frames = num_frames or self.num_frames
        source = self.source(row)
        if not source.path.exists():
            raise ClipError(f"{source.path} does not exist")
        total, rate = source.probe()
        step = frame_step(rate, self.frame_stride, self.fps)
        span = frame_indices(num_frames, step)[-1] + 1  # source frames the clip must have
        if total and total < span:
            raise ClipError(
                f"too short: {total} frames, {span} needed for --num_frames {num_frames} "
                + (f"at --fps {self.fps:g}" if self.fps else f"with --frame_stride {self.frame_stride}")
            )
        start = rng.randint(0, total - span) if self.random_start and total else 0
        indices = frame_indices(num_frames, step, start)
        return source.read(indices), indices

    def cache_key(self) -> dict:
        """What a cache of this dataset's clips (``clip_pixels``) depends on beyond the files
        (``clip_paths``): every setting of how a clip is read, its own ``seed`` and ``center_crop``
        included (its start and crop are drawn from them, not from the cache's arguments)."""
        return {"num_frames": self.num_frames, "frame_stride": self.frame_stride, "fps": self.fps,
                "height": self.height, "width": self.width, "random_start": self.random_start,
                "center_crop": self.center_crop, "seed": self.seed,
                "buckets": [list(b) for b in self.buckets] if self.buckets is not None else None}  # fmt: skip

    def clip_paths(self) -> list[Path]:
        """Each row's clip (a video file or a folder of frames), in row order: what a cache of
        the clips must tell from a rewrite (another folder with the same metadata, a clip
        replaced under its name)."""
        return [self.source(self.dataset[i]).path for i in range(len(self.dataset))]

    def clip_pixels(self, index: int) -> torch.Tensor | None:
        """Row ``index``'s clip as epoch 0 of training reads it (its start and crop; never flipped:
        a cache keeps both orientations), ``(3, F, H, W)``; None when it does not decode or is
        too short. For the frozen models' cache."""
        row, rng = self.dataset[index], self._rng(index, epoch=0)
        pick_caption(row[self.caption_column], rng)  # the same draws as __getitem__, in order
        try:
            num_frames, height, width = self.shape_of(index)
            frames = self.clip_frames(row, rng, num_frames)
        except ClipError:
            return None
        return transform_clip(frames, height, width, self.center_crop, False, rng)[0]

    def clip_audio(self, row: dict, indices: list[int], num_frames: int) -> dict[str, torch.Tensor]:
        """``audio_mel``, ``has_audio`` and ``frame_rate`` of a row's clip taken at source frame
        ``indices`` (see the class doc)."""
        source = self.source(row)
        rate = source.fps if source.is_frame_folder else source.probe()[1]
        clip_rate = rate / frame_step(rate, self.frame_stride, self.fps) if rate else 24.0
        path = None if source.is_frame_folder or not rate else source.path
        start = indices[0] / rate if rate else 0.0  # the first taken frame's time
        try:
            mel, has_audio = self.audio.clip_mel(path, start, num_frames, clip_rate)
        except ValueError as e:
            raise ClipError(f"cannot read its sound ({e})") from e
        # CPU: data-loader side (the batch moves to the device)
        return {"audio_mel": mel, "has_audio": torch.tensor(has_audio), "frame_rate": torch.tensor(clip_rate)}

    def _readable_row(
        self, index: int
    ) -> tuple[int, str, random.Random, np.ndarray | None, np.ndarray | None, dict | None]:
        """The first usable row from ``index`` on: its index, caption, random draws (the caption
        drawn first, then the clip's start, crop and flip), frames, its mask clip's frames at
        the same indices (``mask_column``; None without), and its sound (``clip_audio``; None
        without ``audio`` or without videos)."""
        n = len(self.dataset)
        for i in ((index + offset) % n for offset in range(n)):
            if self.row_buckets is not None and self.row_buckets[i] != self.row_buckets[index]:
                continue  # a stand-in from the same bucket: a batch keeps one shape
            row = self.dataset[i]
            rng = self._rng(i)
            caption = pick_caption(row[self.caption_column], rng)
            try:
                if i in self.unreadable_rows:
                    raise ClipError("skipped when the frozen-model cache was built")
                if not self.with_videos:
                    return i, caption, rng, None, None, None
                frames, indices = self._clip(row, rng, self.shape_of(i)[0])
                # a mask that does not decode: the row is skipped like its clip
                mask = self.mask_source(row).read(indices) if self.mask_column is not None else None
                sound = self.clip_audio(row, indices, len(indices)) if self.audio is not None else None
                return i, caption, rng, frames, mask, sound
            except ClipError as e:
                if i not in self.skipped_rows:
                    self.skipped_rows.add(i)
                    logger.warning("skipping row %d: unusable clip (%s)", i, e)
        raise DataError(f"no readable clip of {self.num_frames} frames in the dataset")

    def __getitem__(self, index: int) -> dict:
        i, caption, rng, frames, mask, sound = self._readable_row(index)
        if self.empty_prompt_probability and random.Random(f"{self.seed}-{self.epoch}-{i}-empty").random() < (
            self.empty_prompt_probability
        ):
            caption = ""
        item = {k: v[0] for k, v in self._tokenize([caption]).items()}
        item["index"] = i
        if frames is not None:
            _, height, width = self.shape_of(i)
            item["pixel_values"], crop = transform_clip(
                frames, height, width, self.center_crop, self.random_flip, rng
            )
            if mask is not None:  # the mask clip's same frames, crop and flip
                item["loss_mask"] = crop_mask_clip(mask, crop, height, width)
        if sound is not None:
            item.update(sound)
        return item


def crop_mask_clip(mask: np.ndarray, crop: ClipCrop, height: int, width: int) -> torch.Tensor:
    """A loss-mask clip (uint8 ``(F, H, W, 3)``, grey levels: white trains) through its clip's
    resize, crop and flip (``crop``); ``(1, F, height, width)`` floats in [0, 1]."""
    from PIL import Image

    top, left = crop.crop_top_left
    out = []
    for frame in mask:
        image = Image.fromarray(frame).convert("L")
        if image.size != (crop.original_size[1], crop.original_size[0]):
            image = image.resize((crop.original_size[1], crop.original_size[0]), Image.BILINEAR)
        image = image.resize((crop.resized_size[1], crop.resized_size[0]), Image.BILINEAR)
        image = image.crop((left, top, left + width, top + height))
        if crop.flipped:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        out.append(np.asarray(image, dtype=np.float32) / 255.0)
    return torch.from_numpy(np.stack(out)).unsqueeze(0)


def parse_video_buckets(spec: str, num_frames: int) -> list[tuple[int, int, int]]:
    """``--aspect_ratio_buckets`` of a video family: ``"frames,height,width;..."`` entries, or
    ``"height,width"`` ones at ``num_frames`` (``--num_frames``). ``DataError`` for an entry
    that is neither; the shapes' fit to the VAE is checked by ``check_video_shape``."""
    buckets: list[tuple[int, int, int]] = []
    for entry in (e.strip() for e in spec.split(";")):
        if not entry:
            continue
        parts = [p.strip() for p in entry.split(",")]
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise DataError(
                f"--aspect_ratio_buckets entry {entry!r} is not 'frames,height,width' or 'height,width' "
                "(positive integers)"
            )
        bucket = (
            tuple(int(p) for p in parts) if len(parts) == 3 else (num_frames, int(parts[0]), int(parts[1]))
        )
        if bucket not in buckets:
            buckets.append(bucket)
    if not buckets:
        raise DataError(f"--aspect_ratio_buckets {spec!r} names no bucket")
    return buckets


def nearest_clip_bucket(frames: int, height: int, width: int, buckets, fits) -> int:
    """The bucket of a clip of ``frames`` x ``height`` x ``width``: among the buckets whose frame
    count the clip holds (``fits(frames, n)``), the longest, then the nearest aspect ratio
    (``buckets.nearest_bucket``); ``NO_BUCKET`` when the clip is shorter than every bucket."""
    longest = max((b[0] for b in buckets if fits(frames, b[0])), default=None)
    if longest is None:
        return NO_BUCKET
    candidates = [i for i, b in enumerate(buckets) if b[0] == longest]
    return candidates[nearest_bucket(height, width, [buckets[i][1:] for i in candidates])]


def bucket_clips(clips: VideoCaptionDataset, buckets: Sequence[tuple[int, int, int]]) -> list[int]:
    """Each row's bucket index (``NO_BUCKET`` for a clip that cannot be probed or is shorter than
    every bucket), every rank probing the headers of its share of the rows. Collective: call on
    every rank."""
    from ..runtime.distributed import all_gather_object, get_rank, get_world_size

    rank, world = get_rank(), get_world_size()
    per_rank = -(-len(clips.dataset) // world)
    mine = []
    for i in range(rank * per_rank, min(len(clips.dataset), (rank + 1) * per_rank)):
        row = clips.dataset[i]
        try:
            total, rate, height, width = clips.probe(row)
        except ClipError as e:
            logger.warning("skipping row %d: unusable clip (%s)", i, e)
            mine.append(NO_BUCKET)
            continue
        mine.append(
            nearest_clip_bucket(total, height, width, buckets, lambda t, n, r=rate: clips.fits(t, r, n))
        )
    return [b for share in all_gather_object(mine) for b in share]


# -------------------------------------------------------------------------------- writing clips

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220), "yellow": (235, 215, 40)}
SHAPES = ("circle", "square")
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float = 8) -> Path:
    """Write uint8 RGB frames ``(F, H, W, 3)`` (even sides) as an H.264 mp4 (x264 at constant
    quantiser 0, yuv420p: players read it; colours round by a unit or two) with PyAV."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=int(fps) if float(fps).is_integer() else fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"qp": "0"}
        for frame in frames:
            for packet in stream.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            ):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_frame_folder(folder: str | os.PathLike, frames: np.ndarray) -> Path:
    """Write uint8 RGB frames ``(F, H, W, 3)`` as ``00000.png``, ``00001.png``, ... in ``folder``."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        Image.fromarray(frame).save(folder / f"{i:05d}.png")
    return folder


def shapes_clip(
    colour: str,
    shape: str,
    direction: str,
    frames: int,
    size: int,
    rng: random.Random,
    width: int | None = None,
) -> np.ndarray:
    """A clip of one coloured shape crossing a light background in ``direction`` (uint8
    ``(frames, size, width, 3)``)."""
    from PIL import Image, ImageDraw

    width = width or size
    r = rng.randint(min(width, size) // 6, min(width, size) // 4)
    dx, dy = DIRECTIONS[direction]
    x0 = rng.randint(r, width - r) if dx == 0 else (r if dx > 0 else width - r)
    y0 = rng.randint(r, size - r) if dy == 0 else (r if dy > 0 else size - r)
    speed = (min(width, size) - 2 * r) / max(1, frames - 1)
    out = []
    for k in range(frames):
        img = Image.new("RGB", (width, size), (235, 235, 235))
        cx, cy = x0 + dx * speed * k, y0 + dy * speed * k
        box = (round(cx - r), round(cy - r), round(cx + r), round(cy + r))
        (ImageDraw.Draw(img).ellipse if shape == "circle" else ImageDraw.Draw(img).rectangle)(
            box, fill=COLOURS[colour]
        )
        out.append(np.asarray(img))
    return np.stack(out)


SHAPES_FPS = 8  # the frame rate of the shapes clips (and the frame folders' fps column)


@dataclass(frozen=True)
class ShapeTones:
    """The sound of the shapes clips (``write_shapes_videos``): each mp4 sounds a sine tone
    whose pitch is its shape's colour (``data.audio.COLOUR_TONES``) at ``sample_rate``, except
    the clips numbered in ``silent`` (no audio stream).

    Example:
        >>> ShapeTones(sample_rate=16000, silent=(15,))
    """

    sample_rate: int
    silent: Sequence[int] = ()


def write_shapes_videos(
    folder: str | os.PathLike,
    num_clips: int = 8,
    frames: int = 9,
    size: int = 32,
    *,
    seed: int = 0,
    layout: str = "video",
    sizes: list[tuple[int, int]] | None = None,
    tones: ShapeTones | None = None,
) -> Path:
    """Write a video folder of moving coloured shapes with captions ("a red circle moving
    right") and return it: ``layout="video"`` writes mp4 clips (``00000.mp4``, ...) at
    ``SHAPES_FPS``, ``"frames"`` one folder of PNG frames per clip (with an ``fps`` column),
    each listed in ``metadata.jsonl`` (``file_name``, ``text``). The tiny default of the video
    families. Clips are ``size`` x ``size``, or take their (width, height) in turn from
    ``sizes`` (landscape and portrait clips: aspect-ratio buckets). With ``tones``
    (``ShapeTones``) the mp4s sound a tone each.

    Example:
        >>> write_shapes_videos("clips", num_clips=8, frames=7, sizes=[(48, 32), (32, 48)])
    """
    fps = SHAPES_FPS
    if layout not in ("video", "frames"):
        raise ValueError(f"layout must be 'video' or 'frames', got {layout!r}")
    if tones is not None and layout != "video":
        raise ValueError("tones need layout='video' (a frame folder has no sound)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(num_clips):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        direction = rng.choice(sorted(DIRECTIONS))
        clip_width, clip_height = sizes[i % len(sizes)] if sizes else (None, size)
        clip = shapes_clip(colour, shape, direction, frames, clip_height, rng, clip_width)
        caption = f"a {colour} {shape} moving {direction}"
        if layout == "video":
            name = f"{i:05d}.mp4"
            if tones is not None and i not in tones.silent:
                from .audio import COLOUR_TONES, write_tone_video

                write_tone_video(folder / name, clip, fps, COLOUR_TONES[colour], tones.sample_rate)
            else:
                write_video(folder / name, clip, fps)
            rows.append({"file_name": name, "text": caption})
        else:
            name = f"{i:05d}"
            write_frame_folder(folder / name, clip)
            rows.append({"file_name": name, "text": caption, "fps": fps})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_validation_videos(
    videos: list[list], folder: str | os.PathLike, step: int, fps: float = 8
) -> list[Path]:
    """Write each validation video (a list of PIL frames) as ``step-<step>-<i>.mp4`` in
    ``folder``, with its sound where it has one (``pipeline_io.VideoWithSound``: at its own
    fps); returns the paths."""
    paths = []
    for i, frames in enumerate(videos):
        array = np.stack([np.asarray(frame.convert("RGB")) for frame in frames])
        h, w = array.shape[1] // 2 * 2, array.shape[2] // 2 * 2  # H.264 takes even sides
        path = Path(folder) / f"step-{step:06d}-{i}.mp4"
        if getattr(frames, "audio", None) is not None:
            from .audio import write_video_with_audio

            paths.append(
                write_video_with_audio(path, array[:, :h, :w], frames.fps, frames.audio, frames.sample_rate)
            )
        else:
            paths.append(write_video(path, array[:, :h, :w], fps=fps))
    return paths
