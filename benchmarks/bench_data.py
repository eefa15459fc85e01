"""A loader that never starves training (issue 38): the data path alone against the training step.

Measured in one run on this machine, side by side:

(a) Samples per second of the data path alone, in one process, through a real
    ``torch.utils.data.DataLoader`` with the package's ``collate`` and ``BATCH`` samples a batch,
    ``num_workers`` 0 and 2 (``persistent_workers`` with 2, so that the steady state is timed and
    not a worker start per epoch of 64 images; the trainer does not set it, which matters on
    tiny datasets only). Each item is what the trainer's ``ImageCaptionDataset`` makes: the
    caption tokenized by the pipeline's own tokenizer (``family.tokenize``), the image decoded,
    resized, centre-cropped and flipped at random (``make train``'s ``--center_crop
    --random_flip``). Variants:

    * live, local: the ``imagefolder`` of ``prepare_default`` (64 PNGs of 32x32, 32 px: the
      default) and 64 photo-like JPEGs of 768x512 and 512x768 (a shape plus per-pixel noise,
      quality 90, about 140 KiB each: the size and entropy of a web photo) at 512 px;
    * with aspect-ratio buckets: ``bucket_rows`` / ``BucketBatchSampler`` and
      ``default_buckets`` (each image cropped to its bucket), on the default's ``--varied``
      images at 32 px and on the JPEGs at 512 px;
    * cached: ``--vae_placement cache``'s path, the loader reading no image (tokens only) and
      ``CachedOutputs.get`` of each batch's indices with random flips, as the training step
      calls it (in the main process, after the loader). 32 px: the default's VAE (latents 4x16x16).
      512 px: a VAE of SD's shape (three 2x downsamplings, 4 latent channels: latents 4x64x64,
      as SD 1.5 at 512 px) but 4 channels wide, so that encoding stays cheap here; the read
      cost depends on the latents' size only. It caches the first ``CACHED_ROWS`` JPEGs. The
      loader of ``ImageCaptionDataset`` with ``RowsToPixels(live_pixels=False)`` still decodes every image (datasets
      decodes an ``Image`` column on access and ``load()``s it); a second 512 px row casts the
      column to ``Image(decode=False)`` to show what the cached path costs without that;
    * streamed: ``datasets.load_dataset("parquet", data_files=..., streaming=True)`` over the
      same images written as two local parquet files (one per worker), each row decoded and
      transformed as above. The trainer has no ``--streaming`` yet: this is datasets'
      iteration and decode only, read from a local disk, not a network.

    The measuring process runs torch on one thread, as each rank of the launch does
    (``OMP_NUM_THREADS=1``). The time of an epoch run before the timing (worker start, the page
    cache, the first decode) is left out; then ``WINDOWS`` windows of whole epochs, each at
    least ``MIN_SECONDS``, are timed, every loader's first window, then every loader's second,
    and so on (the machine is shared: a slow minute then spreads over all the rows): the table
    gives the median window and the range.

(b) The training step's consumption on the default: ``scripts/train_text_to_image.py`` as
    ``make train`` runs it (tiny SD pipeline, ZeRO-3 on 2 CPU ranks, batch 8 per rank,
    ``--center_crop --random_flip --use_ema``, SD's default placements, ``--dataloader_num_workers
    0``), ``TRAIN_STEPS`` steps, without validation or checkpoints, at 32 px and at 64 px. Rank 0
    logs ``step N loss ...`` after each optimizer step; the launch's output is read line by line
    as it comes and each line is time-stamped here. A step's rate is ``BATCH`` over the interval
    between its line and the previous one, for the steps after ``TIMED_FROM`` (the first ones
    warm up): samples per second per rank, the loader's own work included (one live batch a
    step: see (a)). The table gives the median step and the range; beside it the mean over the
    same steps, and the script's own per-phase log ("training done": the steps after the
    first) as a cross-check.

The ratio of a data-path row is its samples per second over the default training step's (32 px)
samples per second per rank: above 1 the loader of one rank keeps up with its step.

``python -m benchmarks.run --only data`` (or ``python -m benchmarks.bench_data``).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import REPO_ROOT, markdown_table, print_section

BATCH = 8  # samples a batch: make train's --train_batch_size
WORKERS = (0, 2)
# Each data path is timed in WINDOWS windows of at least MIN_SECONDS (whole epochs) after a
# warm-up epoch, the paths in turns, and its median window reported: this 2-core machine is
# shared, and a window may run beside another job.
WINDOWS, MIN_SECONDS = 3, 0.5
LARGE_SIZES = [(768, 512), (512, 768)]  # (width, height) of the photo-like images
NUM_LARGE = 64
CACHED_ROWS = 32  # rows of the 512 px cache (encoding them is the slow part of this suite)
TRAIN_STEPS, TIMED_FROM = 16, 4  # steps TIMED_FROM..TRAIN_STEPS are timed
TRAIN_RESOLUTIONS = (32, 64)


# ------------------------------------------------------------------ the data


def write_photo_dataset(folder: Path, num_images: int = NUM_LARGE, seed: int = 0) -> Path:
    """An ``imagefolder`` of photo-like JPEGs: the demo's coloured shapes at ``LARGE_SIZES`` with
    per-pixel noise (a flat PNG decodes far faster than a photo does), and their captions."""
    import numpy as np
    from PIL import Image

    from diffusers_zero3.demo import COLOURS, SHAPES, shape_image

    folder.mkdir(parents=True, exist_ok=True)
    rng, noise = random.Random(seed), np.random.default_rng(seed)
    rows = []
    for i in range(num_images):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        width, height = LARGE_SIZES[i % len(LARGE_SIZES)]
        pixels = np.asarray(shape_image(colour, shape, height, rng, width=width), dtype=np.int16)
        pixels = pixels + noise.integers(-20, 21, size=pixels.shape)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=90)
        rows.append({"file_name": f"{i:05d}.jpg", "text": f"a {colour} {shape}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_parquet_copy(imagefolder: Path, out: Path, files: int = 2) -> list[str]:
    """The images and captions of ``imagefolder`` as ``files`` parquet files (the image bytes
    embedded, as a hub dataset holds them)."""
    import datasets

    rows = [json.loads(line) for line in (imagefolder / "metadata.jsonl").read_text().splitlines()]
    table = {
        "image": [{"bytes": (imagefolder / r["file_name"]).read_bytes(), "path": None} for r in rows],
        "text": [r["text"] for r in rows],
    }
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    ds = datasets.Dataset.from_dict(table, features=features)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(files):
        path = out / f"train-{k:05d}-of-{files:05d}.parquet"
        ds.shard(files, k, contiguous=True).to_parquet(str(path))
        paths.append(str(path))
    return paths


def load_local(folder: Path):
    """The trainer's ``--train_data_dir`` path: ``imagefolder``, its image column made images."""
    from diffusers_zero3.data.images import load_image_caption_dataset, prepare_image_column

    return prepare_image_column(load_image_caption_dataset(train_data_dir=str(folder)), "image", str(folder))


