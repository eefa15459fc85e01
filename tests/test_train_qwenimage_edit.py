"""scripts/train_text_to_image.py on Qwen-Image-Edit-Plus, 2 ZeRO-3 ranks: a folder of editing
pairs, Qwen2.5-VL sharded (it reads each step's source images, so it cannot be cached: refused),
EMA, a checkpoint and an exact resume, and an output pipeline that
``DiffusionPipeline.from_pretrained`` loads and that edits an image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed_harness import accelerate_launch, resume_in_fresh_folder, run_launcher, step_values

pytestmark = pytest.mark.e2e

LAUNCH = accelerate_launch("scripts/train_text_to_image.py")


def test_vl_sharded_reads_the_sources_ema_checkpoint_exact_resume_and_an_output_that_edits(
    tiny_qwenimage_edit, tmp_path
):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from diffusers_zero3.demo import shape_image
    from diffusers_zero3.families import QWENIMAGE_EDIT

    pipe, data = tiny_qwenimage_edit
    common = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
              "--center_crop", "--random_flip", "--train_batch_size", "2", "--max_train_steps", "4",
              "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "none",
              "--max_sequence_length", "16", "--use_ema", "--checkpointing_steps", "2",
              "--text_encoder_placement", "shard", "--vae_placement", "replicate"]  # fmt: skip
    out = tmp_path / "run"
    validation = ["--validation_prompts", "make the circle blue", "--validation_steps", "4",
                  "--num_validation_inference_steps", "2", "--validation_image", f"{pipe}-source.png"]  # fmt: skip
    _, log = run_launcher([*LAUNCH, *common, *validation, "--output_dir", str(out)], timeout=400)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    assert "text_encoder: shard" in log and "editing pairs: 1 source image(s) per target" in log
    assert (out / "validation" / "step-000004.png").exists()

    # The output loads (its processor class from diffusers_zero3) and edits; the EMA transformer changed.
    pipeline = QWENIMAGE_EDIT.prepare_validation_pipeline(DiffusionPipeline.from_pretrained(out), 32)
    assert type(pipeline._pipeline).__name__ == "QwenImageEditPlusPipeline"
    pipeline.set_progress_bar_config(disable=True)
    edited = pipeline(
        image=shape_image("red", "circle"), prompt="make the circle blue", num_inference_steps=2
    )
    assert edited.images[0].size == (32, 32)
    weights = "diffusion_pytorch_model.safetensors"
    before, after = load_file(f"{pipe}/transformer/{weights}"), load_file(str(out / "transformer" / weights))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for component in ("text_encoder", "vae", "processor", "tokenizer"):
        assert sorted(p.name for p in (out / component).iterdir()) == sorted(
            p.name for p in (Path(pipe) / component).iterdir()
        ), component

    # Resumed from checkpoint-2 in a fresh folder: steps 3-4 and the final EMA weights repeat.
    resumed = tmp_path / "resumed"
    log2 = resume_in_fresh_folder([*LAUNCH, *common], out, resumed)
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    final = load_file(str(resumed / "transformer" / weights))
    for k in after:
        torch.testing.assert_close(final[k], after[k], rtol=0, atol=1e-6, msg=k)
