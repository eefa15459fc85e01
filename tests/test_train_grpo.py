"""scripts/train_grpo.py: its settings' errors, its noise, schedule and padding helpers, each
family's sampling schedule, latent shape, decode and guidance against its pipeline's (Qwen-Image,
Flux.2 [dev] and [klein]), and 2-rank launches with groups that straddle the ranks and do not
divide evenly: on a tiny SD3 (LoRA + Flow-GRPO with a function reward beside a sharded CLIP
reward, resumed; full fine-tuning + DiffusionNFT with a sharded reference, resumed on 1 and 3
processes), a tiny Flux.1 (LoRA + grpo with dynamic shifting and the guidance input; full
fine-tuning + nft), a tiny Z-Image (LoRA + grpo with CFG), a tiny Qwen-Image (LoRA + grpo with
true CFG), a tiny Flux.2 [dev] (full fine-tuning + nft with the guidance input) and a tiny
Flux.2 [klein] (LoRA + grpo with CFG). Video: Wan 2.1 with its clips split over 2 ranks
(context parallelism) against one process, with a sharded judge of whole clips; Wan 2.2 TI2V-5B
(LoRA + nft); Wan 2.2 A14B with both experts (nft with KL and EMA resumed across them, grpo).
Each round's log line carries DeepSpeed's optimizer-step count, checked against one step per
micro-batch."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.distributed_harness import (
    accelerate_launch,
    resume_in_fresh_folder,
    run_launcher,
    run_launchers_side_by_side,
)

LAUNCH = accelerate_launch("scripts/train_grpo.py")
REDNESS = "diffusers_zero3.demo.rewards:redness"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
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
def tiny_qwenimage(tmp_path_factory):
    """A tiny Qwen-Image (one-frame 5-D latents, per-channel statistics that are not 0 and 1,
    the published scheduler: dynamic exponential shifting to a terminal sigma)."""
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import QWENIMAGE

    return str(save_tiny_pipeline(QWENIMAGE, tmp_path_factory.mktemp("qwenimage") / "tiny-qwenimage"))


@pytest.fixture(scope="module")
def tiny_flux2(tmp_path_factory):
    """A tiny Flux.2 [dev] (guidance embedded; batch-norm latent statistics that are not 0 and 1)."""
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import FLUX2

    return str(save_tiny_pipeline(FLUX2, tmp_path_factory.mktemp("flux2") / "tiny-flux2"))


@pytest.fixture(scope="module")
def tiny_flux2_klein(tmp_path_factory):
    """A tiny Flux.2 [klein] base model (no guidance embedding: CFG)."""
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import FLUX2_KLEIN

    return str(save_tiny_pipeline(FLUX2_KLEIN, tmp_path_factory.mktemp("klein") / "tiny-flux2-klein"))


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import WAN

    return str(save_tiny_pipeline(WAN, tmp_path_factory.mktemp("wan") / "tiny-wan"))


def _load_pipeline(family, folder: str):
    """``family``'s pipeline from ``folder``, the tokenizer loaded by the family (FLUX.2-dev's
    folder holds a processor that transformers builds only with torchvision)."""
    from pathlib import Path

    import diffusers

    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(folder, tokenizer=None)
    pipe.register_modules(tokenizer=family.load_tokenizer(Path(folder) / "tokenizer"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


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


def _check_stats(stats: dict, rounds: int, objective: str = "grpo") -> None:
    """``rewards.json``'s ``"stats"``: one finite number per round of each statistic of the
    objective, each within its range (fractions in [0, 1], the others non-negative)."""
    import math

    from diffusers_zero3.recipes.grpo import LOSS_STATS

    assert set(stats) == {"reward_std", "zero_std_fraction", *LOSS_STATS[objective]}, stats
    for name, values in stats.items():
        assert len(values) == rounds and all(isinstance(v, float) and math.isfinite(v) for v in values), stats
        fraction = "fraction" in name or name == "clipfrac"
        assert all(0 <= v <= 1 for v in values) if fraction else min(values) >= 0, (name, values)


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
    # the references' defaults: global_std and the zero-advantage filter on, CFG while training at
    # the sampling scale, flow_grpo's timesteps in order and EMA every 8 steps, DiffusionNFT's at
    # random and every step, its old policy's decay type 1 and adv_mode "all"
    grpo, nft = (
        _parse("--prompts", "a", "--guidance_scale", "4.5"),
        _parse("--prompts", "a", "--objective", "nft"),
    )
    assert grpo.global_std and grpo.filter_zero_std and grpo.train_guidance_scale == 4.5
    assert (grpo.timestep_subset, grpo.ema_update_every, grpo.ema_decay) == ("first", 8, 0.9)
    assert (nft.timestep_subset, nft.ema_update_every, nft.nft_decay_type, nft.nft_adv_mode) == (
        "random",
        1,
        1,
        "all",
    )
    assert not _parse("--prompts", "a", "--global_std", "false").global_std
    assert _parse("--prompts", "a", "--gradient_accumulation_steps", "3").accumulation_steps == 30
    assert (
        _parse(
            "--prompts", "a", "--gradient_accumulation_steps", "3", "--step_every_timestep"
        ).accumulation_steps
        == 3
    )
    # a .jsonl prompt file: each row's prompt, the row its metadata
    from diffusers_zero3.recipes.grpo import read_prompt_file

    rows = [{"prompt": "a red bench", "color": "red"}, {"prompt": "two cats", "count": 2}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _parse("--prompt_file", str(tmp_path / "p.jsonl")).prompts == ["a red bench", "two cats"]
    assert read_prompt_file(str(tmp_path / "p.jsonl"), "--prompt_file") == (["a red bench", "two cats"], rows)
    evaluated = _parse(
        "--prompts", "a", "--eval_prompt_file", str(tmp_path / "p.txt"), "--checkpointing_steps", "5"
    )
    assert (evaluated.eval_steps, evaluated.eval_num_inference_steps, evaluated.eval_resolution) == (
        5,
        40,
        512,
    )


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
        (["--prompts", "a", "--train_guidance_scale", "0.5"], "--train_guidance_scale must be >= 1"),
        (["--prompts", "a", "--sde_window_size", "11"], "--sde_window_size 11 must fit in --sde_window_range 0 10"),
        (["--prompts", "a", "--sde_window_range", "0", "2"], "--sde_window_range needs --sde_window_size"),
        (["--prompts", "a", "--sde_window_size", "1", "--sde_window_range", "3"], "--sde_window_range takes two steps"),
        (["--prompts", "a", "--objective", "nft", "--sde_window_size", "2"], "--sde_window_size applies to --objective grpo"),
        (["--prompts", "a", "--sampler", "cps", "--sde_window_size", "2", "--sde_window_range", "5", "10"],
         "--sampler cps adds no noise at the last step"),
        (["--prompts", "a", "--sampler", "cps", "--kl_beta", "0.1"], "--sampler cps with --kl_beta needs an --sde_window_size"),
        (["--prompts", "a", "--sampler", "cps", "--ratio_norm"], "--ratio_norm applies to --objective grpo with --sampler sde"),
        (["--prompts", "a", "--ema_decay", "1"], "--ema_decay must be in [0, 1), got 1.0"),
        (["--prompts", "a", "--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be at least 1"),
        (["--prompts", "a", "--eval_steps", "2"], "--eval_reward and --eval_steps need --eval_prompt_file"),
        (["--prompts", "a", "--eval_prompt_file", "/nonexistent/e.jsonl"],
         "--eval_prompt_file /nonexistent/e.jsonl: no such file"),
        (["--prompts", "a", "--reward_frames", "-1"], "--reward_frames -1: give a count of frames, or 0"),
    ],
)  # fmt: skip
def test_settings_errors_are_one_line(extra, message):
    from diffusers_zero3.errors import ArgumentError

    with pytest.raises(ArgumentError) as e:
        _parse(*extra)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\nnot json\n', "row 2 is not JSON"),
        ('{"caption": "a"}\n', "row 1 is not an object with a 'prompt' string"),
        ("\n\n", "no prompts in it"),
    ],
)
def test_a_bad_jsonl_prompt_file_is_one_line(text, message, tmp_path):
    from diffusers_zero3.errors import ArgumentError

    (tmp_path / "p.jsonl").write_text(text)
    with pytest.raises(ArgumentError) as e:
        _parse("--prompt_file", str(tmp_path / "p.jsonl"))
    assert f"--prompt_file {tmp_path / 'p.jsonl'}: {message}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_no_reward_is_an_error():
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.grpo import GRPOSettings

    with pytest.raises(ArgumentError, match="no reward"):
        GRPOSettings.parse(["--pretrained_model_name_or_path", "p", "--prompts", "a"])


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["sd", "hunyuanvideo15", "kontext"])
def test_a_family_it_is_not_tested_on_is_refused_in_one_line(kind, tiny_pipeline, tmp_path):
    """An SD 1.x pipeline (no flow matching) and a flow family without an end-to-end test here
    (HunyuanVideo 1.5) are refused before anything is loaded, naming the families it trains; an
    editing pipeline (Kontext) with the reason: rounds sample from prompts alone."""
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.grpo import GRPOTrainer

    folder = tiny_pipeline
    if kind != "sd":
        from diffusers_zero3.demo import save_tiny_pipeline
        from diffusers_zero3.families import family_named

        folder = str(save_tiny_pipeline(family_named(kind), tmp_path / f"tiny-{kind}"))
    settings = _parse("--pretrained_model_name_or_path", folder, "--prompts", "a", "--output_dir",
                      str(tmp_path / "out"), "--report_to", "none", "--resolution", "32")  # fmt: skip
    trainer = GRPOTrainer(settings)
    families = "sd3, flux, zimage, qwenimage, flux2, flux2-klein, wan, wan22_5b, wan22"
    message = (
        "which edits a source image; train_grpo.py samples from prompts alone (edit RL on source images is not built)"
        if kind == "kontext"
        else f"trains the flow-matching families it is tested on: {families}"
    )
    with pytest.raises(ArgumentError) as e:
        trainer.setup()
    assert str(e.value).endswith(message) and "\n" not in str(e.value), e.value


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


@pytest.mark.unit
@pytest.mark.parametrize("name", ["qwenimage", "flux2", "flux2-klein"])
def test_sampling_schedule_and_latent_shape_are_the_pipelines(name, request):
    """Qwen-Image's schedule (linspace sigmas, ``calculate_shift`` with its own bounds, exponential
    shifting stretched to its terminal sigma) and Flux.2's (``compute_empirical_mu`` of the
    tokens and the step count): the sigmas the pipeline itself leaves on its scheduler after a
    call, for a non-square image; and the latents' shape is the pipeline's."""
    import torch

    from diffusers_zero3.families import family_named
    from diffusers_zero3.recipes.grpo import sampling_schedule

    family = family_named(name)
    folder = request.getfixturevalue(f"tiny_{name.replace('-', '_')}")
    pipe = _load_pipeline(family, folder)
    height, width, steps = 32, 48, 5
    seen = []  # the packed latents the pipeline gives its transformer
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape), with_kwargs=True
    )
    try:
        pipe(prompt="a red circle", num_inference_steps=steps, height=height, width=width, max_sequence_length=64,
             generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    finally:
        hook.remove()
    shape = family.denoiser_latent_shape(pipe.vae.config, height, width)
    # the pipeline's tokens: one per 2x2 patch (Qwen-Image) or per patchified pixel (Flux.2)
    assert seen[0][1] == family.image_seq_len(shape, pipe.vae.config, pipe.transformer.config), seen
    assert seen[0][1] * seen[0][2] == torch.Size(shape).numel()
    ours = sampling_schedule(
        family, family.load_noise_scheduler(folder), steps, shape, pipe.vae.config, pipe.transformer.config,
        torch.device("cpu"),
    )  # fmt: skip
    assert ours.shape == (steps + 1,) and ours[-1] == 0 and ours[0] == 1
    assert torch.equal(ours, pipe.scheduler.sigmas.float()), (ours, pipe.scheduler.sigmas)
    # another resolution shifts otherwise (mu follows the image's tokens)
    other = family.denoiser_latent_shape(pipe.vae.config, 64, 64)
    assert not torch.equal(ours, sampling_schedule(
        family, family.load_noise_scheduler(folder), steps, other, pipe.vae.config, pipe.transformer.config,
        torch.device("cpu"),
    ))  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("name", ["wan", "wan22_5b"])
def test_wan_clip_shape_schedule_and_decode_are_the_pipelines(name, request):
    """Wan 2.1 and Wan 2.2 TI2V-5B (per-token timesteps): a round's clip latents have the shape
    the pipeline gives its transformer (``1 + 4k`` frames, 2 latent frames for 5), its tokens are
    the transformer's, and its decode of the pipeline's final latents is the pipeline's
    ``output_type="pt"`` clips ``[N, F, 3, H, W]`` (the tiny VAE's channel statistics are not 0
    and 1, so a normalisation left in place shows). Its sigmas are DanceGRPO's Wan schedule at
    the folder's ``flow_shift`` (from exactly 1), not the pipeline's UniPC ones, whose first
    sigma ``1 - 1e-6`` would make Flow-GRPO's first SDE step blow the latents up."""
    import torch

    from diffusers_zero3.families import family_named
    from diffusers_zero3.recipes.grpo import clip_frames, decode_images, sampling_schedule
    from diffusers_zero3.rl import sde_step_with_logprob

    family = family_named(name)
    folder = request.getfixturevalue(f"tiny_{name}")
    pipe = _load_pipeline(family, folder)
    height, width, steps, frames = 32, 64, 3, clip_frames(family, pipe.vae.config, None)
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape), with_kwargs=True
    )
    call = dict(prompt=["a red circle", "a blue square"], num_inference_steps=steps, height=height, width=width,
                num_frames=frames, max_sequence_length=16, guidance_scale=1.0)  # fmt: skip
    try:
        latents = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent").frames
    finally:
        hook.remove()
    shape = family.sample_latent_shape(pipe.vae.config, height, width, frames)
    assert frames == 5 and shape[1] == 2 and seen[0][1:] == shape == latents.shape[1:], (seen, shape)
    assert (
        family.image_seq_len(shape, pipe.vae.config, pipe.transformer.config)
        == shape[1] * shape[2] * shape[3] // 4
    )
    ours = sampling_schedule(
        family, family.load_noise_scheduler(folder), steps, shape, pipe.vae.config, pipe.transformer.config,
        torch.device("cpu"),
    )  # fmt: skip
    shift = pipe.scheduler.config.flow_shift  # DanceGRPO's sd3_time_shift(shift, linspace(1, 0, steps + 1))
    plain = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    torch.testing.assert_close(ours, (shift * plain / (1 + (shift - 1) * plain)).float(), rtol=0, atol=1e-7)
    assert ours[0] == 1 and ours[-1] == 0
    unipc = pipe.scheduler.sigmas.float()  # what the pipeline's call left: 1 - 1e-6 first
    assert 0.99999 < unipc[0] < 1
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    for sigmas, bound in ((ours, 10.0), (unipc, None)):
        step = sde_step_with_logprob(
            torch.zeros_like(x), sigmas[0], sigmas[1], x, noise_level=0.7, noise=torch.zeros_like(x)
        )
        if bound is not None:
            assert step[0].abs().max() < bound
        else:
            assert step[0].abs().max() > 100 * x.abs().max()  # the blow-up the schedule avoids
    expected = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="pt").frames
    with torch.no_grad():
        clips = decode_images(
            family, pipe.vae, family.latent_normalizer(pipe.vae.config, f"{folder}/vae"), latents
        )
    assert clips.shape == expected.shape == (2, frames, 3, height, width)
    torch.testing.assert_close(clips, expected, rtol=0, atol=1e-6)
    from diffusers_zero3.families.base import ChannelMeanStd

    channels = shape[0]
    plain = ChannelMeanStd({"latents_mean": [0.0] * channels, "latents_std": [1.0] * channels})
    with torch.no_grad():
        assert (decode_images(family, pipe.vae, plain, latents) - expected).abs().max() > 1e-3


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--timestep_fraction", "0.5"], "--timestep_fraction 0.5 trains 3 steps of a round's expert, and of the 6 sampled"
         " steps 2 are the high-noise expert's and 4 the low-noise one's (timestep >= 875): lower it to at most 2/6"),
        (["--timestep_fraction", "0.34", "--sde_window_size", "2"],
         "--sde_window_size: Wan 2.2 A14B's rounds train one expert on its own steps, which a sliding window would move"),
    ],
)  # fmt: skip
def test_wan22_a14b_rounds_need_steps_of_each_expert(extra, message, tiny_wan22, tmp_path):
    """Wan 2.2 A14B: a round trains one expert on its own sampled steps, so each expert needs the
    round's trained steps among the sampled ones, and no window may move them; one line each."""
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.grpo import GRPOTrainer

    settings = _parse("--pretrained_model_name_or_path", tiny_wan22, "--prompts", "a", "--output_dir",
                      str(tmp_path / "out"), "--report_to", "none", "--resolution", "32", "--num_inference_steps", "6",
                      "--reference_placement", "replicate", *extra)  # fmt: skip
    with pytest.raises(ArgumentError) as e:
        GRPOTrainer(settings).setup()
    assert str(e.value) == message


