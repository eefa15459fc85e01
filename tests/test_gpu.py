"""scripts/train_text_to_image.py on CUDA ranks: bf16, NCCL, one process per GPU (1..N GPUs).

The ``gpu`` tier (``make test-gpu``, ``pytest -m gpu``): skipped on a host without CUDA. The
other tiers run on CPU ranks on a GPU host too (the harness hides the GPUs from them); these
tests give their ranks the GPUs back and DeepSpeed's CUDA accelerator. ``make smoke-gpu``
runs a wider matrix (every family, reward, DPO, the offload config) with a table of times
and device memory.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed_harness import accelerate_launch, run_launcher, step_values

SCRIPT = "scripts/train_text_to_image.py"
BF16_CONFIG = "configs/accelerate_zero3_bf16.yaml"
STEPS = 4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


def gpu_env() -> dict[str, str]:
    """The ranks' environment over the harness's CPU defaults: every visible GPU, and
    DeepSpeed's CUDA accelerator (accelerate picks NCCL)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    return {"CUDA_VISIBLE_DEVICES": visible, "DS_ACCELERATOR": "cuda"}


def bf16_launch(num_processes: int) -> list[str]:
    """The harness's ``accelerate launch`` argv with the bf16 ZeRO-3 config."""
    argv = accelerate_launch(SCRIPT, num_processes)
    argv[argv.index("--config_file") + 1] = BF16_CONFIG
    return argv


def train_args(pipe: str, data: str, out, vae_placement: str) -> list[str]:
    """EMA, the text encoder sharded, validation and checkpoints at steps 2 and 4."""
    return [
        "--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--output_dir", str(out),
        "--resolution", "32", "--center_crop", "--train_batch_size", "2", "--max_train_steps", str(STEPS),
        "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "tensorboard",
        "--use_ema", "--text_encoder_placement", "shard", "--vae_placement", vae_placement,
        "--checkpointing_steps", "2", "--checkpoints_total_limit", "2",
        "--validation_prompts", "a red circle", "--validation_steps", str(STEPS),
        "--num_validation_inference_steps", "2", "--process_group_timeout", "120",
    ]  # fmt: skip


def check_bf16_run(log: str, out, pipe: str, num_processes: int) -> None:
    """The losses, the bf16 ZeRO-3 checkpoints with one EMA shard per rank, the validation
    image, and an output pipeline that loads (on the CPU) with a trained, finite UNet."""
    losses = step_values(log)
    assert sorted(losses) == list(range(1, STEPS + 1)), log[-3000:]
    assert all(v == v and abs(v) < 1e3 for v in losses.values()), losses  # no NaN, no blow-up
    assert "memory per rank (maximum over ranks)" in log
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    ck = out / "checkpoint-4"
    names = {p.name for p in ck.iterdir()}
    assert {f"ema_rank{r}.pt" for r in range(num_processes)} <= names, names
    # DeepSpeed names the optimizer partitions bf16_zero_pp_rank_* when bf16 is on.
    assert len(list(ck.rglob("bf16_zero_pp_rank_*_optim_states.pt"))) == num_processes, sorted(
        str(p.relative_to(ck)) for p in ck.rglob("*")
    )
    assert (out / "validation" / f"step-{STEPS:06d}.png").exists()
    assert not list(out.glob(".tmp-*"))

    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    pipeline = StableDiffusionPipeline.from_pretrained(out)
    image = pipeline("a red circle", num_inference_steps=2, height=32, width=32).images[0]
    assert image.size == (32, 32)
    before = UNet2DConditionModel.from_pretrained(pipe, subfolder="unet")
    params = list(pipeline.unet.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    assert any(not torch.equal(a, b.to(a.dtype)) for a, b in zip(params, before.parameters()))


@pytest.mark.parametrize("vae_placement", ["replicate", "offload"])
def test_bf16_zero3_on_every_gpu(default_data, tmp_path, vae_placement):
    """One rank per GPU, bf16 under NCCL: EMA, the text encoder sharded, validation,
    checkpoints and a loadable output; with the VAE replicated, then offloaded (ZeRO-3
    partitions in host memory)."""
    pipe, data, _ = default_data
    num_processes = torch.cuda.device_count()
    out = tmp_path / "run"
    _, log = run_launcher(
        [*bf16_launch(num_processes), *train_args(pipe, data, out, vae_placement)], timeout=600, env=gpu_env()
    )
    check_bf16_run(log, out, pipe, num_processes)
