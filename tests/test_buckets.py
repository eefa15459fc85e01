"""Aspect-ratio buckets: parsing, defaults, assignment, the sampler's rank agreement and its
exact resume (also on another number of processes), and bucketed crops through the dataset."""

import random

import pytest
import torch

from diffusers_zero3.data.buckets import (
    NO_BUCKET,
    BucketBatchSampler,
    BucketPosition,
    assign_buckets,
    default_buckets,
    describe_buckets,
    image_sizes,
    nearest_bucket,
    parse_buckets,
)
from diffusers_zero3.errors import DataError

pytestmark = pytest.mark.unit


def test_parse_buckets_and_its_errors():
    assert parse_buckets("64,32; 32,64;64,64;", 16) == [(64, 32), (32, 64), (64, 64)]
    assert parse_buckets("64,32;64,32") == [(64, 32)]  # a repeated entry counts once
    for spec, words in [("64x32", "not 'height,width'"), ("64,-8", "not 'height,width'"), (";", "names no bucket"),
                        ("64,40", "multiples of 16")]:  # fmt: skip
        with pytest.raises(DataError, match=words):
            parse_buckets(spec, 16)


def test_default_buckets_keep_the_area_and_the_multiple():
    buckets = default_buckets(1024, 16)
    assert buckets[0] == (1024, 1024)
    assert all(h % 16 == 0 and w % 16 == 0 for h, w in buckets)
    assert all(abs(h * w / 1024**2 - 1) < 0.06 for h, w in buckets), buckets
    assert (768, 1344) in buckets or (768, 1360) in buckets  # 9:16, about SDXL's own 768 x 1344
    assert (
        len(set(buckets)) == len(buckets)
        and any(h > w for h, w in buckets)
        and any(h < w for h, w in buckets)
    )


def test_nearest_bucket_prefers_the_ratio_among_buckets_that_fit():
    buckets = [(64, 64), (48, 80), (80, 48), (32, 96)]
    assert nearest_bucket(300, 500, buckets) == 1  # landscape 3:5 -> 48 x 80
    assert nearest_bucket(500, 300, buckets) == 2
    assert nearest_bucket(100, 100, buckets) == 0
    # 40 x 120 fits 32 x 96 (the same ratio) and nothing else of that shape
    assert nearest_bucket(40, 120, buckets) == 3
    # an image smaller than every bucket still gets the nearest ratio (it is upscaled)
    assert nearest_bucket(10, 30, buckets) == 3
    # a bucket that does not fit loses to one that does, even at a farther ratio
    assert nearest_bucket(50, 100, [(64, 128), (48, 64)]) == 1
    # log-ratio symmetry: 1:2 and 2:1 are equally far from square; the tie goes to the larger bucket
    assert nearest_bucket(200, 200, [(32, 64), (64, 32), (128, 64)]) == 2


def _image_dataset(sizes, corrupt=()):
    import io

    import datasets
    from PIL import Image

    rows = []
    for i, (h, w) in enumerate(sizes):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (i * 20 % 255, 0, 0)).save(buf, format="PNG")
        data = buf.getvalue()[:20] if i in corrupt else buf.getvalue()
        rows.append({"bytes": data, "path": None})
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    return datasets.Dataset.from_dict(
        {"image": rows, "text": [f"c{i}" for i in range(len(sizes))]}, features=features
    )


def test_image_sizes_read_headers_and_flag_unreadable_images():
    ds = _image_dataset([(40, 80), (80, 40), (64, 64)], corrupt={1})
    assert image_sizes(ds, "image") == [(40, 80), None, (64, 64)]
    assert image_sizes(ds, "image", [2]) == [(64, 64)]
    assert assign_buckets([(40, 80), None], [(32, 64), (64, 32)]) == [0, NO_BUCKET]


def _row_buckets(n=60, buckets=3, seed=1):
    rng = random.Random(seed)
    return [rng.randrange(buckets) for _ in range(n)] + [NO_BUCKET, NO_BUCKET]


def _rank_batches(sampler, num_processes):
    """What accelerate's BatchSamplerShard gives each rank (the prepared loader's sharding)."""
    from accelerate.data_loader import BatchSamplerShard

    return [
        list(BatchSamplerShard(sampler, num_processes=num_processes, process_index=r))
        for r in range(num_processes)
    ]


