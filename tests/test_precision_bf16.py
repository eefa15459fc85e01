"""The precision matrix: every script under ZeRO-3 with ``--mixed_precision bf16`` on 2 CPU
ranks (DeepSpeed's CPU accelerator runs bf16), each for a step or two, a validation and a
save. GPU users train in bf16; before these tests that path had never run, and it crashed
(an fp32 SDXL VAE fed bf16 latents in validation; a bf16 reward model fed fp32 images).

Across the cases every frozen model of a text-to-image family is placed at least once as
``replicate``, ``shard`` and ``cache`` (``offload`` needs a GPU: ``tests/test_gpu.py``), and
LoRA and EMA run at least once. fp32 runs are the rest of the suite.
"""

from __future__ import annotations

import re

import pytest

from tests.distributed_harness import accelerate_launch, launches_of_selected_tests, run_launcher, step_values

pytestmark = pytest.mark.e2e

BF16 = ["--mixed_precision", "bf16", "--resolution", "32", "--train_batch_size", "2", "--learning_rate", "1e-3",
        "--seed", "4", "--report_to", "none"]  # fmt: skip
VALIDATION = ["--validation_prompts", "a red circle", "--validation_steps", "2",
              "--num_validation_inference_steps", "2"]  # fmt: skip

# family fixture, placements and extras of each text-to-image case
TEXT_TO_IMAGE = {
    "sd-ema-te-shard-vae-replicate": (
        "default_data",
        ["--text_encoder_placement", "shard", "--vae_placement", "replicate", "--use_ema"],
    ),
    # the reported crash: SDXL's fp32 VAE decoding bf16 latents in validation
    "sdxl-te2-cache-vae-replicate": (
        "tiny_sdxl",
        [
            "--text_encoder_placement",
            "replicate",
            "--text_encoder_2_placement",
            "cache",
            "--vae_placement",
            "replicate",
        ],
    ),  # fmt: skip
    # some encoders cached, others live (concatenated in the conditioning), LoRA
    "sd3-lora-te-cache-te2-shard-te3-cache-vae-cache": (
        "tiny_sd3",
        [
            "--text_encoder_placement",
            "cache",
            "--text_encoder_2_placement",
            "shard",
            "--text_encoder_3_placement",
            "cache",
            "--vae_placement",
            "cache",
            "--rank",
            "4",
            "--max_sequence_length",
            "16",
        ],
    ),  # fmt: skip
    "flux-ema-te2-shard-vae-shard": (
        "tiny_flux",
        [
            "--text_encoder_placement",
            "replicate",
            "--text_encoder_2_placement",
            "shard",
            "--vae_placement",
            "shard",
            "--use_ema",
            "--max_sequence_length",
            "16",
        ],
    ),  # fmt: skip
}


def _data(request, fixture: str) -> tuple[str, str]:
    value = request.getfixturevalue(fixture)
    return value[0], value[1]


def _text_to_image_argv(case: str, request, out) -> list[str]:
    fixture, extra = TEXT_TO_IMAGE[case]
    pipe, data = _data(request, fixture)
    return [*accelerate_launch("scripts/train_text_to_image.py"), "--pretrained_model_name_or_path", pipe,
            "--train_data_dir", data, "--center_crop", "--max_train_steps", "2", "--checkpointing_steps", "2",
            *BF16, *VALIDATION, *extra, "--output_dir", str(out)]  # fmt: skip


def _reward_argv(request, out) -> list[str]:
    pipe, _, reward = request.getfixturevalue("default_data")
    return [*accelerate_launch("scripts/train_reward.py"), "--pretrained_model_name_or_path", pipe,
            "--reward_model_name_or_path", reward, "--prompts", "a red circle", "a blue square",
            "--max_train_steps", "2", "--num_inference_steps", "2", "--use_ema", "--reward_placement", "shard",
            *BF16, "--output_dir", str(out)]  # fmt: skip


