"""Model families: detection, prompt encoding against the pipelines' own ``encode_prompt``,
SDXL's crop conditioning, the objective against diffusers' training code, and the cache
against the live models on 2 ZeRO-3 ranks."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.distributed_harness import run_on_ranks

# --------------------------------------------------------------------------- detection


@pytest.mark.unit
def test_family_detected_from_model_index(tiny_pipeline, tiny_sdxl, tiny_flux, tiny_sd3, tmp_path):
    from diffusers_zero3.families import FLUX, SD, SD3, SDXL, detect_family
    from diffusers_zero3.state.pretrained import CheckpointError

    assert detect_family(tiny_pipeline) is SD
    assert detect_family(tiny_sdxl[0]) is SDXL
    assert detect_family(tiny_flux[0]) is FLUX
    assert detect_family(tiny_sd3[0]) is SD3
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    from diffusers_zero3.families import FAMILIES

    supported = ", ".join(sorted(FAMILIES))
    assert "FluxPipeline, " in supported and "StableDiffusionXLPipeline" in supported
    with pytest.raises(
        CheckpointError, match=f"KandinskyPipeline pipeline; supported pipelines: {supported}$"
    ):
        detect_family(tmp_path)


# --------------------------------------------------------------------------- prompts


@pytest.mark.unit
@pytest.mark.parametrize("which", ["sd", "sdxl", "flux", "sd3"])
def test_conditioning_equals_the_pipelines_own_encode_prompt(
    tiny_pipeline, tiny_sdxl, tiny_flux, tiny_sd3, which
):
    from diffusers import DiffusionPipeline

    from diffusers_zero3.families import detect_family

    source = {"sd": tiny_pipeline, "sdxl": tiny_sdxl[0], "flux": tiny_flux[0], "sd3": tiny_sd3[0]}[which]
    family = detect_family(source)
    pipe = DiffusionPipeline.from_pretrained(source)
    prompts = ["a red circle", "a blue square on grey"]
    tokenizers = family.load_tokenizers(source)
    ids = family.tokenize(tokenizers, prompts, max_sequence_length=24 if family.flow_matching else None)
    common = dict(device="cpu", num_images_per_prompt=1)
    with torch.no_grad():
        encoders = {spec.name: getattr(pipe, spec.name) for spec in family.text_encoders}
        cond = family.conditioning(family.encode_texts(encoders, ids))
        if which == "sd":
            expected, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, **common)
        elif which == "sdxl":
            expected, _, pooled, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, **common)
            torch.testing.assert_close(cond["text_embeds"], pooled)
        elif which == "flux":
            expected, pooled, _ = pipe.encode_prompt(prompts, prompts, max_sequence_length=24, **common)
            torch.testing.assert_close(cond["pooled_projections"], pooled)
        else:
            expected, _, pooled, _ = pipe.encode_prompt(
                prompts, prompts, prompts, do_classifier_free_guidance=False, max_sequence_length=24, **common
            )
            assert expected.shape[1] == 77 + 24  # CLIP tokens, then T5's
            torch.testing.assert_close(cond["pooled_projections"], pooled)
    torch.testing.assert_close(cond["encoder_hidden_states"], expected)


@pytest.mark.unit
def test_flux_prediction_is_the_pipelines_packed_transformer_call(tiny_flux):
    """``FLUX.predict`` packs the latents, builds ``img_ids``/``txt_ids``, passes sigma as the
    timestep and the guidance value, and unpacks: the same numbers as ``FluxPipeline``'s own
    helpers and transformer call."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from diffusers_zero3.families import FLUX

    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux[0], subfolder="transformer")
    assert transformer.config.guidance_embeds
    torch.manual_seed(0)
    latents = torch.randn(2, 16, 8, 6)
    cond = {"encoder_hidden_states": torch.randn(2, 5, 32), "pooled_projections": torch.randn(2, 32)}
    timesteps = torch.tensor([250.0, 900.0])
    with torch.no_grad():
        ours = FLUX.predict(transformer, latents, timesteps, cond, guidance_scale=3.5)
        packed = FluxPipeline._pack_latents(latents, 2, 16, 8, 6)
        expected = transformer(
            hidden_states=packed,
            timestep=timesteps / 1000,
            guidance=torch.full((2,), 3.5),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=cond["encoder_hidden_states"],
            txt_ids=torch.zeros(5, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32),
            return_dict=False,
        )[0]
        expected = FluxPipeline._unpack_latents(expected, 8 * 8, 6 * 8, 8)
        other_guidance = FLUX.predict(transformer, latents, timesteps, cond, guidance_scale=1.0)
    assert ours.shape == latents.shape
    torch.testing.assert_close(ours, expected)
    assert not torch.allclose(other_guidance, ours)  # the guidance value reaches the model