@pytest.mark.unit
def test_clip_frames_follow_the_vae():
    """A video family's clips are ``1 + 4k`` frames (default 5); an image family makes one frame
    and refuses more; each a one-line error."""
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.families import family_named
    from diffusers_zero3.recipes.grpo import clip_frames

    wan, sd3 = family_named("wan"), family_named("sd3")
    config = {"scale_factor_temporal": 4, "scale_factor_spatial": 8}
    assert clip_frames(wan, config, None) == 5 and clip_frames(wan, config, 9) == 9
    assert clip_frames(sd3, {}, None) == 1 and clip_frames(sd3, {}, 1) == 1
    for family, frames, message in [
        (wan, 6, "--num_frames 6: Wan 2.1 clips are 1 + 4k frames (1, 5, 9, ...)"),
        (wan, 0, "--num_frames 0: Wan 2.1 clips are 1 + 4k frames"),
        (sd3, 5, "--num_frames 5: the SD3 pipeline makes images"),
    ]:
        with pytest.raises(ArgumentError) as e:
            clip_frames(family, config, frames)
        assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["qwenimage", "flux2"])
def test_decode_is_the_pipelines(name, request):
    """The trainer's decode of the pipeline's final latents (in the denoiser's layout) equals the
    pipeline's own ``output_type="pt"`` images: Qwen-Image's per-channel mean and std undone and
    its one frame, Flux.2's batch-norm statistics undone and unpatchified (both tiny VAEs have
    statistics that are not 0 and 1, so a normalisation left in place shows)."""
    import torch

    from diffusers_zero3.families import family_named
    from diffusers_zero3.recipes.grpo import decode_images

    family = family_named(name)
    folder = request.getfixturevalue(f"tiny_{name}")
    pipe = _load_pipeline(family, folder)
    size = 32

    def run(output_type: str):
        return pipe(prompt=["a red circle", "a blue square"], num_inference_steps=2, height=size, width=size,
                    max_sequence_length=64, generator=torch.Generator().manual_seed(0),
                    output_type=output_type).images  # fmt: skip

    packed, expected = run("latent"), run("pt")
    shape = family.denoiser_latent_shape(pipe.vae.config, size, size)
    if name == "qwenimage":
        latents = pipe._unpack_latents(packed, size, size, pipe.vae_scale_factor)
    else:
        latents = pipe._unpack_latents_with_ids(packed, pipe._prepare_latent_ids(torch.zeros(2, *shape)))
    assert latents.shape[1:] == shape
    with torch.no_grad():
        images = decode_images(
            family, pipe.vae, family.latent_normalizer(pipe.vae.config, f"{folder}/vae"), latents
        )
    assert images.shape == expected.shape == (2, 3, size, size)
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)
    # the statistics matter here: undoing a mean 0 and std 1 instead gives other images
    from diffusers_zero3.families.base import ChannelMeanStd
    from diffusers_zero3.families.flux2 import BatchNormLatents

    channels = shape[0]
    if name == "qwenimage":
        plain = ChannelMeanStd({"latents_mean": [0.0] * channels, "latents_std": [1.0] * channels})
    else:
        plain = BatchNormLatents(torch.zeros(channels), torch.ones(channels), 0.0)
    with torch.no_grad():
        assert (decode_images(family, pipe.vae, plain, latents) - expected).abs().max() > 1e-3


