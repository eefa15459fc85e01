"""Host-side stalls of a training step (issue 51, item 5), what a CPU can measure of them.

Measured side by side in one run on this machine (torch on one thread, as each rank runs):

(a) Per-sample draws. Each sample's noise, timestep and VAE latent sample are drawn with its
    own CPU generator (``objectives.sample_generators``: the same values on any number of
    processes) and then copied to the device. Before issue 51 the copy came from pageable
    memory, which on CUDA blocks the host until the GPU's queue has run: the GPU then idled
    while the host drew the next draws. Now they are stacked into pinned memory and copied
    without blocking, so the draws overlap the queued kernels (the VAE encode, the previous
    step's tail). The host time of the draws at published shapes is the idle GPU time the old
    path could cost per step (an upper bound; a CPU cannot time the copies). Beside it: one
    ``randn`` of the whole batch (one generator), what the draws would cost without per-sample
    generators. ``sample_generators`` (the hashing) is timed apart.

(b) The loader, with a stand-in for the GPU step: the training process sleeps ``STEP_S`` a
    batch (on a GPU host it waits on the GPU), and the loader decodes 512 px JPEGs (photo-like,
    768x512 / 512x768, as ``bench_data``) through ``ImageCaptionDataset`` (decode, resize,
    crop, flip) in batches of ``BATCH``, with 0 workers (diffusers' default, and this package's
    on the CPU) and with 1 and 2 worker processes (what ``loader_settings`` gives a CUDA host
    with 2 and 3+ cores per process). Workers are not persistent, as the trainer makes them
    (a dataset's epoch reaches them at each epoch's start). Over ``LOADER_EPOCHS`` epochs: the
    median time a step waits beyond ``STEP_S`` (the stall), an epoch's first step apart (the
    workers start and decode the first batch while the host waits).

(c) ``--offload_ema``: the host average of ``EMA_PARAMS`` fp32 weights, ``_foreach_lerp_``
    directly (before, after a blocking copy per tensor) and ``lerp_through_staging`` (now: two
    buffers of ``STAGING_BYTES``, the copy of bucket k+1 queued before the average of bucket
    k). On the CPU the weights are already on the host: the staged column is the averaging plus
    the extra host copy through the buffers; on CUDA that copy is the device-to-host copy,
    which then overlaps the averaging.

``python -m benchmarks.run --only host_stalls`` (or ``python -m benchmarks.bench_host_stalls``).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import markdown_table, print_section

BATCH = 8
REPEATS = 5  # timings per row of (a) and (c); the median is reported
# (name, batch, per-sample latent shape): the denoiser latents of published training runs
DRAW_SHAPES = [
    ("SD 1.5, 512 px, batch 8", 8, (4, 64, 64)),
    ("SDXL, 1024 px, batch 4", 4, (4, 128, 128)),
    ("Flux / SD3, 1024 px, batch 2", 2, (16, 128, 128)),
    ("Wan 2.1, 720p x 81 frames, batch 1", 1, (16, 21, 90, 160)),
]
STEP_S = 0.3  # the stand-in GPU step of (b): an SD 1.5 step at 512 px, batch 8, bf16 (assumed)
LOADER_EPOCHS = 3
LOADER_WORKERS = (0, 1, 2)
EMA_PARAMS = 25_000_000


def median_seconds(fn, repeats: int = REPEATS) -> float:
    """The median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------ (a) per-sample draws


def _draws(latents: torch.Tensor, indices: list[int]) -> None:
    """A step's noise and timesteps, one generator per sample (``DDPMObjective.loss``'s draws)."""
    from diffusers_zero3.families.objectives import sample_generators, sample_noise, sample_timesteps

    gens = sample_generators(0, 0, indices)
    sample_noise(latents, 0.0, gens)
    sample_timesteps(len(indices), 1000, "cpu", generators=gens)


def _latent_sample(dist, indices: list[int]) -> None:
    """A step's VAE latent sample, one generator per sample (``Family.latents_of``)."""
    from diffusers_zero3.families.objectives import sample_generators, sample_latent_distribution

    sample_latent_distribution(dist, sample_generators(0, 0, indices))


def measure_draws() -> list[dict]:
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from diffusers_zero3.families.objectives import sample_generators

    rows = []
    for name, batch, shape in DRAW_SHAPES:
        latents = torch.zeros(batch, *shape, dtype=torch.bfloat16)
        indices = list(range(batch))
        generators = median_seconds(functools.partial(sample_generators, 0, 0, indices))
        noise = median_seconds(functools.partial(_draws, latents, indices)) - generators
        one = median_seconds(functools.partial(torch.randn, latents.shape, dtype=latents.dtype))
        row = {
            "latents (per step)": name,
            "MiB (bf16)": f"{latents.numel() * 2 / 2**20:.1f}",
            "noise + timesteps, per-sample generators, ms": f"{noise * 1e3:.1f}",
            "one randn of the batch, ms": f"{one * 1e3:.1f}",
            "sample_generators, ms": f"{generators * 1e3:.2f}",
            "VAE latent sample, ms": "",
        }
        if len(shape) == 3:  # an image VAE's latent distribution (mean and log-variance)
            parameters = torch.zeros(batch, 2 * shape[0], *shape[1:], dtype=torch.bfloat16)
            dist = DiagonalGaussianDistribution(parameters)
            sample = median_seconds(functools.partial(_latent_sample, dist, indices)) - generators
            row["VAE latent sample, ms"] = f"{sample * 1e3:.1f}"
        rows.append(row)
    return rows


