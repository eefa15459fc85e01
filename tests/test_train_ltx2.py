"""scripts/train_text_to_image.py on LTX-2 clips with their sound, 2 ZeRO-3 ranks: every frozen
component sharded (Gemma 3, connectors, audio VAE, vocoder, video VAE) with EMA, a checkpoint,
an exact resume, a validation mp4 with an audio stream and an output that
``DiffusionPipeline.from_pretrained`` loads and that generates video with sound; then the text
encoder cached (the connectors' outputs: the connectors are cached with it) with LoRA that the
pipeline's ``load_lora_weights`` loads. The clips carry a tone each, one of them none (that clip
trains video only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed_harness import (
    accelerate_launch,
    resume_in_fresh_folder,
    run_launchers_side_by_side,
    step_values,
)

pytestmark = pytest.mark.e2e

LAUNCH = accelerate_launch("scripts/train_text_to_image.py")
FROZEN = ("text_encoder", "connectors", "audio_vae", "vocoder", "vae")


def _common(pipe: str, data: str, steps: int, placements: dict[str, str]) -> list[str]:
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--center_crop", "--num_frames", "5", "--train_batch_size", "2", "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "none",
            "--max_sequence_length", "16", *(a for n, p in placements.items() for a in (f"--{n}_placement", p))]  # fmt: skip


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))


def _generate(pipeline, **kwargs):
    pipeline.set_progress_bar_config(disable=True)
    return pipeline("a red circle moving right", num_inference_steps=2, height=32, width=32, num_frames=5,
                    max_sequence_length=16, **kwargs)  # fmt: skip


def test_every_frozen_model_sharded_with_an_exact_resume_and_gemma_cached_with_lora(tiny_ltx2, tmp_path):
    """Two independent runs side by side (one launch costs mostly start-up): every frozen model
    sharded with EMA, then its resume; Gemma cached with LoRA."""
    import av
    from diffusers import DiffusionPipeline

    from diffusers_zero3.families import LTX2

    pipe, data = tiny_ltx2
    out, lora = tmp_path / "run", tmp_path / "lora"
    common = [
        *_common(pipe, data, 4, dict.fromkeys(FROZEN, "shard")),
        "--use_ema",
        "--checkpointing_steps",
        "2",
    ]
    validation = ["--validation_prompts", "a red circle", "--validation_steps", "4",
                  "--num_validation_inference_steps", "2"]  # fmt: skip
    cached = {"text_encoder": "cache", "audio_vae": "replicate", "vocoder": "replicate", "vae": "replicate"}
    (_, log), (_, lora_log) = run_launchers_side_by_side(
        [{"argv": [*LAUNCH, *common, *validation, "--output_dir", str(out)]},
         {"argv": [*LAUNCH, *_common(pipe, data, 2, cached), "--rank", "4", "--output_dir", str(lora)]}],
        timeout=400,
    )  # fmt: skip

    # every frozen model sharded: the validation mp4 has sound, the output generates video with sound
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    for name in FROZEN:
        assert f"{name}: shard" in log, (name, log[-3000:])
    video = out / "validation" / "step-000004-0.mp4"
    with av.open(str(video)) as container:  # the validation video carries its sound
        assert len(container.streams.video) == 1 and len(container.streams.audio) == 1
    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == "LTX2Pipeline"
    generated = _generate(pipeline, output_type="np")
    assert generated.frames.shape == (1, 5, 32, 32, 3) and generated.audio.shape[:2] == (1, 2)
    before, after = _weights(Path(pipe)), _weights(out)
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    for component in ("connectors", "audio_vae", "vocoder", "vae", "tokenizer"):  # frozen parts: the source's
        source = sorted(p.relative_to(Path(pipe) / component) for p in (Path(pipe) / component).rglob("*"))
        assert source == sorted(p.relative_to(out / component) for p in (out / component).rglob("*"))

    # Gemma cached (the connectors with it): the LoRA loads with load_lora_weights, on both streams
    assert sorted(step_values(lora_log)) == [1, 2], lora_log[-3000:]
    assert "frozen-model cache:" in lora_log and "connectors: " in lora_log, lora_log[-3000:]
    base_pipeline = DiffusionPipeline.from_pretrained(pipe)
    base = _generate(base_pipeline, generator=torch.Generator().manual_seed(0), output_type="latent")
    base_pipeline.load_lora_weights(lora)
    loaded = [n for n, _ in base_pipeline.transformer.named_parameters() if "lora_" in n]
    targets = [
        n for n, m in base_pipeline.transformer.named_modules() if n.endswith(LTX2.lora_target_modules)
    ]
    assert targets and len(loaded) == 2 * len(targets)
    adapted = _generate(base_pipeline, generator=torch.Generator().manual_seed(0), output_type="latent")
    assert not torch.allclose(base.frames, adapted.frames)  # the trained adapters reach the transformer
    assert not torch.allclose(base.audio, adapted.audio)  # and its audio stream

    # resumed from checkpoint-2 in a fresh folder: steps 3-4 and the final EMA weights repeat
    resumed = tmp_path / "resumed"
    log2 = resume_in_fresh_folder([*LAUNCH, *common], out, resumed)
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    final = _weights(resumed)
    for k in after:
        torch.testing.assert_close(final[k], after[k], rtol=0, atol=1e-6, msg=k)