def test_sampler_gives_every_rank_the_same_bucket_at_each_step():
    rows = _row_buckets()
    sampler = BucketBatchSampler(rows, batch_size=2, num_processes=3, seed=7)
    per_rank = _rank_batches(sampler, 3)
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(sampler) // 3 > 0
    for step in zip(*per_rank):
        assert len({rows[i] for batch in step for i in batch}) == 1, step  # one bucket across ranks
        assert all(len(batch) == 2 for batch in step)
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen))  # no row twice in an epoch
    assert not {i for i, b in enumerate(rows) if b == NO_BUCKET} & set(seen)  # unreadable rows never drawn
    counts = sampler.bucket_counts()
    assert len(seen) == sum(n // 6 * 6 for n in counts.values())  # only whole global batches
    # deterministic from the seed and epoch; another epoch, another order
    assert _rank_batches(BucketBatchSampler(rows, 2, 3, seed=7), 3) == per_rank
    sampler.set_epoch(1)
    assert _rank_batches(sampler, 3) != per_rank
    # buckets interleave (drawn by the batches they have left), not one bucket after another
    order = [b for b, _ in BucketBatchSampler(rows, 1, 2, seed=7).global_batches(0)]
    assert sum(a != b for a, b in zip(order, order[1:])) > len(set(order))


def _bucket_stream(sampler, bucket, length):
    """The first ``length`` rows of ``bucket``'s order across epochs: its passes one after another."""
    n = len(sampler.rows[bucket])
    return [sampler._order(bucket, k // n)[k % n] for k in range(length)]


def _trained_per_bucket(sampler, epochs, start=None):
    """Each bucket's rows in the order ``epochs`` train them (global batch after global batch)."""
    trained = {}
    for epoch in epochs:
        for bucket, rows in sampler.global_batches(epoch, start):
            trained.setdefault(bucket, []).extend(rows)
    return trained


def test_sampler_resumes_at_the_first_unseen_sample_on_the_same_and_another_number_of_processes():
    rows = _row_buckets(n=90, buckets=3, seed=3)
    full = BucketBatchSampler(rows, batch_size=2, num_processes=2, seed=5)
    whole = list(full.global_batches(4))
    epoch_start = full.position_after(4, 0)
    for k in (0, 3, len(whole) - 1):
        position = full.position_after(4, k)
        # same number of processes: the rest of the epoch equals the uninterrupted run's
        resumed = BucketBatchSampler(rows, 2, 2, seed=5)
        resumed.set_epoch(4)
        resumed.start_at(BucketPosition.from_state(position.to_state()))  # through the checkpoint's JSON form
        assert [b for b in resumed] == [r[i : i + 2] for _, r in whole[k:] for i in (0, 2)]
        # 3 processes of 1, for three epochs: each bucket goes on in its own order from where the
        # checkpoint left it, no sample repeated and none skipped (the samples it trains
        # continue where the checkpoint left them)
        other = BucketBatchSampler(rows, 1, 3, seed=5)
        other.start_at(position)
        before = {b: [i for _, r in whole[:k] for i in r if rows[i] == b] for b in full.rows}
        after = _trained_per_bucket(other, [4, 5, 6])
        for bucket in full.rows:
            begin = epoch_start.consumed[bucket]
            seen = before[bucket] + after.get(bucket, [])
            assert seen == _bucket_stream(full, bucket, begin + len(seen))[begin:], bucket
            # epochs 4 to 6 end within one global batch (3) of the end of the bucket's 7th pass
            n = len(full.rows[bucket])
            assert 7 * n - 3 < begin + len(seen) <= 7 * n, (bucket, begin, len(seen))
    end = full.position_after(4, len(whole))
    assert end.epoch == 5 and end == full.position_after(5, 0)  # a finished epoch resumes at the next one


def test_a_bucket_smaller_than_a_global_batch_is_trained_in_a_later_epoch():
    """Issue 49, defect 6: a bucket's rows that do not fill a global batch go on into the next
    epoch (its order runs on across epochs), so a bucket of fewer rows than one global batch is
    trained too: over a few epochs every readable row is trained, and each bucket's rows go
    round pass by pass, every row once a pass. It was never trained ("8 of 13 images")."""
    rows = [0] * 10 + [1] * 3 + [NO_BUCKET]  # bucket 1: 3 rows, one global batch is 4
    sampler = BucketBatchSampler(rows, batch_size=2, num_processes=2, seed=1)
    per_rank = _rank_batches(sampler, 2)
    assert len(per_rank[0]) == len(sampler) // 2 == 2  # epoch 0: bucket 0's 8 rows
    trained = _trained_per_bucket(sampler, range(4))
    assert set(trained) == {0, 1}
    assert {i for r in trained.values() for i in r} == set(range(13))  # every readable row trained
    for bucket, order in trained.items():
        n = len(sampler.rows[bucket])
        for k in range(0, len(order) - n + 1, n):
            assert sorted(order[k : k + n]) == sampler.rows[bucket], (bucket, order)  # each pass whole
    assert len(trained[0]) + len(trained[1]) >= 4 * 13 - 2 * 4  # 4 epochs: about 4 passes of the data
    # every rank one bucket at each step, with the remainder in it
    sampler.set_epoch(1)
    for step in zip(*_rank_batches(sampler, 2)):
        assert len({rows[i] for batch in step for i in batch}) == 1, step


def test_each_pass_over_a_bucket_is_its_own_order():
    """Issue 49, weak test: each pass over a bucket draws its own permutation (the pass in the
    per-bucket seed). Without it every pass would train the bucket in the same order, and every
    epoch the same subset of a bucket that does not fill its global batches; the bucket draw's
    own seed hid that."""
    rows = [0] * 10 + [1] * 7
    sampler = BucketBatchSampler(rows, batch_size=2, num_processes=2, seed=3)
    trained = _trained_per_bucket(sampler, range(6))
    for bucket, order in trained.items():
        n = len(sampler.rows[bucket])
        passes = [tuple(order[k : k + n]) for k in range(0, len(order) - n + 1, n)]
        assert len(passes) >= 4 and len(set(passes)) == len(passes), (bucket, passes)
    epochs = [set(_trained_per_bucket(sampler, [e])[0]) for e in range(4)]
    assert len({frozenset(e) for e in epochs}) > 1  # not the same subset of bucket 0 each epoch


def test_describe_buckets_and_an_empty_sampler():
    line = describe_buckets([(32, 64), (64, 32)], [0, 0, 0, 1, NO_BUCKET], 2)
    assert "32x64: 3" in line and "64x32: 1" in line and "2 of 5 images" in line and "1 unreadable" in line
    with pytest.raises(DataError, match="no readable image"):
        BucketBatchSampler([NO_BUCKET], 1)


def test_bucketed_crops_through_the_dataset(tmp_path):
    from PIL import Image

    from diffusers_zero3.data.images import ImageCaptionDataset, collate, transform_image_with_crop
    from diffusers_zero3.data.pixels import RowsToPixels

    image = Image.new("RGB", (200, 100))
    pixels, crop = transform_image_with_crop(image, (48, 80), False, True, random.Random(0), "lanczos")
    assert pixels.shape == (3, 48, 80) and crop.target_size == (48, 80)
    # covered then cropped: 100 x 200 -> 48 x 96 (scale 0.48), a 48 x 80 crop
    assert crop.resized_size == (48, 96) and crop.original_size == (100, 200)
    assert crop.mirrored().crop_top_left[1] == 96 - 80 - crop.crop_top_left[1]
    with pytest.raises(DataError, match="image_interpolation_mode"):
        transform_image_with_crop(image, 32, False, False, random.Random(0), "cubic")

    ds = _image_dataset([(40, 80), (40, 90), (80, 40), (40, 85)], corrupt={1})
    buckets = [(32, 64), (64, 32)]
    row_buckets = [0, 0, 1, 0]  # the corrupt row 1 is in bucket 0: its stand-in must be too
    dataset = ImageCaptionDataset(
        ds,
        RowsToPixels(
            resolution=32,
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 4, dtype=torch.long)},
            buckets=buckets,
            row_buckets=row_buckets,
        ),
    )
    items = [dataset[i] for i in range(4)]
    assert [tuple(it["pixel_values"].shape[1:]) for it in items] == [(32, 64), (32, 64), (64, 32), (32, 64)]
    assert items[1]["index"] == 3  # the next readable row of the same bucket, not row 2 (another shape)
    assert dataset.skipped_rows == {1}
    batch = collate([items[0], items[3]])
    assert batch["target_size"].tolist() == [[32, 64], [32, 64]]


def test_a_bucketed_cache_holds_each_image_at_its_buckets_shape_as_live_training_encodes_it(tmp_path):
    """The VAE cache with buckets: rows encoded bucket by bucket (a shard per shape), each crop
    the one live training makes at epoch 0, with its target size (SDXL's time_ids); another
    bucket list is another cache."""
    from diffusers import AutoencoderKL

    from diffusers_zero3.data.images import ImageCaptionDataset
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.demo.pipelines import tiny_vae_config
    from diffusers_zero3.families import SDXL
    from tests.common import precompute

    torch.manual_seed(0)
    vae = AutoencoderKL(**tiny_vae_config()).eval()
    ds = _image_dataset([(40, 80), (80, 40), (40, 90), (64, 64), (80, 40)], corrupt={3})
    buckets = [(16, 32), (32, 16)]
    row_buckets = assign_buckets(image_sizes(ds, "image"), buckets)
    assert row_buckets == [0, 1, 0, NO_BUCKET, 1]
    kw = dict(vae=vae, family=SDXL, resolution=16, random_flip=True, seed=3, batch_size=4, shard_rows=8)
    cache = precompute(ds, tmp_path, buckets=buckets, row_buckets=row_buckets, **kw)
    assert cache.skipped_rows == [3] and len(list(cache.folder.glob("part-*"))) == 2  # one shard per shape
    live = ImageCaptionDataset(
        ds,
        RowsToPixels(
            resolution=16,
            random_flip=False,
            seed=3,
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 2, dtype=torch.long)},
            buckets=buckets,
            row_buckets=row_buckets,
        ),
    )
    for rows in ([0, 2], [1, 4]):
        got = cache.get(torch.tensor(rows), sample=False)
        items = [live[i] for i in rows]
        pixels = torch.stack([it["pixel_values"] for it in items])
        with torch.no_grad():
            expected = vae.encode(pixels).latent_dist.mode()
        torch.testing.assert_close(got["latents"], expected, rtol=1e-5, atol=1e-5)
        assert got["target_size"].tolist() == [list(buckets[row_buckets[rows[0]]])] * 2
        assert got["crop_top_left"].tolist() == [it["crop_top_left"].tolist() for it in items]
    other = precompute(
        ds, tmp_path, buckets=buckets[::-1], row_buckets=[1 - b if b >= 0 else b for b in row_buckets], **kw
    )
    assert not other.reused and other.folder != cache.folder


