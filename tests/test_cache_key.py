"""The frozen-model cache's key holds what changes its contents, each field tested on its own
(so that dropping one field from the key fails exactly one case), files rewritten under the same
paths and another folder of clips with the same captions miss the cache, and the cached random
crop of a row with several captions is the crop live training takes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.unit

# A fixed past mtime for the files a test writes: a rewrite a moment later then has another
# mtime whatever the file system's timestamp granularity.
PAST_NS = 1_000_000_000 * 10**9


class _KeyTaken(Exception):
    """Raised by the recording ``cache_key``: nothing is encoded."""


def key_inputs(monkeypatch, dataset, **kw) -> dict:
    """The inputs ``precompute_frozen_outputs`` keys its cache on for these arguments, taken at
    its call of ``cache_key`` (so the test sees exactly what the function hashes)."""
    from diffusers_zero3.placement import cache
    from tests.common import precompute

    taken: dict = {}

    def take(**inputs):
        taken.update(inputs)
        raise _KeyTaken

    with monkeypatch.context() as m:
        m.setattr(cache, "cache_key", take)
        with pytest.raises(_KeyTaken):
            precompute(dataset, "never-written", **kw)
    return json.loads(json.dumps(taken, default=str))  # as cache_key hashes them


def changed_fields(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


class _Tokenizer:
    """What the key reads of a tokenizer: its vocabulary and length."""

    model_max_length = 77

    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(2, 2)  # the key reads weights and dtype only


def _png(path: Path, colour: tuple[int, int, int], size=(24, 16)) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    os.utime(path, ns=(PAST_NS, PAST_NS))


def _path_column_dataset(folder: Path):
    """A parquet whose image columns hold relative file paths (two columns naming the same
    files), loaded and made images as training does."""
    import datasets
    import pandas as pd

    from diffusers_zero3.data.images import prepare_image_column

    for i in range(3):
        _png(folder / "images" / f"{i}.png", (80 * i, 40, 200))
    paths = [f"images/{i}.png" for i in range(3)]
    pd.DataFrame({"image": paths, "image2": paths, "text": [f"row {i}" for i in range(3)]}).to_parquet(
        folder / "train.parquet"
    )
    ds = datasets.load_dataset("parquet", data_files=str(folder / "train.parquet"))["train"]
    for column in ("image", "image2"):
        ds = prepare_image_column(ds, column, str(folder))
    return ds


@dataclass
class Setup:
    """One call's inputs: the dataset, the keyword arguments, a context to call it in."""

    dataset: Any
    kw: dict
    folder: Path
    monkeypatch: Any
    context: Callable[[], Any] = contextlib.nullcontext
    extra: dict = field(default_factory=dict)


def _image_setup(tmp_path: Path, monkeypatch) -> Setup:
    from diffusers_zero3.families import FLUX2

    folder = tmp_path / "data"
    kw = dict(
        text_encoders={"text_encoder": _module(0)},
        tokenizers={"text_encoder": _Tokenizer({"a": 0, "b": 1})},
        family=FLUX2,  # its encoder takes --max_sequence_length
        vae=_module(1),
        image_column="image",
        caption_column="text",
        resolution=16,
        center_crop=False,
        random_flip=False,
        seed=0,
        interpolation="bilinear",
    )
    return Setup(_path_column_dataset(folder), kw, folder, monkeypatch)


def _rewrite_one_image(s: Setup) -> None:
    from PIL import Image

    Image.new("RGB", (24, 16), (1, 2, 3)).save(s.folder / "images" / "1.png")  # same path, new pixels


def _other_caption(s: Setup) -> None:
    s.dataset = s.dataset.map(
        lambda r, i: {"text": r["text"] + (" again" if i == 1 else "")}, with_indices=True
    )


def _autocast(s: Setup) -> None:
    s.context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)


def _other_format(s: Setup) -> None:
    from diffusers_zero3.placement import cache

    s.monkeypatch.setattr(cache, "CACHE_FORMAT", cache.CACHE_FORMAT + 1)


def _set(**changes) -> Callable[[Setup], None]:
    return lambda s: s.kw.update(changes)


# Each case changes one input, and exactly one field of the key must change with it.
IMAGE_CASES: dict[str, tuple[str, Callable[[Setup], None]]] = {
    "format": ("format", _other_format),
    "family": ("family", _set(family="QWENIMAGE")),  # the same sequence length (512) as FLUX2's
    "text_encoders": ("text_encoders", lambda s: s.kw.update(text_encoders={"text_encoder": _module(7)})),
    "tokenizers": ("tokenizers", _set(tokenizers={"text_encoder": _Tokenizer({"a": 0, "c": 1})})),
    "sequence_lengths": ("sequence_lengths", _set(max_sequence_length=64)),
    "vae": ("vae", lambda s: s.kw.update(vae=_module(8))),
    "dtypes": ("dtypes", _autocast),
    "data": ("data", _other_caption),
    "files": ("files", _rewrite_one_image),
    "columns": ("columns", _set(image_column="image2")),  # the same files under another column
    "resolution": ("resolution", _set(resolution=24)),
    "center_crop": ("center_crop", _set(center_crop=True)),
    "random_flip": ("random_flip", _set(random_flip=True)),
    "seed": ("seed", _set(seed=1)),
    "buckets": ("buckets", _set(buckets=[(16, 24)], row_buckets=[0, 0, 0])),
    "interpolation": ("interpolation", _set(interpolation="bicubic")),
}


