"""LoRA against full fine-tuning under ZeRO-3 at N=2: per-rank model-state bytes (parameters,
gradients, optimizer state) and step time, side by side.

The UNet (width 256, about 50 M parameters, fp32) is partitioned in every case. Full
fine-tuning trains every parameter of one ZeRO-3 engine. LoRA (rank 4 on ``to_k, to_q, to_v,
to_out.0``, as diffusers' ``train_text_to_image_lora.py``) freezes the base and trains the
adapters alone, two ways: in one engine with the base (what the script does), or with the
base as a separate ZeRO-3 inference engine and the adapters whole on every rank, trained by
a plain Adam with all-reduced gradients. Gradients are DeepSpeed's flat gradient
partition buffer plus its reduce bucket; optimizer state is Adam's moments plus the fp32
master partitions.
"""

from __future__ import annotations

import time

from benchmarks.common import markdown_table, mib, print_section, report, run_case

WIDTH, RANK, STEPS = 256, 4, 5


def case(kind: str):
    import gc

    import torch
    from accelerate.utils import DeepSpeedPlugin

    from benchmarks.common import (
        current_rss_bytes,
        optimizer_state_bytes,
        peak_rss_since_reset_bytes,
        reset_peak_rss,
    )
    from diffusers_zero3 import build_accelerator, get_rank, local_parameter_bytes, share_fp32_master_weights
    from diffusers_zero3.demo import build_tiny_components
    from diffusers_zero3.families import SD
    from diffusers_zero3.runtime.ds_config import fill_auto_bucket_sizes, zero3_bucket_sizes
    from diffusers_zero3.training.lora import add_lora_adapters

    torch.manual_seed(0)
    unet = build_tiny_components(width=WIDTH)["unet"]
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}  # fmt: skip
    fill_auto_bucket_sizes(cfg, unet)
    accelerator = build_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    g = torch.Generator().manual_seed(get_rank())
    latents, states = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, WIDTH, generator=g)
    timesteps = torch.tensor([10, 500])
    gc.collect()
    reset_peak_rss()
    base = current_rss_bytes()
    if kind == "lora, base in a frozen engine":
        # The alternative: the base as its own ZeRO-3 inference engine, the adapters added
        # after it (whole on every rank), a plain Adam on them and their gradients all-reduced.
        from diffusers_zero3 import prepare_frozen

        frozen = prepare_frozen(unet, "shard", accelerator=accelerator, name="unet")
        module = frozen.module
        trainable = add_lora_adapters(module, rank=RANK, target_modules=SD.lora_target_modules)
        module.train()
        adam = torch.optim.AdamW(trainable, lr=1e-4)

        def step():
            loss = module(latents, timesteps, states).sample.pow(2).mean()
            loss.backward()
            for p in trainable:
                torch.distributed.all_reduce(p.grad)
                p.grad /= 2
            adam.step()
            adam.zero_grad(set_to_none=False)

        step()
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        seconds = (time.perf_counter() - start) / STEPS
        report(
            params=local_parameter_bytes(module),
            grads=sum(p.grad.numel() * 4 for p in trainable),
            optimizer=optimizer_state_bytes(adam),
            trainable=sum(p.numel() for p in trainable),
            total=sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),
            seconds=seconds,
            peak=peak_rss_since_reset_bytes() - base,
        )
        return
    if kind == "lora":
        trainable = add_lora_adapters(unet, rank=RANK, target_modules=SD.lora_target_modules)
        # as the script does: the reduce bucket and sub-groups sized for the adapters
        accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"].update(
            zero3_bucket_sizes(unet)
        )
    else:
        trainable = list(unet.parameters())
    engine, optimizer = accelerator.prepare(unet, torch.optim.AdamW(trainable, lr=1e-4))
    share_fp32_master_weights(optimizer)  # as the scripts do

    def step():
        loss = engine(latents, timesteps, states).sample.pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: optimizer state allocated
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    seconds = (time.perf_counter() - start) / STEPS
    zero = optimizer.optimizer
    grads = zero.grad_partitions_flat_buffer
    grad_bytes = grads.numel() * grads.element_size()
    grad_bytes += sum(
        b.buffer.numel() * b.buffer.element_size() for b in getattr(zero, "ipg_buckets", {}).values()
    )
    report(
        params=local_parameter_bytes(engine.module),
        grads=grad_bytes,
        optimizer=optimizer_state_bytes(optimizer),
        trainable=sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad),
        total=sum(p.ds_numel for p in engine.module.parameters()),
        seconds=seconds,
        peak=peak_rss_since_reset_bytes() - base,
    )


def main() -> None:
    kinds = ("full", "lora", "lora, base in a frozen engine")
    results = {kind: run_case("benchmarks.bench_lora:case", kind=kind) for kind in kinds}
    full = {k: max(r[k] for r in results["full"]) for k in results["full"][0]}
    rows = []
    for kind, res in results.items():
        r = {k: max(x[k] for x in res) for k in res[0]}
        states = r["params"] + r["grads"] + r["optimizer"]
        rows.append(
            {
                "training": {"full": "full fine-tune", "lora": f"LoRA rank {RANK}, one engine"}.get(
                    kind, f"LoRA rank {RANK}, base in a frozen engine"
                ),
                "trainable params": f"{r['trainable'] / 1e6:.2f} M of {r['total'] / 1e6:.1f} M",
                "params MiB / rank": mib(r["params"]),
                "grads MiB / rank": mib(r["grads"]),
                "optimizer MiB / rank": mib(r["optimizer"]),
                "model states vs full": f"{states / (full['params'] + full['grads'] + full['optimizer']):.2f}",
                "s / step": f"{r['seconds']:.3f}",
                "time vs full": f"{r['seconds'] / full['seconds']:.2f}",
                "peak RSS growth MiB": mib(r["peak"]),
            }
        )
    print_section(
        f"LoRA vs full fine-tuning under ZeRO-3, UNet width {WIDTH} (fp32), batch 2 per rank, N=2, CPU",
        markdown_table(rows, list(rows[0])),
    )
