"""Diffusion-DPO: the loss and the preference pairs (unit), and scripts/train_dpo.py end to end
on 2 ZeRO-3 ranks with the reference sharded (full fine-tune) and as the adapter-free base (LoRA)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed_harness import (
    accelerate_launch,
    first_launches_fixture,
    first_run,
    resume_in_fresh_folder,
    step_values,
)

SCRIPT = "scripts/train_dpo.py"
LAUNCH = accelerate_launch(SCRIPT)


@pytest.mark.unit
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_loss_is_diffusers_formula(loss_type):
    from diffusers_zero3.recipes.dpo import dpo_loss

    model = torch.tensor([0.10, 0.30, 0.20, 0.25, 0.40, 0.15])  # 3 preferred, then 3 rejected
    ref = torch.tensor([0.12, 0.28, 0.22, 0.20, 0.41, 0.16])
    beta = 50.0
    inside = -0.5 * beta * ((model[:3] - model[3:]) - (ref[:3] - ref[3:]))
    expected = {
        "sigmoid": -F.logsigmoid(inside).mean(),
        "hinge": torch.relu(1 - inside).mean(),
        "ipo": ((inside - 1 / (2 * beta)) ** 2).mean(),
    }[loss_type]
    loss, metrics = dpo_loss(model, ref, beta, loss_type)
    torch.testing.assert_close(loss, expected)
    assert metrics["implicit_acc"].item() == pytest.approx((inside > 0).float().mean().item())
    assert 0 < metrics["implicit_acc"] < 1  # the example has pairs of both signs
    torch.testing.assert_close(metrics["reward_margin"], inside.mean())
    torch.testing.assert_close(metrics["reward_chosen"] - metrics["reward_rejected"], inside.mean())
    with pytest.raises(ValueError, match="loss type must be one of"):
        dpo_loss(model, ref, beta, "kto")


@pytest.mark.unit
def test_preference_pairs_put_the_preferred_image_first_and_drop_ties(preferences):
    import datasets

    from diffusers_zero3.data.images import DataError
    from diffusers_zero3.demo import COLOURS
    from diffusers_zero3.recipes.dpo import (
        PreferencePairs,
        check_preference_columns,
        collate_pairs,
        drop_ties,
    )

    ds = datasets.load_dataset(preferences)["train"]
    check_preference_columns(ds)
    assert len(ds) == 14 and sorted(set(ds["label_0"])) == [0.0, 0.5, 1.0]
    pairs = drop_ties(ds)
    assert len(pairs) == 12 and 0.5 not in pairs["label_0"]
    data = PreferencePairs(pairs, lambda c: {"input_ids": torch.zeros(len(c), 4, dtype=torch.long)}, 32,
                           random_flip=True, seed=1)  # fmt: skip
    for i in range(len(pairs)):
        item = data[i]
        colour = pairs[i]["caption"].split()[1]
        # the preferred image holds the caption's colour (the shape is drawn in it), the other not
        target = torch.tensor(COLOURS[colour]) / 127.5 - 1
        distance = [(item["pixel_values"][k].permute(1, 2, 0) - target).abs().sum(-1).min() for k in (0, 1)]
        assert distance[0] < 0.05 < distance[1], (i, colour, distance)
        assert torch.equal(item["crop_top_left"][0], item["crop_top_left"][1])  # one crop for both
    batch = collate_pairs([data[0], data[1], data[2]])
    assert batch["pixel_values"].shape == (6, 3, 32, 32) and batch["input_ids"].shape == (3, 4)
    torch.testing.assert_close(batch["pixel_values"][3], data[0]["pixel_values"][1])  # rejected half
    with pytest.raises(DataError, match="lacks the column"):
        check_preference_columns(ds.remove_columns("label_0"))
    with pytest.raises(DataError, match="label_0 must be 0, 0.5"):
        drop_ties(ds.map(lambda r: {"label_0": 0.7}))


def _common(pipe: str, data: str, steps: int) -> list[str]:
    return ["--pretrained_model_name_or_path", pipe, "--dataset_name", data, "--resolution", "32",
            "--center_crop", "--random_flip", "--train_batch_size", "2", "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "2", "--report_to", "none"]  # fmt: skip


def _full_common(pipe: str, preferences: str) -> list[str]:
    return [*_common(pipe, preferences, 4), "--rank", "0", "--reference_placement", "shard",
            "--checkpointing_steps", "2", "--use_ema"]  # fmt: skip


def _full_argv(request, folder):
    pipe, preferences = request.getfixturevalue("default_data")[0], request.getfixturevalue("preferences")
    return [*accelerate_launch(SCRIPT), *_full_common(pipe, preferences), "--output_dir", str(folder / "run")]


def _lora_argv(request, folder):
    pipe, preferences = request.getfixturevalue("default_data")[0], request.getfixturevalue("preferences")
    return [*accelerate_launch(SCRIPT), *_common(pipe, preferences, 3), "--output_dir", str(folder / "run"),
            "--text_encoder_placement", "shard"]  # fmt: skip


# The two e2e tests' first launches run side by side (``first_runs``); the resume runs in its test.
first_runs = first_launches_fixture({
    "test_dpo_full_fine_tune_with_a_sharded_reference_and_exact_resume": _full_argv,
    "test_dpo_lora_default_rank_reference_is_the_base_without_adapters": _lora_argv,
})  # fmt: skip


@pytest.mark.e2e
def test_dpo_full_fine_tune_with_a_sharded_reference_and_exact_resume(
    default_data, preferences, first_runs, request
):
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    pipe, _, _ = default_data
    log, tmp_path = first_run(first_runs, request)
    out, common = tmp_path / "run", _full_common(pipe, preferences)
    losses, acc = step_values(log), step_values(log, "implicit_acc")
    assert sorted(losses) == [1, 2, 3, 4] and sorted(acc) == [1, 2, 3, 4], log[-3000:]
    assert "12 preference pairs (2 ties dropped)" in log
    # The reference holds about 1/N of its bytes per rank (small parameters stay whole) ...
    held, total = map(
        float, re.search(r"reference unet: shard, ([0-9.]+) MiB of ([0-9.]+) MiB", log).groups()
    )
    assert 0.45 < held / total < 0.6, (held, total)
    # ... and is bit-identical after training, while the trained UNet moved.
    before = re.search(r"reference fingerprint before training: (\w+)", log).group(1)
    after = re.search(r"reference fingerprint after training: (\w+)", log).group(1)
    assert before == after
    trained = load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))
    source = load_file(str(Path(pipe) / "unet" / "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(trained[k], source[k]) for k in source)
    assert (out / "implicit_accuracy.png").exists()
    StableDiffusionPipeline.from_pretrained(out)  # a complete pipeline folder

    resumed = tmp_path / "resumed"
    log2 = resume_in_fresh_folder([*LAUNCH, *common], out, resumed)
    again, acc2 = step_values(log2), step_values(log2, "implicit_acc")
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
        assert acc2[step] == acc[step]


@pytest.mark.e2e
def test_dpo_lora_default_rank_reference_is_the_base_without_adapters(first_runs, request):
    log, tmp_path = first_run(first_runs, request)
    out = tmp_path / "run"
    assert sorted(step_values(log)) == [1, 2, 3], log[-3000:]
    assert "LoRA rank 4" in log and "reference: the base denoiser with the LoRA adapters disabled" in log
    # Step 1: the adapters start at zero (lora_B = 0), so the trained and reference errors
    # are equal, the margin is 0 and the sigmoid loss is log 2.
    assert step_values(log)[1] == pytest.approx(0.693147, abs=1e-5)
    assert (out / "pytorch_lora_weights.safetensors").exists() and not (out / "model_index.json").exists()
