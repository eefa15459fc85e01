"""The "cache" placement: precompute on 2 ranks, reuse, invalidation, same loss as live models."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.distributed_harness import run_on_ranks

pytestmark = pytest.mark.multirank


def worker_cache(pipe_dir: str, data_dir: str, cache_dir: str):
    import datasets
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTokenizer

    from diffusers_zero3 import prepare_frozen
    from diffusers_zero3.data.images import ImageCaptionDataset, collate
    from diffusers_zero3.families.objectives import diffusion_loss
    from diffusers_zero3.placement.cache import precompute_frozen_outputs
    from tests.common import accelerator_with_zero3
    from tests.test_frozen import _load_whole

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    ds = datasets.load_dataset("imagefolder", data_dir=data_dir)["train"]
    assert len(ds) == 5  # 3 rows on rank 0, 2 on rank 1: uneven micro-batch counts
    tokenizer = CLIPTokenizer.from_pretrained(pipe_dir, subfolder="tokenizer")
    te, vae = _load_whole(pipe_dir)
    te = prepare_frozen(te, "shard", accelerator=accelerator, name="text_encoder")
    vae = prepare_frozen(vae, "replicate", accelerator=accelerator, name="vae")
    kw = dict(tokenizer=tokenizer, text_encoder=te, vae=vae, resolution=32, center_crop=True, batch_size=2)

    cache = precompute_frozen_outputs(ds, cache_dir, **kw)
    assert not cache.reused and len(cache) == 5
    again = precompute_frozen_outputs(ds, cache_dir, **kw)
    assert again.reused and again.folder == cache.folder
    changed = ds.map(lambda r: {"text": r["text"] + " on grey"}, keep_in_memory=True)
    other = precompute_frozen_outputs(changed, cache_dir, **kw)
    assert not other.reused and other.folder != cache.folder
    other_res = precompute_frozen_outputs(ds, cache_dir, **{**kw, "text_encoder": None, "resolution": 16})
    assert other_res.folder not in (cache.folder, other.folder)

    # Same loss from the cache as from the live frozen models, for the same noise and timesteps.
    data = ImageCaptionDataset(ds, tokenizer, "image", "text", resolution=32, center_crop=True)
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
            lambda x, ts: unet(x, ts, live_states).sample, scheduler, live_latents, noise, t
        )
        from_cache = diffusion_loss(
            lambda x, ts: unet(x, ts, cached["encoder_hidden_states"]).sample,
            scheduler,
            cached["latents"] * sf,
            noise,
            t,
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
    mine = precompute_frozen_outputs(ds, cache_dir, **kw)
    assert not mine.reused and (theirs / "their-part").read_text() == "in progress"

    # A damaged published cache (a part file lost) is an error, not silently missing rows.
    barrier()
    if is_main_process():
        (mine.folder / "part-00001.safetensors").unlink()
    barrier()
    with pytest.raises(DataError, match="damaged; delete that folder"):
        precompute_frozen_outputs(ds, cache_dir, **kw)

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
    skipped = precompute_frozen_outputs(corrupt, cache_dir, **{**kw, "text_encoder": None})
    assert skipped.skipped_rows == [3] and len(skipped) == 4
    rows = ImageCaptionDataset(corrupt, tokenizer, "image", "text", 32, True, with_images=False,
                               unreadable_rows=skipped.skipped_rows)  # fmt: skip
    assert rows[3]["index"] == 4 and skipped.get(torch.tensor([rows[3]["index"]]))["latents"].shape[0] == 1
    print("OK cache", live.item())


def test_cache_precompute_reuse_invalidate_and_loss(tiny_pipeline, tmp_path):
    from diffusers_zero3.demo import write_shapes_dataset

    data_dir = write_shapes_dataset(tmp_path / "data", num_images=5)
    outs = run_on_ranks(
        worker_cache, pipe_dir=tiny_pipeline, data_dir=str(data_dir), cache_dir=str(tmp_path / "cache")
    )
    assert all("OK cache" in o for o in outs)
    # Nothing half-written left behind, but for the simulated other job's folder.
    leftovers = list((tmp_path / "cache").glob(".tmp-*"))
    assert [sorted(p.name for p in t.iterdir()) for t in leftovers] == [["their-part"]]
