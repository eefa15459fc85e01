"""scripts/train_grpo.py: its settings' errors, and 2-rank launches on a tiny SD3 (LoRA + Flow-GRPO
with a function reward beside a sharded CLIP reward; full fine-tuning + DiffusionNFT with a
sharded reference), with groups that straddle the ranks and do not divide evenly."""

from __future__ import annotations

import json
import re

import pytest

from tests.distributed_harness import accelerate_launch, resume_in_fresh_folder, run_launcher

LAUNCH = accelerate_launch("scripts/train_grpo.py")
REDNESS = "diffusers_zero3.demo.rewards:redness"
# 3 prompts x 3 images = 9 samples on 2 ranks: 5 and 4, groups spread over both
SMALL = ["--prompts", "a red circle", "a blue square", "a green circle", "--group_size", "3",
         "--resolution", "32", "--num_inference_steps", "3", "--max_train_steps", "2",
         "--sample_batch_size", "3", "--train_batch_size", "3", "--learning_rate", "1e-3",
         "--report_to", "none", "--timestep_fraction", "0.67"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import SD3

    return str(save_tiny_pipeline(SD3, tmp_path_factory.mktemp("sd3") / "tiny-sd3"))


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny CLIP folder (model, tokenizer, image processor) for the clip_score reward."""
    from tests.test_reward_registry import _clip_processor_files, _tiny_clip

    folder = tmp_path_factory.mktemp("clip")
    _tiny_clip().save_pretrained(folder)
    _clip_processor_files(folder)
    return str(folder)


def _rounds(log: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) reward (-?[0-9.]+)\b", log)}


# ------------------------------------------------------------------ settings


def _parse(*extra: str):
    from diffusers_zero3.recipes.grpo import GRPOSettings

    return GRPOSettings.parse(["--pretrained_model_name_or_path", "p", "--reward", REDNESS, *extra])


@pytest.mark.unit
def test_settings_defaults_and_prompt_file(tmp_path):
    args = _parse("--prompts", "a", "b", "c")
    assert (args.objective, args.group_size, args.prompts_per_round, args.num_inference_steps) == (
        "grpo",
        4,
        3,
        10,
    )
    assert (args.noise_level, args.clip_range, args.adv_clip_max, args.guidance_scale) == (
        0.7,
        1e-4,
        5.0,
        1.0,
    )
    assert args.rank is None and args.reference_placement == "shard" and args.train_timesteps == 10
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert _parse("--prompt_file", str(tmp_path / "p.txt")).prompts == ["one", "two"]
    assert _parse("--prompts", "a", "--timestep_fraction", "0.25").train_timesteps == 2


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "no prompts: give --prompts or a non-empty --prompt_file"),
        (["--prompts", "a", "--prompt_file", "f"], "give --prompts or --prompt_file, not both"),
        (["--prompt_file", "/nonexistent/p.txt"], "--prompt_file /nonexistent/p.txt: no such file"),
        (["--prompts", "a", "--group_size", "1"], "--group_size must be at least 2"),
        (["--prompts", "a", "--prompts_per_round", "2"], "--prompts_per_round must be between 1 and the 1 prompts"),
        (["--prompts", "a", "--timestep_fraction", "0"], "--timestep_fraction must be in (0, 1], got 0.0"),
        (["--prompts", "a", "--noise_level", "0"], "--objective grpo needs --noise_level > 0"),
        (["--prompts", "a", "--kl_beta", "-1"], "--kl_beta must be >= 0, got -1.0"),
        (["--prompts", "a", "--objective", "nft", "--nft_beta", "0"], "--nft_beta must be positive, got 0.0"),
        (["--prompts", "a", "--guidance_scale", "0.5"], "--guidance_scale must be >= 1"),
        (["--prompts", "a", "--rank", "0"], "--rank must be at least 1"),
        (["--prompts", "a", "--rank", "4", "--reference_placement", "replicate"],
         "--reference_placement replicate applies to full fine-tuning"),
        (["--prompts", "a", "--reward", "nosuch"], "--reward nosuch: unknown built-in reward"),
        (["--prompts", "a", "--num_inner_epochs", "0"], "--num_inner_epochs must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_settings_errors_are_one_line(extra, message):
    from diffusers_zero3.errors import ArgumentError

    with pytest.raises(ArgumentError) as e:
        _parse(*extra)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_no_reward_is_an_error():
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.grpo import GRPOSettings

    with pytest.raises(ArgumentError, match="no reward"):
        GRPOSettings.parse(["--pretrained_model_name_or_path", "p", "--prompts", "a"])


@pytest.mark.unit
def test_padding_and_generators():
    import torch

    from diffusers_zero3.recipes.grpo import pad_assignment, sample_generator
    from diffusers_zero3.rl import group_assignment, samples_per_rank

    length = samples_per_rank(3, 3, 2)
    shares = [pad_assignment(group_assignment(3, 3, 2, r, 0, 0), length) for r in range(2)]
    assert [len(p) for p, _ in shares] == [5, 5] and [sum(m) for _, m in shares] == [5, 4]
    assert pad_assignment([], 2) == ([(0, 0), (0, 0)], [False, False])
    a = torch.randn(3, generator=sample_generator(0, 1, 2, 0))
    assert torch.equal(a, torch.randn(3, generator=sample_generator(0, 1, 2, 0)))
    assert not torch.equal(a, torch.randn(3, generator=sample_generator(0, 1, 2, 1)))


# ------------------------------------------------------------------ end to end


@pytest.mark.e2e
def test_lora_grpo_with_function_and_sharded_clip_reward(tiny_sd3, tiny_clip, tmp_path):
    out = tmp_path / "lora"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_sd3, *SMALL, "--rank", "4",
            "--reward", REDNESS, "--reward", "clip_score=0.01", "--reward_model", f"clip_score={tiny_clip}",
            "--reward_placement", "clip_score=shard", "--kl_beta", "0.01", "--num_inner_epochs", "2",
            "--checkpointing_steps", "1", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2], log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "clip_score"} and all(len(v) == 2 for v in rewards.values())
    for mean, red, clip in zip(rewards["mean"], rewards[REDNESS], rewards["clip_score"]):
        assert mean == pytest.approx(red + 0.01 * clip, abs=1e-5)
    assert (out / "rewards.png").exists() and (out / "rewards-2.png").exists()

    import torch
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.load_lora_weights(out)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    image = pipe(
        "a red circle", num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(0)
    )
    assert image.images[0].size == (32, 32)

    # resumed from round 1 in a fresh folder: round 2 again, the same reward (sampling noise is
    # seeded per (round, prompt, member); the engine, optimizer and RNG come from the checkpoint)
    again = resume_in_fresh_folder(argv[:-2], out, tmp_path / "resumed", "checkpoint-1", timeout=240)
    assert _rounds(again) == {2: pytest.approx(rewards["mean"][1], abs=1e-6)}, again[-3000:]


@pytest.mark.e2e
def test_full_fine_tuning_nft_with_sharded_reference(tiny_sd3, tmp_path):
    out = tmp_path / "full"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_sd3, *SMALL, "--objective", "nft",
            "--reward", REDNESS, "--reference_placement", "shard", "--kl_beta", "0.1",
            "--vae_placement", "shard", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2] and "reference: shard" in log, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS} and len(rewards["mean"]) == 2

    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from safetensors.torch import load_file

    before = load_file(f"{tiny_sd3}/transformer/diffusion_pytorch_model.safetensors")
    after = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys() and any(not (before[k] == after[k]).all() for k in before)
    assert isinstance(StableDiffusion3Pipeline.from_pretrained(out).transformer, SD3Transformer2DModel)
