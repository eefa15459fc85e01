"""Video-caption data: the folder layouts (videofolder's metadata, frame folders), frames taken at
``--frame_stride`` / ``--fps``, one crop and one flip per clip, unusable clips skipped and
counted, and the shape rules of the Wan VAE."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.unit

SIZE = 32


def _levels(k: int) -> int:
    return 10 + 20 * k  # frame k's grey level: which source frame a taken frame is reads back


def _counting_clip(frames: int, height: int = SIZE, width: int = SIZE) -> np.ndarray:
    return np.stack([np.full((height, width, 3), _levels(k), np.uint8) for k in range(frames)])


def _grey_levels(pixels: torch.Tensor) -> list[float]:
    """Mean grey level (0..255) of each frame of ``(3, F, H, W)`` pixels in [-1, 1]."""
    return ((pixels + 1) * 127.5).mean(dim=(0, 2, 3)).tolist()


def _tokenize(captions):
    return {"input_ids": torch.tensor([[len(c)] for c in captions])}


def _write(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_shapes_videos_load_as_a_videofolder_and_as_frame_folders(tmp_path):
    import datasets

    from diffusers_zero3.data.images import collate
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_shapes_videos,
    )

    folder = write_shapes_videos(tmp_path / "clips", num_clips=4, frames=9, size=SIZE)
    rows = load_video_caption_dataset(folder)
    assert len(rows) == 4 and rows.column_names == ["file_name", "text"]
    assert all(r["text"].startswith("a ") and " moving " in r["text"] for r in rows)
    # the layout of datasets' videofolder: the same files and captions (not decoded: torchcodec)
    vf = datasets.load_dataset("videofolder", data_dir=str(folder))["train"]
    vf = vf.cast_column("video", datasets.Video(decode=False))
    assert sorted((r["video"]["path"], r["text"]) for r in vf) == sorted(
        (str(r.clip), r["text"]) for r in rows
    )
    frames = write_shapes_videos(tmp_path / "frames", num_clips=4, frames=9, size=SIZE, layout="frames")
    frame_rows = load_video_caption_dataset(frames)
    assert [r["text"] for r in frame_rows] == [r["text"] for r in rows]  # same seed, same clips
    for data in (rows, frame_rows):
        ds = VideoCaptionDataset(
            data, RowsToPixels(resolution=SIZE, center_crop=True, tokenize=_tokenize), ClipSampling(9)
        )
        batch = collate([ds[0], ds[1]])
        assert batch["pixel_values"].shape == (2, 3, 9, SIZE, SIZE) and batch["index"].tolist() == [0, 1]
        pixels = batch["pixel_values"]
        assert -1.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0
        assert (pixels[:, :, 0] - pixels[:, :, -1]).abs().max() > 0.5  # the shape moves
    # mp4 (x264 at quantiser 0, yuv420p) decodes close to the PNG frames of the same clip
    a = VideoCaptionDataset(
        rows, RowsToPixels(resolution=SIZE, center_crop=True, tokenize=_tokenize), ClipSampling(9)
    )[2]["pixel_values"]
    b = VideoCaptionDataset(
        frame_rows, RowsToPixels(resolution=SIZE, center_crop=True, tokenize=_tokenize), ClipSampling(9)
    )[2]
    assert (a - b["pixel_values"]).abs().mean() < 0.05


@pytest.mark.parametrize("layout", ["video", "frames"])
def test_frames_are_taken_at_the_stride_or_the_fps(tmp_path, layout):
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_frame_folder,
        write_video,
    )

    clip = _counting_clip(12)
    name = "clip.mp4" if layout == "video" else "clip"
    (write_video if layout == "video" else write_frame_folder)(
        tmp_path / name, clip, *((8,) if layout == "video" else ())
    )
    rows = load_video_caption_dataset(_write(tmp_path, [{"file_name": name, "text": "a clip", "fps": 8}]))
    tol = 2.5 if layout == "video" else 1e-3

    def levels(**kw):
        pixels = RowsToPixels(resolution=SIZE, center_crop=True, tokenize=_tokenize)
        item = VideoCaptionDataset(rows, pixels, ClipSampling(**kw))[0]
        return _grey_levels(item["pixel_values"])

    np.testing.assert_allclose(levels(num_frames=5), [_levels(k) for k in range(5)], atol=tol)
    np.testing.assert_allclose(
        levels(num_frames=5, frame_stride=2), [_levels(k) for k in (0, 2, 4, 6, 8)], atol=tol
    )
    np.testing.assert_allclose(levels(num_frames=3, fps=2), [_levels(k) for k in (0, 4, 8)], atol=tol)
    # a fractional step (8 fps to 3): the nearest source frames, 0, 2.67, 5.33, 8
    np.testing.assert_allclose(levels(num_frames=4, fps=3), [_levels(k) for k in (0, 3, 5, 8)], atol=tol)
    np.testing.assert_allclose(levels(num_frames=3, fps=4), [_levels(k) for k in (0, 2, 4)], atol=tol)
    # a random start: consecutive strided frames, the same for a (seed, epoch), moving between epochs
    ds = VideoCaptionDataset(
        rows,
        RowsToPixels(resolution=SIZE, tokenize=_tokenize),
        ClipSampling(3, frame_stride=2, random_start=True),
    )
    starts = []
    for epoch in range(12):
        ds.set_epoch(epoch)
        got = _grey_levels(ds[0]["pixel_values"])
        assert got == pytest.approx(_grey_levels(ds[0]["pixel_values"]))
        start = round((got[0] - 10) / 20)
        np.testing.assert_allclose(got, [_levels(start + 2 * k) for k in range(3)], atol=tol)
        starts.append(start)
    assert len(set(starts)) > 2 and max(starts) <= 12 - 5


def test_one_crop_and_one_flip_per_clip(tmp_path):
    """Every frame of a clip is one noise image plus its frame's brightness: the frames of an item
    differ by a constant only if they were cropped and flipped alike. Across seeds the crops move
    and both orientations come."""
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_frame_folder,
    )

    rng = np.random.default_rng(0)
    base = rng.integers(40, 200, size=(40, 56, 3)).astype(np.int16)
    clip = np.stack([np.clip(base + 6 * k, 0, 255).astype(np.uint8) for k in range(5)])
    write_frame_folder(tmp_path / "noise", clip)
    rows = load_video_caption_dataset(_write(tmp_path, [{"file_name": "noise", "text": "noise"}]))
    firsts = []
    for seed in range(16):
        ds = VideoCaptionDataset(
            rows,
            RowsToPixels(random_flip=True, seed=seed, tokenize=_tokenize),
            ClipSampling(5, height=SIZE, width=SIZE),
        )
        pixels = ds[0]["pixel_values"]
        for k in range(1, 5):
            diff = pixels[:, k] - pixels[:, 0]
            assert float(diff.std()) < 1e-6 and float(diff.mean()) == pytest.approx(6 * k / 127.5, abs=1e-5)
        firsts.append(pixels[:, 0])
    distinct = {tuple(p.flatten()[:64].tolist()) for p in firsts}
    assert len(distinct) > 4  # crops (and flips) vary with the seed
    # with a centre crop, each item is the clip or its mirror image, and both come
    unflipped = VideoCaptionDataset(
        rows, RowsToPixels(resolution=SIZE, center_crop=True, tokenize=_tokenize), ClipSampling(5)
    )[0]
    mirrored = unflipped["pixel_values"].flip(-1)
    centre = [
        VideoCaptionDataset(
            rows,
            RowsToPixels(resolution=SIZE, center_crop=True, random_flip=True, seed=s, tokenize=_tokenize),
            ClipSampling(5),
        )[0]["pixel_values"]
        for s in range(12)
    ]
    n_flipped = sum(torch.equal(p, mirrored) for p in centre)
    n_plain = sum(torch.equal(p, unflipped["pixel_values"]) for p in centre)
    assert n_flipped + n_plain == 12 and n_flipped > 0 and n_plain > 0
    # the resize covers height x width: 40x56 becomes 34x48, cropped to 32x48
    wide = VideoCaptionDataset(
        rows, RowsToPixels(center_crop=True, tokenize=_tokenize), ClipSampling(5, height=32, width=48)
    )[0]
    assert wide["pixel_values"].shape == (3, 5, 32, 48)


def test_corrupt_short_and_missing_clips_are_skipped_and_counted(tmp_path, caplog):
    from diffusers_zero3.data.images import DataError
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_video,
    )

    write_video(tmp_path / "good.mp4", _counting_clip(9))
    (tmp_path / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    write_video(tmp_path / "short.mp4", _counting_clip(3))
    write_video(tmp_path / "good2.mp4", _counting_clip(9))
    names = ["good.mp4", "corrupt.mp4", "short.mp4", "missing.mp4", "good2.mp4"]
    rows = load_video_caption_dataset(_write(tmp_path, [{"file_name": n, "text": n} for n in names]))
    ds = VideoCaptionDataset(rows, RowsToPixels(resolution=SIZE, tokenize=_tokenize), ClipSampling(5))
    with caplog.at_level(logging.WARNING, logger="diffusers_zero3"):
        items = [ds[i] for i in range(len(ds))]
    assert [item["index"] for item in items] == [0, 4, 4, 4, 4]  # each skipped row: the next readable one
    assert ds.skipped_rows == {1, 2, 3}
    for row, why in ((1, "cannot"), (2, "too short: 3 frames, 5 needed"), (3, "does not exist")):
        assert any(
            f"skipping row {row}:" in r.getMessage() and why in r.getMessage() for r in caplog.records
        ), row
    assert sum("skipping row" in r.getMessage() for r in caplog.records) == 3  # once per row
    # with --frame_stride 3 the good clips are too short too: nothing readable
    with pytest.raises(DataError, match="no readable clip"):
        VideoCaptionDataset(
            rows, RowsToPixels(resolution=SIZE, tokenize=_tokenize), ClipSampling(5, frame_stride=3)
        )[0]
    # a cache that skipped row 0: skipped here as well, without decoding
    cached = VideoCaptionDataset(
        rows,
        RowsToPixels(resolution=SIZE, live_pixels=False, tokenize=_tokenize),
        ClipSampling(5),
        unreadable_rows=[0],
    )
    item = cached[0]
    assert item["index"] == 1 and "pixel_values" not in item


def test_video_shapes_must_fit_the_vae():
    from diffusers_zero3.data.video import check_video_shape
    from diffusers_zero3.families.qwenimage import QWENIMAGE
    from diffusers_zero3.families.wan import PUBLISHED_VAE_21, PUBLISHED_VAE_22, WAN, WAN22_5B

    check_video_shape(81, 480, 832, WAN, PUBLISHED_VAE_21)  # the published default
    check_video_shape(1, 480, 832, WAN, PUBLISHED_VAE_21)  # an image
    with pytest.raises(ValueError, match=r"--num_frames 80 .* 1 \+ 4k frames, e.g. 77 or 81"):
        check_video_shape(80, 480, 832, WAN, PUBLISHED_VAE_21)
    with pytest.raises(ValueError, match="--height 488 must be a multiple of 16.*480 or 496"):
        check_video_shape(81, 488, 832, WAN, PUBLISHED_VAE_21)
    with pytest.raises(ValueError, match="--width 8 must be a multiple of 16"):
        check_video_shape(5, 32, 8, WAN, PUBLISHED_VAE_21)
    check_video_shape(121, 704, 1280, WAN22_5B, PUBLISHED_VAE_22)  # TI2V-5B's 720p
    with pytest.raises(ValueError, match="--height 720 must be a multiple of 32"):
        check_video_shape(121, 720, 1280, WAN22_5B, PUBLISHED_VAE_22)
    qwen_vae = dict(temperal_downsample=[False, True, True])
    with pytest.raises(ValueError, match="--num_frames 5: Qwen-Image is an image family"):
        check_video_shape(5, 64, 64, QWENIMAGE, qwen_vae)
    with pytest.raises(ValueError, match="--num_frames must be at least 1"):
        check_video_shape(0, 64, 64, WAN, PUBLISHED_VAE_21)


def test_bad_folders_and_flags_are_data_errors(tmp_path):
    from diffusers_zero3.data.images import DataError
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_frame_folder,
    )

    with pytest.raises(DataError, match="is not a directory"):
        load_video_caption_dataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no metadata.jsonl or metadata.csv"):
        load_video_caption_dataset(tmp_path / "empty")
    _write(tmp_path / "nocaption", [{"file_name": "a.mp4", "caption": "x"}])
    with pytest.raises(DataError, match="--caption_column 'text' is not a column"):
        load_video_caption_dataset(tmp_path / "nocaption")
    # metadata.csv works like metadata.jsonl; a frame folder without fps cannot take --fps
    write_frame_folder(tmp_path / "csv" / "clip", _counting_clip(4))
    (tmp_path / "csv" / "metadata.csv").write_text("file_name,text\nclip,a clip\n")
    rows = load_video_caption_dataset(tmp_path / "csv")
    assert rows[0]["text"] == "a clip"
    assert (
        VideoCaptionDataset(rows, RowsToPixels(resolution=SIZE, tokenize=_tokenize), ClipSampling(4))[0][
            "pixel_values"
        ].shape[1]
        == 4
    )
    with pytest.raises(DataError, match="no readable clip"):
        VideoCaptionDataset(rows, RowsToPixels(resolution=SIZE, tokenize=_tokenize), ClipSampling(2, fps=4))[
            0
        ]
    with pytest.raises(ValueError, match="--frame_stride or --fps, not both"):
        VideoCaptionDataset(
            rows, RowsToPixels(resolution=SIZE, tokenize=_tokenize), ClipSampling(2, frame_stride=2, fps=4)
        )


def test_foreign_metadata_with_its_own_video_and_frames_columns(tmp_path):
    """A folder written by another tool: clips in a subfolder, named by a relative ``file_name``
    beside the user's own ``video``, ``frames`` and ``text`` columns. The clip is the file the
    folder names (the columns stay as written), and any column, ``video`` too, can be the captions."""
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_video,
    )

    records = []
    for i in range(2):
        name = f"videos/clip_{i:02d}.mp4"
        write_video(tmp_path / name, _counting_clip(9))
        records.append({"file_name": name, "video": name, "frames": 9, "text": f"clip {i}"})
    folder = _write(tmp_path, records)
    rows = load_video_caption_dataset(folder)
    ds = VideoCaptionDataset(rows, RowsToPixels(resolution=SIZE, tokenize=_tokenize), ClipSampling(5))
    assert [ds[i]["index"] for i in range(2)] == [0, 1] and not ds.skipped_rows
    assert ds[0]["pixel_values"].shape == (3, 5, SIZE, SIZE)
    assert rows[1].clip == folder.absolute() / "videos/clip_01.mp4"  # resolved against the folder
    assert rows[1]["video"] == "videos/clip_01.mp4" and rows[1]["frames"] == 9  # as written
    assert rows.column_names == ["file_name", "video", "frames", "text"]
    # the user's video column as the captions: the cache reads them by column name
    by_video = load_video_caption_dataset(folder, caption_column="video")
    assert by_video["video"] == ["videos/clip_00.mp4", "videos/clip_01.mp4"]
    captioned = VideoCaptionDataset(
        by_video, RowsToPixels(resolution=SIZE, caption_column="video", tokenize=_tokenize), ClipSampling(5)
    )
    assert captioned[1]["input_ids"].tolist() == [len("videos/clip_01.mp4")] and not captioned.skipped_rows


def test_items_carry_the_familys_tokens(tmp_path):
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_shapes_videos,
    )
    from diffusers_zero3.demo.tokenizers import write_umt5_tokenizer
    from diffusers_zero3.families.wan import WAN

    tokenizers = {"text_encoder": WAN.load_tokenizer(write_umt5_tokenizer(tmp_path / "tok"))}
    rows = load_video_caption_dataset(
        write_shapes_videos(tmp_path / "clips", num_clips=2, frames=5, size=SIZE)
    )
    ds = VideoCaptionDataset(
        rows,
        RowsToPixels(
            resolution=SIZE, empty_prompt_probability=1.0, tokenize=lambda c: WAN.tokenize(tokenizers, c, 16)
        ),
        ClipSampling(5),
    )
    item = ds[1]
    assert set(item) == {"input_ids", "attention_mask", "index", "pixel_values"}
    assert item["input_ids"].shape == (16,) and int(item["attention_mask"].sum()) == 1  # "" is </s> alone
    ds.empty_prompt_probability = 0.0
    expected = WAN.tokenize(tokenizers, [rows[1]["text"]], 16)["input_ids"][0]
    assert torch.equal(ds[1]["input_ids"], expected)


def test_a_cached_video_vae_holds_the_clips_training_reads(tiny_wan, tmp_path, caplog):
    """The frozen-model cache of a video family encodes each row's clip as epoch 0 reads it: its
    frames, its random crop, and both orientations. A row that does not decode is recorded."""
    from diffusers import AutoencoderKLWan

    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import ClipSampling, VideoCaptionDataset, load_video_caption_dataset
    from diffusers_zero3.families import WAN
    from tests.common import precompute

    pipe, data = tiny_wan
    vae = AutoencoderKLWan.from_pretrained(pipe, subfolder="vae").eval()
    rows = load_video_caption_dataset(data)
    rows[3].clip.rename(Path(tmp_path) / "moved.mp4")  # row 3 no longer decodes
    try:
        clips = VideoCaptionDataset(
            rows, RowsToPixels(resolution=SIZE, random_flip=True, seed=3, tokenize=_tokenize), ClipSampling(5)
        )
        with caplog.at_level(logging.INFO, logger="diffusers_zero3"):
            cache = precompute(
                rows, tmp_path / "cache", vae=vae, family=WAN, random_flip=True, seed=3, clips=clips,
                batch_size=4,
            )  # fmt: skip
    finally:
        (Path(tmp_path) / "moved.mp4").rename(rows[3].clip)
    assert cache.skipped_rows == [3]
    assert any("MiB per row (latent_params, latent_params_flipped)" in r.getMessage() for r in caplog.records)
    for i in (0, 5):
        item = clips[i]
        plain = clips.clip_pixels(i)
        flipped = torch.equal(item["pixel_values"], plain.flip(-1))
        assert flipped or torch.equal(item["pixel_values"], plain)
        with torch.no_grad():
            live = WAN.latent_distribution(vae, item["pixel_values"][None]).mode()
        cached = cache.get(torch.tensor([i]), flip=torch.tensor([flipped]), sample=False)["latents"]
        torch.testing.assert_close(cached, live, rtol=0, atol=1e-5)
        other = cache.get(torch.tensor([i]), flip=torch.tensor([not flipped]), sample=False)["latents"]
        assert (other - live).abs().max() > 1e-3  # the other orientation is another clip
    # another --num_frames is another cache
    fewer = VideoCaptionDataset(
        rows, RowsToPixels(resolution=SIZE, random_flip=True, seed=3, tokenize=_tokenize), ClipSampling(1)
    )
    again = precompute(
        rows, tmp_path / "cache", vae=vae, family=WAN, random_flip=True, seed=3, clips=fewer, batch_size=4
    )
    assert (
        again.folder != cache.folder and again.get(torch.tensor([0]), sample=False)["latents"].shape[2] == 1
    )


def test_video_buckets_take_each_clip_at_the_longest_bucket_it_holds_and_its_ratio(tmp_path):
    """(frames, height, width) buckets: a clip goes to the longest bucket it holds, at its
    nearest ratio; one shorter than every bucket is in none; items take their bucket's shape."""
    from diffusers_zero3.data.buckets import NO_BUCKET
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        bucket_clips,
        load_video_caption_dataset,
        parse_video_buckets,
        write_shapes_videos,
    )
    from diffusers_zero3.errors import DataError

    folder = tmp_path / "clips"
    # (width, height) and frames: landscape 9, portrait 5, square 3 (too short), square 9
    for name, frames, size in (
        ("a", 9, (48, 32)),
        ("b", 5, (32, 48)),
        ("c", 3, (32, 32)),
        ("d", 9, (32, 32)),
    ):
        write_shapes_videos(folder / name, num_clips=1, frames=frames, sizes=[size])
    rows = [{"file_name": f"{n}/00000.mp4", "text": f"clip {n}"} for n in "abcd"]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_video_caption_dataset(folder)
    buckets = parse_video_buckets("9,32,48;9,48,32;5,32,48;5,48,32;32,32", num_frames=9)
    assert buckets[-1] == (9, 32, 32)  # "h,w" at --num_frames
    clips = VideoCaptionDataset(
        ds,
        RowsToPixels(
            resolution=32, tokenize=lambda c: {"input_ids": torch.zeros(len(c), 2, dtype=torch.long)}
        ),
        ClipSampling(9),
    )
    row_buckets = bucket_clips(clips, buckets)
    assert row_buckets == [0, 3, NO_BUCKET, 4]
    clips.set_buckets(buckets, row_buckets)
    assert [tuple(clips[i]["pixel_values"].shape) for i in (0, 1, 3)] == [
        (3, 9, 32, 48),
        (3, 5, 48, 32),
        (3, 9, 32, 32),
    ]
    assert clips.clip_pixels(2) is None  # in no bucket: the cache skips it too
    with pytest.raises(DataError, match="not 'frames,height,width'"):
        parse_video_buckets("9,32,48,1", 9)
