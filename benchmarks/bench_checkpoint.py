"""Partitioned load and streamed save at N=2, on a UNet of a few hundred million parameters.

Peak RSS growth per rank while loading (ours vs ``from_pretrained`` + ``deepspeed.initialize``)
and while saving (ours vs the consolidated state dict that ``accelerator.get_state_dict``
builds, written with ``safetensors``), side by side, as ratios to the goals:
load <= 1.2 x (model bytes / N + largest tensor); save on rank 0 <= model bytes / N + one bucket
(our bucket is one tensor).
"""

from __future__ import annotations

import tempfile

from benchmarks.common import markdown_table, mib, print_section, report, run_case

WIDTH = 512


def _config():
    return {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": False},
    }


def case(kind: str, folder: str):
    import gc

    import deepspeed
    import torch
    from diffusers import UNet2DConditionModel

    from benchmarks.common import current_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss
    from diffusers_zero3 import get_rank, load_pretrained_zero3, save_pretrained_zero3, zero3_init_disabled

    deepspeed.init_distributed(dist_backend="gloo")
    torch.distributed.barrier()
    gc.collect()
    reset_peak_rss()
    base = current_rss_bytes()
    if kind in ("load ours", "save ours", "save consolidated"):
        model = load_pretrained_zero3(UNet2DConditionModel, folder, ds_config=_config())
        engine, *_ = deepspeed.initialize(model=model, config=_config())
    else:  # "load from_pretrained"
        with zero3_init_disabled():
            model = UNet2DConditionModel.from_pretrained(folder)
        engine, *_ = deepspeed.initialize(model=model, config=_config())
    load_peak = peak_rss_since_reset_bytes() - base
    save_peak = None
    if kind.startswith("save"):
        gc.collect()
        reset_peak_rss()
        base = current_rss_bytes()
        out = tempfile.mkdtemp()
        if kind == "save ours":
            save_pretrained_zero3(engine, out + "/unet")
        else:
            from safetensors.torch import save_file

            state = engine._zero3_consolidated_16bit_state_dict()  # what get_state_dict calls
            if get_rank() == 0:
                save_file(state, out + "/model.safetensors")
            del state
        torch.distributed.barrier()
        save_peak = peak_rss_since_reset_bytes() - base
    report(load_peak=load_peak, save_peak=save_peak, rank=get_rank())


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
        rows = []
        for kind in ("load ours", "load from_pretrained", "save ours", "save consolidated"):
            res = run_case("benchmarks.bench_checkpoint:case", kind=kind, folder=folder, timeout_s=1800)
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
    print_section(
        f"Load and save, UNet width {WIDTH}: {model_bytes / 4e6:.0f}M params, {mib(model_bytes)} MiB fp32 (N=2, CPU)",
        markdown_table(rows, list(rows[0])),
    )
