"""Converting a ZeRO-3 checkpoint to DeepSpeed's universal form (resume on another number of
processes), N=2: global rank 0 alone (``ds_to_universal.main``, what ``convert_to_universal``
did) against the work spread over the ranks (``convert_engine_to_universal``), by model size.

Each size is one launch: a stack of ``Linear(WIDTH, WIDTH)`` layers trained one AdamW step
under ZeRO-3 (fp32) and saved with ``engine.save_checkpoint``; then the two conversions of that
checkpoint alternate ``REPEATS`` times, each from a cold page cache (the checkpoint's pages
dropped after a sync) and timed until its files are synced to disk (``os.sync``), beside
``dd``'s fsynced write of as many bytes as the conversion writes. Per conversion: its wall time
(the slowest rank), the bytes each rank wrote (counted in DeepSpeed's one file writer,
``ds_to_universal._save_checkpoint``) and the longest time any rank spent inside one collective
(the time that counts against the process-group timeout).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from benchmarks.common import markdown_table, print_section, report, run_case

WIDTH = 3072  # Flux's hidden size: 9.4 M parameters per layer
LAYERS = (2, 4, 8)
REPEATS = 5
MODES = ("rank 0 alone", "spread over the ranks")


def case(layers: int, folder: str):
    import os
    import shutil
    from pathlib import Path

    import deepspeed
    import deepspeed.checkpoint.ds_to_universal as dsu
    import torch
    import torch.distributed as dist

    from benchmarks.bench_checkpoint import disk_write_mb_s, drop_page_cache
    from diffusers_zero3.runtime.deepspeed_internals.universal import convert_whole
    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.state.resume import convert_engine_to_universal

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": False},
    }
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    params = sum(p.ds_numel for p in model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg
    )
    engine.backward(engine(torch.randn(1, WIDTH)).square().mean())
    engine.step()
    root = Path(folder)
    engine.save_checkpoint(str(root), tag="checkpoint")
    src = root / "checkpoint"
    del engine, model

    written, waits = [0], [0.0]

    def counted_save(path, obj, _save=dsu._save_checkpoint):
        _save(path, obj)
        written[0] += os.path.getsize(path)

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                waits[0] = max(waits[0], time.perf_counter() - start)

        return wrapper

    numbers: dict[str, list] = {"disk_write": []}
    for mode in MODES:
        numbers.update({f"{mode} s": [], f"{mode} bytes": [], f"{mode} wait": []})
    saved = dsu._save_checkpoint, dist.all_gather_object, dist.barrier
    for _ in range(REPEATS):
        if (
            get_rank() == 0
        ):  # as many bytes as a conversion writes at 2 saved ranks: 2 x 12 + 12 / 2 per parameter
            numbers["disk_write"].append(disk_write_mb_s(folder, 30 * params))
        for mode in MODES:
            dst = root / "universal" / "checkpoint"
            drop_page_cache(str(src))
            dist.barrier()
            written[0], waits[0] = 0, 0.0
            dsu._save_checkpoint, dist.all_gather_object, dist.barrier = (
                counted_save,
                timed(saved[1]),
                timed(saved[2]),
            )
            start = time.perf_counter()
            try:
                if mode == "rank 0 alone":
                    if get_rank() == 0:
                        convert_whole(src, dst)
                else:
                    convert_engine_to_universal(src, dst)
                os.sync()  # until the bytes are on disk, as dd's conv=fsync
                dist.barrier()  # the ranks that are done wait here for the others
            finally:
                dsu._save_checkpoint, dist.all_gather_object, dist.barrier = saved
            numbers[f"{mode} s"].append(time.perf_counter() - start)
            numbers[f"{mode} bytes"].append(written[0])
            numbers[f"{mode} wait"].append(waits[0])
            dist.barrier()
            if get_rank() == 0:
                shutil.rmtree(root / "universal")
            dist.barrier()
    report(rank=get_rank(), params=params, **numbers)


def main() -> None:
    rows = []
    for layers in LAYERS:
        with tempfile.TemporaryDirectory() as folder:
            res = run_case("benchmarks.bench_universal:case", layers=layers, folder=folder, timeout_s=1800)
        rank0 = next(r for r in res if r["rank"] == 0)
        row = {"parameters": f"{rank0['params'] / 1e6:.0f} M ({layers} x {WIDTH}^2)"}
        seconds = {}
        for mode in MODES:
            per_run = [max(times) for times in zip(*(r[f"{mode} s"] for r in res))]  # the slowest rank
            seconds[mode] = statistics.median(per_run)
            total = sum(r[f"{mode} bytes"][0] for r in res)
            shares = "/".join(
                f"{r[f'{mode} bytes'][0] / 1e9:.2f}" for r in sorted(res, key=lambda r: r["rank"])
            )
            wait = statistics.median([max(w) for w in zip(*(r[f"{mode} wait"] for r in res))])
            row[f"{mode}: s (median of {REPEATS})"] = (
                f"{seconds[mode]:.2f} ({', '.join(f'{s:.2f}' for s in per_run)})"
            )
            row[f"{mode}: GB written (rank 0/1)"] = f"{total / 1e9:.2f} ({shares})"
            row[f"{mode}: MB/s"] = f"{total / seconds[mode] / 1e6:.0f}"
            row[f"{mode}: longest wait in one collective, s"] = f"{wait:.2f}"
        row["spread / alone (time)"] = f"{seconds[MODES[1]] / seconds[MODES[0]]:.2f}"
        row["disk MB/s (dd write, fsync; each repeat)"] = ", ".join(f"{d:.0f}" for d in rank0["disk_write"])
        rows.append(row)
    print_section(
        f"Universal conversion of a ZeRO-3 checkpoint (fp32, AdamW), N=2: rank 0 alone vs spread (width {WIDTH})",
        markdown_table(rows, list(rows[0])),
    )


if __name__ == "__main__":
    main()