@pytest.mark.unit
def test_guidance_follows_the_pipelines():
    """Qwen-Image's true CFG (the combination rescaled per packed token to the prompt's norm),
    written as ``QwenImagePipeline.__call__`` on packed predictions; plain CFG elsewhere; no CFG
    for a guidance-embedded transformer (Flux.1 / Flux.2 [dev]) or a step-distilled Flux.2 [klein]."""
    import torch

    from diffusers_zero3.families import FLUX2, FLUX2_KLEIN, QWENIMAGE, SD3
    from diffusers_zero3.families.qwenimage import pack_latents, unpack_latents

    g = torch.Generator().manual_seed(0)
    neg, cond = torch.randn(2, 8, 4 * 6, generator=g), torch.randn(2, 8, 4 * 6, generator=g)  # 2x4 tokens
    comb = neg + 3.0 * (cond - neg)  # the pipeline's lines, on its packed tokens
    expected = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    ours = QWENIMAGE.guided_velocity(unpack_latents(neg, 4, 8), unpack_latents(cond, 4, 8), 3.0)
    assert ours.shape == (2, 6, 1, 4, 8)
    torch.testing.assert_close(pack_latents(ours), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(SD3.guided_velocity(neg, cond, 3.0), comb)
    assert QWENIMAGE.classifier_free_guidance({}, {"guidance_embeds": False}, 2.0)
    assert not FLUX2.classifier_free_guidance({}, {"guidance_embeds": True}, 4.0)
    assert FLUX2_KLEIN.classifier_free_guidance({"is_distilled": False}, {"guidance_embeds": False}, 4.0)
    assert not FLUX2_KLEIN.classifier_free_guidance({"is_distilled": True}, {"guidance_embeds": False}, 4.0)
    assert not FLUX2_KLEIN.classifier_free_guidance({}, {"guidance_embeds": False}, 1.0)


# ------------------------------------------------------------------ end to end


@pytest.mark.e2e
def test_lora_grpo_with_function_and_sharded_clip_reward(tiny_sd3, tiny_clip, tmp_path):
    """LoRA + grpo with a python reward beside a sharded CLIP score, every knob of the references
    away from its default, and an evaluation before each round and after the last on 3 held-out
    .jsonl prompts (their metadata to a GenEval-style reward), at another resolution."""
    out = tmp_path / "lora"
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in [
        {"prompt": "a red apple", "color": "red"}, {"prompt": "a photo of a car", "color": "blue"},
        {"prompt": "a green field", "tag": "colors"}]))  # fmt: skip
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_sd3, *SMALL, "--rank", "4",
            "--reward", REDNESS, "--reward", "clip_score=0.01", "--reward_model", f"clip_score={tiny_clip}",
            "--reward_placement", "clip_score=shard", "--kl_beta", "0.01", "--num_inner_epochs", "2",
            "--gradient_accumulation_steps", "2", "--use_ema", "--ema_decay", "0.5", "--ema_update_every", "1",
            "--global_std", "false", "--ratio_norm",
            "--eval_prompt_file", str(held_out), "--eval_steps", "1", "--eval_num_inference_steps", "2",
            "--eval_resolution", "48", "--eval_reward", "diffusers_zero3.demo.rewards:named_colour",
            "--checkpointing_steps", "1", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2], log[-3000:]
    # rank 0 holds 5 samples: 2 micro-batches of 3, stepped once together (--gradient_accumulation_steps
    # 2) over their 2 trained timesteps each, in each of 2 inner epochs
    assert "one optimizer step per 4 backward(s)" in log, log[-3000:]
    assert _optimizer_steps(log) == {1: 2, 2: 4}, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    seconds, stats = rewards.pop("seconds"), rewards.pop("stats")
    assert set(rewards) == {"mean", REDNESS, "clip_score"} and all(len(v) == 2 for v in rewards.values())
    _check_seconds(seconds, 2)
    # the round's statistics: every sample's reward differs (no zero-std group); with the KL on,
    # its term is above 0 once the first step has moved the adapters (4 steps a round)
    _check_stats(stats, 2)
    assert min(stats["reward_std"]) > 0 and stats["zero_std_fraction"] == [0.0, 0.0], stats
    assert min(stats["kl_loss"]) > 0 and min(stats["approx_kl"]) > 0, stats
    for mean, red, clip in zip(rewards["mean"], rewards[REDNESS], rewards["clip_score"]):
        assert mean == pytest.approx(red + 0.01 * clip, abs=1e-5)
    # the total's curve and one per reward, named for it; the summary names each file that exists
    plots = {"rewards.png", "rewards-diffusers_zero3.demo.rewards-redness.png", "rewards-clip_score.png"}
    assert {p.name for p in out.glob("rewards*.png")} == plots
    summary = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in log.splitlines() if ": /" in line}
    for label, path in [("LoRA weights", out / LORA_WEIGHTS), ("total reward curve", out / "rewards.png"),
                        (f"{REDNESS} curve", out / "rewards-diffusers_zero3.demo.rewards-redness.png"),
                        ("clip_score curve", out / "rewards-clip_score.png"), ("step log", out / "logs" / "train.log")]:  # fmt: skip
        assert summary.get(label) == str(path.resolve()), (label, log[-3000:])
    assert summary["rewards"].startswith(f"{(out / 'rewards.json').resolve()} (")
    assert summary["sample grids"].startswith(f"{(out / 'samples').resolve()} (")
    # evaluations before rounds 1 and 2 and after round 2, each reward's mean over the 3 prompts
    # (2 on rank 0, 1 on rank 1 and a dummy); the curve, and rank 0's images at 48 px
    evaluations = json.loads((out / "eval.json").read_text())
    colour = "diffusers_zero3.demo.rewards:named_colour"
    assert set(evaluations) == {"round", "mean", REDNESS, "clip_score", colour}, evaluations
    assert evaluations["round"] == [0, 1, 2] and all(len(v) == 3 for v in evaluations.values()), evaluations
    assert all(v in (0.0, 1 / 3, 2 / 3, 1.0) for v in evaluations[colour]), evaluations  # 0/1 per prompt
    for mean, red, clip in zip(evaluations["mean"], evaluations[REDNESS], evaluations["clip_score"]):
        assert mean == pytest.approx(red + 0.01 * clip, abs=1e-5)  # the total of --reward only
    assert summary.get("evaluation curve") == str((out / "eval.png").resolve())
    from PIL import Image

    assert Image.open(out / "samples" / "eval-2.png").size == (2 * 48, 48)
    assert "TensorBoard logs" not in summary  # --report_to none
    # the round lines print (the log is not a terminal) and go to the step log alike
    logged = (out / "logs" / "train.log").read_text().splitlines()
    assert [int(line.split()[1]) for line in logged] == [1, 2] and logged[0] in log
    # a grid of rank 0's samples per round (every checkpoint by default): 5 of the 9 samples
    # (3 prompts x 3) are rank 0's, 4 a row, with each one's prompt and weighted reward
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
    assert _optimizer_steps(again) == {2: 4}, again[-3000:]  # DeepSpeed's count comes back with the engine
    # the checkpoint restores every list: round 1's timings are the first run's
    resumed = json.loads((tmp_path / "resumed" / "rewards.json").read_text())
    assert resumed["mean"] == pytest.approx(rewards["mean"], abs=1e-6)
    _check_seconds(resumed["seconds"], 2)
    assert all(resumed["seconds"][p][0] == seconds[p][0] for p in seconds)
    assert all(resumed["stats"][k][0] == stats[k][0] for k in stats)  # round 1's from the checkpoint
    _check_stats(resumed["stats"], 2)
    # the evaluation before round 1 comes from the checkpoint; those before round 2 and after it are
    # sampled again, deterministically, from the same (EMA) weights: the same numbers
    again_evals = json.loads((tmp_path / "resumed" / "eval.json").read_text())
    assert again_evals["round"] == [0, 1, 2] and again_evals["mean"][0] == evaluations["mean"][0]
    for name in evaluations:
        assert again_evals[name] == pytest.approx(evaluations[name], abs=1e-6), (
            name,
            again_evals,
            evaluations,
        )


