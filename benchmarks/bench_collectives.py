"""The collectives of one training step over gloo on this host, alone (no compute), N=2.

What limits ZeRO-3's time against DDP's on a CPU host: per step ZeRO-3 all-gathers the
model's parameters twice (in the forward and again in the backward: at most a tenth of the
model stays gathered, ``ds_config.live_parameters``) and reduce-scatters its gradients
once; DDP all-reduces its gradients once. Each runs here in the buckets the package sizes
for the model (``ds_config.zero3_bucket_sizes``), fp32, on the UNets of
``bench_end_to_end.FINE_GRAINED``; the table gives each collective's seconds for the whole
model and its rate, and the two steps' totals.
"""

from __future__ import annotations

import time

from benchmarks.common import markdown_table, print_section, report, run_case

REPEATS = 3


def case_collectives(numel: int, bucket: int) -> None:
    """Seconds for the whole model's all-gather, reduce-scatter and all-reduce in buckets of
    ``bucket`` elements (best of ``REPEATS``); every rank reports."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    sizes = [min(bucket, numel - start) for start in range(0, numel, bucket)]
    sizes = [size + (-size) % world for size in sizes]  # padded to the world, as DeepSpeed pads
    full = [torch.randn(size) for size in sizes]
    parts = [torch.randn(size // world) for size in sizes]

    def all_gather():
        for whole, part in zip(full, parts):
            dist.all_gather_into_tensor(whole, part)

    def reduce_scatter():
        for whole, part in zip(full, parts):
            dist.reduce_scatter_tensor(part, whole)

    def all_reduce():
        for whole in full:
            dist.all_reduce(whole)

    seconds = {}
    for name, collective in (
        ("all_gather", all_gather),
        ("reduce_scatter", reduce_scatter),
        ("all_reduce", all_reduce),
    ):
        best = float("inf")
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            collective()
            best = min(best, time.perf_counter() - start)
        seconds[name] = best
    report(**seconds, buckets=len(sizes))
    dist.destroy_process_group()


def model_sizes(shape: str, width: int) -> tuple[int, int]:
    """Parameter elements and reduce bucket of the demo UNet of ``shape`` at ``width``."""
    import torch
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.demo import tiny_component_configs
    from diffusers_zero3.runtime.ds_config import zero3_bucket_sizes

    with torch.device("meta"):
        unet = UNet2DConditionModel(**tiny_component_configs(width, unet_shape=shape)["unet"])
    return sum(p.numel() for p in unet.parameters()), zero3_bucket_sizes(unet)["reduce_bucket_size"]


def collective_rows() -> list[dict]:
    """One row per fine-grained UNet shape: each collective's seconds for the model and its
    rate, and the collectives of a ZeRO-3 and a DDP step (2 ranks)."""
    from benchmarks.bench_end_to_end import FINE_GRAINED

    rows = []
    for shape, width in FINE_GRAINED.items():
        numel, bucket = model_sizes(shape, width)
        ranks = run_case("benchmarks.bench_collectives:case_collectives", numel=numel, bucket=bucket)
        s = {key: max(rank[key] for rank in ranks) for key in ranks[0]}  # the slower rank's
        gib = numel * 4 / 2**30
        zero3, ddp = 2 * s["all_gather"] + s["reduce_scatter"], s["all_reduce"]
        rows.append(
            {
                "UNet shape": shape,
                "fp32 MiB": f"{gib * 1024:.0f}",
                "buckets": s["buckets"],
                "all-gather s (GiB/s)": f"{s['all_gather']:.3f} ({gib / s['all_gather']:.2f})",
                "reduce-scatter s (GiB/s)": f"{s['reduce_scatter']:.3f} ({gib / s['reduce_scatter']:.2f})",
                "all-reduce s (GiB/s)": f"{s['all_reduce']:.3f} ({gib / s['all_reduce']:.2f})",
                "ZeRO-3 step: 2 all-gathers + 1 reduce-scatter, s": f"{zero3:.3f}",
                "DDP step: 1 all-reduce, s": f"{ddp:.3f}",
                "ZeRO-3 / DDP": f"{zero3 / ddp:.2f}",
            }
        )
    return rows


def main() -> None:
    rows = collective_rows()
    print_section(
        "Collectives of one step over gloo, alone (no compute), fp32, N=2, in the package's buckets",
        markdown_table(rows, list(rows[0])),
    )


if __name__ == "__main__":
    main()