def _inputs(s: Setup) -> dict:
    from diffusers_zero3 import families

    kw = dict(s.kw)
    if isinstance(kw["family"], str):
        kw["family"] = getattr(families, kw["family"])
    with s.context():
        return key_inputs(s.monkeypatch, s.dataset, **kw)


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_each_image_key_field_changes_the_key_on_its_own(case, tmp_path, monkeypatch):
    """Changing one input (the family, a model's weights or dtype, the tokenizer, the sequence
    length, a caption, one image file rewritten under its path, the column, each transform
    setting) changes that field of the key and no other, and so the key."""
    from diffusers_zero3.placement.cache import cache_key

    s = _image_setup(tmp_path, monkeypatch)
    before = _inputs(s)
    expected, change = IMAGE_CASES[case]
    change(s)
    after = _inputs(s)
    assert changed_fields(before, after) == {expected}
    assert cache_key(**before) != cache_key(**after)


# ---------------------------------------------------------------------------------- video


def _tokenize(captions):
    return {"input_ids": torch.tensor([[len(c)] for c in captions])}


def _video_setup(tmp_path: Path, monkeypatch, **clip_kw) -> Setup:
    from diffusers_zero3.data.video import load_video_caption_dataset, write_shapes_videos
    from diffusers_zero3.families import WAN
    from tests.common import clip_dataset

    folder = write_shapes_videos(tmp_path / "clips", num_clips=2, frames=3, size=16, seed=0)
    for clip in folder.glob("*.mp4"):
        os.utime(clip, ns=(PAST_NS, PAST_NS))
    rows = load_video_caption_dataset(folder)
    clip_kw = {"num_frames": 3, "resolution": 16, "seed": 0, **clip_kw}
    clips = clip_dataset(rows, _tokenize, **clip_kw)
    kw = dict(vae=_module(1), family=WAN, resolution=16, seed=0, clips=clips)
    return Setup(rows, kw, folder, monkeypatch, extra={"clip_kw": clip_kw})


def _other_clips_same_captions(s: Setup) -> None:
    """Another folder of clips (other shapes) under the first folder's metadata: the same file
    names and captions, so the rows are equal column by column."""
    from diffusers_zero3.data.video import load_video_caption_dataset, write_shapes_videos
    from tests.common import clip_dataset

    other = write_shapes_videos(s.folder.parent / "other", num_clips=2, frames=3, size=16, seed=1)
    shutil.copy(s.folder / "metadata.jsonl", other / "metadata.jsonl")
    rows = load_video_caption_dataset(other)
    assert [dict(r) for r in rows] == [dict(r) for r in s.dataset]  # the same rows, other clips
    s.dataset = rows
    s.kw["clips"] = clip_dataset(rows, _tokenize, **s.extra["clip_kw"])


def _rewrite_one_clip(s: Setup) -> None:
    from diffusers_zero3.data.video import write_shapes_videos

    other = write_shapes_videos(s.folder.parent / "other", num_clips=2, frames=3, size=16, seed=1)
    shutil.copy(other / "00001.mp4", s.folder / "00001.mp4")  # same path, another clip


def _clips(**changes) -> Callable[[Setup], None]:
    def change(s: Setup) -> None:
        from tests.common import clip_dataset

        s.kw["clips"] = clip_dataset(s.dataset, _tokenize, **{**s.extra["clip_kw"], **changes})

    return change


def _clip_buckets(s: Setup) -> None:
    s.kw["clips"].set_buckets([(3, 16, 24)], [0, 0])


# (field of the key, field of clips.cache_key() or None, change)
VIDEO_CASES: dict[str, tuple[str, str | None, Callable[[Setup], None]]] = {
    "another folder, same captions": ("files", None, _other_clips_same_captions),
    "a clip rewritten": ("files", None, _rewrite_one_clip),
    "num_frames": ("clips", "num_frames", _clips(num_frames=2)),
    "frame_stride": ("clips", "frame_stride", _clips(frame_stride=2)),
    "fps": ("clips", "fps", _clips(fps=4.0)),
    "height": ("clips", "height", _clips(resolution=None, height=24, width=16)),
    "width": ("clips", "width", _clips(resolution=None, height=16, width=24)),
    "random_start": ("clips", "random_start", _clips(random_start=True)),
    "center_crop": ("clips", "center_crop", _clips(center_crop=True)),
    "seed": ("clips", "seed", _clips(seed=1)),  # the clips' own draws (start, crop)
    "buckets": ("clips", "buckets", _clip_buckets),
}