@pytest.mark.e2e
def test_full_fine_tuning_nft_with_sharded_reference_resumed_on_1_and_3_processes(tiny_sd3, tmp_path):
    out = tmp_path / "full"
    flags = ["--pretrained_model_name_or_path", tiny_sd3, *SMALL, "--objective", "nft", "--reward", REDNESS,
             "--reference_placement", "shard", "--kl_beta", "0.1", "--vae_placement", "shard",
             "--use_ema", "--ema_decay", "0.8", "--nft_adv_mode", "positive_only", "--checkpointing_steps", "1"]  # fmt: skip
    _, log = run_launcher([*LAUNCH, *flags, "--output_dir", str(out)], timeout=240)
    assert sorted(_rounds(log)) == [1, 2] and "reference: shard" in log, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "seconds", "stats"} and len(rewards["mean"]) == 2
    _check_seconds(rewards["seconds"], 2)
    _check_stats(rewards["stats"], 2, "nft")
    # --kl_beta 0.1 against the frozen reference: above 0 once the first step has moved the policy
    assert min(rewards["stats"]["kl_loss"]) > 0, rewards["stats"]

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
    # The two resumes run side by side.
    for processes in (1, 3):
        (tmp_path / f"n{processes}").mkdir()
        shutil.copytree(out / "checkpoint-1", tmp_path / f"n{processes}" / "checkpoint-1")
    logs = run_launchers_side_by_side(
        [{"argv": [*accelerate_launch("scripts/train_grpo.py", processes), *flags, "--output_dir",
                   str(tmp_path / f"n{processes}"), "--resume_from_checkpoint", "latest"]} for processes in (1, 3)],
        timeout=240,
    )  # fmt: skip
    for processes, (_, again) in zip((1, 3), logs):
        folder = tmp_path / f"n{processes}"
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
def test_flux_lora_grpo_split_over_two_ranks_equals_one_process(tiny_flux, tmp_path):
    """Flux.1 with dynamic shifting and its distilled guidance, LoRA with the KL to the base, CPS
    steps in a one-step SDE window of [0, 2) and each group's shared initial noise, on
    one process (K=1); its round-1 checkpoint resumed with --context_parallel_size 2 on 2 ranks,
    one group that draws all 9 samples and splits every transformer sequence in two (Ulysses).
    Round 2's rewards (sampling) and the trained adapters (training) equal the one process's, and
    the LoRA loads in the pipeline. (The comparison starts from a checkpoint because the adapters'
    initial values depend on the number of processes.)"""
    flags = ["--pretrained_model_name_or_path", tiny_flux, *SMALL, "--rank", "4", "--reward", REDNESS,
             "--guidance_scale", "3.5", "--max_sequence_length", "16", "--kl_beta", "0.01",
             "--sampler", "cps", "--sde_window_size", "1", "--sde_window_range", "0", "2", "--same_noise_per_group",
             "--text_encoder_2_placement", "shard", "--checkpointing_steps", "1"]  # fmt: skip
    single, out = tmp_path / "flux-lora-1", tmp_path / "flux-lora-cp2"
    _, log1 = run_launcher([*accelerate_launch("scripts/train_grpo.py", 1), *flags, "--output_dir", str(single)],
                           timeout=240)  # fmt: skip
    # one process trains all 9 samples: 3 micro-batches of 3 a round
    assert sorted(_rounds(log1)) == [1, 2] and _optimizer_steps(log1) == {1: 3, 2: 6}, log1[-3000:]
    one = json.loads((single / "rewards.json").read_text())
    log = resume_in_fresh_folder([*LAUNCH, *flags, "--context_parallel_size", "2"], single, out, "checkpoint-1",
                                 timeout=240)  # fmt: skip
    # the 2 ranks are one group: rank 0 also takes all 9 samples
    assert sorted(_rounds(log)) == [2] and _optimizer_steps(log) == {2: 6}, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "seconds", "stats"} and len(rewards["mean"]) == 2
    assert rewards["mean"] == pytest.approx(one["mean"], rel=1e-5, abs=1e-7), (rewards, one)

    import torch
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    split, whole = load_file(out / LORA_WEIGHTS), load_file(single / LORA_WEIGHTS)
    assert split.keys() == whole.keys()
    worst = max((split[k] - whole[k]).abs().max().item() for k in split)
    moved = max((v.abs().max().item() for k, v in split.items() if "lora_B" in k), default=0.0)
    assert moved > 1e-4 and worst < 1e-6, (moved, worst)  # trained (lora_B starts at 0), and alike

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
    """Z-Image through the same family interface, with CFG (sampled at 2, trained at 1.5 with the
    empty prompt's branch detached): its text states are trimmed to a batch's longest caption, so
    the empty prompts' are shorter and padded to meet them."""
    out = tmp_path / "zimage-lora"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_zimage, *SMALL, "--rank", "4", "--reward", REDNESS,
            "--guidance_scale", "2", "--train_guidance_scale", "1.5", "--max_sequence_length", "16",
            "--kl_beta", "0.01", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2], log[-3000:]
    assert len(json.loads((out / "rewards.json").read_text())["mean"]) == 2

    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    pipe.load_lora_weights(out)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())


