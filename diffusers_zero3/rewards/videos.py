"""Qwen2-VL's video input of a clip tensor, on the clip's device: the frames a judge sees, their
size, and the patches of ``pixel_values_videos``.

A judge of clips (``BuiltinReward.takes_videos``) is given float videos ``[B, F, 3, H, W]`` in
``[0, 1]`` on the accelerator's device. What a Qwen2-VL / Qwen2.5-VL judge is shown of a video
file in its authors' inference is decided in two places, transcribed here (their packages are not
imported: qwen-vl-utils needs torchvision, and so does transformers' Qwen2-VL video processor):

* qwen-vl-utils' ``fetch_video`` (``vision_process.py``, the same rule in 0.0.10 to 0.0.14; the
  ``process_vision_info(..., return_video_kwargs=True)`` UnifiedReward's video scripts call
  appeared in 0.0.10): ``smart_nframes`` takes ``F / video_fps * 2`` frames (2 per second of
  video), at least 4 and at most ``min(768, F)``, floored to an even count, at
  ``torch.linspace(0, F - 1, n).round()``; every frame is resized (torchvision's bicubic with
  antialias) to ``smart_resize`` of its size with ``min_pixels = 128 * 28 * 28`` and
  ``max_pixels = max(min(768 * 28 * 28, total_pixels / n * 2), 1.05 * min_pixels)``; the sampled
  frame rate ``n / F * video_fps`` goes to the processor.
* transformers' ``Qwen2VLVideoProcessor`` (``video_processing_qwen2_vl.py``): ``smart_resize``
  again with its own pixel range (the identity on frames qwen-vl-utils has resized, unless the
  ranges disagree), ``/ 255``, the normalisation, and ``patchify``: consecutive frames in pairs
  (``temporal_patch_size`` 2; an odd count repeats the last frame), each pair's ``P x P`` patches
  in merge-window order. Qwen2.5-VL's processor adds ``second_per_grid_ts = 2 / sampled fps``, the
  seconds between two temporal patches, which spaces the video's temporal rotary positions
  (``tokens_per_second`` per second).

The resize is ``images.resize_bicubic`` (torch's bicubic with antialias, which is what
torchvision's tensor resize calls), on floats: qwen-vl-utils resizes 8-bit frames and rounds to
8 bits, so where a frame is resized the two agree to about one 8-bit level; at a size kept as
it is, to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .images import QwenVLImageConfig, normalize, resize_bicubic, smart_resize

# qwen-vl-utils' vision_process.py (0.0.10-0.0.14; 0.0.14 writes the pixel bounds as 128 and 768
# tokens of 28 x 28 pixels and the total as its MODEL_SEQ_LEN of 128000 tokens x 0.9)
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
FRAME_FACTOR = 2
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768


def check_videos(videos: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` unless ``videos`` is a float tensor ``[B, F, 3, H, W]`` with ``F >= 2``.

    Args:
        videos: the batch a judge of clips is called with.
        name: the reward's name, for the message.
    """
    if not torch.is_tensor(videos) or videos.dim() != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if torch.is_tensor(videos) else type(videos).__name__
        raise ValueError(
            f"reward '{name}' scores whole clips: it takes videos as a float tensor [B, F, 3, H, W] in [0, 1],"
            f" got {shape}"
        )
    if not videos.is_floating_point():
        raise ValueError(f"reward '{name}' takes float videos in [0, 1], got dtype {videos.dtype}")
    if videos.shape[1] < FRAME_FACTOR:
        raise ValueError(
            f"reward '{name}' needs clips of at least {FRAME_FACTOR} frames (its model sees frames in pairs),"
            f" got {videos.shape[1]}"
        )


