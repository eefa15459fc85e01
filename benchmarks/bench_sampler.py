"""The GRPO trainer's SDE sampler against the pipeline's own ``__call__`` (issue 53, item 6).

A round's sampling in ``train_grpo.py`` (``GRPOTrainer.sample_round``: the prompts' encoding,
the SDE steps with their log-probabilities, each sample's own generator, the decode) against
the family's pipeline generating the same number of images from the same prompts at the same
steps, resolution and guidance, in the same process, side by side (warm-up call first, then
the best of ``REPEAT`` timed calls of each). Three settings: one process without DeepSpeed
(the sampler's own overhead: the goal is <= 1.1 x), one ZeRO-3 process (the engine's parameter
hooks), and 2 ZeRO-3 ranks (each samples half; every forward gathers the partitioned weights).
The tiny SD3 of ``make train-grpo``, and the same pipeline with a wider transformer (more time
in the model, less in Python) to show how the ratio moves with the model's share.

``python -m benchmarks.run --only sampler`` (or ``python -m benchmarks.bench_sampler``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, print_section, report, run_case
from diffusers_zero3.testing import DDP_ENV, ZERO3_ENV

PROMPTS = ("a red circle", "a blue square", "a green circle", "a yellow square")
GROUP, STEPS, RESOLUTION, GUIDANCE, REPEAT = 2, 10, 64, 4.5, 3
SETTINGS = (
    ("1 process, no DeepSpeed", 1, DDP_ENV, "replicate"),
    ("2 ranks, ZeRO-3", 2, ZERO3_ENV, "shard"),
)


def _best_in_turn(fns: list, repeat: int) -> list[float]:
    """The best of ``repeat`` timed calls of each of ``fns``, called in turn after a warm-up
    call of each (first-call allocations, lazy inits)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def sampler_and_pipeline(pipe_dir: str, out: str, placement: str) -> None:
    """On every rank: seconds per image of ``sample_round`` and of the pipeline's ``__call__``
    for this rank's share of a round. Collective (the trainer's setup and rounds)."""
    import torch

    from diffusers_zero3 import zero3_init_disabled
    from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer
    from diffusers_zero3.runtime.distributed import get_world_size

    settings = GRPOSettings.parse([
        "--pretrained_model_name_or_path", pipe_dir, "--reward", "diffusers_zero3.demo.rewards:redness",
        "--output_dir", out, "--prompts", *PROMPTS, "--group_size", str(GROUP), "--resolution", str(RESOLUTION),
        "--num_inference_steps", str(STEPS), "--guidance_scale", str(GUIDANCE),
        "--sample_batch_size", str(len(PROMPTS) * GROUP), "--train_batch_size", "2", "--max_train_steps", "1",
        "--report_to", "none", "--seed", "0", "--dead_rank_timeout", "0", "--reference_placement", placement,
    ])  # fmt: skip
    trainer = GRPOTrainer(settings)
    trainer.setup()
    per_rank = len(PROMPTS) * GROUP // get_world_size()
    rounds = iter(range(10_000))

    import diffusers

    with zero3_init_disabled():
        pipeline_class = getattr(diffusers, trainer.family.pipeline_class)
        pipeline = pipeline_class.from_pretrained(pipe_dir, torch_dtype=trainer.dtype)
    pipeline.to(trainer.accelerator.device)
    pipeline.set_progress_bar_config(disable=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(per_rank)]

    def generate() -> None:
        with torch.no_grad():
            pipeline(
                prompt=prompts, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=RESOLUTION,
                width=RESOLUTION, output_type="pt",
                generator=torch.Generator().manual_seed(0),  # CPU: the pipeline draws its noise on the host here
            )  # fmt: skip

    sampler_s, pipeline_s = (
        t / per_rank for t in _best_in_turn([lambda: trainer.sample_round(next(rounds)), generate], REPEAT)
    )
    report(sampler_s=sampler_s, pipeline_s=pipeline_s, images=per_rank)


def write_pipelines(work: Path) -> dict[str, Path]:
    """The tiny SD3 of ``make train-grpo`` and the same with a transformer 4 x wider."""
    import json
    import shutil

    from diffusers import SD3Transformer2DModel

    from diffusers_zero3.demo import prepare_default

    tiny, _ = prepare_default(work / "tiny", num_images=4, model="sd3")
    wide = work / "wide"
    shutil.copytree(tiny, wide)
    config = json.loads((wide / "transformer" / "config.json").read_text())
    heads = config["num_attention_heads"] * 4
    config.update(num_attention_heads=heads, caption_projection_dim=heads * config["attention_head_dim"])
    shutil.rmtree(wide / "transformer")
    SD3Transformer2DModel.from_config(
        {k: v for k, v in config.items() if not k.startswith("_")}
    ).save_pretrained(wide / "transformer")
    return {"tiny SD3": Path(tiny), "SD3, transformer 4 x wider": wide}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sampler-") as tmp:
        work = Path(tmp)
        for model, folder in write_pipelines(work).items():
            for label, world, env, placement in SETTINGS:
                results = run_case(
                    "benchmarks.bench_sampler:sampler_and_pipeline", world_size=world, env=env,
                    pipe_dir=str(folder), out=str(work / f"out-{len(rows)}"), placement=placement,
                )  # fmt: skip
                sampler = max(r["sampler_s"] for r in results)
                pipeline = max(r["pipeline_s"] for r in results)
                rows.append({
                    "model": model, "setting": label, "images per rank": results[0]["images"],
                    "sampler s / image": f"{sampler:.3f}", "pipeline s / image": f"{pipeline:.3f}",
                    "sampler vs pipeline (goal <= 1.1)": f"{sampler / pipeline:.2f}",
                })  # fmt: skip
    columns = ["model", "setting", "images per rank", "sampler s / image", "pipeline s / image",
               "sampler vs pipeline (goal <= 1.1)"]  # fmt: skip
    print_section(
        f"GRPO's sampler vs the pipeline's __call__ ({STEPS} steps, {RESOLUTION} px, guidance {GUIDANCE})",
        markdown_table(rows, columns),
    )


if __name__ == "__main__":
    main()
