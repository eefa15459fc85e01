"""The frozen-output cache on disk: peak RSS per rank while encoding, shards against one part (N=2).

A VAE-only cache (``precompute_frozen_outputs(vae=...)``) of the demo's shapes dataset at 10x
``prepare_default``'s size (640 images instead of 64), encoded on 2 CPU ranks three ways: each rank's share held in memory and written as one part at the end
(``shard_rows=None``, the writer before shards), the default ``shard_rows`` (512 rows, more than
a rank's share here: the same as one part), and shards of 64 rows written as they fill. Then
the read-back time per sample (``CachedOutputs.get`` on shuffled micro-batches of 8, the
training loop's access). Two VAEs: the demo's tiny SD VAE at the demo's 32 px (a rank's share
is 2.5 MiB), and one whose rows are large for its compute, so that a share outweighs the
encoder's working memory within a CPU benchmark's minutes: width 8 without the mid-block
attention (quadratic in the latent's pixels), at 256 px (0.5 MiB a row, 160 MiB a rank). Each case is its own launch, so that one case's freed heap does not
pad the next one's peak.

``python -m benchmarks.run --only cache`` (or ``python -m benchmarks.bench_cache``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, mib, print_section, report, run_case
from diffusers_zero3.placement.cache import DEFAULT_SHARD_ROWS

NUM_IMAGES = 10 * 64  # 10x prepare_default's num_images
CASES = [  # (VAE, resolution, random_flip)
    ("demo VAE", 32, False),
    ("VAE width 8, no attention", 256, False),
]
VAES = {"demo VAE": {}, "VAE width 8, no attention": {"width": 8, "mid_block_add_attention": False}}
WRITERS = [("one part per rank, in memory (shard_rows=None)", None),
           (f"default shards ({DEFAULT_SHARD_ROWS} rows)", DEFAULT_SHARD_ROWS), ("shards of 64 rows", 64)]  # fmt: skip
READ_SAMPLES, MICRO_BATCH = 256, 8


def case_encode(
    data_dir: str, cache_dir: str, vae_name: str, resolution: int, random_flip: bool, shard_rows: int | None
):
    """On every rank: encode the cache with ``shard_rows``, then read samples back."""
    import datasets
    import torch
    from diffusers import AutoencoderKL

    from benchmarks.common import (
        current_rss_bytes,
        peak_rss_bytes,
        peak_rss_since_reset_bytes,
        reset_peak_rss,
    )
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.demo.pipelines import tiny_vae_config
    from diffusers_zero3.placement.cache import FrozenEncoders, precompute_frozen_outputs

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    options = dict(VAES[vae_name])
    vae = AutoencoderKL(**tiny_vae_config(width=options.pop("width", 32)), **options).eval()
    ds = datasets.load_dataset("imagefolder", data_dir=data_dir, split="train")
    before = current_rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    pixels = RowsToPixels(resolution=resolution, center_crop=True, random_flip=random_flip)
    cache = precompute_frozen_outputs(
        ds, cache_dir, FrozenEncoders(vae=vae), pixels, batch_size=8, shard_rows=shard_rows
    )
    encode_s = time.perf_counter() - start
    encode_peak = peak_rss_since_reset_bytes()
    files = sorted(Path(cache.folder).glob(f"part-{rank:05d}-*.safetensors"))
    share = sum(f.stat().st_size for f in files)
    generator = torch.Generator().manual_seed(rank)
    order = torch.randperm(len(cache), generator=generator)[:READ_SAMPLES]
    flips = torch.rand(len(order), generator=generator) < 0.5
    cache.get(order[:MICRO_BATCH], flip=flips[:MICRO_BATCH], generator=generator)  # warm-up
    start = time.perf_counter()
    for idx, flip in zip(order.split(MICRO_BATCH), flips.split(MICRO_BATCH)):
        cache.get(idx, flip=flip, generator=generator)
    read_s = (time.perf_counter() - start) / len(order)
    torch.distributed.barrier()
    report(before=before, encode_peak=encode_peak, peak=peak_rss_bytes(), encode_s=encode_s, read_s=read_s,
           files=len(files), share=share, rows=len(cache))  # fmt: skip
    torch.distributed.destroy_process_group()


def main() -> None:
    import datasets

    from diffusers_zero3.demo import write_shapes_dataset

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = write_shapes_dataset(Path(tmp) / "data", num_images=NUM_IMAGES)
        datasets.load_dataset("imagefolder", data_dir=str(data_dir), split="train")  # built once, here
        for vae_name, resolution, flip in CASES:
            base = None
            for label, shard_rows in WRITERS:
                res = run_case(
                    "benchmarks.bench_cache:case_encode",
                    env={"OMP_NUM_THREADS": "1"},
                    data_dir=str(data_dir),
                    cache_dir=f"{tmp}/cache-{resolution}-{shard_rows}",
                    vae_name=vae_name,
                    resolution=resolution,
                    random_flip=flip,
                    shard_rows=shard_rows,
                )
                growth = max(r["encode_peak"] - r["before"] for r in res)
                base = base or growth
                rows.append(
                    {
                        "VAE, images, px": f"{vae_name}, {res[0]['rows']}, {resolution}{' + flips' if flip else ''}",
                        "writer": label,
                        "files / rank": max(r["files"] for r in res),
                        "cache MiB / rank": mib(max(r["share"] for r in res)),
                        "RSS before MiB": mib(max(r["before"] for r in res)),
                        "peak RSS while encoding MiB": mib(max(r["encode_peak"] for r in res)),
                        "growth MiB": mib(growth),
                        "growth vs one part": f"{growth / base:.2f}",
                        "peak RSS, whole run MiB": mib(max(r["peak"] for r in res)),
                        "encode s": f"{max(r['encode_s'] for r in res):.1f}",
                        "read ms / sample": f"{max(r['read_s'] for r in res) * 1e3:.3f}",
                    }
                )
    print_section(
        f"Frozen-output cache on disk: VAE only, {NUM_IMAGES} images (10x the default), N=2, CPU",
        markdown_table(rows, list(rows[0])),
    )


if __name__ == "__main__":
    main()
