"""The Wan family against diffusers' own code: prompt encoding (cleaning, masks, trimming to the
valid tokens, zero padding) against ``WanPipeline.encode_prompt``, the denoiser call (and the
expert switch of Wan 2.2) against the pipeline's loop, latents against ``AutoencoderKLWan``,
the objective against the flow-matching lines of musubi-tuner's Wan recipe written out here,
the expert helpers, the published counts, and the tiny pipelines."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.unit

# three lengths, an HTML entity and runs of whitespace (the pipeline cleans them), one truncated
PROMPTS = ["a red circle", "a  blue &amp; green\n square   moving left", "", "a " * 40]
MAX_LEN = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families.wan import WAN, WAN22, WAN22_5B

    root = tmp_path_factory.mktemp("wan")
    return {f.name: str(save_tiny_pipeline(f, root / f"tiny-{f.name}")) for f in (WAN, WAN22, WAN22_5B)}


@pytest.fixture(scope="module")
def pipes(folders):
    from diffusers import DiffusionPipeline

    out = {}
    for name, folder in folders.items():
        out[name] = DiffusionPipeline.from_pretrained(folder)
        out[name].set_progress_bar_config(disable=True)
    return out


def _cond(family, folder, pipeline, prompts, max_sequence_length=MAX_LEN):
    tokenizers = family.load_tokenizers(folder)
    ids = family.tokenize(tokenizers, prompts, max_sequence_length)
    with torch.no_grad():
        outputs = family.encode_texts({"text_encoder": pipeline.text_encoder}, ids)
    return ids, outputs, family.conditioning(outputs)


def _hooked_call(pipeline, modules, **call):
    """``{module name: [(kwargs, output)]}`` of the modules' forward calls during a pipeline call."""
    calls = {name: [] for name in modules}
    hooks = [
        getattr(pipeline, name).register_forward_hook(
            lambda m, args, kwargs, out, name=name: calls[name].append((kwargs, out[0].detach().clone())),
            with_kwargs=True,
        )
        for name in modules
    ]
    try:
        pipeline(**call)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def test_the_folder_tells_the_family_and_wan22_by_its_second_expert(folders):
    from diffusers_zero3.families.wan import WAN, WAN22, WAN22_5B, is_two_expert, wan_family

    index = {name: json.loads(open(f"{folder}/model_index.json").read()) for name, folder in folders.items()}
    assert {i["_class_name"] for i in index.values()} == {"WanPipeline"}  # one class: the class cannot tell
    assert index["wan"]["transformer_2"] == [None, None] and index["wan"]["boundary_ratio"] is None
    assert index["wan22"]["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["wan22"]["boundary_ratio"] == 0.875 and index["wan22_5b"]["expand_timesteps"] is True
    assert [is_two_expert(folders[n]) for n in ("wan", "wan22", "wan22_5b")] == [False, True, False]
    assert [wan_family(folders[n]) for n in ("wan", "wan22", "wan22_5b")] == [WAN, WAN22, WAN22_5B]
    assert WAN22.boundary(folders["wan22"]) == 875.0 and WAN.boundary(folders["wan"]) is None
    assert WAN22.component_class("transformer_2").__name__ == "WanTransformer3DModel"
    assert WAN.frozen_components == ("text_encoder", "vae") == WAN22.frozen_components


def test_conditioning_equals_the_pipelines_encode_prompt(folders, pipes):
    from diffusers_zero3.families.wan import WAN

    pipe = pipes["wan"]
    ids, outputs, cond = _cond(WAN, folders["wan"], pipe, PROMPTS)
    assert ids["input_ids"].shape == (4, MAX_LEN)  # fixed length per row: each row caches alone
    lengths = outputs["prompt_embeds_mask"].sum(dim=1).tolist()
    assert len(set(lengths)) == 4 and lengths[3] == MAX_LEN  # the mask matters; the last is truncated
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(
            PROMPTS, do_classifier_free_guidance=False, max_sequence_length=MAX_LEN, device="cpu"
        )
    assert negative is None
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds, rtol=0, atol=0)
    assert set(cond) == {"encoder_hidden_states"}  # the transformer takes no text mask
    for row, n in enumerate(lengths):  # the padded rows are exact zeros, the valid ones are not
        assert torch.all(embeds[row, n:] == 0) and torch.all(embeds[row, :n].abs().sum(-1) > 0)
    with torch.no_grad():  # the control: umT5's own states at padded positions are not zero
        raw = pipe.text_encoder(ids["input_ids"], ids["attention_mask"]).last_hidden_state
    assert raw[0, lengths[0] :].abs().sum() > 0
    # the caption is cleaned as the pipeline cleans it (an uncleaned one tokenizes otherwise)
    assert WAN.prompt_text(WAN.text_encoders[0], PROMPTS[1]) == "a blue & green square moving left"
    # one row encoded alone (as the cache encodes) equals its row in the batch
    _, alone, _ = _cond(WAN, folders["wan"], pipe, PROMPTS[1:2])
    torch.testing.assert_close(alone["prompt_embeds"][0], outputs["prompt_embeds"][1])