def sd_vae_shape(width: int = 4):
    """An ``AutoencoderKL`` of SD's downsampling (x8) and latent channels (4), ``width`` wide."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(width,) * 4, latent_channels=4,
        layers_per_block=1, norm_num_groups=width // 2, sample_size=512, mid_block_add_attention=False,
    ).eval()  # fmt: skip


# ------------------------------------------------------------------ (a) the data path alone


def epoch(loader, after=None) -> int:
    """One pass over ``loader``, ``after(batch)`` run on each batch (the cache lookup a training
    step makes); the samples it gave."""
    n = 0
    for batch in loader:
        if after is not None:
            after(batch)
        n += len(batch["index"])
    return n


def window(loader, after=None) -> float:
    """Samples per second of whole epochs of ``loader`` over at least ``MIN_SECONDS``."""
    samples, start = 0, time.perf_counter()
    while time.perf_counter() - start < MIN_SECONDS:
        samples += epoch(loader, after)
    return samples / (time.perf_counter() - start)


def make_loader(dataset, workers: int, batch_sampler=None):
    """A DataLoader as ``TextToImageTrainer._prepare_training`` builds it (shuffled, or the
    bucket sampler), with ``workers`` processes."""
    from diffusers_zero3.data.images import collate

    common = dict(collate_fn=collate, num_workers=workers, persistent_workers=workers > 0)
    if batch_sampler is not None:
        return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, **common)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, **common)
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.utils.data.DataLoader(dataset, shuffle=True, batch_size=BATCH, generator=generator, **common)


def cache_reader(cache):
    """What the training step does with a batch under ``--vae_placement cache``
    (``FrozenInputs.__call__``): the rows' latents, flipped at random, sampled."""

    def read(batch: dict) -> None:
        flip = torch.rand(len(batch["index"]), device="cpu") < 0.5
        cache.get(batch["index"].cpu(), flip=flip)

    return read