def _exif_jpeg(folder, name, stored_hw, orientation):
    """``folder/name.jpg``: a JPEG stored ``stored_hw`` (height, width), a bright top-left corner,
    carrying EXIF ``orientation`` (1 upright; 6 and 8 displayed turned a quarter, so height and
    width swap after ``ImageOps.exif_transpose``), and beside it ``name-upright.png``: the same
    image as a viewer shows it (and ``datasets`` decodes it), with no EXIF."""
    from PIL import Image, ImageOps

    h, w = stored_hw
    image = Image.new("RGB", (w, h), (20, 20, 20))
    image.paste((250, 250, 250), (0, 0, w // 4, h // 4))
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = folder / f"{name}.jpg"
    image.save(path, format="JPEG", exif=exif.tobytes(), quality=95)
    with Image.open(path) as stored:
        ImageOps.exif_transpose(stored).save(folder / f"{name}-upright.png")
    return path


def test_an_exif_rotated_image_is_bucketed_as_it_is_decoded(tmp_path):
    """A photo stored landscape with EXIF orientation 6 or 8 is a portrait once decoded
    (``datasets`` applies ``ImageOps.exif_transpose``): its bucket is the upright copy's, read from
    the header without decoding, whether the column holds bytes or paths; orientation 1 is a control."""
    import datasets

    from diffusers_zero3.data.buckets import bucket_rows, image_size
    from diffusers_zero3.data.images import ImageCaptionDataset
    from diffusers_zero3.data.pixels import RowsToPixels

    buckets = [(32, 64), (64, 32)]  # landscape, portrait
    cases = [("six", 6), ("eight", 8), ("one", 1)]
    paths = [_exif_jpeg(tmp_path, name, (40, 80), o) for name, o in cases]  # each stored 40 high, 80 wide
    upright = [str(tmp_path / f"{name}-upright.png") for name, _ in cases]
    by_path = datasets.Dataset.from_dict({"image": [str(p) for p in paths] + upright}).cast_column(
        "image", datasets.Image()
    )
    by_bytes = datasets.Dataset.from_dict(
        {"image": [{"bytes": p.read_bytes(), "path": None} for p in paths]},
        features=datasets.Features({"image": datasets.Image()}),
    )
    decoded = [by_path[i]["image"].size[::-1] for i in range(3)]
    assert decoded == [(80, 40), (80, 40), (40, 80)]  # what datasets decodes: 6 and 8 turned upright
    sizes = image_sizes(by_path, "image")
    assert sizes[:3] == decoded and sizes[:3] == sizes[3:]  # each the size of its upright copy
    assert image_sizes(by_bytes, "image") == decoded
    expected = [1, 1, 0]  # portrait, portrait, landscape (the control)
    assert assign_buckets(sizes[3:], buckets) == expected  # the upright copies' buckets
    assert bucket_rows(by_path, "image", buckets) == expected + expected
    assert bucket_rows(by_bytes, "image", buckets) == expected
    from PIL import Image

    with Image.open(paths[0]) as opened:  # a PIL image not yet transposed: the size it will have
        assert image_size(opened) == (80, 40)
    # and the crop is the bucket's shape with no stretching: the image is the upright one, resized
    dataset = ImageCaptionDataset(
        by_path.add_column("text", ["c"] * 6),
        RowsToPixels(
            resolution=32,
            center_crop=True,
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 1, dtype=torch.long)},
            buckets=buckets,
            row_buckets=bucket_rows(by_path, "image", buckets),
        ),
    )
    for i in range(3):
        item, twin = dataset[i], dataset[i + 3]
        assert tuple(item["pixel_values"].shape[1:]) == buckets[expected[i]]
        assert item["original_size"].tolist() == list(decoded[i])
        torch.testing.assert_close(item["pixel_values"], twin["pixel_values"], atol=0.1, rtol=0)


