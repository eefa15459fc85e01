"""scripts/train_controlnet.py: a ControlNet trained as a ZeRO-3 engine beside a frozen denoiser
placed like every frozen model (sharded here), initialised from the UNet's weights without a
whole UNet on any rank; the same ControlNet weights as plain DDP with the UNet replicated; an
output that loads with ControlNetModel and works in the ControlNet pipeline; SDXL too."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import (
    REPO_ROOT,
    accelerate_launch,
    run_launcher,
    run_launchers_side_by_side,
    run_on_ranks,
    step_values,
)

SCRIPT = "scripts/train_controlnet.py"


@pytest.fixture(scope="module")
def controlnet_data(tmp_path_factory):
    """A generated ControlNet dataset (shapes, their masks, captions) and its mask images."""
    from diffusers_zero3.demo import write_controlnet_dataset

    folder = write_controlnet_dataset(tmp_path_factory.mktemp("controlnet") / "data", num_images=8)
    return str(folder), str(folder.with_name(folder.name + "-masks") / "circle.png")


def worker_partitioned_init(pipe_dir: str):
    from diffusers import ControlNetModel, UNet2DConditionModel

    from diffusers_zero3 import gathered_parameters
    from diffusers_zero3.recipes.controlnet import FROM_UNET, ZERO_INIT, new_controlnet_from_unet
    from diffusers_zero3.runtime.zero3 import zero3_init_disabled
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3()  # persistence threshold 0: every tensor partitioned
    ours = new_controlnet_from_unet(accelerator, f"{pipe_dir}/unet", (16, 32), seed=4)
    with zero3_init_disabled():
        unet = UNet2DConditionModel.from_pretrained(pipe_dir, subfolder="unet")
        torch.manual_seed(4)
        reference = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
    expected = dict(reference.named_parameters())
    copied = zeroed = 0
    with gathered_parameters(list(ours.parameters())):
        for name, p in ours.named_parameters():
            torch.testing.assert_close(p.detach(), expected[name].detach(), rtol=0, atol=0, msg=name)
            copied += name.startswith(FROM_UNET)
            zeroed += name.startswith(ZERO_INIT) and not bool(p.any())
    assert copied > 20 and zeroed > 4, (copied, zeroed)
    print("OK controlnet init")


@pytest.mark.multirank
def test_a_partitioned_controlnet_starts_as_from_unet(tiny_pipeline):
    """Copied tensors, zeroed output convolutions and the seeded rest equal
    ``ControlNetModel.from_unet`` exactly (zero_module() alone would leave the partitions of the
    output convolutions random under zero.Init)."""
    outs = run_on_ranks(worker_partitioned_init, pipe_dir=tiny_pipeline, timeout=240)
    assert all("OK controlnet init" in o for o in outs)


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "controlnet" / "diffusion_pytorch_model.safetensors"))


@pytest.mark.e2e
def test_controlnet_beside_a_sharded_unet_equals_ddp_and_its_output_works(
    default_data, controlnet_data, tmp_path
):
    import sys

    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline
    from PIL import Image

    from diffusers_zero3.testing import free_port

    pipe, _, _ = default_data
    data, mask = controlnet_data
    # adam_epsilon 1e-4: Adam's update varies smoothly with the gradient (see the DreamBooth test)
    common = ["--pretrained_model_name_or_path", pipe, "--dataset_name", data, "--resolution", "32",
              "--train_batch_size", "1", "--gradient_accumulation_steps", "2", "--max_train_steps", "3",
              "--learning_rate", "1e-3", "--adam_epsilon", "1e-4", "--lr_warmup_steps", "0", "--seed", "1",
              "--report_to", "none", "--checkpointing_steps", "100"]  # fmt: skip
    zero3 = tmp_path / "zero3"
    validation = ["--validation_prompt", "a red circle", "--validation_image", mask, "--num_validation_images", "2",
                  "--validation_steps", "3", "--num_validation_inference_steps", "2"]  # fmt: skip
    ddp = tmp_path / "ddp"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(free_port()), str(REPO_ROOT / SCRIPT)]  # fmt: skip
    (_, log), (_, log_ddp) = run_launchers_side_by_side(  # ZeRO-3 and the same job under DDP, side by side
        [{"argv": [*accelerate_launch(SCRIPT), *common, *validation, "--unet_placement", "shard",
                   "--output_dir", str(zero3)]},
         {"argv": [*launch, *common, "--output_dir", str(ddp)], "env": {"ACCELERATE_USE_DEEPSPEED": "false"}}],
        timeout=400,
    )  # fmt: skip
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3], log[-3000:]
    assert "unet: shard" in log and "ControlNet from the UNet's weights" in log
    grid = Image.open(zero3 / "validation" / "step-000003.png")
    assert grid.size == (3 * 32, 32)  # the conditioning image, then 2 samples

    for step, value in step_values(log_ddp).items():
        assert value == pytest.approx(losses[step], abs=1e-5), (step, losses, step_values(log_ddp))
    ours, theirs = _weights(zero3), _weights(ddp)
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-6

    controlnet = ControlNetModel.from_pretrained(zero3 / "controlnet")
    pipeline = StableDiffusionControlNetPipeline.from_pretrained(
        pipe, controlnet=controlnet, safety_checker=None
    )
    image = pipeline(
        "a red circle", image=Image.open(mask), num_inference_steps=2, height=32, width=32
    ).images[0]
    assert image.size == (32, 32)


@pytest.mark.e2e
def test_sdxl_controlnet_gets_the_time_ids_and_pooled_embeds(tiny_sdxl, controlnet_data, tmp_path):
    from diffusers import ControlNetModel

    pipe, _ = tiny_sdxl
    data, _ = controlnet_data
    out = tmp_path / "out"
    _, log = run_launcher([*accelerate_launch(SCRIPT), "--pretrained_model_name_or_path", pipe, "--dataset_name", data,
                           "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "2",
                           "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "1", "--report_to", "none",
                           "--unet_placement", "shard", "--text_encoder_2_placement", "shard",
                           "--output_dir", str(out)], timeout=400)  # fmt: skip
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    config = ControlNetModel.load_config(out / "controlnet")
    assert config["addition_embed_type"] == "text_time"
