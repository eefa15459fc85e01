"""Video RL on Wan with context parallelism (issue 53, item 6): a GRPO round of ``train_grpo.py``
with ``--context_parallel_size 2`` against 1 on 2 ZeRO-3 ranks.

The tiny Wan 2.1 of ``make train-grpo MODEL=wan`` with a wider transformer (4 heads of 32, 4
blocks, rope long enough) on 33-frame clips at 128 x 128 px (9 latent frames of 16 x 16: 576
tokens a clip). K=1: each rank samples and trains its own 4 clips of a round's 8; K=2: both
ranks sample and train all 8, each holding half of every clip's tokens (Ulysses). Per rank: the
peak RSS rise over a round after a warm-up round (the activations and their gradients: what
grows with the clip), the seconds of each phase, and the time per clip of the round, measured
side by side in one run (the cases in turn).

``python -m benchmarks.run --only video_rl`` (or ``python -m benchmarks.bench_video_rl``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, mib, print_section, report, run_case
from diffusers_zero3.testing import ZERO3_ENV

PROMPTS = ("a red circle", "a blue square")
GROUP, STEPS, FRAMES, SIDE = 4, 4, 33, 128
TOKENS = ((FRAMES - 1) // 4 + 1) * (SIDE // 16) ** 2  # latent frames x 2 x 2 patches of the 8x VAE's latents


def round_memory_and_time(pipe_dir: str, out: str, size: int) -> None:
    """On every rank: the peak RSS rise and the seconds of a GRPO round (after a warm-up
    round) at ``--context_parallel_size size``. Collective (the trainer's setup and rounds)."""
    from benchmarks.common import peak_rss_since_reset_bytes, reset_peak_rss
    from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer
    from diffusers_zero3.runtime.memory import current_rss_bytes

    settings = GRPOSettings.parse([
        "--pretrained_model_name_or_path", pipe_dir, "--reward", "diffusers_zero3.demo.rewards:redness=-1",
        "--output_dir", out, "--prompts", *PROMPTS, "--group_size", str(GROUP), "--resolution", str(SIDE),
        "--num_frames", str(FRAMES), "--num_inference_steps", str(STEPS), "--sample_batch_size", "2",
        "--train_batch_size", "2", "--max_train_steps", "2", "--report_to", "none", "--seed", "0",
        "--dead_rank_timeout", "0", "--context_parallel_size", str(size), "--timestep_fraction", "0.5",
        "--gradient_accumulation_steps", "1",
    ])  # fmt: skip
    trainer = GRPOTrainer(settings)
    trainer.setup()
    seconds = {}
    for round_index in range(2):
        before = current_rss_bytes()
        reset_peak_rss()
        start = time.perf_counter()
        batch = trainer.sample_round(round_index)
        sampled = time.perf_counter()
        trainer.score_round(batch)
        scored = time.perf_counter()
        trainer.train_round(batch)
        seconds = {
            "sampling": sampled - start,
            "scoring": scored - sampled,
            "training": time.perf_counter() - scored,
        }
        rise = peak_rss_since_reset_bytes() - before
    groups, _ = trainer.sampling_ranks
    report(rise=rise, clips=len(batch.pairs), groups=groups, **seconds)


def write_pipeline(work: Path) -> Path:
    """The tiny Wan 2.1 with a transformer of 4 heads of 32 in 4 blocks (rope long enough for the clips)."""
    import shutil

    from diffusers import WanTransformer3DModel

    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import WAN

    folder = save_tiny_pipeline(WAN, work / "tiny-wan")
    config = WanTransformer3DModel.load_config(folder / "transformer")
    config.update(
        num_attention_heads=4, attention_head_dim=32, ffn_dim=256, num_layers=4, rope_max_seq_len=1024
    )
    shutil.rmtree(folder / "transformer")
    WanTransformer3DModel.from_config(
        {k: v for k, v in config.items() if not k.startswith("_")}
    ).save_pretrained(folder / "transformer")
    return folder


def main() -> None:
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-video-rl-") as tmp:
        work = Path(tmp)
        folder = write_pipeline(work)
        for size in (1, 2):
            results[size] = run_case(
                "benchmarks.bench_video_rl:round_memory_and_time", env=ZERO3_ENV, pipe_dir=str(folder),
                out=str(work / f"out-{size}"), size=size,
            )  # fmt: skip
    base = results[1]
    for size, ranks in results.items():
        rise = max(r["rise"] for r in ranks)
        total = max(r["sampling"] + r["scoring"] + r["training"] for r in ranks)
        clips = len(PROMPTS) * GROUP
        base_total = max(r["sampling"] + r["scoring"] + r["training"] for r in base)
        rows.append({
            "K": size, "clips sampled per rank": ranks[0]["clips"], "tokens per rank per clip": TOKENS // size,
            "peak RSS rise per rank": mib(rise), "vs K=1": f"{rise / max(r['rise'] for r in base):.2f}",
            "sampling s": f"{max(r['sampling'] for r in ranks):.1f}",
            "training s": f"{max(r['training'] for r in ranks):.1f}",
            "s per clip": f"{total / clips:.2f}", "time vs K=1": f"{total / base_total:.2f}",
        })  # fmt: skip
    columns = ["K", "clips sampled per rank", "tokens per rank per clip", "peak RSS rise per rank", "vs K=1",
               "sampling s", "training s", "s per clip", "time vs K=1"]  # fmt: skip
    print_section(
        f"Wan GRPO round, --context_parallel_size K on 2 ZeRO-3 ranks ({FRAMES} frames at {SIDE} x {SIDE}, "
        f"{STEPS} steps, {len(PROMPTS)} prompts x {GROUP})",
        markdown_table(rows, columns),
    )


if __name__ == "__main__":
    main()
