"""scripts/train_text_to_image.py on Flux.2 [klein] with reference images, 2 ZeRO-3 ranks: the
text-to-image pipeline given a folder of editing pairs trains its editing variant (Qwen3
sharded, each step's sources encoded by the VAE), validates by editing ``--validation_image``,
and writes an output pipeline that ``DiffusionPipeline.from_pretrained`` loads and that edits
an image (``image=``)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import accelerate_launch, run_launcher, step_values

pytestmark = pytest.mark.e2e

LAUNCH = accelerate_launch("scripts/train_text_to_image.py")


def test_klein_trains_editing_pairs_and_its_output_edits(tiny_flux2_klein, tmp_path):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from diffusers_zero3.demo import shape_image
    from diffusers_zero3.demo.edits import write_edit_pairs

    pipe, _ = tiny_flux2_klein
    # 64 px: Flux2KleinPipeline refuses reference images with a side under 64
    pairs = write_edit_pairs(tmp_path / "pairs", num_pairs=4, size=64)
    source = tmp_path / "source.png"
    shape_image("red", "circle", 64).save(source)
    out = tmp_path / "run"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", pipe, "--train_data_dir", str(pairs), "--resolution", "64",
            "--train_batch_size", "1", "--max_train_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_steps", "0",
            "--seed", "3", "--report_to", "none", "--max_sequence_length", "16", "--text_encoder_placement", "shard",
            "--vae_placement", "replicate", "--validation_prompts", "make the circle blue", "--validation_steps", "2",
            "--num_validation_inference_steps", "2", "--validation_image", str(source), "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=400)
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    assert "text_encoder: shard" in log and "editing pairs: 1 source image(s) per target" in log
    assert (out / "validation" / "step-000002.png").exists()

    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == "Flux2KleinPipeline"
    pipeline.set_progress_bar_config(disable=True)
    edits = [
        pipeline(
            image=shape_image(colour, "circle", 64),
            prompt="make the circle blue",
            num_inference_steps=2,
            height=64,
            width=64,
            max_sequence_length=16,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        ).images  # fmt: skip
        for colour in ("red", "green")
    ]
    assert edits[0].shape == (1, 4, 32, 32) and not torch.allclose(edits[0], edits[1])  # the source matters
    weights = "diffusion_pytorch_model.safetensors"
    before, after = load_file(f"{pipe}/transformer/{weights}"), load_file(str(out / "transformer" / weights))
    assert any(not torch.equal(before[k], after[k]) for k in before)
