"""Partitioned load and streamed save at N=2, on a UNet of a few hundred million parameters.

Peak RSS growth per rank while loading (ours vs ``from_pretrained`` + ``deepspeed.initialize``)
and while saving (ours vs the consolidated state dict that ``accelerator.get_state_dict``
builds, written with ``safetensors``), side by side, as ratios to the goals:
load <= 1.2 x (model bytes / N + largest tensor); save on rank 0 <= model bytes / N + one bucket
(our bucket is one tensor).

Throughput against the disk, in the same run: the save's MB/s (until its files are synced to
disk) beside ``dd``'s write with ``conv=fsync`` of as many bytes, and the load's MB/s from a
cold page cache (the files' pages dropped with ``posix_fadvise(DONTNEED)`` after a sync)
beside ``dd``'s cold read of the same file. This disk's throughput moves a lot between reads
(0.7-1.9 GB/s cold), so each phase runs ``REPEATS`` times in one launch, each time right
after its own ``dd``, and the table gives each run's ratio and their median. The load is
timed until the engine exists (``deepspeed.initialize`` included: the from_pretrained row
partitions there), after the process's one-off imports.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, mib, print_section, report, run_case

WIDTH = 512


def _config():
    return {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": False},
    }


REPEATS = 3  # the disk's throughput here varies 0.7-1.9 GB/s between reads: each phase is paired with dd


def case(kind: str, folder: str, model_bytes: int):
    import gc
    import shutil

    import deepspeed
    import torch
    from diffusers import UNet2DConditionModel

    from benchmarks.common import current_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss
    from diffusers_zero3 import get_rank, load_pretrained_zero3, save_pretrained_zero3, zero3_init_disabled

    deepspeed.init_distributed(dist_backend="gloo")
    # deepspeed.initialize's first torch.compiler.disable imports torch._dynamo (0.3-1.2 s, once
    # per process, whatever the model): outside the timer, for both loads alike.
    torch.compiler.disable(lambda: None)
    weights = next(Path(folder).glob("*.safetensors"))
    numbers: dict[str, list] = {"load_s": [], "save_s": [], "disk_read": [], "disk_write": []}
    for repeat in range(REPEATS):
        if get_rank() == 0:
            drop_page_cache(folder)
            numbers["disk_read"].append(_dd_mb_s([f"if={weights}", "of=/dev/null", "bs=16M"]))
            drop_page_cache(folder)
        torch.distributed.barrier()
        gc.collect()
        reset_peak_rss()
        base = current_rss_bytes()
        start = time.perf_counter()
        if kind in ("load ours", "save ours", "save consolidated"):
            model = load_pretrained_zero3(UNet2DConditionModel, folder, ds_config=_config())
            engine, *_ = deepspeed.initialize(model=model, config=_config())
        else:  # "load from_pretrained"
            with zero3_init_disabled():
                model = UNet2DConditionModel.from_pretrained(folder)
            engine, *_ = deepspeed.initialize(model=model, config=_config())
        torch.distributed.barrier()
        numbers["load_s"].append(time.perf_counter() - start)
        if repeat == 0:
            numbers["load_peak"] = peak_rss_since_reset_bytes() - base
        if kind.startswith("save"):
            if get_rank() == 0:
                numbers["disk_write"].append(disk_write_mb_s(folder, model_bytes))
            gc.collect()
            reset_peak_rss()
            base = current_rss_bytes()
            out = tempfile.mkdtemp(dir=folder)
            torch.distributed.barrier()
            start = time.perf_counter()
            if kind == "save ours":
                save_pretrained_zero3(engine, out + "/unet")
            else:
                from safetensors.torch import save_file

                state = engine._zero3_consolidated_16bit_state_dict()  # what get_state_dict calls
                if get_rank() == 0:
                    save_file(state, out + "/model.safetensors")
                del state
            if get_rank() == 0:
                os.sync()  # until the bytes are on disk, as dd's conv=fsync
            torch.distributed.barrier()
            numbers["save_s"].append(time.perf_counter() - start)
            if repeat == 0:
                numbers["save_peak"] = peak_rss_since_reset_bytes() - base
            torch.distributed.barrier()
            if get_rank() == 0:
                shutil.rmtree(out)
        del engine, model
        gc.collect()
    report(rank=get_rank(), **numbers)


def drop_page_cache(folder: str) -> None:
    """Sync, then drop the page cache of every file under ``folder`` (no root needed)."""
    os.sync()
    for path in Path(folder).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dd_mb_s(args: list[str]) -> float:
    """Run ``dd``; its reported throughput in MB/s (10^6 bytes)."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    seconds = float(re.search(r"copied, ([\d.]+) s", out).group(1))
    copied = int(re.search(r"^(\d+) bytes", out, re.M).group(1))
    return copied / seconds / 1e6


