"""Baseline of the memory readings: a 2-rank ZeRO-3 engine holds 1/N of a model's states.

This is the harness's self-check: the same model's parameter and Adam-state bytes per rank
after one step, whole (plain torch) vs. partitioned by ZeRO-3, side by side.
"""

from __future__ import annotations

from benchmarks.common import (
    markdown_table,
    mib,
    optimizer_state_bytes,
    peak_rss_bytes,
    print_section,
    report,
    run_case,
)


def case_partitioned(width: int, zero3: bool):
    import deepspeed
    import torch

    from diffusers_zero3 import local_parameter_bytes, share_fp32_master_weights

    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if zero3:
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "train_batch_size": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        model, optimizer, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        share_fp32_master_weights(optimizer)  # fp32: the partitions are the master weights
    loss = model(torch.randn(1, width)).pow(2).mean()
    model.backward(loss) if zero3 else loss.backward()
    optimizer.step()
    module = getattr(model, "module", model)
    report(
        param_bytes=local_parameter_bytes(module),
        optimizer_bytes=optimizer_state_bytes(optimizer),
        peak_rss=peak_rss_bytes(),
    )


def main() -> None:
    rows, base = [], None
    for zero3 in (False, True):
        res = run_case("benchmarks.bench_rss_baseline:case_partitioned", width=1024, zero3=zero3)
        pb, ob = max(r["param_bytes"] for r in res), max(r["optimizer_bytes"] for r in res)
        base = base or (pb, ob)
        rows.append(
            {
                "placement": "ZeRO-3 (N=2)" if zero3 else "whole",
                "param MiB / rank": mib(pb),
                "param ratio": f"{pb / base[0]:.2f}",
                "optimizer state MiB / rank": mib(ob),
                "optimizer ratio": f"{ob / base[1]:.2f}",
                "peak RSS MiB / rank": mib(max(r["peak_rss"] for r in res)),
            }
        )
    print_section(
        "Harness baseline: 8 x Linear(1024, 1024), Adam, one step", markdown_table(rows, list(rows[0]))
    )
