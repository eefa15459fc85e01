"""Flux and SD3 pieces on 2 ZeRO-3 ranks: the T5 encoder read straight into partitions (tied
weights), bucket sizes of partitioned models, and the Flux cache encoded with T5 sharded."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_on_ranks


def worker_t5_partitioned(pipe_dir: str, data_dir: str, cache_dir: str):
    import datasets
    from transformers import T5EncoderModel

    from diffusers_zero3 import load_pretrained_zero3, placement_bytes_per_rank, zero3_init_disabled
    from diffusers_zero3.data.images import ImageCaptionDataset, collate
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.families import FLUX
    from diffusers_zero3.placement.frozen import prepare_frozen
    from diffusers_zero3.placement.frozen_inputs import CacheRequest, place_frozen_models
    from diffusers_zero3.runtime.ds_config import (
        fill_auto_bucket_sizes,
        frozen_engine_config,
        zero3_bucket_sizes,
    )
    from tests.common import accelerator_with_zero3, zero3_config

    accelerator = accelerator_with_zero3(zero3_init_flag=True)
    with zero3_init_disabled():
        whole = T5EncoderModel.from_pretrained(pipe_dir, subfolder="text_encoder_2")
    # T5's shared embedding is tied to encoder.embed_tokens; the checkpoint holds it once.
    t5 = load_pretrained_zero3(T5EncoderModel, pipe_dir, "text_encoder_2", accelerator=accelerator)
    assert t5.shared.weight is t5.encoder.embed_tokens.weight
    # Bucket sizes read a partitioned model's real shapes (its data is a 1-D placeholder).
    assert zero3_bucket_sizes(t5) == zero3_bucket_sizes(whole)
    # A frozen engine gets sizes from its own shapes, not those filled in for the trained model.
    trained = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    auto = dict.fromkeys(
        ("stage3_param_persistence_threshold", "reduce_bucket_size", "stage3_prefetch_bucket_size"), "auto"
    )
    cfg = fill_auto_bucket_sizes(zero3_config(**auto), trained)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 5120
    frozen_cfg = frozen_engine_config(t5, cfg)["zero_optimization"]
    assert (
        frozen_cfg["stage3_param_persistence_threshold"]
        == zero3_bucket_sizes(whole)["stage3_param_persistence_threshold"]
        == 640
    )
    engine = prepare_frozen(t5, "shard", accelerator=accelerator, name="t5")
    # The bytes a rank holds are what placement_bytes_per_rank computes from the shapes alone.
    # (the tests' config keeps nothing whole: persistence threshold 0)
    assert engine.local_parameter_bytes() == placement_bytes_per_rank(
        whole, "shard", 2, persistence_threshold=0
    )
    assert engine.local_parameter_bytes() < 0.6 * placement_bytes_per_rank(whole, "replicate", 2)
    ids = torch.randint(3, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(engine(ids)[0], whole(ids)[0])

    # The cache placement encodes with T5 sharded (loaded partitioned) and gives the live
    # replica's conditioning.
    ds = datasets.load_dataset("imagefolder", data_dir=data_dir)["train"]
    tokenizers = FLUX.load_tokenizers(pipe_dir)
    common = dict(pixels=RowsToPixels(resolution=32),
                  cache=CacheRequest(ds, cache_dir, tokenizers, max_sequence_length=16, batch_size=3))  # fmt: skip
    cached = place_frozen_models(accelerator, FLUX, pipe_dir, {"text_encoder_2": "cache"}, **common)
    assert cached.models["text_encoder_2"] is None and cached.cache.has_text
    live = place_frozen_models(accelerator, FLUX, pipe_dir, {}, **common)
    data = ImageCaptionDataset(
        ds,
        RowsToPixels(
            resolution=32,
            center_crop=True,
            random_flip=False,
            tokenize=lambda c: FLUX.tokenize(tokenizers, c, 16),
        ),
    )
    batch = collate([data[i] for i in range(len(ds))])
    _, from_cache, _ = cached(batch, torch.device("cpu"))
    _, from_live, _ = live(batch, torch.device("cpu"))
    assert from_live["encoder_hidden_states"].shape == (len(ds), 16, 32)
    for key in ("encoder_hidden_states", "pooled_projections"):
        torch.testing.assert_close(from_cache[key], from_live[key])
    print("OK t5 partitioned")


@pytest.mark.multirank
def test_t5_partitioned_load_buckets_and_cache_encoded_sharded(tiny_flux, tmp_path):
    pipe, data = tiny_flux
    outs = run_on_ranks(
        worker_t5_partitioned, pipe_dir=pipe, data_dir=data, cache_dir=str(tmp_path / "cache")
    )
    assert all("OK t5 partitioned" in o for o in outs)
    # The log of the cache placement says how the encoder ran: sharded, half of it per rank.
    assert (
        "text_encoder_2: shard, 0.05 MiB of 0.10 MiB on this rank (to encode the cache as shard)" in outs[0]
    )