@pytest.mark.unit
@pytest.mark.parametrize("scheme", ["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"])
def test_flow_matching_loss_is_diffusers_rectified_flow(tiny_flux, scheme):
    """The denoiser sees ``(1 - sigma) x + sigma n`` at ``timestep = 1000 sigma`` with sigma
    from the scheduler's own table; predicting ``n - x`` gives zero loss, predicting zero gives
    the weighted mean of ``(n - x)^2`` with diffusers' weighting."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    from diffusers_zero3.families.objectives import ObjectiveSettings, flow_matching_loss

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_flux[0], subfolder="scheduler")
    torch.manual_seed(1)
    x, n = torch.randn(4, 16, 4, 4), torch.randn(4, 16, 4, 4)
    seen = {}

    def exact(noisy, timesteps):
        sigmas = (timesteps / 1000).view(-1, 1, 1, 1)
        torch.testing.assert_close(noisy, (1 - sigmas) * x + sigmas * n)
        assert all(bool((scheduler.timesteps == t).any()) for t in timesteps)
        seen["sigmas"] = sigmas
        return n - x

    assert flow_matching_loss(
        exact, scheduler, x, n, settings=ObjectiveSettings(weighting_scheme=scheme)
    ).item() == pytest.approx(0, abs=1e-6)
    torch.manual_seed(2)
    loss = flow_matching_loss(
        exact, scheduler, x, n, settings=ObjectiveSettings(weighting_scheme=scheme)
    )  # draws the sigmas
    torch.manual_seed(2)
    zero = flow_matching_loss(
        lambda noisy, t: torch.zeros_like(noisy),
        scheduler,
        x,
        n,
        settings=ObjectiveSettings(weighting_scheme=scheme),
    )
    weights = compute_loss_weighting_for_sd3(scheme, seen["sigmas"])
    expected = (weights * (n - x) ** 2).reshape(4, -1).mean(dim=1).mean()
    assert loss.item() == pytest.approx(0, abs=1e-6)
    torch.testing.assert_close(zero, expected)
    with pytest.raises(ValueError, match="weighting scheme must be one of"):
        flow_matching_loss(exact, scheduler, x, n, settings=ObjectiveSettings(weighting_scheme="uniform"))


@pytest.mark.unit
def test_flags_that_do_not_apply_to_a_family_are_refused(tiny_flux, tiny_pipeline):
    from diffusers_zero3.args import ArgumentError
    from diffusers_zero3.families import FLUX, SD
    from diffusers_zero3.recipes.text_to_image_settings import (
        TextToImageSettings,
        check_resolution,
        validate_family,
    )

    def args(*extra):
        return TextToImageSettings.parse(
            ["--pretrained_model_name_or_path", "p", "--train_data_dir", "d", *extra]
        )

    validate_family(args("--weighting_scheme", "cosmap", "--max_sequence_length", "64"), FLUX)
    validate_family(args("--snr_gamma", "5"), SD)
    with pytest.raises(
        ArgumentError, match="--snr_gamma 5.0 does not apply to a FluxPipeline, which trains with flow"
    ):
        validate_family(args("--snr_gamma", "5"), FLUX)
    with pytest.raises(
        ArgumentError, match="--weighting_scheme cosmap does not apply to a StableDiffusionPipeline"
    ):
        validate_family(args("--weighting_scheme", "cosmap"), SD)
    with pytest.raises(ArgumentError, match="--text_encoder_3_placement shard: a FluxPipeline has no"):
        validate_family(args("--text_encoder_3_placement", "shard"), FLUX)
    # Flux packs 2x2 latents: sides must be a multiple of twice the VAE's downsampling.
    check_resolution(32, FLUX, f"{tiny_flux[0]}/vae")
    with pytest.raises(
        ArgumentError, match="--resolution must be a multiple of 4 for this FluxPipeline, got 34"
    ):
        check_resolution(34, FLUX, f"{tiny_flux[0]}/vae")
    check_resolution(34, SD, f"{tiny_flux[0]}/vae")


@pytest.mark.unit
@pytest.mark.parametrize("center_crop", [True, False])
def test_crop_conditioning_records_where_each_crop_came_from(center_crop):
    """For random and centre crops, flipped or not, ``crop_top_left`` points at the crop in
    the resized image (in the flipped image when flipped, as diffusers' SDXL script records
    it), and ``time_ids`` are what the SDXL pipeline builds from the same numbers."""
    import numpy as np
    from PIL import Image

    from diffusers_zero3.data.images import transform_image_with_crop
    from diffusers_zero3.demo import shape_image
    from diffusers_zero3.families import time_ids

    image = shape_image("red", "circle", 40, random.Random(1), width=56)
    seen_flips = set()
    for seed in range(12):
        pixels, crop = transform_image_with_crop(image, 32, center_crop, True, random.Random(seed))
        assert crop.original_size == (40, 56)
        resized = image.resize((45, 32), Image.BILINEAR)  # shorter side to 32
        if crop.flipped:
            resized = resized.transpose(Image.FLIP_LEFT_RIGHT)
        top, left = crop.crop_top_left
        expected = np.asarray(resized.crop((left, top, left + 32, top + 32)), dtype=np.float32) / 127.5 - 1
        torch.testing.assert_close(pixels, torch.from_numpy(expected).permute(2, 0, 1))
        seen_flips.add(crop.flipped)
    assert seen_flips == {True, False}

    from diffusers import StableDiffusionXLPipeline

    ids = time_ids(torch.tensor([[40, 56]]), torch.tensor([[0, 6]]), 32)
    reference = StableDiffusionXLPipeline._get_add_time_ids
    unet = type("U", (), {"config": type("C", (), {"addition_time_embed_dim": 8})(),
                          "add_embedding": type("A", (), {"linear_1": torch.nn.Linear(80, 1)})()})()  # fmt: skip
    expected = reference(type("P", (), {"unet": unet})(), (40, 56), (0, 6), (32, 32), torch.float32, 32)
    torch.testing.assert_close(ids, expected)


# --------------------------------------------------------------------------- objective


def _objective_inputs(tiny_pipeline, prediction_type="epsilon"):
    from diffusers import DDPMScheduler, UNet2DConditionModel

    scheduler = DDPMScheduler.from_pretrained(tiny_pipeline, subfolder="scheduler")
    scheduler.register_to_config(prediction_type=prediction_type)
    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(4, 4, 16, 16, generator=g)
    states = torch.randn(4, 77, 32, generator=g)
    noise = torch.randn(4, 4, 16, 16, generator=g)
    timesteps = torch.tensor([3, 250, 600, 990])
    return unet, scheduler, latents, states, noise, timesteps


@pytest.mark.unit
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_objective_matches_diffusers_training_utils(tiny_pipeline, prediction_type):
    """Min-SNR weighting with diffusers' own ``compute_snr`` and the targets of diffusers'
    script: a wrong weight (e.g. ``/ (snr + 1)`` for epsilon) fails here."""
    import torch.nn.functional as F
    from diffusers.training_utils import compute_snr

    from diffusers_zero3.families.objectives import DDPMDraw, ObjectiveSettings, diffusion_loss

    unet, scheduler, latents, states, noise, t = _objective_inputs(tiny_pipeline, prediction_type)
    with torch.no_grad():
        pred = unet(scheduler.add_noise(latents, noise, t), t, states).sample
        target = noise if prediction_type == "epsilon" else scheduler.get_velocity(latents, noise, t)
        alphas = scheduler.alphas_cumprod[t]
        if prediction_type == "v_prediction":  # v = sqrt(a) * noise - sqrt(1 - a) * x0
            manual_v = (
                alphas.sqrt().view(-1, 1, 1, 1) * noise - (1 - alphas).sqrt().view(-1, 1, 1, 1) * latents
            )
            torch.testing.assert_close(target, manual_v)
        predict = lambda x, ts: unet(x, ts, states).sample  # noqa: E731
        plain = diffusion_loss(predict, scheduler, latents, DDPMDraw(noise, t))
        torch.testing.assert_close(plain, F.mse_loss(pred, target))

        snr = compute_snr(scheduler, t)
        weights = torch.minimum(snr, torch.full_like(snr, 5.0))
        weights = weights / snr if prediction_type == "epsilon" else weights / (snr + 1)
        per_sample = F.mse_loss(pred, target, reduction="none").mean(dim=(1, 2, 3))
        ours = diffusion_loss(
            predict, scheduler, latents, DDPMDraw(noise, t), settings=ObjectiveSettings(snr_gamma=5.0)
        )
        torch.testing.assert_close(ours, (per_sample * weights).mean())
        assert not torch.allclose(ours, plain)


@pytest.mark.unit
def test_noise_offset_input_perturbation_and_dream_match_diffusers(tiny_pipeline):
    import torch.nn.functional as F
    from diffusers.training_utils import compute_dream_and_update_latents

    from diffusers_zero3.families.objectives import DDPMDraw, ObjectiveSettings, diffusion_loss, sample_noise

    unet, scheduler, latents, states, noise, t = _objective_inputs(tiny_pipeline)
    # Noise offset, as diffusers' script draws it: noise + offset * randn(b, c, 1, 1).
    ours = sample_noise(latents, 0.1, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    theirs = torch.randn(latents.shape, generator=g) + 0.1 * torch.randn((4, 4, 1, 1), generator=g)
    torch.testing.assert_close(ours, theirs)

    with torch.no_grad():
        # Input perturbation: the noisy input uses noise + p * perturbation, the target is noise.
        perturbation = torch.randn_like(noise)
        noisy = scheduler.add_noise(latents, noise + 0.1 * perturbation, t)
        expected = F.mse_loss(unet(noisy, t, states).sample, noise)
        predict = lambda x, ts: unet(x, ts, states).sample  # noqa: E731
        got = diffusion_loss(
            predict,
            scheduler,
            latents,
            DDPMDraw(noise, t, perturbation),
            settings=ObjectiveSettings(input_perturbation=0.1),
        )
        torch.testing.assert_close(got, expected)

        # DREAM through diffusers' own helper.
        noisy = scheduler.add_noise(latents, noise, t)
        dream_latents, dream_target = compute_dream_and_update_latents(
            unet, scheduler, t, noise, noisy, noise, states, 1.0
        )
        expected = F.mse_loss(unet(dream_latents, t, states).sample, dream_target)
        got = diffusion_loss(
            predict,
            scheduler,
            latents,
            DDPMDraw(noise, t),
            settings=ObjectiveSettings(dream_detail_preservation=1.0),
        )
        torch.testing.assert_close(got, expected)


@pytest.mark.unit
def test_timestep_bias_weights():
    from diffusers_zero3.families.objectives import sample_timesteps, timestep_bias_weights

    assert timestep_bias_weights(1000) is None
    later = timestep_bias_weights(1000, "later", multiplier=3.0, portion=0.25)
    assert later[-250:].sum() == pytest.approx(3 * 250 / (750 + 3 * 250))
    ranged = timestep_bias_weights(1000, "range", multiplier=0.0 + 2.0, begin=100, end=200)
    assert ranged[150] == pytest.approx(2 * ranged[50])
    torch.manual_seed(0)
    drawn = sample_timesteps(4000, 1000, "cpu", timestep_bias_weights(1000, "earlier", 10.0, portion=0.1))
    assert (drawn < 100).float().mean() > 0.4  # 10x weight on 10 % of the range: ~53 %
    with pytest.raises(ValueError):
        timestep_bias_weights(1000, "range", begin=900, end=1200)


# --------------------------------------------------------------------------- cache vs live, 2 ranks


def _sdxl_cache_vs_live(pipe_dir: str, data_dir: str, cache_dir: str):
    import datasets

    from diffusers_zero3.data.images import ImageCaptionDataset, collate, transform_image_with_crop
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.families import SDXL, time_ids
    from diffusers_zero3.placement.frozen_inputs import CacheRequest, place_frozen_models
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=True)
    ds = datasets.load_dataset("imagefolder", data_dir=data_dir)["train"]
    tokenizers = SDXL.load_tokenizers(pipe_dir)
    common = dict(pixels=RowsToPixels(resolution=32, random_flip=True, seed=7),
                  cache=CacheRequest(ds, cache_dir, tokenizers, batch_size=2))  # fmt: skip
    live = place_frozen_models(accelerator, SDXL, pipe_dir, {"text_encoder_2": "shard"}, **common)
    cached = place_frozen_models(
        accelerator,
        SDXL,
        pipe_dir,
        {"text_encoder": "cache", "text_encoder_2": "cache", "vae": "cache"},
        **common,
    )
    assert cached.cache is not None and all(m is None for m in cached.models.values())
    data = ImageCaptionDataset(
        ds,
        RowsToPixels(
            resolution=32,
            center_crop=False,
            random_flip=True,
            seed=7,
            tokenize=lambda c: SDXL.tokenize(tokenizers, c),
        ),
    )
    rows = list(range(len(ds)))
    batch = collate([data[i] for i in rows])
    flips = torch.tensor(
        [
            transform_image_with_crop(ds[i]["image"], 32, False, True, random.Random(f"7-0-{i}"))[1].flipped
            for i in rows
        ]
    )
    assert flips.any() and not flips.all()
    from diffusers_zero3.families import SDXL as family

    with torch.no_grad():
        live_cond = family.conditioning(family.encode_texts(live.models, batch))
    from_cache = cached.cache.get(batch["index"], flip=flips)
    cache_cond = family.conditioning(from_cache)
    torch.testing.assert_close(cache_cond["encoder_hidden_states"], live_cond["encoder_hidden_states"])
    torch.testing.assert_close(cache_cond["text_embeds"], live_cond["text_embeds"])
    live_ids = time_ids(batch["original_size"], batch["crop_top_left"], 32)
    cache_ids = time_ids(from_cache["original_size"], from_cache["crop_top_left"], 32)
    torch.testing.assert_close(cache_ids, live_ids)
    assert len({tuple(r[:2].tolist()) for r in live_ids}) > 1  # varied original sizes
    # Latents: the cached distribution is the live VAE's, for the flipped rows too.
    with torch.no_grad():
        live_params = live.models["vae"].encode(batch["pixel_values"]).latent_dist.parameters
    torch.manual_seed(3)
    from_cache = cached.cache.get(batch["index"], flip=flips)
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    torch.manual_seed(3)
    expected = DiagonalGaussianDistribution(live_params).sample()
    torch.testing.assert_close(from_cache["latents"], expected, atol=1e-5, rtol=1e-4)
    print("OK sdxl cache")


@pytest.mark.multirank
def test_sdxl_cache_gives_the_live_conditioning_pooled_embeds_and_time_ids(tiny_sdxl, tmp_path):
    pipe, data = tiny_sdxl
    outs = run_on_ranks(_sdxl_cache_vs_live, pipe_dir=pipe, data_dir=data, cache_dir=str(tmp_path / "cache"))
    assert all("OK sdxl cache" in o for o in outs)


@pytest.mark.unit
def test_sdxl_vae_runs_in_fp32_under_mixed_precision(tiny_pipeline, tiny_sdxl):
    """bf16 mixed precision: SDXL's VAE stays fp32 (it overflows in half precision), the
    text encoders follow the training dtype; SD's VAE follows it too."""
    from accelerate.state import AcceleratorState, GradientState

    from diffusers_zero3 import build_accelerator
    from diffusers_zero3.families import SD, SDXL
    from diffusers_zero3.placement.frozen_inputs import place_frozen_models

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = build_accelerator(mixed_precision="bf16", cpu=True)
        xl = place_frozen_models(accelerator, SDXL, tiny_sdxl[0], {})
        assert xl.models["vae"].dtype == torch.float32
        assert xl.models["text_encoder_2"].dtype == torch.bfloat16 and xl.dtype == torch.bfloat16
        sd = place_frozen_models(accelerator, SD, tiny_pipeline, {})
        assert sd.models["vae"].dtype == torch.bfloat16
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.unit
@pytest.mark.parametrize("objective", ["ddpm", "flow"])
def test_per_sample_generators_make_a_samples_loss_independent_of_its_batch(objective):
    """With one generator per sample (seed, epoch, dataset index), a sample's noise, timestep
    and perturbation are the same alone or in any batch, so a global batch split over 1, 2 or 4
    ranks has the same loss (what resuming on another number of processes needs). The control:
    this rank's RNG gives a sample other draws in another batch."""
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    from diffusers_zero3.families.objectives import (
        DDPMObjective,
        FlowMatchingObjective,
        ObjectiveSettings,
        sample_generators,
    )

    if objective == "ddpm":
        settings = ObjectiveSettings(noise_offset=0.05, input_perturbation=0.1, snr_gamma=5.0)
        obj = DDPMObjective(DDPMScheduler(num_train_timesteps=1000), settings)
    else:
        obj = FlowMatchingObjective(
            FlowMatchEulerDiscreteScheduler(shift=3.0), ObjectiveSettings(weighting_scheme="logit_normal")
        )
    latents = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    indices = torch.tensor([11, 3, 7, 42])

    def predict(noisy, t):  # per sample, deterministic
        return 0.5 * noisy + (t.float() / 1000).view(-1, 1, 1, 1)

    def loss(rows, generators=True):
        gens = sample_generators(5, 2, indices[rows]) if generators else None
        return obj.loss(predict, latents[rows], gens)

    whole = loss([0, 1, 2, 3])
    halves = (loss([0, 1]) + loss([2, 3])) / 2
    quarters = sum(loss([i]) for i in range(4)) / 4
    torch.testing.assert_close(halves, whole)
    torch.testing.assert_close(quarters, whole)
    assert (
        sample_generators(5, 3, indices)[0].initial_seed()
        != sample_generators(5, 2, indices)[0].initial_seed()
    )
    torch.manual_seed(0)
    control_whole = loss([0, 1, 2, 3], generators=False)
    torch.manual_seed(0)
    control_halves = (loss([0, 1], generators=False) + loss([2, 3], generators=False)) / 2
    assert not torch.allclose(control_halves, control_whole)
