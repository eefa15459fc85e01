"""scripts/train_text_to_image.py on Flux.1 and SD3 pipelines, 2 ZeRO-3 ranks: T5 sharded or
cached, EMA, exact resume, gradient checkpointing, and output pipelines that load and generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed_harness import (
    accelerate_launch,
    first_launches_fixture,
    first_run,
    resume_in_fresh_folder,
    run_launcher,
    step_values,
)

pytestmark = pytest.mark.e2e

SCRIPT = "scripts/train_text_to_image.py"
LAUNCH = accelerate_launch(SCRIPT)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def _common(pipe: str, data: str, steps: int) -> list[str]:
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--center_crop", "--random_flip", "--train_batch_size", "2", "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "none",
            "--max_sequence_length", "16"]  # fmt: skip


def _generates(out: Path, pipeline_class: str) -> None:
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == pipeline_class
    image = pipeline(
        "a red circle", num_inference_steps=2, height=32, width=32, max_sequence_length=16
    ).images[0]
    assert image.size == (32, 32)


def _flux_sharded_common(pipe: str, data: str) -> list[str]:
    return [*_common(pipe, data, 4), "--use_ema", "--checkpointing_steps", "2",
            "--text_encoder_placement", "replicate", "--text_encoder_2_placement", "shard",
            "--weighting_scheme", "logit_normal", "--guidance_scale", "2.5"]  # fmt: skip


def _flux_sharded_argv(request, folder):
    validation = ["--validation_prompts", "a red circle", "--validation_steps", "4",
                  "--num_validation_inference_steps", "2"]  # fmt: skip
    common = _flux_sharded_common(*request.getfixturevalue("tiny_flux"))
    return [*accelerate_launch(SCRIPT), *common, *validation, "--output_dir", str(folder / "run")]


def _flux_cached_argv(request, folder):
    from diffusers_zero3.demo import write_masked_shapes_dataset

    pipe, _ = request.getfixturevalue("tiny_flux")
    data = write_masked_shapes_dataset(folder / "masked", num_images=8)
    common = [arg if arg != "--train_data_dir" else "--dataset_name" for arg in _common(pipe, str(data), 2)]
    return [*accelerate_launch(SCRIPT), *common, "--output_dir", str(folder / "run"), "--text_encoder_placement",
            "cache", "--text_encoder_2_placement", "cache", "--gradient_checkpointing",
            "--use_aspect_ratio_buckets", "--aspect_ratio_buckets", "32,32;32,48;48,32", "--mask_column", "mask",
            "--validation_prompts", "a blue square", "--validation_steps", "2",
            "--num_validation_inference_steps", "2"]  # fmt: skip


def _sd3_common(pipe: str, data: str) -> list[str]:
    return [*_common(pipe, data, 3), "--text_encoder_3_placement", "shard", "--vae_placement", "cache",
            "--text_encoder_2_placement", "replicate"]  # fmt: skip


def _sd3_plain_argv(request, folder):
    common = _sd3_common(*request.getfixturevalue("tiny_sd3"))
    return [*accelerate_launch(SCRIPT), *common, "--output_dir", str(folder / "plain"), "--frozen_cache_dir",
            str(folder / "cache"), "--validation_prompts", "a red circle", "--validation_steps", "3",
            "--num_validation_inference_steps", "2"]  # fmt: skip


# Each test's first launch runs side by side with the other selected tests' (``first_runs``);
# a later launch (a resume, the run with gradient checkpointing) runs in its test.
first_runs = first_launches_fixture({
    "test_flux_t5_sharded_clip_replicated_ema_output_and_exact_resume": _flux_sharded_argv,
    "test_flux_t5_cached_aspect_ratio_buckets_and_masked_loss": _flux_cached_argv,
    "test_sd3_end_to_end_and_gradient_checkpointing_changes_nothing": _sd3_plain_argv,
})  # fmt: skip


def test_flux_t5_sharded_clip_replicated_ema_output_and_exact_resume(tiny_flux, first_runs, request):
    pipe, data = tiny_flux
    log, tmp_path = first_run(first_runs, request)
    out, common = tmp_path / "run", _flux_sharded_common(pipe, data)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    assert "text_encoder_2: shard, 0.05 MiB of 0.10 MiB on this rank" in log  # T5 held 1/N per rank
    assert "text_encoder: replicate" in log
    assert "FluxPipeline.from_pretrained" in log
    assert (out / "validation" / "step-000004.png").exists()

    # The output: a FluxPipeline that loads and generates; the (EMA) transformer was streamed
    # from the partitions and changed; the frozen components are the source's, byte for byte.
    _generates(out, "FluxPipeline")
    before, after = _state(Path(pipe) / "transformer"), _state(out / "transformer")
    assert before.keys() == after.keys() and all(after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for name in ("text_encoder", "text_encoder_2", "tokenizer_2", "vae", "scheduler"):
        assert _files(out / name) == _files(Path(pipe) / name), name

    # Resume from checkpoint-2 in a fresh folder: steps 3-4 and the final (EMA) weights
    # repeat the uninterrupted run's.
    resumed = tmp_path / "resumed"
    log2 = resume_in_fresh_folder([*LAUNCH, *common], out, resumed)
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    final = _state(resumed / "transformer")
    for k in after:
        torch.testing.assert_close(final[k], after[k], rtol=0, atol=1e-6, msg=k)


def test_flux_t5_cached_aspect_ratio_buckets_and_masked_loss(first_runs, request):
    """T5 and CLIP cached (encoded with T5 sharded, then freed), gradient checkpointing on, on a
    parquet dataset of landscape and portrait images in two buckets, with loss masks."""
    log, tmp_path = first_run(first_runs, request)
    out = tmp_path / "run"
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    assert "text_encoder_2: shard, 0.05 MiB of 0.10 MiB on this rank (to encode the cache as shard)" in log
    assert "encoding 8 rows with the frozen models" in log
    # each micro-batch one bucket: the packed sequence of a 32 x 48 image is not a square's
    assert "aspect-ratio buckets (height x width: images): 32x48: 4, 48x32: 4;" in log, log[-3000:]
    assert "loss masks: column 'mask'" in log
    assert (out / "validation" / "step-000002.png").exists()  # cached encoders reloaded for it
    _generates(out, "FluxPipeline")


def test_sd3_end_to_end_and_gradient_checkpointing_changes_nothing(tiny_sd3, first_runs, request):
    """SD3 with its T5 (text_encoder_3) sharded and the VAE cached; the same run with
    gradient checkpointing of the transformer gives the same losses and weights (after the
    first run: it reads the cache that run wrote)."""
    pipe, data = tiny_sd3
    log, tmp_path = first_run(first_runs, request)
    common = _sd3_common(pipe, data)
    plain, checkpointed = tmp_path / "plain", tmp_path / "gc"
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3], log[-3000:]
    assert "text_encoder_3: shard" in log and "StableDiffusion3Pipeline.from_pretrained" in log
    _generates(plain, "StableDiffusion3Pipeline")
    _, log_gc = run_launcher(
        [*LAUNCH, *common, "--output_dir", str(checkpointed), "--frozen_cache_dir", str(tmp_path / "cache"),
         "--gradient_checkpointing"],
        timeout=400,
    )  # fmt: skip
    losses_gc = step_values(log_gc)
    assert "gradient checkpointing of the transformer: on" in log_gc
    assert sorted(losses_gc) == [1, 2, 3], log_gc[-3000:]
    for step in losses:
        assert losses_gc[step] == pytest.approx(losses[step], abs=1e-5), (losses, losses_gc)
    a, b = _state(plain / "transformer"), _state(checkpointed / "transformer")
    before = _state(Path(pipe) / "transformer")
    assert any(not torch.equal(a[k], before[k]) for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