# ------------------------------------------------------------------ (b) the loader


def measure_loader(work: Path) -> list[dict]:
    from benchmarks.bench_data import load_local, write_photo_dataset
    from diffusers_zero3.data.images import ImageCaptionDataset, collate
    from diffusers_zero3.data.pixels import RowsToPixels

    folder = write_photo_dataset(work / "photos")
    rows = load_local(folder)

    def tokenize(captions):
        return {"input_ids": torch.zeros(len(captions), 77, dtype=torch.long)}

    dataset = ImageCaptionDataset(
        rows, RowsToPixels(resolution=512, center_crop=True, random_flip=True, seed=0, tokenize=tokenize)
    )
    decode = median_seconds(lambda: collate([dataset[i] for i in range(BATCH)]), repeats=3)
    results = []
    for workers in LOADER_WORKERS:
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, shuffle=True, collate_fn=collate, num_workers=workers,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        first, steady = [], []  # each epoch's first step (the workers start), the others
        for epoch in range(LOADER_EPOCHS):
            dataset.set_epoch(epoch)
            start = time.perf_counter()
            for k, _ in enumerate(loader):
                time.sleep(STEP_S)  # the GPU's step, which the host waits for
                now = time.perf_counter()
                (first if k == 0 else steady).append(now - start)
                start = now
        stall = statistics.median(steady) - STEP_S
        results.append({
            "workers": workers,
            "stall a step, ms (median, steady state)": f"{stall * 1e3:.0f}",
            "stall, % of the step": f"{100 * stall / STEP_S:.1f}",
            "an epoch's first step, stall ms": f"{(statistics.median(first) - STEP_S) * 1e3:.0f}",
            "decode of a batch, ms (main process)": f"{decode * 1e3:.0f}",
        })  # fmt: skip
    return results


# ------------------------------------------------------------------ (c) the offloaded EMA


def measure_ema() -> list[dict]:
    from diffusers_zero3.state.ema import STAGING_BYTES, lerp_through_staging, staging_buckets

    g = torch.Generator().manual_seed(0)
    sizes = [EMA_PARAMS // 100] * 100  # 100 partitions of 250k parameters
    shadow = [torch.randn(n, generator=g) for n in sizes]
    sources = [torch.randn(n, generator=g) for n in sizes]
    buckets = staging_buckets(sizes, STAGING_BYTES // 4)
    size = max(sum(sizes[i] for i in b) for b in buckets)
    buffers = (torch.empty(size), torch.empty(size))
    direct = median_seconds(
        lambda: torch._foreach_lerp_(shadow, [s.to("cpu", torch.float32) for s in sources], 1e-4)
    )
    staged = median_seconds(lambda: lerp_through_staging(shadow, sources, 1e-4, buckets, buffers))
    mb = EMA_PARAMS * 4 / 2**20
    return [
        {"update": "direct (_foreach_lerp_)", "ms": f"{direct * 1e3:.0f}", "ms / 100 MiB": f"{direct * 1e3 * 100 / mb:.0f}"},
        {"update": f"staged ({len(buckets)} buckets, 2 x {STAGING_BYTES >> 20} MiB)", "ms": f"{staged * 1e3:.0f}",
         "ms / 100 MiB": f"{staged * 1e3 * 100 / mb:.0f}"},
    ]  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    print_section(
        "(a) per-sample draws on the host, per step (bf16 latents)",
        markdown_table(measure_draws(), ["latents (per step)", "MiB (bf16)", "noise + timesteps, per-sample generators, ms",
                                         "VAE latent sample, ms", "one randn of the batch, ms", "sample_generators, ms"]),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        print_section(
            f"(b) loader, 512 px JPEGs, batch {BATCH}, a {STEP_S} s stand-in step",
            markdown_table(measure_loader(Path(work)), ["workers", "stall a step, ms (median, steady state)",
                                                         "stall, % of the step", "an epoch's first step, stall ms",
                                                         "decode of a batch, ms (main process)"]),
        )  # fmt: skip
    print_section(
        f"(c) offloaded EMA update, {EMA_PARAMS / 1e6:.0f} M fp32 parameters on the host",
        markdown_table(measure_ema(), ["update", "ms", "ms / 100 MiB"]),
    )


if __name__ == "__main__":
    main()