@pytest.mark.parametrize("name", ["wan", "wan22", "wan22_5b"])
def test_prediction_is_the_pipelines_transformer_call(folders, pipes, name):
    """Every transformer call of a 3-step generation (guidance 1: no unconditional call) against
    ``predict`` on the same latents and timestep; for Wan 2.2 each step's expert as well."""
    from diffusers_zero3.families.wan import HIGH, LOW, WAN, WAN22, WAN22_5B, expert_for

    family = {"wan": WAN, "wan22": WAN22, "wan22_5b": WAN22_5B}[name]
    pipe = pipes[name]
    _, _, cond = _cond(family, folders[name], pipe, PROMPTS[:2])
    call = dict(
        prompt=PROMPTS[:2], num_inference_steps=3, height=32, width=32, num_frames=5, guidance_scale=1.0,
        max_sequence_length=MAX_LEN, generator=torch.Generator().manual_seed(0), output_type="latent",
    )  # fmt: skip
    calls = _hooked_call(pipe, family.experts, **call)
    assert sum(len(c) for c in calls.values()) == 3
    for expert, expert_calls in calls.items():
        for kwargs, expected in expert_calls:
            t = kwargs["timestep"]
            if family.expand_timesteps:  # one timestep per latent token of the 2x2 patches
                n, _, f, h, w = kwargs["hidden_states"].shape
                assert t.shape == (n, f * (h // 2) * (w // 2)) and bool((t == t[:, :1]).all())
                t = t[:, 0]
            assert kwargs["hidden_states"].ndim == 5
            with torch.no_grad():
                ours = family.predict(getattr(pipe, expert), kwargs["hidden_states"], t, cond)
            torch.testing.assert_close(ours, expected)
            assert expert_for(t, family.boundary(folders[name])) == [expert] * len(t)
    if family is WAN22:  # the 3 steps (t = 999, 857, 600 at flow_shift 3) use both experts
        assert len(calls[HIGH]) == 1 and len(calls[LOW]) == 2


def test_latents_and_normalisation_are_the_vaes(folders, pipes):
    from diffusers_zero3.families.wan import WAN, WAN22_5B

    vae = pipes["wan"].vae
    pixels = torch.rand(2, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad():
        dist = WAN.latent_distribution(vae, pixels)
        expected = vae.encode(pixels).latent_dist
        torch.testing.assert_close(dist.parameters, expected.parameters)
        z = WAN.latents_of(dist)  # the posterior mean, as Wan's own VAE encodes
        assert torch.equal(z, expected.mode()) and z.shape == (2, 8, 2, 4, 4)
        one = WAN.latent_distribution(vae, pixels[:, :, 0])  # an image: a video of one frame
        assert one.mode().shape == (2, 8, 1, 4, 4)
    latents = WAN.latent_normalizer(vae.config)(z)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    assert not torch.allclose(mean, torch.zeros_like(mean)) and not torch.allclose(std, torch.ones_like(std))
    torch.testing.assert_close(latents, (z - mean) / std)
    # the pipeline's decode undoes it: latents / (1 / std) + mean
    torch.testing.assert_close(latents / (1.0 / std) + mean, z)
    config = dict(vae.config)
    assert (WAN.latent_multiple(config), WAN.frame_multiple(config), WAN.latent_frames(81, config)) == (
        16,
        4,
        21,
    )
    assert WAN22_5B.latent_multiple(dict(pipes["wan22_5b"].vae.config)) == 32
    assert WAN.vae_in_fp32 and WAN.component_dtype("vae", torch.bfloat16) == torch.float32


def test_objective_is_the_flow_matching_of_wans_recipes(folders, pipes):
    """``WAN.loss`` against the lines of a Wan training step written out here: the scheduler at the
    published shift (UniPC's ``flow_shift`` 3.0), noise, then ``u = sigmoid(N(0, 1))`` (musubi-
    tuner's ``--timestep_sampling shift``, whose shift the scheduler's table applies), the table's
    sigma and timestep, ``(1 - sigma) x + sigma noise``, the transformer as the pipeline calls it,
    target ``noise - x``, a plain mean squared error."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusers_zero3.families.objectives import ObjectiveSettings
    from diffusers_zero3.families.wan import WAN, WAN22_5B

    pipe = pipes["wan"]
    scheduler = WAN.load_noise_scheduler(folders["wan"])
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler) and scheduler.config.shift == 3.0
    assert WAN22_5B.load_noise_scheduler(folders["wan22_5b"]).config.shift == 5.0
    assert WAN.default_weighting_scheme == "logit_normal"
    sampler = WAN.sampling_scheduler(scheduler)  # validation: the pipeline's own UniPC
    assert type(sampler) is type(pipe.scheduler) and sampler.config.flow_shift == 3.0
    _, _, cond = _cond(WAN, folders["wan"], pipe, PROMPTS[:2])
    latents = torch.randn(2, 8, 2, 4, 4)
    with torch.no_grad():
        torch.manual_seed(7)
        noise = torch.randn_like(latents)
        u = torch.sigmoid(torch.normal(mean=0.0, std=1.0, size=(2,)))
        indices = (u * 1000).long()
        sigmas = scheduler.sigmas[indices]
        shift = 3.0  # musubi: t = sigmoid(n), then shift * t / (1 + (shift - 1) t), the same up to 1/1000
        torch.testing.assert_close(sigmas, shift * (1 - u) / (1 + (shift - 1) * (1 - u)), atol=4e-3, rtol=0)
        timesteps = scheduler.timesteps[indices]
        torch.testing.assert_close(timesteps, sigmas * 1000)
        s = sigmas.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        pred = pipe.transformer(
            hidden_states=noisy, timestep=timesteps, encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
        )[0]  # fmt: skip
        expected = torch.mean((pred.float() - (noise - latents).float()) ** 2)
        torch.manual_seed(7)
        settings = ObjectiveSettings(weighting_scheme=WAN.default_weighting_scheme)
        ours = WAN.loss(pipe.transformer, scheduler, latents, cond, settings)
    torch.testing.assert_close(ours, expected)
    assert expected.item() > 0.01  # a real loss


def test_an_expert_trains_on_its_side_of_the_boundary(folders, pipes):
    from diffusers_zero3.families.objectives import (
        FlowMatchingObjective,
        ObjectiveSettings,
        sample_generators,
    )
    from diffusers_zero3.families.wan import (
        HIGH,
        LOW,
        TRAIN_EXPERTS,
        WAN22,
        ExpertFlowMatchingObjective,
        expert_for,
        expert_of_step,
    )

    pipe = pipes["wan22"]
    scheduler = WAN22.load_noise_scheduler(folders["wan22"])
    boundary = WAN22.boundary(folders["wan22"])
    assert boundary == 875.0 and TRAIN_EXPERTS["high"] == (HIGH,) and TRAIN_EXPERTS["both"] == (HIGH, LOW)
    assert expert_for(torch.tensor([999.0, 875.0, 874.9, 10.0]), boundary) == [HIGH, HIGH, LOW, LOW]
    assert expert_for(torch.tensor([10.0]), None) == [HIGH]  # Wan 2.1: one transformer everywhere
    high = WAN22.expert_timesteps(scheduler, HIGH, boundary)
    assert bool((scheduler.timesteps[high] >= 875).all()) and bool((scheduler.timesteps[~high] < 875).all())
    assert int(high.sum()) == 300  # shift 3: sigma >= 0.875 <=> unshifted sigma >= 0.7
    _, _, cond = _cond(WAN22, folders["wan22"], pipe, ["a red circle"] * 4)
    latents = torch.randn(4, 8, 2, 4, 4)
    settings = ObjectiveSettings(weighting_scheme="logit_normal")
    for expert, side in ((HIGH, lambda t: t >= boundary), (LOW, lambda t: t < boundary)):
        seen = []

        def predict(noisy, t, expert=expert, seen=seen):
            seen.append(t.clone())
            return WAN22.predict(getattr(pipe, expert), noisy, t, cond)

        objective = WAN22.objective(scheduler, settings, expert, boundary)
        for seed in range(3):
            torch.manual_seed(seed)
            with torch.no_grad():
                assert objective.loss(predict, latents).item() > 0
        assert all(bool(side(t).all()) for t in seen) and len(torch.cat(seen).unique()) > 3
    # per-sample generators: each sample's timestep is the first draw of its own sequence (after its
    # noise) that lands on the expert's side, as a rejection sampler keeps the density's shape
    generators = sample_generators(0, 0, [3, 4, 5])
    objective = ExpertFlowMatchingObjective(scheduler, settings, high)
    u = objective.draw_u(3, generators)
    for k, g in enumerate(sample_generators(0, 0, [3, 4, 5])):
        while True:
            v = torch.sigmoid(torch.normal(0.0, 1.0, size=(1,), generator=g))
            if scheduler.timesteps[(v * 1000).long()] >= boundary:
                break
        assert torch.equal(u[k : k + 1], v)
    # the restricted code path with every entry allowed is objectives.flow_matching_loss itself
    every = torch.ones_like(high)
    with torch.no_grad():
        predict = lambda noisy, t: WAN22.predict(pipe.transformer, noisy, t, cond)  # noqa: E731
        gens = lambda: sample_generators(1, 2, [0, 1, 2, 3])  # noqa: E731
        ours = ExpertFlowMatchingObjective(scheduler, settings, every).loss(predict, latents, gens(), "none")
        reference = FlowMatchingObjective(scheduler, settings).loss(predict, latents, gens(), "none")
    torch.testing.assert_close(ours, reference)
    # --train_experts both: one expert per micro-batch, the high one as often as the density is there
    for scheme in ("none", "logit_normal", "mode"):
        s = ObjectiveSettings(weighting_scheme=scheme)
        p = WAN22.expert_probability(scheduler, s, boundary)
        from diffusers.training_utils import compute_density_for_timestep_sampling

        torch.manual_seed(0)
        draws = compute_density_for_timestep_sampling(scheme, 200_000, 0.0, 1.0, 1.29)
        monte_carlo = float(
            (scheduler.timesteps[(draws * 1000).long().clamp(max=999)] >= boundary).double().mean()
        )
        assert abs(p - monte_carlo) < 0.005, (scheme, p, monte_carlo)
    picks = [expert_of_step(0, step, 0.3) for step in range(2000)]
    assert picks == [expert_of_step(0, step, 0.3) for step in range(2000)]  # the same on every rank
    assert 0.25 < picks.count(HIGH) / len(picks) < 0.35
    with pytest.raises(ValueError, match="expert must be"):
        WAN22.expert_timesteps(scheduler, "transformer_3", boundary)


def test_published_counts():
    """Exact counts of the published configs built on the meta device (the papers' round names:
    Wan 2.1 "1.3B" and "14B" (arXiv:2503.20314), its VAE "127M", Wan 2.2 "A14B" = two 14 B experts
    and "TI2V-5B")."""
    from diffusers_zero3.families.wan import WAN, WAN22, WAN22_5B
    from diffusers_zero3.placement.plan import build_on_meta

    counts = {}
    for family in (WAN, WAN22, WAN22_5B):
        for pub in family.published():
            assert pub.pipeline_class == "WanPipeline"
            counts[pub.hub_id] = {
                name: sum(p.numel() for p in build_on_meta(lib, cls, cfg).parameters())
                for name, (lib, cls, cfg) in pub.components.items()
            }
    umt5, vae21 = 5_680_910_336, 126_892_531
    assert counts == {
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {
            "transformer": 1_418_996_800,
            "text_encoder": umt5,
            "vae": vae21,
        },
        "Wan-AI/Wan2.1-T2V-14B-Diffusers": {
            "transformer": 14_288_491_584,
            "text_encoder": umt5,
            "vae": vae21,
        },
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": {
            "transformer": 14_288_491_584,
            "transformer_2": 14_288_491_584,
            "text_encoder": umt5,
            "vae": vae21,
        },
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": {
            "transformer": 4_999_787_712,
            "text_encoder": umt5,
            "vae": 704_688_668,
        },
    }
    vae22 = WAN22_5B.published()[0].components["vae"][2]
    assert (WAN22_5B.latent_multiple(vae22), WAN22_5B.frame_multiple(vae22)) == (32, 4)
    vae = WAN.published()[0].components["vae"][2]
    assert (WAN.latent_multiple(vae), WAN.frame_multiple(vae)) == (16, 4)


def test_tiny_pipelines_load_and_generate_short_videos(folders, pipes):
    from diffusers import WanPipeline

    from diffusers_zero3.families.wan import WAN, WAN22

    for name, pipe in pipes.items():
        assert isinstance(pipe, WanPipeline)
        video = pipe("a red circle", num_frames=5, height=32, width=32, num_inference_steps=2,
                     max_sequence_length=MAX_LEN, generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
        assert video.shape == (1, 5, 32, 32, 3), name
        assert 0.0 <= video.min() and video.max() <= 1.0 and video.std() > 0
    kwargs = WAN.validation_kwargs(None, None)
    assert kwargs == {"max_sequence_length": 512, "num_frames": 5, "output_type": "pil"}
    # the family's own pipeline: Wan 2.2 needs both experts
    p = pipes["wan22"]
    parts = ({"text_encoder": p.text_encoder}, {"text_encoder": p.tokenizer}, p.scheduler)
    with pytest.raises(ValueError, match="both experts"):
        WAN22.pipeline(p.transformer, p.vae, *parts)
    built = WAN22.pipeline({"transformer": p.transformer, "transformer_2": p.transformer_2}, p.vae, *parts)
    assert built.config.boundary_ratio == 0.875 and built.transformer_2 is p.transformer_2


def test_lora_attaches_at_the_wan_targets_and_round_trips(folders, pipes, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline, WanTransformer3DModel
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    from diffusers_zero3.families.wan import WAN
    from diffusers_zero3.training.lora import add_lora_adapters

    transformer = WanTransformer3DModel.from_pretrained(folders["wan"], subfolder="transformer")
    _, _, cond = _cond(WAN, folders["wan"], pipes["wan"], ["a red circle"])
    x, t = torch.randn(1, 8, 2, 4, 4), torch.tensor([500.0])
    with torch.no_grad():
        before = WAN.predict(transformer, x, t, cond)
    adapters = add_lora_adapters(transformer, rank=4, target_modules=WAN.lora_target_modules)
    # A and B of 10 linears (self- and cross-attention q, k, v, out; the FFN's two) in 2 blocks
    assert len(adapters) == 2 * 10 * 2
    with torch.no_grad():
        torch.testing.assert_close(WAN.predict(transformer, x, t, cond), before)  # B starts at zero
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        after = WAN.predict(transformer, x, t, cond)
    assert (after - before).abs().max() > 1e-4
    state = convert_state_dict_to_diffusers(get_peft_model_state_dict(transformer))
    WanPipeline.save_lora_weights(tmp_path, transformer_lora_layers=state)
    pipe = DiffusionPipeline.from_pretrained(folders["wan"])
    pipe.load_lora_weights(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(WAN.predict(pipe.transformer, x, t, cond), after)


def test_a_frozen_bf16_replica_keeps_the_rotary_tables_from_pretrained_computes(folders):
    """A frozen placement casts the parameters to bf16, not the non-persistent rotary tables
    (what ``from_pretrained(torch_dtype=bf16)`` keeps in fp32); the control: a bare
    ``.to(bf16)`` rounds them."""
    from diffusers import WanTransformer3DModel

    from diffusers_zero3 import prepare_frozen

    reference = WanTransformer3DModel.from_pretrained(folders["wan"], subfolder="transformer").rope
    rounded = WanTransformer3DModel.from_pretrained(folders["wan"], subfolder="transformer").to(
        torch.bfloat16
    )
    assert (rounded.rope.freqs_sin.float() - reference.freqs_sin).abs().max() > 1e-3
    model = WanTransformer3DModel.from_pretrained(folders["wan"], subfolder="transformer")
    frozen = prepare_frozen(model, "replicate", dtype=torch.bfloat16)
    assert next(frozen.module.parameters()).dtype == torch.bfloat16
    for key in ("freqs_cos", "freqs_sin"):
        assert torch.equal(getattr(frozen.module.rope, key), getattr(reference, key))


def test_the_folders_registered_boundary_is_the_familys(folders, pipes, tmp_path):
    """``boundary_ratio`` is ``WanPipeline``'s config (``model_index.json``), 0.875 only the
    published default: a Wan 2.2 folder saved at 0.5 switches experts at t = 500 in training and in
    validation's pipeline."""
    from diffusers import WanPipeline

    from diffusers_zero3.families import detect_family
    from diffusers_zero3.families.wan import HIGH, LOW, WAN22

    pipe = pipes["wan22"]
    out = tmp_path / "wan22-half"
    WanPipeline(**pipe.components, boundary_ratio=0.5).save_pretrained(out)
    family = detect_family(out)
    validation = family.pipeline(
        {HIGH: pipe.transformer, LOW: pipe.transformer_2}, pipe.vae, {"text_encoder": pipe.text_encoder},
        {"text_encoder": pipe.tokenizer}, pipe.scheduler,
    )  # fmt: skip
    assert validation.config.boundary_ratio == 0.5
    assert family.name == WAN22.name and family.boundary_ratio == 0.5 and family.boundary(out) == 500.0
    assert detect_family(folders["wan22"]) is WAN22  # the published value: the family itself
