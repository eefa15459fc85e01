"""The T5 encoder of Flux and SD3, by placement: per-rank weight bytes at N = 2, 8 and 64
for T5-XXL (computed from its real shapes on the meta device), and a T5 that fits this
machine loaded at N=2, measured against the same computation.

T5-XXL (d_model 4096, 24 layers, d_ff 10240, 64 heads) holds 4.76 B parameters: 9.5 GB in
bf16, 19 GB in fp32. ``replicate`` puts all of it on every rank; ``shard`` (a ZeRO-3 inference
engine, loaded partitioned) puts 1/N of each weight plus the few parameters below the
persistence threshold (layer norms, the relative-position bias) on each rank; ``cache``
encodes the captions once, with the encoder sharded, and frees it: no weights at all during
training, and the embeddings on disk.

The measured part loads the encoder at N=2 through the package's own path
(``placement.frozen.load_frozen_component``): ``replicate`` reads the whole model on every rank, ``shard``
and ``cache`` read each rank's partition only. Peak RSS growth per rank during load is
compared with the encoder's bytes / N, and with bytes / N plus its largest tensor (the
embedding, which ``zero.Init`` builds whole once before partitioning it). Weights that
``from_pretrained`` leaves memory-mapped are paged in before the peak is read, as the first
forward would.
"""

from __future__ import annotations

import tempfile

from benchmarks.common import markdown_table, mib, print_section, report, run_case

XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
MEASURED = dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=2816, num_layers=12, num_heads=16)
SEQUENCE = 512  # Flux's T5 tokens per caption
# glibc's default raises its mmap threshold as large blocks are freed, after which the
# whole-module tensors zero.Init builds and partitions stay in the heap (RSS) once freed; a
# fixed threshold returns them to the OS.
MMAP = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
CASES = [("replicate", None), ("shard", None), ("cache", None), ("replicate", MMAP), ("shard", MMAP)]


def t5_config(**dims):
    from transformers import T5Config

    return T5Config(
        **dims, feed_forward_proj="gated-gelu", is_encoder_decoder=False, relative_attention_num_buckets=32
    )


def meta_t5(dims: dict):
    import torch
    from transformers import T5EncoderModel

    with torch.device("meta"):
        return T5EncoderModel(t5_config(**dims))


def computed_table() -> str:
    import torch

    from diffusers_zero3 import placement_bytes_per_rank

    model = meta_t5(XXL)
    params = sum(p.numel() for p in model.parameters())
    whole = placement_bytes_per_rank(model, "replicate", 1, torch.bfloat16)
    rows = []
    for n in (2, 8, 64):
        for placement in ("replicate", "shard", "cache"):
            held = placement_bytes_per_rank(model, placement, n, torch.bfloat16)
            held_fp32 = placement_bytes_per_rank(model, placement, n, torch.float32)
            rows.append(
                {
                    "N": n,
                    "placement": placement,
                    "GiB / rank (bf16)": f"{held / 2**30:.3f}",
                    "GiB / rank (fp32)": f"{held_fp32 / 2**30:.3f}",
                    "vs replicate": f"{held / whole:.4f}",
                    "vs bytes / N": f"{held / (whole / n):.3f}",
                }
            )
    cache = SEQUENCE * XXL["d_model"] * 2
    return (
        f"T5-XXL: {params / 1e9:.2f} B parameters, {whole / 1e9:.1f} GB in bf16. The cache holds "
        f"{mib(cache)} MiB per image on disk ({SEQUENCE} tokens x {XXL['d_model']} x bf16).\n\n"
        + markdown_table(rows, list(rows[0]))
    )


def case_load(placement: str, folder: str):
    import gc

    import torch
    from accelerate.utils import DeepSpeedPlugin
    from transformers import T5EncoderModel

    from benchmarks.common import current_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss
    from diffusers_zero3 import build_accelerator
    from diffusers_zero3.placement.frozen import load_frozen_component

    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "zero_optimization": {"stage": 3}}
    accelerator = build_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    torch.distributed.barrier()
    gc.collect()
    reset_peak_rss()
    base = current_rss_bytes()
    model = load_frozen_component(
        accelerator, folder, "t5", placement, T5EncoderModel
    )  # cache: loaded as it runs
    with torch.no_grad():  # page in weights that from_pretrained left memory-mapped (as a forward would)
        for p in model.module.parameters():
            p.sum()
    load_peak = peak_rss_since_reset_bytes() - base
    held = model.local_parameter_bytes()
    if placement == "cache":
        with torch.no_grad():  # encode a batch, as the cache does, then free the encoder
            model(torch.randint(3, 1000, (8, 64)))
        model.release()
        held = 0
    torch.distributed.barrier()
    report(load_peak=load_peak, held=held)


def measured_table() -> str:
    import torch
    from transformers import T5EncoderModel

    from diffusers_zero3 import placement_bytes_per_rank, zero3_init_disabled

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        with zero3_init_disabled():
            torch.manual_seed(0)
            model = T5EncoderModel(t5_config(**MEASURED))
        model.save_pretrained(f"{folder}/t5")
        params = sum(p.numel() for p in model.parameters())
        whole = placement_bytes_per_rank(model, "replicate", 1)
        largest = max(p.numel() * 4 for p in model.parameters())
        del model
        meta = meta_t5(MEASURED)
        for placement, env in CASES:
            res = run_case(
                "benchmarks.bench_t5:case_load", placement=placement, folder=folder, timeout_s=1800, env=env
            )
            peak, held = max(r["load_peak"] for r in res), max(r["held"] for r in res)
            computed = placement_bytes_per_rank(meta, placement, 2)
            rows.append(
                {
                    "placement": placement + (" (MALLOC_MMAP_THRESHOLD_=1 MiB)" if env else ""),
                    "held MiB / rank (measured)": mib(held),
                    "computed": mib(computed),
                    "measured / computed": f"{held / computed:.3f}" if computed else "-",
                    "peak RSS growth at load MiB": mib(peak),
                    "peak / (bytes / N)": f"{peak / (whole / 2):.2f}",
                    "peak / (bytes / N + largest tensor)": f"{peak / (whole / 2 + largest):.2f}",
                }
            )
    return (
        f"Measured: T5 d_model {MEASURED['d_model']}, {MEASURED['num_layers']} layers, d_ff {MEASURED['d_ff']}: "
        f"{params / 1e6:.0f} M parameters, {mib(whole)} MiB fp32, N=2, CPU.\n\n"
        + markdown_table(rows, list(rows[0]))
    )


def main() -> None:
    print_section(
        "T5 encoder (Flux's text_encoder_2, SD3's text_encoder_3): bytes per rank by placement",
        computed_table(),
    )
    print_section("T5 encoder loaded at N=2 by placement", measured_table())
