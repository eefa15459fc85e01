"""scripts/train_text_to_image.py on HunyuanVideo 1.5 clips, 2 ZeRO-3 ranks: both encoders
(Qwen2.5-VL and ByT5) sharded with EMA, a checkpoint, an exact resume, a validation video and an
output that ``DiffusionPipeline.from_pretrained`` loads and that generates a video; then both
encoders cached with LoRA that the transformer's ``load_lora_adapter`` loads (the pipeline class
has no ``load_lora_weights``: ``training.lora.load_lora_into``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed_harness import (
    accelerate_launch,
    first_launches_fixture,
    first_run,
    resume_in_fresh_folder,
    step_values,
)

pytestmark = pytest.mark.e2e

SCRIPT = "scripts/train_text_to_image.py"
LAUNCH = accelerate_launch(SCRIPT)
ENCODERS = ("text_encoder", "text_encoder_2")


def _common(pipe: str, data: str, steps: int, placement: str) -> list[str]:
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--center_crop", "--num_frames", "5", "--train_batch_size", "1", "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "none",
            "--max_sequence_length", "16", *(a for e in ENCODERS for a in (f"--{e}_placement", placement))]  # fmt: skip


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))


def _generate(pipeline, **kwargs):
    from diffusers_zero3.families import HUNYUANVIDEO15

    pipeline.set_progress_bar_config(disable=True)
    pipeline.tokenizer_max_length = 16  # the training's --max_sequence_length
    return pipeline("a red circle moving right", num_inference_steps=2, height=32, width=32,
                    **{**HUNYUANVIDEO15.validation_kwargs(16, None), **kwargs}).frames  # fmt: skip


def _sharded_common(pipe: str, data: str) -> list[str]:
    return [*_common(pipe, data, 4, "shard"), "--random_flip", "--use_ema", "--checkpointing_steps", "2"]


def _sharded_argv(request, folder):
    validation = ["--validation_prompts", 'a sign that reads "OPEN"', "--validation_steps", "4",
                  "--num_validation_inference_steps", "2"]  # fmt: skip
    common = _sharded_common(*request.getfixturevalue("tiny_hunyuanvideo15"))
    return [*accelerate_launch(SCRIPT), *common, *validation, "--output_dir", str(folder / "run")]


def _lora_argv(request, folder):
    pipe, data = request.getfixturevalue("tiny_hunyuanvideo15")
    return [*accelerate_launch(SCRIPT), *_common(pipe, data, 2, "cache"), "--rank", "4", "--output_dir",
            str(folder / "lora")]  # fmt: skip


# The two tests' first launches run side by side (``first_runs``); the resume runs in its test.
first_runs = first_launches_fixture({
    "test_encoders_sharded_ema_checkpoint_exact_resume_and_output": _sharded_argv,
    "test_encoders_cached_and_lora_loads_in_the_transformer": _lora_argv,
})  # fmt: skip


def test_encoders_sharded_ema_checkpoint_exact_resume_and_output(tiny_hunyuanvideo15, first_runs, request):
    from diffusers import DiffusionPipeline

    pipe, data = tiny_hunyuanvideo15
    log, tmp_path = first_run(first_runs, request)
    out, common = tmp_path / "run", _sharded_common(pipe, data)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    assert "text_encoder: shard" in log and "text_encoder_2: shard" in log, log[-3000:]
    assert "HunyuanVideo15Pipeline.from_pretrained" in log
    assert (out / "validation" / "step-000004-0.mp4").stat().st_size > 0
    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == "HunyuanVideo15Pipeline"
    frames = _generate(pipeline)[0]
    assert len(frames) == 5 and frames[0].size == (32, 32)
    before, after = _weights(Path(pipe)), _weights(out)
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    for component in ("text_encoder_2", "tokenizer_2", "guider", "vae"):  # frozen parts: the source's
        source = sorted(p.relative_to(Path(pipe) / component) for p in (Path(pipe) / component).rglob("*"))
        assert source == sorted(p.relative_to(out / component) for p in (out / component).rglob("*"))

    resumed = tmp_path / "resumed"
    log2 = resume_in_fresh_folder([*LAUNCH, *common], out, resumed)
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    final = _weights(resumed)
    for k in after:
        torch.testing.assert_close(final[k], after[k], rtol=0, atol=1e-6, msg=k)


def test_encoders_cached_and_lora_loads_in_the_transformer(tiny_hunyuanvideo15, first_runs, request):
    from diffusers import DiffusionPipeline

    from diffusers_zero3.families import HUNYUANVIDEO15
    from diffusers_zero3.training.lora import load_lora_into

    pipe = tiny_hunyuanvideo15[0]
    log, tmp_path = first_run(first_runs, request)
    out = tmp_path / "lora"
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    assert "frozen-model cache:" in log and "(to encode the cache as shard)" in log, log[-3000:]
    pipeline = DiffusionPipeline.from_pretrained(pipe)
    assert not hasattr(pipeline, "load_lora_weights")
    seed = {"generator": torch.Generator().manual_seed(0), "output_type": "latent"}
    base = _generate(pipeline, **seed)
    load_lora_into(pipeline, HUNYUANVIDEO15, out)
    loaded = [n for n, _ in pipeline.transformer.named_parameters() if "lora_" in n]
    targets = [
        n for n, m in pipeline.transformer.named_modules() if n.endswith(HUNYUANVIDEO15.lora_target_modules)
    ]
    assert targets and len(loaded) == 2 * len(targets)
    adapted = _generate(pipeline, generator=torch.Generator().manual_seed(0), output_type="latent")
    assert not torch.allclose(base, adapted)  # the trained adapters reach the transformer