def _dpo_argv(request, out) -> list[str]:
    pipe, _, _ = request.getfixturevalue("default_data")
    preferences = request.getfixturevalue("preferences")
    return [*accelerate_launch("scripts/train_dpo.py"), "--pretrained_model_name_or_path", pipe,
            "--dataset_name", preferences, "--center_crop", "--max_train_steps", "2", "--checkpointing_steps", "2",
            "--text_encoder_placement", "shard", *BF16, *VALIDATION, "--output_dir", str(out)]  # fmt: skip


def _plain_python_argv(request, out) -> list[str]:
    import sys

    pipe, data = request.getfixturevalue("tiny_sdxl")
    return [sys.executable, "scripts/train_text_to_image.py", "--pretrained_model_name_or_path", pipe,
            "--train_data_dir", data, "--center_crop", "--max_train_steps", "2", "--checkpointing_steps", "2",
            *BF16, *VALIDATION, "--output_dir", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected test's launch, side by side (they are independent: each its own folder
    and port): ``{test name: ((returncode, output), output folder)}``. The SD case's resume
    runs in its test, after its first run."""
    folders = {}

    def launch_for(item):
        out = folders[item.name] = tmp_path_factory.mktemp("bf16") / "run"
        if item.originalname == "test_text_to_image_bf16_trains_validates_and_saves":
            return {"argv": _text_to_image_argv(item.callspec.params["case"], request, out)}
        argv = {"test_reward_bf16_trains_and_saves": _reward_argv, "test_dpo_bf16_trains_validates_and_saves": _dpo_argv,
                "test_plain_python_bf16_validates_with_the_fp32_vae": _plain_python_argv}[item.originalname]  # fmt: skip
        return {"argv": argv(request, out)}

    results = launches_of_selected_tests(request, launch_for)
    return {test: (result, folders[test]) for test, result in results.items()}


def _result(runs, request):
    (code, log), out = runs[request.node.name]
    assert code == 0, log[-8000:]
    return log, out


@pytest.mark.parametrize("case", sorted(TEXT_TO_IMAGE))
def test_text_to_image_bf16_trains_validates_and_saves(case, request, runs):
    """Its launch runs side by side with the other selected tests' (``runs``)."""
    extra = TEXT_TO_IMAGE[case][1]
    log, out = _result(runs, request)
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    assert (out / "validation" / "step-000002.png").exists(), log[-3000:]
    assert (out / "checkpoint-2").is_dir()
    marker = "pytorch_lora_weights.safetensors" if "--rank" in extra else "model_index.json"
    assert (out / marker).exists(), log[-3000:]
    if case.startswith("sd-"):
        # Resume in bf16: DeepSpeed names the optimizer states bf16_zero_pp_rank_*, which the
        # resume check once refused as an incomplete checkpoint.
        assert any((out / "checkpoint-2" / "pytorch_model").glob("bf16_zero_pp_rank_*optim_states.pt"))
        argv = _text_to_image_argv(case, request, out)
        argv[argv.index("--max_train_steps") + 1] = "3"
        _, log = run_launcher([*argv, "--resume_from_checkpoint", "latest"], timeout=400)
        assert "resumed from" in log and sorted(step_values(log)) == [3], log[-3000:]


def test_reward_bf16_trains_and_saves(request, runs):
    log, out = _result(runs, request)
    rewards = re.findall(r"step (\d+) reward (-?[0-9.]+)", log)
    assert [int(s) for s, _ in rewards] == [1, 2], log[-3000:]
    assert (out / "model_index.json").exists() and (out / "rewards.png").exists()


def test_dpo_bf16_trains_validates_and_saves(request, runs):
    log, out = _result(runs, request)
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    assert (out / "validation" / "step-000002.png").exists(), log[-3000:]
    assert (out / "pytorch_lora_weights.safetensors").exists()


def test_plain_python_bf16_validates_with_the_fp32_vae(request, runs):
    """Without DeepSpeed, accelerate's autocast wrapper hands the pipeline fp32 denoiser
    outputs beside bf16 text encoders and SDXL's fp32 VAE: validation runs under autocast."""
    log, out = _result(runs, request)
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    assert (out / "validation" / "step-000002.png").exists() and (out / "model_index.json").exists()
