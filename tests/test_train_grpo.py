"""scripts/train_grpo.py: its settings' errors, its noise, schedule and padding helpers, and 2-rank
launches with groups that straddle the ranks and do not divide evenly: on a tiny SD3 (LoRA +
Flow-GRPO with a function reward beside a sharded CLIP reward, resumed; full fine-tuning +
DiffusionNFT with a sharded reference, resumed on 1 and 3 processes), a tiny Flux.1 (LoRA + grpo
with dynamic shifting and the guidance input; full fine-tuning + nft) and a tiny Z-Image (LoRA +
grpo with CFG). Each round's log line carries DeepSpeed's optimizer-step count, checked against
one step per micro-batch."""

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
def tiny_flux(tmp_path_factory):
    """A tiny Flux.1 whose scheduler shifts by resolution (``use_dynamic_shifting``, as FLUX.1
    [dev]'s does) and whose transformer takes a guidance input (``guidance_embeds``)."""
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import FLUX

    folder = save_tiny_pipeline(FLUX, tmp_path_factory.mktemp("flux") / "tiny-flux")
    config = folder / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_dynamic_shifting": True}))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_zimage(tmp_path_factory):
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import ZIMAGE

    return str(save_tiny_pipeline(ZIMAGE, tmp_path_factory.mktemp("zimage") / "tiny-zimage"))


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


def _optimizer_steps(log: str) -> dict[int, int]:
    """``{round: optimizer steps taken so far}`` (DeepSpeed's count) from the round lines."""
    return {int(s): int(n) for s, n in re.findall(r"step (\d+) reward .*; optimizer steps (\d+)", log)}


def _check_seconds(seconds: dict, rounds: int) -> None:
    """``rewards.json``'s ``"seconds"``: one positive wall-clock time per round of each phase."""
    assert set(seconds) == {"sampling", "rewards", "training"}, seconds
    assert all(len(v) == rounds and all(t > 0 for t in v) for v in seconds.values()), seconds


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
    assert (
        not args.step_every_timestep and args.accumulation_steps == 10
    )  # as Flow-GRPO: one step per sample batch
    assert _parse("--prompts", "a", "--step_every_timestep").accumulation_steps == 1
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
        (["--prompts", "a", "--sample_grid_steps", "0"], "--sample_grid_steps must be at least 1, got 0"),
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
def test_a_family_it_is_not_tested_on_is_refused_in_one_line(tiny_pipeline, tmp_path):
    """An SD 1.x pipeline (no flow matching) and any flow family without an end-to-end test
    here are refused before anything is loaded, naming the families it trains."""
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.grpo import GRPOTrainer

    settings = _parse("--pretrained_model_name_or_path", tiny_pipeline, "--prompts", "a", "--output_dir",
                      str(tmp_path / "out"), "--report_to", "none", "--resolution", "32")  # fmt: skip
    trainer = GRPOTrainer(settings)
    with pytest.raises(
        ArgumentError, match="trains the flow-matching families it is tested on: sd3, flux, zimage"
    ):
        trainer.setup()


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


@pytest.mark.unit
def test_cat_padded_meets_trimmed_text_states():
    import torch

    from diffusers_zero3.recipes.grpo import cat_padded

    states, mask = (
        cat_padded(torch.ones(2, 3, 4), torch.ones(2, 5, 4)),
        cat_padded(torch.ones(2, 3), torch.ones(2, 5)),
    )
    assert (
        states.shape == (4, 5, 4) and states[:2, 3:].abs().sum() == 0 and mask.sum(1).tolist() == [3, 3, 5, 5]
    )
    assert torch.equal(
        cat_padded(torch.ones(1, 2), torch.zeros(1, 2)), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    )


@pytest.mark.unit
def test_nft_noise_is_per_sample_and_timestep():
    import torch

    from diffusers_zero3.recipes.grpo import nft_noise_generator, sample_generator

    def draw(*key):
        return torch.randn(4, generator=nft_noise_generator(*key))

    a = draw(0, 1, 2, 0, 3)
    assert torch.equal(a, draw(0, 1, 2, 0, 3))  # whichever rank, whichever position in its share
    for other in [(1, 1, 2, 0, 3), (0, 0, 2, 0, 3), (0, 1, 1, 0, 3), (0, 1, 2, 1, 3), (0, 1, 2, 0, 2)]:
        assert not torch.equal(a, draw(*other)), other
    # and not the sampling noise
    assert not torch.equal(a, torch.randn(4, generator=sample_generator(0, 1, 2, 0)))