@pytest.mark.e2e
def test_qwenimage_lora_grpo_with_true_cfg(tiny_qwenimage, tmp_path):
    """Qwen-Image: one-frame 5-D latents through the SDE and the loss, its VAE's per-channel
    statistics undone before the decode, and true CFG (rescaled to the prompt's norm) with the
    empty prompt's shorter states padded to the prompts'."""
    out = tmp_path / "qwenimage-lora"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_qwenimage, *SMALL, "--rank", "4", "--reward", REDNESS,
            "--guidance_scale", "2", "--max_sequence_length", "16", "--kl_beta", "0.01", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2] and "ignored" not in log, log[-3000:]  # CFG runs
    # rank 0's 5 samples: 2 micro-batches of 3, each one step over its 2 trained timesteps
    assert _optimizer_steps(log) == {1: 2, 2: 4}, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "seconds", "stats"} and len(rewards["mean"]) == 2
    _check_seconds(rewards["seconds"], 2)

    import torch
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage)
    pipe.load_lora_weights(out)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, max_sequence_length=16,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert image.images[0].size == (32, 32)


@pytest.mark.e2e
def test_flux2_full_fine_tuning_nft_with_guidance_input(tiny_flux2, tmp_path):
    """Flux.2 [dev]: patchified latents, the empirical mu of its schedule, the batch-norm
    statistics undone and the latents unpatchified before the decode, --guidance_scale as the
    transformer's guidance input (no CFG), a sharded reference for the KL."""
    out = tmp_path / "flux2-full"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_flux2, *SMALL, "--objective", "nft", "--reward", REDNESS,
            "--guidance_scale", "3.5", "--max_sequence_length", "64", "--kl_beta", "0.1", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2] and "reference: shard" in log, log[-3000:]
    assert "ignored" not in log and _optimizer_steps(log) == {1: 2, 2: 4}, log[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "seconds", "stats"} and len(rewards["mean"]) == 2
    _check_seconds(rewards["seconds"], 2)

    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    from diffusers_zero3.families import FLUX2

    before = load_file(f"{tiny_flux2}/transformer/diffusion_pytorch_model.safetensors")
    after = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys() and any(not (before[k] == after[k]).all() for k in before)
    assert isinstance(_load_pipeline(FLUX2, str(out)).transformer, Flux2Transformer2DModel)