@dataclass(frozen=True)
class QwenVLVideoConfig:
    """What qwen-vl-utils' ``fetch_video`` does to a video of ``video_fps`` frames per second
    (the defaults are its own; the message keys of a ``{"type": "video", ...}`` entry override
    them in the reference, as these fields do here).

    Attributes:
        video_fps: the frame rate of the clips the judge is given (a file's own in the reference;
            here a setting: 16 is Wan's).
        fps: frames sampled per second of video.
        min_frames: the fewest frames sampled (when the clip has them).
        max_frames: the most frames sampled.
        min_pixels: the least area of a frame after the resize.
        max_pixels: the largest area of a frame (None: qwen-vl-utils' rule, see the module docstring).
        total_pixels: the area of all the sampled frames together, over which frames shrink.
    """

    video_fps: float = 16.0
    fps: float = FPS
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int | None = None
    total_pixels: int = VIDEO_TOTAL_PIXELS

    def num_frames(self, total_frames: int) -> int:
        """qwen-vl-utils' ``smart_nframes``: how many of ``total_frames`` frames are sampled.

        Raises:
            ValueError: fewer than 2 frames would be sampled.
        """
        min_frames = math.ceil(self.min_frames / FRAME_FACTOR) * FRAME_FACTOR
        max_frames = math.floor(min(self.max_frames, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
        n = total_frames / self.video_fps * self.fps
        n = min(min(max(n, min_frames), max_frames), total_frames)
        n = math.floor(n / FRAME_FACTOR) * FRAME_FACTOR
        if not FRAME_FACTOR <= n <= total_frames:
            raise ValueError(
                f"a clip of {total_frames} frames gives {n} sampled frames, fewer than {FRAME_FACTOR}"
            )
        return n

    def frame_indices(self, total_frames: int) -> list[int]:
        """The sampled frames of a clip of ``total_frames`` frames, as qwen-vl-utils reads them
        (``torch.linspace(0, F - 1, n).round()``)."""
        n = self.num_frames(total_frames)
        # CPU: a handful of indices, computed as the reference does (float32 linspace, round half to even)
        return torch.linspace(0, total_frames - 1, n).round().long().tolist()

    def sampled_fps(self, total_frames: int) -> float:
        """The frame rate of the sampled frames, ``n / F * video_fps``, as qwen-vl-utils gives it
        to the processor."""
        return self.num_frames(total_frames) / max(total_frames, 1e-6) * self.video_fps

    def frame_size(self, height: int, width: int, num_frames: int, factor: int = 28) -> tuple[int, int]:
        """The ``(height, width)`` qwen-vl-utils resizes each of ``num_frames`` sampled frames to."""
        max_pixels = max(
            min(VIDEO_MAX_PIXELS, self.total_pixels / num_frames * FRAME_FACTOR), int(self.min_pixels * 1.05)
        )
        if self.max_pixels is not None:
            max_pixels = min(self.max_pixels, max_pixels)
        return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class VideoPatches:
    """Qwen2-VL's video input of a batch of clips.

    Attributes:
        patches: ``[B, grid_t * grid_h * grid_w, 3 * T * P * P]`` float32, each clip's rows in
            the order the processor's ``pixel_values_videos`` has them.
        grid: ``(grid_t, grid_h, grid_w)`` of every clip (``video_grid_thw``).
        second_per_grid: seconds between two temporal patches (Qwen2.5-VL's ``second_per_grid_ts``).
    """

    patches: torch.Tensor
    grid: tuple[int, int, int]
    second_per_grid: float


def qwen_vl_video_patches(
    videos: torch.Tensor, image_config: QwenVLImageConfig, video_config: QwenVLVideoConfig
) -> VideoPatches:
    """Qwen2-VL's video input of ``videos`` (``[B, F, 3, H, W]`` in ``[0, 1]``), on their device:
    the sampled frames resized, normalised and packed in temporal pairs (module docstring).

    Example:
        >>> v = qwen_vl_video_patches(torch.rand(2, 4, 3, 56, 56), QwenVLImageConfig(), QwenVLVideoConfig())
        >>> v.grid, v.patches.shape  # 4 frames (at least 4), upscaled to 128 tokens of 28 x 28 each
        ((2, 24, 24), torch.Size([2, 1152, 1176]))
    """
    b, total, c = videos.shape[:3]
    p, m, t = image_config.patch_size, image_config.merge_size, image_config.temporal_patch_size
    frames = videos[:, video_config.frame_indices(total)]
    n = frames.shape[1]
    size = video_config.frame_size(*frames.shape[-2:], n, factor=p * m)
    x = resize_bicubic(frames.flatten(0, 1), *size)
    # the processor's own smart_resize (its pixel range): the identity unless the ranges disagree
    size = smart_resize(
        *size, factor=p * m, min_pixels=image_config.min_pixels, max_pixels=image_config.max_pixels
    )
    x = normalize(resize_bicubic(x, *size), image_config.mean, image_config.std).reshape(b, n, c, *size)
    if pad := -n % t:  # the processor's patchify repeats the last frame (never here: n is even)
        x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    gt, gh, gw = x.shape[1] // t, size[0] // p, size[1] // p
    x = x.reshape(b, gt, t, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)  # (B, gt, gh/m, gw/m, m, m, C, T, P, P)
    patches = x.reshape(b, gt * gh * gw, c * t * p * p)
    return VideoPatches(patches, (gt, gh, gw), t / video_config.sampled_fps(total))