@pytest.mark.unit
@pytest.mark.parametrize("dynamic", [False, True], ids=["shift", "dynamic"])
def test_sampling_schedule_is_the_pipelines(dynamic):
    """FluxPipeline's schedule (sigmas linspace(1, 1/N, N), mu of the image's token count under
    dynamic shifting) and StableDiffusion3Pipeline's (the scheduler's own spacing)."""
    import numpy as np
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    from diffusers_zero3.recipes.grpo import pipeline_sigmas, set_sampling_timesteps

    def scheduler():
        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=dynamic)

    cpu, seq = torch.device("cpu"), 1024
    flux = set_sampling_timesteps(scheduler(), 6, seq, cpu, sigmas=pipeline_sigmas("FluxPipeline", 6))
    reference = scheduler()
    mu = calculate_shift(seq, 256, 4096, 0.5, 1.15)  # the config's defaults
    retrieve_timesteps(reference, 6, cpu, sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
    assert torch.equal(flux, reference.sigmas.float()) and flux.shape == (7,) and flux[-1] == 0
    assert pipeline_sigmas("StableDiffusion3Pipeline", 6) is None
    sd3 = set_sampling_timesteps(scheduler(), 6, seq, cpu)
    reference = scheduler()
    reference.set_timesteps(6, device=cpu, **({"mu": mu} if dynamic else {}))
    assert torch.equal(sd3, reference.sigmas.float()) and not torch.equal(sd3, flux)


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
    # rank 0 holds 5 samples: 2 micro-batches of 3, each stepped once over its 2 trained timesteps,
    # in each of 2 inner epochs
    assert "one optimizer step per 2 backward(s)" in log, log[-3000:]
    assert _optimizer_steps(log) == {1: 4, 2: 8}, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    seconds = rewards.pop("seconds")
    assert set(rewards) == {"mean", REDNESS, "clip_score"} and all(len(v) == 2 for v in rewards.values())
    _check_seconds(seconds, 2)
    for mean, red, clip in zip(rewards["mean"], rewards[REDNESS], rewards["clip_score"]):
        assert mean == pytest.approx(red + 0.01 * clip, abs=1e-5)
    assert (out / "rewards.png").exists() and (out / "rewards-2.png").exists()
    # a grid of rank 0's samples per round (every checkpoint by default): 5 of the 9 samples
    # (3 prompts x 3) are rank 0's, 4 a row, with each one's prompt and weighted reward
    from PIL import Image

    for n in (1, 2):
        shown = json.loads((out / "samples" / f"round-{n}.json").read_text())
        assert len(shown) == 5 and all(isinstance(s["reward"], float) for s in shown), shown
        assert Image.open(out / "samples" / f"round-{n}.png").size == (4 * 32, 2 * 32)

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
    assert _optimizer_steps(again) == {2: 8}, again[-3000:]  # DeepSpeed's count comes back with the engine
    # the checkpoint restores every list: round 1's timings are the first run's
    resumed = json.loads((tmp_path / "resumed" / "rewards.json").read_text())
    assert resumed["mean"] == pytest.approx(rewards["mean"], abs=1e-6)
    _check_seconds(resumed["seconds"], 2)
    assert all(resumed["seconds"][p][0] == seconds[p][0] for p in seconds)


@pytest.mark.e2e
def test_full_fine_tuning_nft_with_sharded_reference_resumed_on_1_and_3_processes(tiny_sd3, tmp_path):
    out = tmp_path / "full"
    flags = ["--pretrained_model_name_or_path", tiny_sd3, *SMALL, "--objective", "nft", "--reward", REDNESS,
             "--reference_placement", "shard", "--kl_beta", "0.1", "--vae_placement", "shard",
             "--checkpointing_steps", "1"]  # fmt: skip
    _, log = run_launcher([*LAUNCH, *flags, "--output_dir", str(out)], timeout=240)
    assert sorted(_rounds(log)) == [1, 2] and "reference: shard" in log, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "seconds"} and len(rewards["mean"]) == 2
    _check_seconds(rewards["seconds"], 2)

    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from safetensors.torch import load_file

    before = load_file(f"{tiny_sd3}/transformer/diffusion_pytorch_model.safetensors")
    after = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys() and any(not (before[k] == after[k]).all() for k in before)
    assert isinstance(StableDiffusion3Pipeline.from_pretrained(out).transformer, SD3Transformer2DModel)

    # Resumed from round 1 on 1 and on 3 processes: round 2 samples the same 9 (prompt, member)
    # pairs (the shuffle's order is cut into other shares, 9 | 5+4 | 3+3+3) from the same
    # checkpointed weights with the same per-sample noise, so every sample's reward, and the
    # round's mean over all of them, is the 2-process run's up to the order of floating-point
    # sums (other micro-batches through the transformer and the VAE). Its training is not:
    # each rank's micro-batches, hence the optimizer steps, are cut from its own share.
    for processes in (1, 3):
        folder = tmp_path / f"n{processes}"
        again = resume_in_fresh_folder([*accelerate_launch("scripts/train_grpo.py", processes), *flags], out,
                                       folder, "checkpoint-1", timeout=240)  # fmt: skip
        assert f"resharded for {processes}" in again and sorted(_rounds(again)) == [2], again[-3000:]
        # 2 steps in round 1 (2 micro-batches on rank 0), then rank 0's micro-batches of round 2:
        # 9 samples on 1 process are 3, 3 on each of 3 processes 1
        assert _optimizer_steps(again) == {2: 2 + {1: 3, 3: 1}[processes]}, again[-3000:]
        resumed = json.loads((folder / "rewards.json").read_text())
        assert resumed["mean"][0] == rewards["mean"][0]  # restored from the checkpoint
        # measured: equal to the bit on 1 process, 1e-8 apart (relative 1e-6) on 3
        expected = pytest.approx(rewards["mean"][1], rel=1e-5, abs=1e-7)
        assert resumed["mean"][1] == expected and resumed[REDNESS][1] == expected, (
            processes,
            resumed,
            rewards,
        )