def data_variants(work: Path, pipe: Path, small: Path, varied: Path) -> list[tuple[str, int, Callable]]:
    """``(label, resolution, make(workers) -> (loader, after))`` of each data path measured."""
    import datasets
    from diffusers import AutoencoderKL

    from diffusers_zero3.data.buckets import BucketBatchSampler, bucket_rows, default_buckets
    from diffusers_zero3.data.images import ImageCaptionDataset
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.families import family_named
    from diffusers_zero3.placement.cache import FrozenEncoders, precompute_frozen_outputs

    family = family_named("sd")
    tokenize = functools.partial(family.tokenize, family.load_tokenizers(pipe))
    # Bucket sides: multiples of the tiny pipeline's VAE downsampling at 32 px, of SD's at 512 px.
    multiple = {32: family.latent_multiple(AutoencoderKL.load_config(str(pipe / "vae"))), 512: 8}
    photos = write_photo_dataset(work / "photos")
    local = {32: load_local(small), 512: load_local(photos)}
    streamed = {
        32: write_parquet_copy(small, work / "parquet-32"),
        512: write_parquet_copy(photos, work / "parquet-512"),
    }
    bucketed = {32: load_local(varied), 512: local[512]}
    options = dict(center_crop=True, random_flip=True, seed=0)
    encoders = {  # rows and the VAE of each cache, as --vae_placement cache builds it
        32: (local[32], AutoencoderKL.from_pretrained(str(pipe / "vae")).eval()),
        512: (local[512].select(range(CACHED_ROWS)), sd_vae_shape()),
    }
    caches = {
        res: (rows, precompute_frozen_outputs(rows, work / f"cache-{res}", FrozenEncoders(vae=vae, family=family),
                                              RowsToPixels(resolution=res, **options), batch_size=BATCH))
        for res, (rows, vae) in encoders.items()
    }  # fmt: skip

    def dataset(res, rows=None, **extra):
        ds = rows if rows is not None else local[res]
        return ImageCaptionDataset(ds, RowsToPixels(resolution=res, tokenize=tokenize, **options, **extra))

    def live(res):
        return lambda w: (make_loader(dataset(res), w), None)

    def buckets(res):
        shapes = default_buckets(res, multiple[res])
        row_buckets = bucket_rows(bucketed[res], "image", shapes)  # the image headers only

        def make(w):
            items = dataset(res, bucketed[res], buckets=shapes, row_buckets=row_buckets)
            return make_loader(items, w, BucketBatchSampler(row_buckets, BATCH, 1, seed=0)), None

        return make

    def cached(res, decode=True):
        rows, cache = caches[res]
        if not decode:  # datasets decodes an Image column on every access, with_images or not
            rows = rows.cast_column("image", datasets.Image(decode=False))
        return lambda w: (make_loader(dataset(res, rows, live_pixels=False), w), cache_reader(cache))

    def stream(res):
        """--streaming as the trainer reads it: StreamedRows in the main process, the rows decoded
        by StreamedExamples in ``w`` threads (worker processes would reorder a stream)."""
        from diffusers_zero3.data.images import ImageCaptionDataset
        from diffusers_zero3.data.pixels import RowsToPixels
        from diffusers_zero3.data.streaming import StreamedExamples, StreamedRows, streamed_loader

        # datasets sleeps 5 s at the end of every stream read with threads (its workaround for an
        # Arrow crash at shutdown): once per epoch in training, once per 64 samples here. Left out
        # of the throughput (and stated beside the table).
        datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0

        def make(w):
            source = datasets.load_dataset("parquet", data_files=streamed[res], split="train", streaming=True)
            rows = StreamedRows(source, "image", global_batch=BATCH, seed=0, shuffle_buffer_size=64)
            examples = ImageCaptionDataset(
                [], RowsToPixels(resolution=res, center_crop=True, random_flip=True, tokenize=tokenize)
            )
            return streamed_loader(rows, StreamedExamples(examples, "image", threads=w), BATCH), None

        return make

    big = "64 JPEGs 768x512 / 512x768"
    return [
        ("live, local imagefolder: decode + crop + flip (the default: 64 PNGs, 32x32)", 32, live(32)),
        (
            "live, local, aspect-ratio buckets (the default's --varied PNGs: 5 sizes, 32x32 to 40x64)",
            32,
            buckets(32),
        ),
        ("cached latents (--vae_placement cache: tokens + CachedOutputs.get, 4x16x16)", 32, cached(32)),
        (
            "--streaming (StreamedRows + StreamedExamples; workers = decoding threads): "
            "2 local parquet files, the default's 64 PNGs",
            32,
            stream(32),
        ),
        (f"live, local imagefolder: decode + crop + flip ({big})", 512, live(512)),
        (f"live, local, aspect-ratio buckets ({big})", 512, buckets(512)),
        (f"cached latents (tokens + CachedOutputs.get, 4x64x64, {CACHED_ROWS} rows)", 512, cached(512)),
        (
            "cached latents, the image column cast to datasets.Image(decode=False) by hand "
            "(a control: the trainer's cached path now reads it so itself)",
            512,
            cached(512, decode=False),
        ),
        (
            "--streaming (StreamedRows + StreamedExamples; workers = decoding threads): "
            f"2 local parquet files, the same {big}",
            512,
            stream(512),
        ),
    ]


