"""Context parallelism under ZeRO-3 at N=2: a Wan transformer on a long clip with K=1 (each rank
its own whole clip) against K=2 (both ranks one clip, each half of its tokens, Ulysses).

Per rank: the tokens it holds, the peak RSS rise over a training step (the activations and
their gradients: what grows with the clip), the step time and the time per clip, measured side
by side. The parameters are partitioned over both ranks in both rows.
"""

from __future__ import annotations

import time

from benchmarks.common import markdown_table, mib, print_section, report, run_case

# 4 latent frames of 32 x 48 latents: 4 x 16 x 24 = 1536 tokens a clip (patch 1 x 2 x 2)
LATENTS = (1, 16, 4, 32, 48)
STEPS = 3


def case_context_parallel(size: int):
    import deepspeed
    import torch
    from diffusers import WanTransformer3DModel

    from benchmarks.common import peak_rss_since_reset_bytes, reset_peak_rss
    from diffusers_zero3.runtime.context_parallel import context_parallel, enable_context_parallel
    from diffusers_zero3.runtime.memory import current_rss_bytes
    from diffusers_zero3.runtime.zero3 import zero3_init_disabled

    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    with zero3_init_disabled():
        torch.manual_seed(0)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
            text_dim=64, freq_dim=256, ffn_dim=256, num_layers=4, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
        )  # fmt: skip
    cp = context_parallel(size, "ulysses")
    if cp is not None:
        enable_context_parallel(model, cp, torch.device("cpu"))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-4), config=config
    )
    # K=1: each rank its own clip; K=2: the group's one clip on both ranks
    clip = 0 if cp is not None else rank
    gen = torch.Generator().manual_seed(clip)
    x, text = torch.randn(LATENTS, generator=gen), torch.randn(1, 16, 64, generator=gen)
    scale = cp.group_loss(torch.tensor(1.0)).item() if cp is not None else 1.0
    rise, seconds = 0, 0.0
    for step in range(STEPS + 1):
        before = current_rss_bytes()
        reset_peak_rss()
        start = time.perf_counter()
        out = engine(x, torch.tensor([500.0]), text, return_dict=False)[0]
        engine.backward(out.pow(2).mean() * scale)
        engine.step()
        if step > 0:  # the first step warms up (and records ZeRO-3's trace)
            seconds += time.perf_counter() - start
            rise = max(rise, peak_rss_since_reset_bytes() - before)
    tokens = LATENTS[2] * (LATENTS[3] // 2) * (LATENTS[4] // 2)
    report(size=size, tokens=tokens // size, rise=rise, step_s=seconds / STEPS)


def main() -> None:
    rows = []
    results = {
        size: run_case("benchmarks.bench_context_parallel:case_context_parallel", size=size)
        for size in (1, 2)
    }
    base = results[1]
    for size, ranks in results.items():
        rise = max(r["rise"] for r in ranks)
        step_s = max(r["step_s"] for r in ranks)
        clips_per_step = 2 // size  # 2 ranks
        rows.append(
            {
                "K": size,
                "tokens per rank": ranks[0]["tokens"],
                "peak RSS rise per rank, MiB": mib(rise),
                "vs K=1": f"{rise / max(r['rise'] for r in base):.2f}",
                "step, s": f"{step_s:.2f}",
                "per clip, s": f"{step_s / clips_per_step:.2f}",
                "per clip vs K=1": f"{(step_s / clips_per_step) / (max(r['step_s'] for r in base) / 2):.2f}",
            }
        )
    print_section(
        f"Context parallelism (Ulysses) under ZeRO-3, 2 ranks: Wan transformer (4 layers, 4 heads of 32), "
        f"latents {LATENTS[1:]}, one SGD step (mean of {STEPS})",
        markdown_table(rows, list(rows[0])),
    )


if __name__ == "__main__":
    main()