@pytest.mark.e2e
def test_flux_lora_grpo_with_dynamic_shifting_and_distilled_guidance(tiny_flux, tmp_path):
    out = tmp_path / "flux-lora"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_flux, *SMALL, "--rank", "4", "--reward", REDNESS,
            "--guidance_scale", "3.5", "--max_sequence_length", "16", "--kl_beta", "0.01",
            "--text_encoder_2_placement", "shard", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2], log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "seconds"} and len(rewards["mean"]) == 2
    _check_seconds(rewards["seconds"], 2)

    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.load_lora_weights(out)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, max_sequence_length=16,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert image.images[0].size == (32, 32)


@pytest.mark.e2e
def test_flux_full_fine_tuning_nft(tiny_flux, tmp_path):
    out = tmp_path / "flux-full"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_flux, *SMALL, "--objective", "nft",
            "--reward", REDNESS, "--guidance_scale", "3.5", "--max_sequence_length", "16", "--kl_beta", "0.1",
            "--reference_placement", "replicate", "--step_every_timestep", "--use_ema", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2] and "reference: replicate" in log, log[-3000:]
    # --step_every_timestep: 2 micro-batches x 2 trained timesteps, a step each
    assert _optimizer_steps(log) == {1: 4, 2: 8} and "one optimizer step per 1 backward(s)" in log, log[
        -3000:
    ]
    assert len(json.loads((out / "rewards.json").read_text())["mean"]) == 2

    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import load_file

    before = load_file(f"{tiny_flux}/transformer/diffusion_pytorch_model.safetensors")
    after = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys() and any(not (before[k] == after[k]).all() for k in before)
    assert isinstance(FluxPipeline.from_pretrained(out).transformer, FluxTransformer2DModel)


@pytest.mark.e2e
def test_zimage_lora_grpo_with_cfg(tiny_zimage, tmp_path):
    """Z-Image through the same family interface, with CFG: its text states are trimmed to a
    batch's longest caption, so the empty prompts' are shorter and padded to meet them."""
    out = tmp_path / "zimage-lora"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_zimage, *SMALL, "--rank", "4", "--reward", REDNESS,
            "--guidance_scale", "2", "--max_sequence_length", "16", "--kl_beta", "0.01", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2], log[-3000:]
    assert len(json.loads((out / "rewards.json").read_text())["mean"]) == 2

    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    pipe.load_lora_weights(out)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