def measure_data(variants) -> list[dict]:
    """Samples per second of each variant at each worker count: ``WINDOWS`` windows each, taken
    in turns (every loader's first window, then every loader's second, ...), so that another
    job's load on this shared machine spreads over all of them rather than falling on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of the launch runs (OMP_NUM_THREADS=1)
    try:
        runs = [(v, w, *v[2](w)) for v in variants for w in WORKERS]
        for _, _, loader, after in runs:  # warm-up: workers start, the page cache, first decodes
            epoch(loader, after)
        rates = {(v[0], w): [] for v, w, _, _ in runs}
        for _ in range(WINDOWS):
            for v, w, loader, after in runs:
                rates[v[0], w].append(window(loader, after))
        del runs  # the persistent workers end with their loaders
    finally:
        torch.set_num_threads(threads)
    out = []
    for label, res, _ in variants:
        out.append({"label": label, "resolution": res, "rates": {w: rates[label, w] for w in WORKERS}})
        print(
            f"  {res} px {label}: " + ", ".join(f"{w} workers {spread(rates[label, w])}/s" for w in WORKERS)
        )
    return out


# ------------------------------------------------------------------ (b) the training step

_STEP = re.compile(r"step (\d+) loss ")
_DONE = re.compile(r"^\s+training done\s+RSS .*\)\s+([\d.]+) s")


def train_rate(pipe: Path, data: Path, out: Path, resolution: int) -> dict:
    """``scripts/train_text_to_image.py`` on the default (2 CPU ranks, ZeRO-3): samples per second
    per rank from the time-stamps of the step lines, and from the script's phase log."""
    from diffusers_zero3.families import family_named
    from diffusers_zero3.testing import free_port

    run_args = [a.format(pipeline=pipe) for a in family_named("sd").default_run_args]
    argv = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO_ROOT / "configs" / "accelerate_zero3.yaml"),
        "--num_processes", "2", "--main_process_port", str(free_port()),
        str(REPO_ROOT / "scripts" / "train_text_to_image.py"),
        "--pretrained_model_name_or_path", str(pipe), "--train_data_dir", str(data), "--output_dir", str(out),
        "--resolution", str(resolution), "--center_crop", "--random_flip",
        "--train_batch_size", str(BATCH), "--max_train_steps", str(TRAIN_STEPS),
        "--learning_rate", "1e-3", "--lr_scheduler", "constant", "--lr_warmup_steps", "0", "--use_ema",
        *run_args, "--checkpointing_steps", "100000", "--seed", "0", "--report_to", "none",
    ]  # fmt: skip
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(REPO_ROOT),
        "ACCELERATE_USE_DEEPSPEED": "true",
    }
    stamps, lines, done_s = {}, [], None
    # Text mode reads tqdm's carriage returns as line ends too: each step line arrives when written.
    with subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        for line in proc.stdout:
            now = time.perf_counter()
            lines.append(line)
            m, d = _STEP.search(line), _DONE.match(line)
            if m:
                stamps[int(m.group(1))] = now
            if d:
                done_s = float(d.group(1))
        rc = proc.wait(timeout=600)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch.log").write_text("".join(lines))
    if rc != 0 or TIMED_FROM not in stamps or TRAIN_STEPS not in stamps:
        raise RuntimeError(f"train_text_to_image.py failed ({rc}):\n{''.join(lines)[-4000:]}")
    steps = range(TIMED_FROM, TRAIN_STEPS)
    step_s = [stamps[n + 1] - stamps[n] for n in steps]
    return {
        "resolution": resolution,
        "step_s": statistics.median(step_s),
        "rates": [BATCH / s for s in step_s],
        "mean_rate": BATCH * len(step_s) / (stamps[TRAIN_STEPS] - stamps[TIMED_FROM]),
        "phase_rate": BATCH * (TRAIN_STEPS - 1) / done_s if done_s else None,
    }


