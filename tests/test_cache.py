"""The "cache" placement: precompute on 2 ranks, reuse, invalidation, same loss as live models;
shards, the dtype in the key, reuse on another number of processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import run_on_ranks


def worker_cache(pipe_dir: str, data_dir: str, cache_dir: str):
    import datasets
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTokenizer

    from diffusers_zero3 import prepare_frozen
    from diffusers_zero3.data.images import ImageCaptionDataset, collate
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.families.objectives import DDPMDraw, diffusion_loss
    from tests.common import accelerator_with_zero3, precompute
    from tests.test_frozen import _load_whole

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    ds = datasets.load_dataset("imagefolder", data_dir=data_dir)["train"]
    assert len(ds) == 5  # 3 rows on rank 0, 2 on rank 1: uneven micro-batch counts
    tokenizer = CLIPTokenizer.from_pretrained(pipe_dir, subfolder="tokenizer")
    te, vae = _load_whole(pipe_dir)
    te = prepare_frozen(te, "shard", accelerator=accelerator, name="text_encoder")
    vae = prepare_frozen(vae, "replicate", accelerator=accelerator, name="vae")
    kw = dict(tokenizer=tokenizer, text_encoder=te, vae=vae, resolution=32, center_crop=True, batch_size=2)

    cache = precompute(ds, cache_dir, **kw)
    assert not cache.reused and len(cache) == 5
    again = precompute(ds, cache_dir, **kw)
    assert again.reused and again.folder == cache.folder
    changed = ds.map(lambda r: {"text": r["text"] + " on grey"}, keep_in_memory=True)
    other = precompute(changed, cache_dir, **kw)
    assert not other.reused and other.folder != cache.folder
    other_res = precompute(ds, cache_dir, **{**kw, "text_encoder": None, "resolution": 16})
    assert other_res.folder not in (cache.folder, other.folder)

    # Shards of 1 row: several files per rank (rank 0's chunks of 2 rows split; rank 1 writes its
    # last shard after its padding call), the same key, and the same rows as one part per rank.
    shards_dir = Path(cache_dir).parent / "shards"
    sharded = precompute(ds, shards_dir, **kw, shard_rows=1)
    assert sharded.folder.name == cache.folder.name and not sharded.reused
    assert sorted(p.name for p in sharded.folder.glob("part-*")) == [
        f"part-{r:05d}-{s:05d}.safetensors" for r, shards in ((0, 3), (1, 2)) for s in range(shards)
    ]
    assert sorted(p.name for p in cache.folder.glob("part-*")) == [
        "part-00000-00000.safetensors",
        "part-00001-00000.safetensors",
    ]  # the default shard_rows: one shard per rank here
    everything = torch.arange(5)
    for name in ("encoder_hidden_states", "latent_params"):
        assert torch.equal(sharded._rows(name, everything), cache._rows(name, everything)), name

    # Same loss from the cache as from the live frozen models, for the same noise and timesteps.
    data = ImageCaptionDataset(ds, RowsToPixels(resolution=32, center_crop=True), tokenizer=tokenizer)
    batch = collate([data[i] for i in range(5)])
    scheduler = DDPMScheduler.from_pretrained(pipe_dir, subfolder="scheduler")
    unet = UNet2DConditionModel.from_pretrained(pipe_dir, subfolder="unet")
    sf = vae.config.scaling_factor
    with torch.no_grad():
        live_states = te(batch["input_ids"])[0]
        live_latents = (
            vae.encode(batch["pixel_values"]).latent_dist.sample(torch.Generator().manual_seed(3)) * sf
        )
    cached = cache.get(batch["index"], generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(cached["encoder_hidden_states"], live_states)
    torch.testing.assert_close(cached["latents"] * sf, live_latents)
    noise = torch.randn(live_latents.shape, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([1, 100, 300, 600, 999])
    with torch.no_grad():
        live = diffusion_loss(
            lambda x, ts: unet(x, ts, live_states).sample, scheduler, live_latents, DDPMDraw(noise, t)
        )
        from_cache = diffusion_loss(
            lambda x, ts: unet(x, ts, cached["encoder_hidden_states"]).sample,
            scheduler,
            cached["latents"] * sf,
            DDPMDraw(noise, t),
        )
    torch.testing.assert_close(from_cache, live)

    # Another job's temporary folder of the same key is left alone (the name used to be fixed,
    # and rank 0 deleted and reused it).
    from diffusers_zero3 import barrier, is_main_process
    from diffusers_zero3.data.images import DataError

    theirs = cache.folder.parent / f".tmp-{cache.folder.name}"
    if is_main_process():
        theirs.mkdir()
        (theirs / "their-part").write_text("in progress")
        shutil.rmtree(cache.folder)
    barrier()
    mine = precompute(ds, cache_dir, **kw)
    assert not mine.reused and (theirs / "their-part").read_text() == "in progress"

    # A damaged published cache (a part file lost) is an error, not silently missing rows.
    barrier()
    if is_main_process():
        next(mine.folder.glob("part-00001-*.safetensors")).unlink()
    barrier()
    with pytest.raises(DataError, match="damaged; delete that folder"):
        precompute(ds, cache_dir, **kw)

    # A corrupt image is skipped while caching (on whichever rank holds it), and training
    # from the cache skips the same row.
    corrupt = (
        ds.cast_column("image", datasets.Image(decode=False))
        .map(
            lambda r, i: {"image": {"bytes": b"not a png", "path": None} if i == 3 else r["image"]},
            with_indices=True,
            keep_in_memory=True,
        )
        .cast_column("image", datasets.Image())
    )
    skipped = precompute(corrupt, cache_dir, **{**kw, "text_encoder": None})
    assert skipped.skipped_rows == [3] and len(skipped) == 4
    rows = ImageCaptionDataset(
        corrupt,
        RowsToPixels(resolution=32, center_crop=True, live_pixels=False),
        tokenizer=tokenizer,
        unreadable_rows=skipped.skipped_rows,
    )
    assert rows[3]["index"] == 4 and skipped.get(torch.tensor([rows[3]["index"]]))["latents"].shape[0] == 1
    print("OK cache", live.item())


@pytest.mark.multirank
def test_cache_precompute_reuse_invalidate_and_loss(tiny_pipeline, tmp_path):
    import datasets
    from transformers import CLIPTokenizer

    from diffusers_zero3.demo import write_shapes_dataset
    from tests.common import precompute
    from tests.test_frozen import _load_whole

    data_dir = write_shapes_dataset(tmp_path / "data", num_images=5)
    outs = run_on_ranks(
        worker_cache, pipe_dir=tiny_pipeline, data_dir=str(data_dir), cache_dir=str(tmp_path / "cache")
    )
    assert all("OK cache" in o for o in outs)
    # Nothing half-written left behind, but for the simulated other job's folder.
    leftovers = list((tmp_path / "cache").glob(".tmp-*"))
    assert [sorted(p.name for p in t.iterdir()) for t in leftovers] == [["their-part"]]
    # The sharded cache the 2 ranks wrote is reused as is by 1 process (whole models, no
    # process group): the key does not hold the number of ranks, and the reader any layout.
    te, vae = _load_whole(tiny_pipeline)
    tokenizer = CLIPTokenizer.from_pretrained(tiny_pipeline, subfolder="tokenizer")
    ds = datasets.load_dataset("imagefolder", data_dir=str(data_dir))["train"]
    alone = precompute(ds, tmp_path / "shards", tokenizer=tokenizer, text_encoder=te, vae=vae,
                                      resolution=32, center_crop=True, batch_size=2)  # fmt: skip
    assert alone.reused and len(alone) == 5 and len(list(alone.folder.glob("part-*"))) == 5


def _shapes(n: int, size: int = 16):
    import random

    import datasets

    from diffusers_zero3.demo import shape_image

    images = [shape_image("red", "circle", size, random.Random(i)) for i in range(n)]  # rows that differ
    return datasets.Dataset.from_dict({"image": images, "text": [f"row {i}" for i in range(n)]})


@pytest.mark.unit
def test_shards_split_chunks_at_the_row_limit_and_at_a_shape_change():
    from diffusers_zero3.placement.cache import group_into_shards

    def chunk(start: int, rows: int, side: int = 2):
        return {"index": torch.arange(start, start + rows), "x": torch.full((rows, side), float(start))}

    def layout(chunks, shard_rows):
        return [s["index"].tolist() for s in group_into_shards(iter(chunks), shard_rows)]

    three = [chunk(0, 3), chunk(3, 3), chunk(6, 3)]
    assert layout(three, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert layout(three, 1) == [[i] for i in range(9)]
    assert layout(three, None) == [list(range(9))]
    assert layout([], 4) == []
    # a chunk of another shape (a later aspect-ratio bucket) starts a shard of its own
    mixed = [chunk(0, 3), chunk(3, 2, side=5), chunk(5, 3, side=5)]
    shards = list(group_into_shards(iter(mixed), 4))
    assert [s["index"].tolist() for s in shards] == [[0, 1, 2], [3, 4, 5, 6], [7]]
    assert [tuple(s["x"].shape) for s in shards] == [(3, 2), (4, 5), (1, 5)]
    # the rows keep their values across the splits
    assert torch.equal(torch.cat([s["x"] for s in group_into_shards(iter(three), 2)])[:, 0],
                       torch.tensor([0.0] * 3 + [3.0] * 3 + [6.0] * 3))  # fmt: skip


@pytest.mark.unit
def test_the_weights_dtype_is_in_the_key_and_any_shard_layout_reads_alike(tmp_path):
    """fp32, autocast bf16 and bf16 weights are three caches; shards of 3 rows, one part, and
    the old one-file-per-rank name (``part-00000.safetensors``) read back the same rows."""
    import copy

    from diffusers import AutoencoderKL

    from diffusers_zero3.demo.pipelines import tiny_vae_config
    from diffusers_zero3.placement.cache import CachedOutputs
    from tests.common import precompute

    torch.manual_seed(0)
    vae = AutoencoderKL(**tiny_vae_config()).eval()
    ds = _shapes(5)
    kw = dict(vae=vae, resolution=16, center_crop=True, batch_size=2)
    sharded = precompute(ds, tmp_path / "a", shard_rows=3, **kw)
    assert sorted(p.name for p in sharded.folder.glob("part-*")) == [
        "part-00000-00000.safetensors",
        "part-00000-00001.safetensors",
    ]
    assert sharded.meta["dtypes"] == {"vae": "torch.float32"}
    whole = precompute(ds, tmp_path / "b", shard_rows=None, **kw)
    assert whole.folder.name == sharded.folder.name and len(list(whole.folder.glob("part-*"))) == 1
    rows = torch.arange(5)
    assert torch.equal(whole._rows("latent_params", rows), sharded._rows("latent_params", rows))
    (whole.folder / "part-00000-00000.safetensors").rename(whole.folder / "part-00000.safetensors")
    old = CachedOutputs(whole.folder)
    assert torch.equal(old._rows("latent_params", rows), sharded._rows("latent_params", rows))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = precompute(ds, tmp_path / "a", **kw)
    assert not autocast.reused and autocast.folder != sharded.folder
    assert autocast.meta["dtypes"]["vae"].startswith("autocast torch.bfloat16")
    bf16 = precompute(ds, tmp_path / "a", **{**kw, "vae": copy.deepcopy(vae).to(torch.bfloat16)})
    assert not bf16.reused and bf16.folder not in (sharded.folder, autocast.folder)
    assert bf16.meta["dtypes"] == {"vae": "torch.bfloat16"}
    assert precompute(ds, tmp_path / "a", **kw).reused  # fp32 again, autocast off
