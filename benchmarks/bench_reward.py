"""Reward model at N=2: per-rank bytes and time per scored sample, "shard" vs "replicate" vs
main_process (gather to rank 0, score with a replica there, scatter back)."""

from __future__ import annotations

import time

from benchmarks.common import markdown_table, mib, print_section, report, run_case

HIDDEN, LAYERS, SAMPLES, REPEAT = 256, 6, 8, 2


def case_reward(kind: str):
    import torch
    from accelerate.utils import DeepSpeedPlugin

    from diffusers_zero3 import ParallelReward, build_accelerator, zero3_init_disabled
    from diffusers_zero3.demo import RednessRewardModel

    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "zero_optimization": {"stage": 3}}
    acc = build_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    with zero3_init_disabled():
        torch.manual_seed(0)
        model = RednessRewardModel(hidden=HIDDEN, layers=LAYERS)
    placement = "shard" if kind == "shard" else "replicate"
    mode = "main_process" if kind == "main_process" else "all_ranks"
    reward = ParallelReward(model, accelerator=acc, placement=placement, mode=mode, micro_batch_size=4)
    images = torch.rand(SAMPLES, 3, 32, 32) * 2 - 1
    reward(images)  # warm-up
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(REPEAT):
        reward(images)
    torch.distributed.barrier()
    seconds = (time.perf_counter() - start) / (REPEAT * SAMPLES * acc.num_processes)
    report(held=reward.model.local_parameter_bytes(), seconds_per_sample=seconds)


def main() -> None:
    rows, base = [], None
    for kind in ("replicate", "shard", "main_process"):
        res = run_case("benchmarks.bench_reward:case_reward", kind=kind)
        held, secs = max(r["held"] for r in res), max(r["seconds_per_sample"] for r in res)
        base = base or (held, secs)
        rows.append(
            {
                "reward scoring": kind,
                "reward MiB / rank (max)": mib(held),
                "bytes vs replicate": f"{held / base[0]:.2f}",
                "ms / scored sample": f"{secs * 1e3:.1f}",
                "time vs replicate": f"{secs / base[1]:.2f}",
            }
        )
    print_section(
        f"Reward model (conv, hidden {HIDDEN} x {LAYERS} layers), {SAMPLES} samples per rank, N=2, CPU",
        markdown_table(rows, list(rows[0])),
    )