def disk_write_mb_s(folder: str, nbytes: int) -> float:
    """This disk's write MB/s for ``nbytes`` under ``folder``: ``dd`` with ``conv=fsync``."""
    path = os.path.join(folder, "dd-probe.bin")
    count = max(1, nbytes // 2**24)
    try:
        return _dd_mb_s(["if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fsync"])
    finally:
        os.remove(path)


def _make_model(folder: str) -> tuple[int, int]:
    from diffusers_zero3.demo import build_tiny_components

    unet = build_tiny_components(width=WIDTH)["unet"]
    unet.save_pretrained(folder)
    sizes = [p.numel() * 4 for p in unet.parameters()]
    return sum(sizes), max(sizes)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        model_bytes, largest = _make_model(folder)
        load_goal = 1.2 * (model_bytes / 2 + largest)
        save_goal = model_bytes / 2 + largest
        rows, speed = [], []
        for kind in ("load ours", "load from_pretrained", "save ours", "save consolidated"):
            res = run_case(
                "benchmarks.bench_checkpoint:case",
                kind=kind,
                folder=folder,
                model_bytes=model_bytes,
                timeout_s=1800,
            )
            phase = "save" if kind.startswith("save") else "load"
            seconds = [max(times) for times in zip(*(r[f"{phase}_s"] for r in res))]  # the slowest rank
            disk = next(r for r in res if r["rank"] == 0)["disk_write" if phase == "save" else "disk_read"]
            ratios = [model_bytes / s / 1e6 / d for s, d in zip(seconds, disk)]  # each beside its own dd
            speed.append(
                {
                    "phase": kind,
                    "seconds (median)": f"{statistics.median(seconds):.2f}",
                    "MB/s (median)": f"{model_bytes / statistics.median(seconds) / 1e6:.0f}",
                    "disk MB/s (dd, median)": f"{statistics.median(disk):.0f} "
                    f"({'write, fsync' if phase == 'save' else 'cold read'})",
                    "/ disk, each run (its dd MB/s)": ", ".join(
                        f"{r:.2f} ({d:.0f})" for r, d in zip(ratios, disk)
                    ),
                    "/ disk (median; goal >= 0.5)": f"{statistics.median(ratios):.2f}",
                }
            )
            if kind.startswith("load"):
                peak = max(r["load_peak"] for r in res)
                goal = load_goal
            else:
                peak = next(r["save_peak"] for r in res if r["rank"] == 0)
                goal = save_goal
            rows.append(
                {
                    "phase": kind,
                    "peak RSS growth MiB (max rank / rank 0 for save)": mib(peak),
                    "goal MiB": mib(goal),
                    "peak / goal": f"{peak / goal:.2f}",
                    "peak / model bytes": f"{peak / model_bytes:.2f}",
                }
            )
    title = f"UNet width {WIDTH}: {model_bytes / 4e6:.0f}M params, {mib(model_bytes)} MiB fp32 (N=2, CPU)"
    print_section(f"Load and save, {title}", markdown_table(rows, list(rows[0])))
    print_section(f"Load and save against the disk, {title}", markdown_table(speed, list(speed[0])))