# ------------------------------------------------------------------ the tables


def spread(rates: list[float]) -> str:
    """``median (min-max)`` of a list of rates."""
    digits = 1 if statistics.median(rates) < 100 else 0
    return f"{statistics.median(rates):.{digits}f} ({min(rates):.{digits}f}-{max(rates):.{digits}f})"


def main() -> None:
    from diffusers_zero3.demo import prepare_default

    load_before = os.getloadavg()[0]  # other jobs on this shared machine
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pipe, small = prepare_default(work / "default")
        _, varied = prepare_default(work / "default", varied=True)
        data = measure_data(data_variants(work, pipe, small, varied))
        train = {r: train_rate(pipe, small, work / f"run-{r}", r) for r in TRAIN_RESOLUTIONS}
    step = statistics.median(train[32]["rates"])
    rows = []
    for t in train.values():
        rows.append(
            {
                "data path": f"**training step**, {t['resolution']} px, per rank ({t['step_s']:.2f} s/step; "
                f"mean {t['mean_rate']:.1f}/s, phase log {t['phase_rate']:.1f}/s)",
                "px": t["resolution"],
                # the trainer's own loader: --dataloader_num_workers 0
                "samples/s, 0 workers": spread(t["rates"]),
                "÷ step, 0 workers": f"{statistics.median(t['rates']) / step:.2f}",
            }
        )
    for d in data:
        rows.append(
            {
                "data path": d["label"],
                "px": d["resolution"],
                **{f"samples/s, {w} workers": spread(r) for w, r in d["rates"].items()},
                **{
                    f"÷ step, {w} workers": f"{statistics.median(r) / step:.1f}"
                    for w, r in d["rates"].items()
                },
            }
        )
    columns = ["data path", "px"] + [
        c for w in WORKERS for c in (f"samples/s, {w} workers", f"÷ step, {w} workers")
    ]
    print_section(
        f"Data path vs training step: one process's loader (batch {BATCH}) against the default's step "
        f"(tiny SD, ZeRO-3, 2 CPU ranks, batch {BATCH} per rank, 32 px: {step:.1f} samples/s per rank); "
        "samples/s as median (min-max) of the windows or steps; the machine's load average "
        f"(1 min) {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after",
        markdown_table(rows, columns),
    )


if __name__ == "__main__":
    main()