@pytest.mark.parametrize("case", list(VIDEO_CASES))
def test_each_video_key_field_changes_the_key_on_its_own(case, tmp_path, monkeypatch):
    """Another folder of clips with the same captions, a clip rewritten under its path, and each
    clip setting change the key, each in one field (of ``clips.cache_key()`` for the settings)."""
    from diffusers_zero3.placement.cache import cache_key

    s = _video_setup(tmp_path, monkeypatch)
    before = _inputs(s)
    expected, sub, change = VIDEO_CASES[case]
    change(s)
    after = _inputs(s)
    assert changed_fields(before, after) == {expected}
    if sub is not None:
        assert changed_fields(before["clips"], after["clips"]) == {sub}
    assert cache_key(**before) != cache_key(**after)


def test_every_key_field_has_a_case(tmp_path, monkeypatch):
    """A field added to the key (or to ``clips.cache_key()``) without a case above fails here."""
    images = _inputs(_image_setup(tmp_path / "i", monkeypatch))
    video = _inputs(_video_setup(tmp_path / "v", monkeypatch))
    covered = {f for f, _ in IMAGE_CASES.values()} | {f for f, _, _ in VIDEO_CASES.values()}
    assert set(images) == set(video) == covered
    assert set(video["clips"]) == {sub for _, sub, _ in VIDEO_CASES.values() if sub is not None}


def test_a_rewritten_image_is_encoded_again(tmp_path):
    """End to end with a real VAE: an image file rewritten under the same path (a parquet column
    of paths) misses the cache and its new latents are cached; the others are the same."""
    from diffusers import AutoencoderKL

    from diffusers_zero3.demo.pipelines import tiny_vae_config
    from tests.common import precompute

    torch.manual_seed(0)
    vae = AutoencoderKL(**tiny_vae_config()).eval()
    folder = tmp_path / "data"
    ds = _path_column_dataset(folder)
    kw = dict(vae=vae, resolution=16, center_crop=True, batch_size=3)
    first = precompute(ds, tmp_path / "cache", **kw)
    assert precompute(ds, tmp_path / "cache", **kw).reused  # positive control
    _rewrite_one_image(Setup(ds, kw, folder, None))
    again = precompute(ds, tmp_path / "cache", **kw)
    assert not again.reused and again.folder != first.folder
    rows = torch.arange(3)
    old, new = first.get(rows, sample=False)["latents"], again.get(rows, sample=False)["latents"]
    assert torch.equal(old[[0, 2]], new[[0, 2]]) and not torch.allclose(old[1], new[1])


# ---------------------------------------------------------------- the cached crop is the live one


def test_the_cached_random_crop_is_the_live_crop_with_several_captions(tmp_path):
    """Rows with several captions (live training draws one first, from the row's generator),
    random crop on: the cache's crop of each row and its latents are epoch 0's live ones."""
    import datasets
    from diffusers import AutoencoderKL
    from PIL import Image

    from diffusers_zero3.data.images import ImageCaptionDataset
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.demo.pipelines import tiny_vae_config
    from diffusers_zero3.families import SDXL
    from tests.common import precompute

    torch.manual_seed(0)
    vae = AutoencoderKL(**tiny_vae_config()).eval()
    rng = random.Random(0)
    sizes = [(48, 16), (16, 48), (40, 24), (24, 40), (48, 20), (20, 48)]  # (width, height): room to crop
    images = [
        Image.fromarray(
            torch.randint(
                0, 256, (h, w, 3), generator=torch.Generator().manual_seed(i), dtype=torch.uint8
            ).numpy()
        )
        for i, (w, h) in enumerate(sizes)
    ]
    captions = [[f"row {i} caption {k}" for k in range(rng.randint(2, 4))] for i in range(len(sizes))]
    ds = datasets.Dataset.from_dict({"image": images, "text": captions})
    cache = precompute(ds, tmp_path / "cache", vae=vae, family=SDXL, resolution=16, seed=5,
                                      batch_size=3)  # fmt: skip
    live = ImageCaptionDataset(ds, RowsToPixels(resolution=16, seed=5, tokenize=_tokenize))
    live.set_epoch(0)
    corners = []
    for i in range(len(ds)):
        item = live[i]
        cached = cache.get(torch.tensor([i]), sample=False)
        assert cached["crop_top_left"][0].tolist() == item["crop_top_left"].tolist(), i
        with torch.no_grad():
            latents = SDXL.latent_distribution(vae, item["pixel_values"][None]).mode()
        torch.testing.assert_close(cached["latents"], latents, rtol=0, atol=1e-5)
        corners.append(tuple(item["crop_top_left"].tolist()))
    assert len(set(corners)) > 1  # the crops are random: the test can tell them apart
