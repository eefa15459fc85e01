"""scripts/train_text_to_image.py on video (Wan), 2 ZeRO-3 ranks, umT5 sharded: Wan 2.1 with
EMA, a checkpoint, an exact resume, validation videos and an output that loads and generates,
and LoRA from cached clips that WanPipeline.load_lora_weights reads; Wan 2.2 with both experts,
each its own engine (exact resume of both), and with either expert alone (the other copied byte
for byte; the low-noise one with EMA and an exact resume). Bad video flags:
tests/test_bad_input.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import (
    accelerate_launch,
    resume_in_fresh_folder,
    run_launcher,
    run_launchers_side_by_side,
    step_values,
)

pytestmark = pytest.mark.e2e

LAUNCH = accelerate_launch("scripts/train_text_to_image.py")


def _common(pipe: str, data: str, steps: int = 4) -> list[str]:
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--center_crop", "--random_flip", "--num_frames", "5", "--train_batch_size", "1",
            "--max_train_steps", str(steps), "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3",
            "--report_to", "none", "--max_sequence_length", "16", "--text_encoder_placement", "shard"]  # fmt: skip


def _weights(folder: Path, component: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next((folder / component).glob("*.safetensors"))))


def _generate(folder) -> list:
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(folder)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline("a red circle moving right", num_inference_steps=2, height=32, width=32, num_frames=5,
                    max_sequence_length=16).frames[0]  # fmt: skip


def test_wan21_umt5_sharded_ema_videos_buckets_exact_resume_and_output(tiny_wan, tmp_path):
    """On landscape and portrait clips in two (frames, height, width) buckets, with loss masks."""
    from diffusers_zero3.data.video import write_shapes_videos

    pipe, _ = tiny_wan
    folder = write_shapes_videos(tmp_path / "clips", num_clips=8, frames=7, sizes=[(48, 32), (32, 48)])
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    # each clip its own loss mask (a clip of grey levels: its luminance)
    (folder / "metadata.jsonl").write_text(
        "".join(json.dumps({**r, "mask": r["file_name"]}) + "\n" for r in rows)
    )
    data = str(folder)
    out = tmp_path / "run"
    common = [*_common(pipe, data), "--use_ema", "--checkpointing_steps", "2", "--use_aspect_ratio_buckets",
              "--aspect_ratio_buckets", "5,32,48;5,48,32", "--mask_column", "mask"]  # fmt: skip
    validation = ["--validation_prompts", "a red circle moving right", "--validation_steps", "4",
                  "--num_validation_inference_steps", "2"]  # fmt: skip
    _, log = run_launcher([*LAUNCH, *common, *validation, "--output_dir", str(out)], timeout=400)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    assert "text_encoder: shard" in log and "WanPipeline.from_pretrained" in log
    assert "aspect-ratio buckets (frames x height x width: clips): 5x32x48: 4, 5x48x32: 4;" in log, log[
        -3000:
    ]
    assert (out / "validation" / "step-000004-0.mp4").stat().st_size > 0
    from PIL import Image

    assert Image.open(out / "validation" / "step-000004.png").size == (5 * 32, 32)  # the clip's 5 frames
    frames = _generate(out)
    assert len(frames) == 5
    # the model card's snippet runs as printed: validation's 2 steps, its frames written as a GIF
    from tests.common import run_card_snippet

    (tmp_path / "card").mkdir()
    scope = run_card_snippet(out, tmp_path / "card")
    assert scope["frames"][0].size == (32, 32) and (tmp_path / "card" / "video.gif").exists()
    before, after = _weights(Path(pipe), "transformer"), _weights(out, "transformer")
    assert any(not torch.equal(before[k], after[k]) for k in before)

    resumed = tmp_path / "resumed"
    log2 = resume_in_fresh_folder([*LAUNCH, *common], out, resumed)
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    final = _weights(resumed, "transformer")
    for k in after:
        torch.testing.assert_close(final[k], after[k], rtol=0, atol=1e-6, msg=k)


def test_wan21_lora_from_cached_clips_equals_live_and_loads_in_the_pipeline(tiny_wan, tmp_path):
    """umT5 and the video VAE cached (each clip encoded once, as epoch 0 reads it) train the same
    losses as both live (without --random_flip: the cache draws its orientation from the sample's
    generator, live training from the crop's); the LoRA file loads in WanPipeline."""
    from diffusers import DiffusionPipeline

    from diffusers_zero3.families import WAN

    pipe, data = tiny_wan
    out = tmp_path / "lora"
    lora = [a for a in [*LAUNCH, *_common(pipe, data, 2), "--rank", "4"] if a != "--random_flip"]
    cached = ["--text_encoder_placement", "cache", "--vae_placement", "cache"]
    live = [*accelerate_launch("scripts/train_text_to_image.py"), *lora[len(LAUNCH) :]]  # a port of its own
    (_, log), (_, live_log) = run_launchers_side_by_side(  # cached and live, side by side
        [{"argv": [*lora, *cached, "--output_dir", str(out)]},
         {"argv": [*live, "--output_dir", str(tmp_path / "live")]}],
        timeout=400,
    )  # fmt: skip
    losses = step_values(log)
    assert sorted(losses) == [1, 2] and "frozen-model cache:" in log and "MiB per row" in log, log[-3000:]
    live = step_values(live_log)  # the live run's losses
    assert "vae: replicate" in live_log and "frozen-model cache" not in live_log, live_log[-3000:]
    for step in (1, 2):
        assert losses[step] == pytest.approx(live[step], abs=1e-5), (losses, live)
    pipeline = DiffusionPipeline.from_pretrained(pipe)
    pipeline.load_lora_weights(out)
    loaded = [n for n, _ in pipeline.transformer.named_parameters() if "lora_" in n]
    targets = [n for n, m in pipeline.transformer.named_modules() if n.endswith(WAN.lora_target_modules)]
    assert targets and len(loaded) == 2 * len(targets)


def test_wan22_both_experts_two_engines_exact_resume_and_one_expert_alone(tiny_wan22, tmp_path):
    pipe, data = tiny_wan22
    out = tmp_path / "both"
    common = [*_common(pipe, data), "--use_ema", "--checkpointing_steps", "2", "--train_experts", "both"]
    _, log = run_launcher([*LAUNCH, *common, "--output_dir", str(out)], timeout=400)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    assert "experts trained: transformer, transformer_2 (boundary at timestep 875)" in log
    assert (out / "checkpoint-2" / "transformer_2").is_dir()  # the low-noise expert's own engine
    for expert in ("transformer", "transformer_2"):
        before, after = _weights(Path(pipe), expert), _weights(out, expert)
        assert any(not torch.equal(before[k], after[k]) for k in before), expert  # both were trained
    assert len(_generate(out)) == 5

    # Resumed from checkpoint-2 in a fresh folder, beside the high-noise expert trained alone.
    resumed, high = tmp_path / "resumed", tmp_path / "high"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    (_, log2), (_, log3) = run_launchers_side_by_side(
        [{"argv": [*LAUNCH, *common, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"]},
         {"argv": [*accelerate_launch("scripts/train_text_to_image.py"), *_common(pipe, data, 2),
                   "--train_experts", "high", "--output_dir", str(high)]}],
        timeout=400,
    )  # fmt: skip
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    for expert in ("transformer", "transformer_2"):
        final, after = _weights(resumed, expert), _weights(out, expert)
        for k in after:
            torch.testing.assert_close(final[k], after[k], rtol=0, atol=1e-6, msg=f"{expert} {k}")

    # The high-noise expert alone: the low-noise one is not loaded and goes out byte for byte.
    assert "experts trained: transformer (boundary" in log3, log3[-3000:]
    low_file = next((Path(pipe) / "transformer_2").glob("*.safetensors"))
    assert (high / "transformer_2" / low_file.name).read_bytes() == low_file.read_bytes()
    before, after = _weights(Path(pipe), "transformer"), _weights(high, "transformer")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_wan22_low_noise_expert_alone_ema_exact_resume_and_high_copied(tiny_wan22, tmp_path):
    """The other single-expert mode: transformer_2 trained as the job's denoiser (EMA, a
    checkpoint, an exact resume), the high-noise expert never loaded and copied byte for byte."""
    pipe, data = tiny_wan22
    out = tmp_path / "low"
    common = [*_common(pipe, data), "--use_ema", "--checkpointing_steps", "2", "--train_experts", "low"]
    _, log = run_launcher([*LAUNCH, *common, "--output_dir", str(out)], timeout=400)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4] and "experts trained: transformer_2 (boundary" in log, log[-3000:]
    high_file = next((Path(pipe) / "transformer").glob("*.safetensors"))
    assert (out / "transformer" / high_file.name).read_bytes() == high_file.read_bytes()
    before, after = _weights(Path(pipe), "transformer_2"), _weights(out, "transformer_2")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert len(_generate(out)) == 5

    resumed = tmp_path / "resumed"
    again = step_values(resume_in_fresh_folder([*LAUNCH, *common], out, resumed))
    assert sorted(again) == [3, 4]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    final = _weights(resumed, "transformer_2")
    for k in after:
        torch.testing.assert_close(final[k], after[k], rtol=0, atol=1e-6, msg=k)
    assert (resumed / "transformer" / high_file.name).read_bytes() == high_file.read_bytes()
