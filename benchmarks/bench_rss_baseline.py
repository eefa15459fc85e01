"""Baseline of the memory readings: a 2-rank ZeRO-3 engine holds 1/N of a model's parameters.

This is the harness's self-check: the same model's parameter bytes per rank, whole vs.
partitioned by ZeRO-3, side by side.
"""

from __future__ import annotations

from benchmarks.common import (
    markdown_table,
    mib,
    parameter_bytes,
    peak_rss_bytes,
    print_section,
    report,
    run_case,
)


def case_partitioned(width: int, zero3: bool):
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    layers = [torch.nn.Linear(width, width) for _ in range(8)]
    model = torch.nn.Sequential(*layers)
    if zero3:
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "train_batch_size": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        model, *_ = deepspeed.initialize(model=model, config=cfg)
    report(param_bytes=parameter_bytes(model), peak_rss=peak_rss_bytes())


def main() -> None:
    rows = []
    base = None
    for zero3 in (False, True):
        res = run_case("benchmarks.bench_rss_baseline:case_partitioned", width=1024, zero3=zero3)
        pb = max(r["param_bytes"] for r in res)
        base = base or pb
        rows.append(
            {
                "placement": "ZeRO-3 (N=2)" if zero3 else "whole",
                "param MiB / rank": mib(pb),
                "ratio": f"{pb / base:.2f}",
                "peak RSS MiB / rank": mib(max(r["peak_rss"] for r in res)),
            }
        )
    print_section(
        "Harness baseline: 8 x Linear(1024, 1024)",
        markdown_table(rows, ["placement", "param MiB / rank", "ratio", "peak RSS MiB / rank"]),
    )
