"""scripts/train_reward.py end to end on 2 ZeRO-3 ranks, with checkpoint and exact resume."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.distributed_harness import accelerate_launch, run_launcher, run_launchers_side_by_side

pytestmark = pytest.mark.e2e

LAUNCH = accelerate_launch("scripts/train_reward.py")


def _rewards(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) reward (-?[0-9.]+)\b", output)}


def test_reward_fine_tuning_end_to_end_and_resume(tmp_path):
    from diffusers_zero3.demo import prepare_default

    pipe, _ = prepare_default(tmp_path / "default", num_images=4)
    common = [
        "--pretrained_model_name_or_path", str(pipe), "--reward_model_name_or_path",
        str(tmp_path / "default" / "redness-reward"), "--prompts", "a red circle", "a blue square",
        "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--num_inference_steps", "4",
        "--learning_rate", "1e-3", "--use_ema", "--checkpointing_steps", "2", "--report_to", "tensorboard",
    ]  # fmt: skip
    out = tmp_path / "run"
    _, log = run_launcher([*LAUNCH, *common, "--output_dir", str(out)], timeout=400)
    rewards = _rewards(log)
    assert sorted(rewards) == [1, 2, 3, 4], log[-3000:]
    assert (out / "rewards.png").exists() and (out / "model_index.json").exists()
    # the rewards come from the registry: one list per --reward spec beside the weighted total
    saved = json.loads((out / "rewards.json").read_text())
    by_spec = saved["diffusers_zero3.demo:RednessRewardModel"]
    assert len(saved["mean"]) == len(by_spec) == 4 and saved["mean"] == pytest.approx(by_spec, abs=1e-6)
    assert {"ema_rank0.pt", "ema_rank1.pt"} <= {p.name for p in (out / "checkpoint-2").iterdir()}

    from diffusers import StableDiffusionPipeline

    image = StableDiffusionPipeline.from_pretrained(out)(
        "a red circle", num_inference_steps=2, height=32, width=32
    )
    assert image.images[0].size == (32, 32)

    # Three resumes of `out`'s checkpoints, side by side: on 2 processes exactly, on 4
    # processes (1 sample each, the same 4 per step) from checkpoint-2, and on 1 process (the
    # same 4 samples per step) from the final checkpoint.
    resumed, four, one = tmp_path / "resumed", tmp_path / "four", tmp_path / "one"
    for folder, checkpoint in ((resumed, "checkpoint-2"), (four, "checkpoint-2"), (one, "checkpoint-4")):
        folder.mkdir()
        shutil.copytree(out / checkpoint, folder / checkpoint)
    batch = common.index("--train_batch_size") + 1
    quad = [*accelerate_launch("scripts/train_reward.py", num_processes=4), *common[:batch], "1",
            *common[batch + 1 :], "--output_dir", str(four), "--resume_from_checkpoint", "latest"]  # fmt: skip
    single = [*accelerate_launch("scripts/train_reward.py", num_processes=1), *common[:batch], "4",
              *common[batch + 1 :], "--output_dir", str(one), "--resume_from_checkpoint", "latest"]  # fmt: skip
    (_, log2), (_, log4), (_, log1) = run_launchers_side_by_side(
        [{"argv": [*LAUNCH, *common, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"]},
         {"argv": quad}, {"argv": single}],
        timeout=500,
    )  # fmt: skip
    again = _rewards(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in (3, 4):
        assert again[step] == pytest.approx(rewards[step], abs=2e-6)

    # On 4 processes: training goes on from the resharded engine, EMA and schedule.
    assert "written by 2 processes; resharded for 4" in log4, log4[-3000:]
    assert sorted(_rewards(log4)) == [3, 4] and (four / "model_index.json").exists(), log4[-3000:]

    # On 1 process from the final checkpoint: the same output.
    assert "resumed from" in log1 and not _rewards(log1), log1[-3000:]
    unet = "unet/diffusion_pytorch_model.safetensors"
    assert (one / unet).read_bytes() == (out / unet).read_bytes()
