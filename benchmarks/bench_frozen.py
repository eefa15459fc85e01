"""Frozen text encoder + VAE: per-rank weight bytes and time per forward, by placement (N=2).

Models of tens of millions of parameters built from configs (weights dominate memory).
"replicate" is the baseline of every ratio; "cache" holds no frozen weights during training
and its "forward" is a lookup of the precomputed outputs.
"""

from __future__ import annotations

import tempfile
import time

from benchmarks.common import DEEPSPEED_DEFAULTS_ENV, markdown_table, mib, print_section, report, run_case

WIDTH, TEXT_DIM, TEXT_LAYERS, STEPS = 256, 512, 8, 5


def case_placement(placement: str, tmp: str):
    import torch

    from diffusers_zero3 import build_accelerator, prepare_frozen
    from diffusers_zero3.demo import build_tiny_components

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": False},
    }
    from accelerate.utils import DeepSpeedPlugin

    accelerator = build_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    parts = build_tiny_components(width=WIDTH, text_layers=TEXT_LAYERS, cross_dim=TEXT_DIM)
    te, vae = parts["text_encoder"], parts["vae"]
    ids = torch.randint(0, 500, (4, 77))
    many_ids = torch.randint(0, 500, (32, 77))  # a larger batch: the same gathers, 8x the compute
    pixels = torch.rand(4, 3, 64, 64) * 2 - 1
    if placement == "cache":
        import datasets
        from transformers import CLIPTokenizer

        from diffusers_zero3.data.pixels import RowsToPixels
        from diffusers_zero3.demo import shape_image, write_clip_tokenizer
        from diffusers_zero3.placement.cache import FrozenEncoders, precompute_frozen_outputs

        tok = CLIPTokenizer.from_pretrained(write_clip_tokenizer(tmp + "/tok"))
        ds = datasets.Dataset.from_dict(
            {"image": [shape_image("red", "circle", 64) for _ in range(8)], "text": ["a red circle"] * 8}
        )
        te, vae = prepare_frozen(te, "replicate"), prepare_frozen(vae, "replicate")
        models = FrozenEncoders({"text_encoder": te}, {"text_encoder": tok}, vae=vae)
        cache = precompute_frozen_outputs(
            ds, tmp + "/cache", models, RowsToPixels(resolution=64, center_crop=True)
        )
        te.release(), vae.release()
        held = 0

        def forward():
            cache.get(torch.arange(4))

        def text_forward(many=False):
            cache.get(torch.arange(32 if many else 4) % 8)
    else:
        te = prepare_frozen(te, placement, accelerator=accelerator, name="text_encoder")
        vae = prepare_frozen(vae, placement, accelerator=accelerator, name="vae")
        held = te.local_parameter_bytes() + vae.local_parameter_bytes()

        def text_forward(many=False):
            with torch.no_grad():
                te(many_ids if many else ids)

        def forward():
            text_forward()
            with torch.no_grad():
                vae.encode(pixels)

    forward()  # warm-up
    start = time.perf_counter()
    for _ in range(STEPS):
        forward()
    seconds = (time.perf_counter() - start) / STEPS
    start = time.perf_counter()
    for _ in range(4 * STEPS):
        text_forward()
    text_seconds = (time.perf_counter() - start) / (4 * STEPS)
    start = time.perf_counter()
    for _ in range(STEPS):
        text_forward(many=True)
    many = (time.perf_counter() - start) / STEPS
    report(held=held, seconds=seconds, text_seconds=text_seconds, text_many_seconds=many)


def main() -> None:
    rows, base = [], None
    defaults = "shard, DeepSpeed's defaults"  # the per-module levers set back (bench_end_to_end)
    for placement in ("replicate", "shard", defaults, "offload", "cache"):
        if placement == "offload":
            rows.append({"placement": "offload", "frozen MiB / rank": "n/a: needs a GPU (CPU here)"})
            continue
        env = DEEPSPEED_DEFAULTS_ENV if placement == defaults else None
        with tempfile.TemporaryDirectory() as tmp:  # shared by the ranks (the cache folder)
            res = run_case(
                "benchmarks.bench_frozen:case_placement",
                placement="shard" if placement == defaults else placement,
                tmp=tmp,
                env=env,
            )
        held, secs = max(r["held"] for r in res), max(r["seconds"] for r in res)
        text = max(r["text_seconds"] for r in res)
        many = max(r["text_many_seconds"] for r in res)
        base = base or (held, secs, text, many)
        rows.append(
            {
                "placement": placement,
                "frozen MiB / rank": mib(held),
                "bytes vs replicate": f"{held / base[0]:.2f}",
                "ms / forward": f"{secs * 1e3:.1f}",
                "time vs replicate": f"{secs / base[1]:.2f}",
                "text encoder ms, 4 prompts": f"{text * 1e3:.1f}",
                "vs replicate": f"{text / base[2]:.2f}",
                "text encoder ms, 32 prompts": f"{many * 1e3:.1f}",
                "vs replicate ": f"{many / base[3]:.2f}",
            }
        )
    cols = list(rows[0])
    print_section(
        f"Frozen text encoder + VAE (CLIP {TEXT_DIM}x{TEXT_LAYERS}, VAE width {WIDTH}), N=2, CPU",
        markdown_table(rows, cols),
    )
