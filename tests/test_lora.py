"""LoRA under ZeRO-3: adapters on a partitioned base, gathered into diffusers' LoRA format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusers_zero3.training.lora import LORA_WEIGHT_NAME
from tests.distributed_harness import (
    accelerate_launch,
    first_launches_fixture,
    first_run,
    resume_in_fresh_folder,
    run_on_ranks,
    step_values,
)

SCRIPT = "scripts/train_text_to_image.py"
LAUNCH = accelerate_launch(SCRIPT)


def _fresh_adapters(unet, seed: int | None) -> dict[str, torch.Tensor]:
    """The initial adapters ``add_lora_adapters`` gives a copy of ``unet`` with ``seed``."""
    import copy

    from diffusers_zero3.families import SD
    from diffusers_zero3.training.lora import add_lora_adapters

    copied = copy.deepcopy(unet)
    add_lora_adapters(copied, rank=4, target_modules=SD.lora_target_modules, seed=seed)
    return {n: p.detach() for n, p in copied.named_parameters() if "lora_" in n}


def worker_lora_save(pipe_dir: str, out: str):
    from peft.utils import get_peft_model_state_dict

    from diffusers_zero3 import gathered_parameters, get_rank
    from diffusers_zero3.families import SD
    from diffusers_zero3.training.job import load_trainable_denoiser
    from diffusers_zero3.training.lora import LORA_WEIGHT_NAME, add_lora_adapters, save_lora_zero3
    from tests.common import accelerator_with_zero3

    torch.manual_seed(0)
    accelerator = accelerator_with_zero3(zero3_init_flag=True)
    unet = load_trainable_denoiser(accelerator, pipe_dir, SD)
    # Seeded adapters start as a whole model's in one process, whatever the RNG went through
    # before (the partitioned load here, another process count); unseeded ones do not.
    from diffusers import UNet2DConditionModel

    from diffusers_zero3 import zero3_init_disabled

    with zero3_init_disabled():
        plain = UNet2DConditionModel.from_pretrained(pipe_dir, subfolder="unet")
    histories = []
    for history in (1, 2):  # the control: unseeded adapters carry the RNG's history
        torch.manual_seed(history)
        histories.append(_fresh_adapters(plain, None))
    assert not all(torch.equal(histories[0][n], histories[1][n]) for n in histories[0] if "lora_A" in n)
    seeded = _fresh_adapters(plain, 11)
    params = add_lora_adapters(unet, rank=4, target_modules=SD.lora_target_modules, seed=11)
    initial = {n: p for n, p in unet.named_parameters() if "lora_" in n}
    assert initial.keys() == seeded.keys()
    assert all(torch.equal(initial[n], seeded[n]) for n in initial)
    base_numel = sum(p.ds_numel for n, p in unet.named_parameters() if "lora_" not in n)
    lora_numel = sum(p.numel() for p in params)
    assert all(not p.requires_grad for n, p in unet.named_parameters() if "lora_" not in n)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    # The optimizer's fp32 master partitions are the adapters' alone (1/N of them).
    fp32 = sum(g.numel() for g in optimizer.optimizer.fp32_partitioned_groups_flat)
    assert lora_numel / 2 <= fp32 <= lora_numel / 2 + 64 * len(params), (fp32, lora_numel, base_numel)
    g = torch.Generator().manual_seed(get_rank())
    latents, states = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g)
    for _ in range(2):  # lora_B starts at zero: train it away from zero
        loss = unet(latents, torch.tensor([10, 500]), states).sample.pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    module = unet.module
    # Upstream's empty LoRA: reading partitioned adapters without a gather gives shape [0].
    assert all(t.numel() == 0 for t in get_peft_model_state_dict(module).values())
    lora = {n: p for n, p in module.named_parameters() if "lora_" in n}
    with gathered_parameters(list(lora.values())):
        trained = {n.replace(".default", ""): p.detach().clone() for n, p in lora.items()}
    assert any(n.endswith("lora_B.weight") and t.abs().sum() > 0 for n, t in trained.items())
    path = save_lora_zero3(unet, SD, out)
    assert path.name == LORA_WEIGHT_NAME

    if get_rank() == 0:
        from diffusers import StableDiffusionPipeline
        from safetensors.torch import load_file

        saved = load_file(str(path))
        assert len(saved) == len(trained) and all(t.numel() > 0 for t in saved.values())
        pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, safety_checker=None)
        pipe.set_progress_bar_config(disable=True)
        base_image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                          generator=torch.Generator().manual_seed(0)).images  # fmt: skip
        pipe.load_lora_weights(out)
        loaded = {n.replace(".default_0", ""): p for n, p in pipe.unet.named_parameters() if "lora_" in n}
        assert loaded.keys() == trained.keys()
        for n, t in trained.items():
            torch.testing.assert_close(loaded[n], t, rtol=0, atol=0, msg=n)
        lora_image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                          generator=torch.Generator().manual_seed(0)).images  # fmt: skip
        assert abs(lora_image - base_image).max() > 1e-3
    print("OK lora")


@pytest.mark.multirank
def test_lora_on_a_partitioned_unet_saves_gathered_adapters_that_load(tiny_pipeline, tmp_path):
    outs = run_on_ranks(worker_lora_save, pipe_dir=tiny_pipeline, out=str(tmp_path / "out"))
    assert all("OK lora" in o for o in outs)


# --------------------------------------------------------------------------- the script, end to end


def _lora_image(base: str, lora_dir: str | None, **kwargs):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
    return pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0), **kwargs).images  # fmt: skip


def _sd_common(pipe: str, data: str) -> list[str]:
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--center_crop", "--train_batch_size", "2", "--max_train_steps", "4", "--learning_rate", "1e-2",
            "--lr_warmup_steps", "0", "--seed", "4", "--report_to", "none", "--rank", "4", "--use_ema",
            "--checkpointing_steps", "2", "--text_encoder_placement", "shard"]  # fmt: skip


def _sd_argv(request, folder):
    pipe, data, _ = request.getfixturevalue("default_data")
    return [*accelerate_launch(SCRIPT), *_sd_common(pipe, data), "--output_dir", str(folder / "run")]


def _flux_argv(request, folder):
    pipe, data = request.getfixturevalue("tiny_flux")
    return [*accelerate_launch(SCRIPT), "--pretrained_model_name_or_path", pipe, "--train_data_dir", data,
            "--resolution", "32", "--center_crop", "--train_batch_size", "2", "--max_train_steps", "3",
            "--learning_rate", "1e-2", "--lr_warmup_steps", "0", "--seed", "4", "--report_to", "none", "--rank", "4",
            "--text_encoder_2_placement", "shard", "--max_sequence_length", "16", "--output_dir", str(folder / "run"),
            "--validation_prompts", "a red circle", "--validation_steps", "3",
            "--num_validation_inference_steps", "2"]  # fmt: skip


# The two script tests' first launches run side by side (``first_runs``); the resume runs in its test.
first_runs = first_launches_fixture({
    "test_sd_lora_script_ema_exact_resume_and_output_that_loads": _sd_argv,
    "test_flux_lora_script_with_t5_sharded": _flux_argv,
})  # fmt: skip


@pytest.mark.e2e
def test_sd_lora_script_ema_exact_resume_and_output_that_loads(default_data, first_runs, request):
    from safetensors.torch import load_file

    pipe, data, _ = default_data
    log, tmp_path = first_run(first_runs, request)
    out, common = tmp_path / "run", _sd_common(pipe, data)
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    assert "LoRA rank 4 on to_k, to_q, to_v, to_out.0" in log
    assert (out / LORA_WEIGHT_NAME).exists() and not (out / "model_index.json").exists()
    saved = load_file(str(out / LORA_WEIGHT_NAME))
    assert saved and all(t.numel() > 0 for t in saved.values())
    assert all(k.startswith("unet.") for k in saved)
    # A checkpoint holds the adapters' optimizer state, not a copy of the UNet's.
    ckpt_bytes = sum(p.stat().st_size for p in (out / "checkpoint-2").rglob("*optim_states.pt"))
    unet_bytes = (Path(pipe) / "unet" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert ckpt_bytes < 0.2 * unet_bytes, (ckpt_bytes, unet_bytes)
    # Loaded into the base pipeline, the adapters change the image at the same seed.
    assert abs(_lora_image(pipe, str(out)) - _lora_image(pipe, None)).max() > 1e-3

    resumed = tmp_path / "resumed"
    log2 = resume_in_fresh_folder([*LAUNCH, *common], out, resumed)
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    final = load_file(str(resumed / LORA_WEIGHT_NAME))
    for k in saved:
        torch.testing.assert_close(final[k], saved[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.e2e
def test_flux_lora_script_with_t5_sharded(tiny_flux, first_runs, request):
    pipe = tiny_flux[0]
    log, tmp_path = first_run(first_runs, request)
    out = tmp_path / "run"
    assert sorted(step_values(log)) == [1, 2, 3], log[-3000:]
    assert "ff_context.net.2" in log  # the Flux LoRA script's targets
    assert (out / "validation" / "step-000003.png").exists()
    base = _lora_image(pipe, None, max_sequence_length=16)
    assert abs(_lora_image(pipe, str(out), max_sequence_length=16) - base).max() > 1e-3


# --------------------------------------------------------------------------- DoRA (--use_dora)


def worker_dora_zero3(pipe_dir: str, out: str):
    """DoRA adapters on a partitioned UNet: peft's initial magnitudes (row norms of each base
    weight, gathered for the purpose), training through the engine, and the gathered save
    loading into the pipeline with the magnitudes trained."""
    from diffusers_zero3 import gathered_parameters, get_rank
    from diffusers_zero3.families import SD
    from diffusers_zero3.training.job import load_trainable_denoiser
    from diffusers_zero3.training.lora import add_lora_adapters, save_lora_zero3
    from diffusers_zero3.training.parts import prepare_first_part, set_micro_batch_size
    from tests.common import accelerator_with_zero3

    torch.manual_seed(0)
    accelerator = accelerator_with_zero3(zero3_init_flag=True)
    unet = load_trainable_denoiser(accelerator, pipe_dir, SD)
    params = add_lora_adapters(unet, rank=4, target_modules=SD.lora_target_modules, use_dora=True)
    magnitudes = {n: p for n, p in unet.named_parameters() if "lora_magnitude_vector" in n}
    bases = {n.replace("lora_magnitude_vector.default.weight", "base_layer.weight"): n for n in magnitudes}
    weights = dict(unet.named_parameters())
    with gathered_parameters([*magnitudes.values(), *(weights[b] for b in bases)]):
        for base, name in bases.items():  # lora_B starts at zero: the magnitudes are the base's row norms
            torch.testing.assert_close(magnitudes[name], weights[base].norm(dim=1), msg=name)
        initial = {n: p.detach().clone() for n, p in magnitudes.items()}
    set_micro_batch_size(accelerator, 1)
    part, _ = prepare_first_part(accelerator, "unet", unet, torch.optim.AdamW(params, lr=1e-2))
    g = torch.Generator().manual_seed(get_rank())
    latents, states = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g)
    for _ in range(2):
        accelerator.backward(part.engine(latents, torch.tensor([10, 500]), states).sample.pow(2).mean())
        part.optimizer.step()
        part.optimizer.zero_grad()
    trained_magnitudes = {n: p for n, p in part.module.named_parameters() if "lora_magnitude_vector" in n}
    with gathered_parameters(list(trained_magnitudes.values())):
        trained = {n: p.detach().clone() for n, p in trained_magnitudes.items()}
    assert all(not torch.equal(trained[n], initial[n]) for n in trained)
    path = save_lora_zero3(part.engine, SD, out)
    if get_rank() == 0:
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, safety_checker=None)
        pipe.load_lora_weights(str(path.parent))
        loaded = {n.replace(".default_0", ".default"): p for n, p in pipe.unet.named_parameters()
                  if "lora_magnitude_vector" in n}  # fmt: skip
        assert loaded.keys() == trained.keys()
        for n, t in trained.items():
            torch.testing.assert_close(loaded[n], t, rtol=0, atol=0, msg=n)
    print("OK dora")


@pytest.mark.multirank
def test_dora_on_a_partitioned_unet_initialises_trains_and_saves(tiny_pipeline, tmp_path):
    outs = run_on_ranks(worker_dora_zero3, pipe_dir=tiny_pipeline, out=str(tmp_path / "out"))
    assert all("OK dora" in o for o in outs)