def _png_chunks(data: bytes) -> list[bytes]:
    import struct

    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        chunks.append(data[at : at + 12 + length])
        at += 12 + length
    return chunks


def test_a_pngs_exif_orientation_counts_before_or_after_its_pixels_and_headers_are_not_decoded(monkeypatch):
    """PNG keeps EXIF in an eXIf chunk, before the pixels or after them (PIL reads a late one
    only when it decodes): both give the decoded size. Sizes come without decoding the pixels,
    except for a PNG with such a late chunk."""
    import io

    import datasets
    from PIL import Image, ImageFile

    from diffusers_zero3.data.buckets import image_size

    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("RGB", (80, 40), (200, 0, 0)).save(buf, format="PNG", exif=exif.tobytes())
    early = buf.getvalue()
    chunks = _png_chunks(early)
    kinds = [c[4:8] for c in chunks]
    assert kinds.index(b"eXIf") < kinds.index(b"IDAT")
    moved = [c for c in chunks if c[4:8] != b"eXIf"]
    late = early[:8] + b"".join(moved[:-1] + [chunks[kinds.index(b"eXIf")], moved[-1]])
    for data in (early, late):
        assert datasets.Image().decode_example({"bytes": data, "path": None}).size == (40, 80)
        assert image_size({"bytes": data, "path": None}) == (80, 40)
    jpeg = io.BytesIO()
    Image.new("RGB", (80, 40)).save(jpeg, format="JPEG", exif=exif.tobytes())
    plain = io.BytesIO()
    Image.new("RGB", (80, 40)).save(plain, format="PNG")

    def no_decoding(self):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert image_size({"bytes": jpeg.getvalue(), "path": None}) == (80, 40)
    assert image_size({"bytes": early, "path": None}) == (80, 40)
    assert image_size({"bytes": plain.getvalue(), "path": None}) == (40, 80)
    assert image_size({"bytes": late, "path": None}) is None  # the one case that decodes (here: refused)
