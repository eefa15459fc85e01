"""EMA under ZeRO-3 at N=2: ShardedEMA vs diffusers' EMAModel (per-tensor gather, foreach=True).

Per-rank bytes held by the EMA, collectives per EMA step, and EMA time as a fraction of the
training step time, measured side by side on the same UNet (tens of millions of parameters).
"""

from __future__ import annotations

import time

from benchmarks.common import markdown_table, mib, print_section, report, run_case

WIDTH, STEPS = 256, 4


def case_ema(mode: str):
    import copy

    import torch
    from accelerate.utils import DeepSpeedPlugin

    from diffusers_zero3 import ShardedEMA, build_accelerator
    from diffusers_zero3.demo import build_tiny_components
    from diffusers_zero3.testing import count_collectives

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10_000},
        "bf16": {"enabled": False},
    }
    acc = build_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg, zero3_init_flag=True))
    unet = build_tiny_components(width=WIDTH)["unet"]
    n_params = sum(p.numel() for p in unet.parameters())
    if mode != "ShardedEMA":
        # diffusers' example: EMAModel of a whole copy, stepped with the ZeRO-3 parameters.
        import deepspeed
        import diffusers.training_utils
        from diffusers.training_utils import EMAModel

        diffusers.training_utils.deepspeed = deepspeed  # the upstream NameError, worked around
        ema = EMAModel(copy.deepcopy(unet).parameters(), foreach=mode.endswith("foreach=True"))
    unet, opt = acc.prepare(unet, torch.optim.AdamW(unet.parameters(), lr=1e-4))
    if mode == "ShardedEMA":
        ema = ShardedEMA(unet)

        def ema_step():
            ema.step()

        held = ema.local_bytes()
    else:
        # diffusers' EMAModel gathers only where transformers says ZeRO-3 is on, a registration
        # build_accelerator drops (see unregister_transformers_zero3): register it again, as
        # diffusers' example has it.
        from transformers.integrations import HfDeepSpeedConfig

        registration = HfDeepSpeedConfig(acc.state.deepspeed_plugin.deepspeed_config)  # noqa: F841 (kept alive)

        def ema_step():
            ema.step(unet.module.parameters())

        held = sum(s.numel() * s.element_size() for s in ema.shadow_params)
    x, t, h = torch.randn(1, 4, 16, 16), torch.tensor([10]), torch.randn(1, 77, WIDTH)
    train_s = ema_s = 0.0
    for step in range(STEPS + 1):
        start = time.perf_counter()
        loss = unet(x, t, h).sample.pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        mid = time.perf_counter()
        with count_collectives() as calls:
            ema_step()
        end = time.perf_counter()
        if step > 0:  # the first step warms up
            train_s += mid - start
            ema_s += end - mid
    report(held=held, params=n_params, train_s=train_s / STEPS, ema_s=ema_s / STEPS, collectives=calls["n"])


def main() -> None:
    rows = []
    for mode in ("ShardedEMA", "EMAModel", "EMAModel foreach=True"):
        res = run_case("benchmarks.bench_ema:case_ema", mode=mode)
        r = max(res, key=lambda d: d["ema_s"])
        rows.append(
            {
                "EMA": mode,
                "EMA MiB / rank": mib(max(d["held"] for d in res)),
                "vs 4Ψ/N": f"{max(d['held'] for d in res) / (4 * r['params'] / 2):.2f}",
                "collectives / step": r["collectives"],
                "EMA ms / step": f"{r['ema_s'] * 1e3:.1f}",
                "train ms / step": f"{r['train_s'] * 1e3:.0f}",
                "EMA / train step": f"{100 * r['ema_s'] / r['train_s']:.1f}%",
            }
        )
    cols = ["EMA", "EMA MiB / rank", "vs 4Ψ/N", "collectives / step", "EMA ms / step", "train ms / step"]
    print_section(
        f"EMA under ZeRO-3, UNet width {WIDTH} (N=2, CPU)", markdown_table(rows, [*cols, "EMA / train step"])
    )