@pytest.mark.e2e
def test_flux2_klein_lora_grpo_with_cfg(tiny_flux2_klein, tmp_path):
    """Flux.2 [klein] (a base model: no guidance input): CFG with the empty prompt, as
    ``Flux2KleinPipeline``; the LoRA loads with its ``load_lora_weights``."""
    out = tmp_path / "klein-lora"
    argv = [*LAUNCH, "--pretrained_model_name_or_path", tiny_flux2_klein, *SMALL, "--rank", "4", "--reward", REDNESS,
            "--guidance_scale", "2", "--max_sequence_length", "16", "--output_dir", str(out)]  # fmt: skip
    _, log = run_launcher(argv, timeout=240)
    assert sorted(_rounds(log)) == [1, 2] and _optimizer_steps(log) == {1: 2, 2: 4}, log[-3000:]
    assert "ignored" not in log, log[-3000:]  # a base model: CFG runs
    rewards = json.loads((out / "rewards.json").read_text())
    assert set(rewards) == {"mean", REDNESS, "seconds", "stats"} and len(rewards["mean"]) == 2

    import torch

    from diffusers_zero3.families import FLUX2_KLEIN

    pipe = _load_pipeline(FLUX2_KLEIN, tiny_flux2_klein)
    pipe.load_lora_weights(out)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    image = pipe(prompt="a red circle", num_inference_steps=2, height=32, width=32, max_sequence_length=16,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert image.images[0].size == (32, 32)


def _default_flags(pipe: str, output_dir: str) -> list[str]:
    """The flags ``make train-grpo`` (scripts/train_grpo_default.sh) gives scripts/train_grpo.py,
    read from the script, its pipeline and output folder replaced: the learning check below
    follows the embedded default when that changes."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "scripts" / "train_grpo_default.sh").read_text()
    call = text.split("scripts/train_grpo.py", 1)[1].split('"$@"', 1)[0].replace("\\\n", " ")
    flags = shlex.split(call)
    return [{"$OUT/tiny-sd3": pipe, "$OUT/grpo-run": output_dir}.get(f, f) for f in flags]


def _with_flag(flags: list[str], name: str, value: str) -> list[str]:
    """``flags`` with ``name``'s value replaced (an appending flag such as --reward is not
    overridden by a second occurrence)."""
    i = flags.index(name)
    return [*flags[: i + 1], value, *flags[i + 2 :]]


LEARNING_ROUNDS = 6


@pytest.mark.e2e
def test_both_objectives_raise_a_reward_and_its_negation(tiny_sd3, tmp_path):
    """The learning check on the embedded default (``make train-grpo``'s flags: a tiny SD3, 4
    prompts x 4 images on 2 ranks, one optimizer step a round), for 6 rounds instead of 60:
    GRPO and DiffusionNFT each raise the mean redness and, with the reward's weight -1, the
    mean of the negated redness (the direction follows the reward, not the initialisation:
    the same first round, then apart). Each raise is the mean of the last 2 rounds over the
    first 2 by at least 0.005; measured on this CPU host: 0.013 to 0.030 (redness starts at
    0.008). The four launches run side by side."""
    runs = {}
    for objective in ("grpo", "nft"):
        for weight in ("1", "-1"):
            out = tmp_path / f"{objective}{weight}"
            flags = _default_flags(tiny_sd3, str(out))
            flags = _with_flag(flags, "--reward", f"{REDNESS}={weight}")
            flags = _with_flag(flags, "--objective", objective)
            flags = _with_flag(flags, "--max_train_steps", str(LEARNING_ROUNDS))
            flags += ["--report_to", "none"]
            # a port of its own each (LAUNCH's one port, shared, would join the runs' ranks)
            runs[objective, weight] = (out, [*accelerate_launch("scripts/train_grpo.py"), *flags])
    assert len({argv[argv.index("--main_process_port") + 1] for _, argv in runs.values()}) == len(runs)
    logs = run_launchers_side_by_side([{"argv": argv} for _, argv in runs.values()], timeout=400)
    curves = {}
    for (key, (out, _)), (_, log) in zip(runs.items(), logs):
        assert _optimizer_steps(log)[LEARNING_ROUNDS] == LEARNING_ROUNDS, log[-3000:]  # one step a round
        curves[key] = json.loads((out / "rewards.json").read_text())["mean"]
    for key, curve in curves.items():
        assert len(curve) == LEARNING_ROUNDS, (key, curve)
        rise = sum(curve[-2:]) / 2 - sum(curve[:2]) / 2
        assert rise > 0.005, (key, rise, curves)
    # the same samples in round 1, scored with opposite signs
    for objective in ("grpo", "nft"):
        assert curves[objective, "1"][0] == pytest.approx(-curves[objective, "-1"][0], abs=1e-6), curves


# ------------------------------------------------------------------ video: Wan


@pytest.fixture(scope="module")
def tiny_video_judge(tmp_path_factory):
    """A tiny UnifiedReward video judge (``tests.test_video_judges``): the folder."""
    from tests.test_video_judges import save_tiny_video_judge

    return str(save_tiny_video_judge(tmp_path_factory.mktemp("video-judge")))


# 4 prompts x 4 clips of 5 frames; one optimizer step a round (every sample in one micro-batch);
# the reward: less red clips (redness through 8 frames, weight -1) beside the sharded video judge
WAN_PROMPTS = ["a red circle", "a blue square", "a green circle", "a yellow square"]


def _wan_flags(folder: str, judge: str, out) -> list[str]:
    return ["--pretrained_model_name_or_path", folder, "--prompts", *WAN_PROMPTS, "--group_size", "4",
            "--reward", f"{REDNESS}=-1", "--reward", "unifiedreward_video=0.01",
            "--reward_model", f"unifiedreward_video={judge}", "--resolution", "32", "--num_inference_steps", "6",
            "--sample_batch_size", "8", "--train_batch_size", "16", "--learning_rate", "3e-2",
            "--max_train_steps", "4", "--checkpointing_steps", "2", "--report_to", "none",
            "--output_dir", str(out)]  # fmt: skip


@pytest.mark.e2e
def test_video_rl_wan21_split_over_two_ranks_equals_one_process_learns_and_resumes_and_wan22_5b_lora_nft(
    tiny_wan, tiny_wan22_5b, tiny_video_judge, tmp_path
):
    """Wan 2.1 full fine-tuning with Flow-GRPO on 5-frame clips, each clip's sequence split over
    both ranks (``--context_parallel_size 2``: one group of 2 ranks draws all 16 clips, and each
    rank decodes and scores every other one), scored by an image reward through their frames
    and by a sharded UnifiedReward judge of whole clips: every round's rewards equal a 1-process
    run's with gradient checkpointing (measured 3e-7 apart), the reward rises (measured: -0.107 to -0.098 over 3 rounds), a
    resume from round 2 in a fresh folder gives rounds 3 and 4 again exactly, the sample grid
    holds each clip's frames in a row, and the saved pipeline loads with
    ``WanPipeline.from_pretrained`` and makes a clip. Beside them (the launches side by side):
    Wan 2.2 TI2V-5B (a timestep per latent token) with LoRA and DiffusionNFT on 2 ranks, 9-frame
    clips scored through 3 of their frames: two rounds, one optimizer step each, and LoRA weights
    that load into the pipeline."""
    split, one, five = tmp_path / "split", tmp_path / "one", tmp_path / "5b"
    argv = [*LAUNCH, *_wan_flags(tiny_wan, tiny_video_judge, split), "--context_parallel_size", "2"]
    single = [*accelerate_launch("scripts/train_grpo.py", 1), *_wan_flags(tiny_wan, tiny_video_judge, one),
              "--gradient_checkpointing"]  # fmt: skip
    five_argv = [*accelerate_launch("scripts/train_grpo.py"), "--pretrained_model_name_or_path", tiny_wan22_5b,
                 *SMALL, "--objective", "nft", "--rank", "4", "--reward", REDNESS, "--num_frames", "9",
                 "--reward_frames", "3", "--train_batch_size", "5", "--sample_grid_steps", "2",
                 "--output_dir", str(five)]  # fmt: skip
    (_, log), (_, log_one), (_, log_five) = run_launchers_side_by_side(
        [{"argv": argv}, {"argv": single}, {"argv": five_argv}], timeout=400
    )
    rounds, rounds_one = _rounds(log), _rounds(log_one)
    assert sorted(rounds) == [1, 2, 3, 4], log[-3000:]
    assert _optimizer_steps(log) == {1: 1, 2: 2, 3: 3, 4: 4}, log[-3000:]
    for n in rounds:  # the same samples and updates, the attention split over the ranks
        assert rounds[n] == pytest.approx(rounds_one[n], abs=1e-5), (rounds, rounds_one)
    rewards = json.loads((split / "rewards.json").read_text())
    judged = rewards["unifiedreward_video"]
    assert all(0 <= s <= 1 for s in judged) and len(judged) == 4, judged
    for mean, red, judge in zip(rewards["mean"], rewards[REDNESS], judged):
        assert mean == pytest.approx(-red + 0.01 * judge, abs=1e-5)
    curve = rewards["mean"]
    assert sum(curve[-2:]) / 2 - sum(curve[:2]) / 2 > 0.003, curve
    from PIL import Image

    # each rank of the group decodes and scores half of its 16 clips: rank 0's 8 clips of 5 frames
    assert Image.open(split / "samples" / "round-2.png").size == (5 * 32, 8 * 32)
    again = resume_in_fresh_folder(argv[:-4] + argv[-2:], split, tmp_path / "resumed", "checkpoint-2")
    assert _rounds(again) == {3: rounds[3], 4: rounds[4]}, again[-3000:]

    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(split)
    clip = pipe("a red circle", num_inference_steps=2, height=32, width=32, num_frames=5, output_type="pt",
                generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert clip.shape == (1, 5, 3, 32, 32)

    assert sorted(_rounds(log_five)) == [1, 2], log_five[-3000:]
    stats = json.loads((five / "rewards.json").read_text())["stats"]
    assert all(v is not None for v in stats["old_deviate"]), stats
    assert Image.open(five / "samples" / "round-2.png").size == (
        9 * 32,
        5 * 32,
    )  # rank 0's 5 clips of 9 frames
    pipe = WanPipeline.from_pretrained(tiny_wan22_5b)
    pipe.load_lora_weights(five)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    clip = pipe("a red circle", num_inference_steps=2, height=32, width=32, num_frames=5, output_type="pt",
                generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert clip.shape == (1, 5, 3, 32, 32)


@pytest.fixture(scope="module")
def tiny_wan22(tmp_path_factory):
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import WAN22

    return str(save_tiny_pipeline(WAN22, tmp_path_factory.mktemp("wan22") / "tiny-wan22"))


def _trained_experts(log: str) -> dict[int, str]:
    """``{round: the expert it trained}`` from Wan 2.2 A14B's round lines."""
    return {int(s): name for s, name in re.findall(r"step (\d+) reward .*; trained (\w+)", log)}


