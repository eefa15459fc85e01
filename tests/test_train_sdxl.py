"""scripts/train_text_to_image.py on an SDXL pipeline: 2 ZeRO-3 ranks, text_encoder_2 sharded,
the VAE cached, aspect-ratio buckets, EMA, checkpoints, exact resume on another number of
processes, and the output pipeline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import accelerate_launch, run_launcher, step_values

pytestmark = pytest.mark.e2e

LAUNCH = accelerate_launch("scripts/train_text_to_image.py")


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_sdxl_end_to_end_shard_cache_buckets_ema_and_exact_resume_on_one_process(tiny_sdxl, tmp_path):
    pipe, data = tiny_sdxl
    out = tmp_path / "run"
    common = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
              "--random_flip", "--train_batch_size", "2", "--max_train_steps", "4", "--learning_rate", "1e-3",
              "--lr_warmup_steps", "0", "--seed", "5", "--report_to", "none", "--use_ema",
              "--text_encoder_2_placement", "shard", "--vae_placement", "cache", "--checkpointing_steps", "2",
              "--proportion_empty_prompts", "0.2", "--timestep_bias_strategy", "later",
              "--timestep_bias_multiplier", "2", "--use_aspect_ratio_buckets",
              "--aspect_ratio_buckets", "32,32;24,40;40,24"]  # fmt: skip
    validation = ["--validation_prompts", "a red circle", "--validation_steps", "4",
                  "--num_validation_inference_steps", "2"]  # fmt: skip
    _, log = run_launcher([*LAUNCH, *common, *validation, "--output_dir", str(out)], timeout=400)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    # the 10 images of 5 shapes, each in the bucket nearest its aspect ratio that fits in it
    assert "aspect-ratio buckets (height x width: images): 32x32: 4, 24x40: 4, 40x24: 2;" in log, log[-3000:]
    assert "8 of 10 images per epoch in batches of 4" in log
    assert "StableDiffusionXLPipeline.from_pretrained" in log
    assert (out / "validation" / "step-000004.png").exists()

    # The output: an SDXL pipeline that loads and generates; the EMA UNet was streamed from
    # the partitions; the second text encoder and tokenizer are the source's, unchanged.
    from diffusers import DiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel

    pipeline = DiffusionPipeline.from_pretrained(out)
    assert isinstance(pipeline, StableDiffusionXLPipeline)
    image = pipeline("a red circle", num_inference_steps=2, height=32, width=32).images[0]
    assert image.size == (32, 32)
    before = UNet2DConditionModel.from_pretrained(pipe, subfolder="unet")
    assert any(not torch.equal(a, b) for a, b in zip(pipeline.unet.parameters(), before.parameters()))
    for name in ("text_encoder_2", "tokenizer_2", "vae"):
        assert _files(out / name) == _files(Path(pipe) / name), name

    # Resume from checkpoint-2 in a fresh folder on 1 process of 4 samples (the same global
    # batch as 2 x 2): the bucket position goes on at each bucket's first unseen sample, so the
    # cached latents, each sample's noise and the re-cut optimizer state give steps 3-4 the
    # uninterrupted run's losses (a mean of 4 instead of 2 x 2: equal to float rounding).
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    one = [
        *accelerate_launch("scripts/train_text_to_image.py", num_processes=1),
        *common,
        "--train_batch_size",
        "4",
    ]
    _, log2 = run_launcher(
        [*one, "--output_dir", str(resumed), "--frozen_cache_dir", str(out / "frozen_cache"),
         "--resume_from_checkpoint", "latest"],
        timeout=400,
    )  # fmt: skip
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    assert "reusing the frozen-model cache" in log2
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=1e-5), (step, again, losses)