@pytest.mark.e2e
def test_wan22_a14b_trains_the_expert_of_each_round_and_resumes_exactly(tiny_wan22, tmp_path):
    """Wan 2.2 A14B on 2 ranks, both experts trained, each its own ZeRO-3 engine: a round samples
    with the expert of each step's timestep (the high-noise one at timestep >= 875: 2 of the 6
    steps here) and trains the expert drawn for it (``wan.expert_of_step`` of the round, the
    high one with probability 2/6: low, low, high, low for seed 2) on that expert's steps only.
    Full fine-tuning with DiffusionNFT, a KL to each expert's sharded reference, each expert's
    EMA and old policy: a resume from round 2 in a fresh folder gives rounds 3 (the high expert)
    and 4 (the low one) exactly, and both experts of the saved pipeline moved. Beside it,
    Flow-GRPO for 2 rounds (the low expert twice). LoRA is refused in one line (diffusers' Wan
    LoRA file holds one expert's adapters)."""
    from diffusers_zero3.families.wan import expert_of_step

    out, grpo = tmp_path / "nft", tmp_path / "grpo"
    common = ["--pretrained_model_name_or_path", tiny_wan22, "--prompts", "a red circle", "a blue square",
              "a green circle", "--group_size", "3", "--reward", f"{REDNESS}=-1", "--resolution", "32",
              "--num_inference_steps", "6", "--timestep_fraction", "0.34", "--sample_batch_size", "3",
              "--train_batch_size", "5", "--learning_rate", "1e-3", "--report_to", "none", "--seed", "2"]  # fmt: skip
    argv = [*LAUNCH, *common, "--objective", "nft", "--kl_beta", "0.01", "--use_ema", "--ema_update_every", "1",
            "--max_train_steps", "4", "--checkpointing_steps", "2", "--output_dir", str(out)]  # fmt: skip
    grpo_argv = [*accelerate_launch("scripts/train_grpo.py"), *common, "--max_train_steps", "2",
                 "--output_dir", str(grpo)]  # fmt: skip
    lora_argv = [
        *accelerate_launch("scripts/train_grpo.py", 1),
        *common,
        "--rank",
        "4",
        "--output_dir",
        str(tmp_path / "lora"),
    ]
    (_, log), (_, grpo_log), (_, lora_log) = run_launchers_side_by_side(
        [{"argv": argv}, {"argv": grpo_argv}, {"argv": lora_argv, "expect_rc": None}], timeout=400
    )
    assert "error: --rank: Wan 2.2 A14B's rounds train both experts; LoRA trains one at a time" in lora_log, (
        lora_log[-2000:]
    )
    assert "the high-noise one with probability 0.33 (2 of 6 sampled steps at timestep >= 875)" in log, log[
        -3000:
    ]
    drawn = {r + 1: expert_of_step(2, r, 2 / 6) for r in range(4)}
    assert drawn == {1: "transformer_2", 2: "transformer_2", 3: "transformer", 4: "transformer_2"}
    assert _trained_experts(log) == drawn, log[-3000:]
    assert _optimizer_steps(log) == {1: 1, 2: 2, 3: 3, 4: 4}, log[-3000:]  # one a round, over both engines
    rounds = _rounds(log)
    again = resume_in_fresh_folder(argv[:-2], out, tmp_path / "resumed", "checkpoint-2")
    assert _rounds(again) == {3: rounds[3], 4: rounds[4]}, again[-3000:]
    assert _trained_experts(again) == {3: "transformer", 4: "transformer_2"}

    import torch
    from diffusers import WanPipeline

    source, trained = WanPipeline.from_pretrained(tiny_wan22), WanPipeline.from_pretrained(out)
    for name in ("transformer", "transformer_2"):
        moved = max(
            (a - b).abs().max().item()
            for a, b in zip(getattr(source, name).parameters(), getattr(trained, name).parameters())
        )
        assert moved > 0, name
    assert _trained_experts(grpo_log) == {1: "transformer_2", 2: "transformer_2"}, grpo_log[-3000:]
    clip = trained("a red circle", num_inference_steps=2, height=32, width=32, num_frames=5, output_type="pt",
                   generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert clip.shape == (1, 5, 3, 32, 32)


@pytest.mark.unit
def test_make_train_grpo_model_wan_flags_parse_and_another_model_is_one_error_line(tmp_path):
    """``make train-grpo MODEL=wan``'s flags (scripts/train_grpo_wan_default.sh) are settings of
    scripts/train_grpo.py: a Wan clip reward through the frames beside the sharded judge of whole
    clips; ``MODEL=flux`` stops at one error line, before anything runs."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    from diffusers_zero3.recipes.grpo import GRPOSettings

    root = Path(__file__).resolve().parent.parent
    text = (root / "scripts" / "train_grpo_wan_default.sh").read_text()
    call = text.split("scripts/train_grpo.py", 1)[1].split('"$@"', 1)[0].replace("\\\n", " ")
    flags = [f.replace("$OUT", str(tmp_path)) for f in shlex.split(call)]
    settings = GRPOSettings.parse(flags)
    assert settings.reward == [f"{REDNESS}=-1", "unifiedreward_video=0.001"] and settings.num_frames == 5
    assert settings.reward_model == [f"unifiedreward_video={tmp_path}/tiny-video-judge"]
    run = subprocess.run(["bash", "scripts/train_grpo_default.sh"], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "MODEL": "flux"}, timeout=60)  # fmt: skip
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "error: MODEL=flux: make train-grpo trains the tiny SD3 (the default) or MODEL=wan"
    ]
