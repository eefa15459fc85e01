"""The Flux.2 families (dev: ``Flux2Pipeline``, klein: ``Flux2KleinPipeline``) against
diffusers' own code: prompt encoding (chat templates, padding sides, stacked layers, text ids)
against ``encode_prompt``, the denoiser call against the pipelines' (guidance for dev, CFG's
two calls for klein), the objective against ``train_dreambooth_lora_flux2.py`` and its klein
twin, the batch-norm latent statistics in fp32, the published configs' parameter counts, and
the tiny pipelines (loaded without torchvision, as FLUX.2-dev's PixtralProcessor folder
must be)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.unit

VARIANTS = ("dev", "klein")
# Different lengths, one truncated at 64 tokens, one with "[IMG]" (dev's format_input drops it).
PROMPTS = ["a red circle", "a blue square on a big green [IMG] tree", "", "a yellow circle " * 30]
LENGTH = 64  # tokens per caption: dev's system message alone takes 32


def _family(variant):
    from diffusers_zero3.families import FLUX2, FLUX2_KLEIN

    return FLUX2 if variant == "dev" else FLUX2_KLEIN


def load_pipeline(family, folder):
    """A Flux.2 pipeline folder loaded without torchvision: every component but the tokenizer
    by ``from_pretrained`` (a PixtralProcessor cannot be built), then the family's tokenizer."""
    import diffusers

    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(folder, tokenizer=None)
    pipe.register_modules(tokenizer=family.load_tokenizer(folder / "tokenizer"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from diffusers_zero3.demo import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flux2")
    return {v: save_tiny_pipeline(_family(v), root / v) for v in VARIANTS}


@pytest.fixture(scope="module")
def pipes(folders):
    return {v: load_pipeline(_family(v), folders[v]) for v in VARIANTS}


def _cond(family, folder, pipe, prompts, length=LENGTH):
    tokenizers = family.load_tokenizers(folder)
    ids = family.tokenize(tokenizers, prompts, length)
    with torch.no_grad():
        outputs = family.encode_texts({"text_encoder": pipe.text_encoder}, ids)
    return ids, outputs, family.conditioning(outputs)


# ---------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("variant", VARIANTS)
def test_conditioning_equals_the_pipelines_encode_prompt(variant, folders, pipes):
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

    from diffusers_zero3.families import detect_family

    family, folder, pipe = _family(variant), folders[variant], pipes[variant]
    assert detect_family(folder) is family
    ids, outputs, cond = _cond(family, folder, pipe, PROMPTS)
    tok = pipe.tokenizer
    # The pipelines' own tokenization: dev's apply_chat_template on the conversations
    # (pipeline_flux2.py:323-332), klein's tokenizer call on each rendered prompt (klein 225-239).
    if variant == "dev":
        expected = tok.apply_chat_template(format_input(PROMPTS, SYSTEM_MESSAGE), add_generation_prompt=False,
                                           tokenize=True, return_dict=True, return_tensors="pt",
                                           padding="max_length", truncation=True, max_length=LENGTH)  # fmt: skip
    else:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False) for p in PROMPTS]  # fmt: skip
        expected = tok(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=LENGTH)
    assert torch.equal(ids["input_ids"], expected["input_ids"])
    assert torch.equal(ids["attention_mask"], expected["attention_mask"])
    mask = ids["attention_mask"]
    assert len(set(mask.sum(dim=1).tolist())) == 4 and int(mask[3].sum()) == LENGTH  # the last one truncated
    pad_column = 0 if variant == "dev" else -1  # Mistral pads on the left, Qwen3 on the right
    assert mask[:3, pad_column].tolist() == [0, 0, 0]
    if variant == "dev":
        assert ids["input_ids"][0][mask[0].bool()].tolist().count(tok.bos_token_id) == 1  # one <s>
        assert "[IMG]" not in tok.decode(ids["input_ids"][1][mask[1].bool()])

    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=LENGTH)
    assert set(cond) == {"encoder_hidden_states", "txt_ids"}
    assert cond["encoder_hidden_states"].shape == (4, LENGTH, 3 * 16) == embeds.shape
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds, rtol=0, atol=1e-6)
    assert cond["txt_ids"].dtype == torch.int64 and torch.equal(cond["txt_ids"], text_ids)
    # One caption encoded alone (as the cache encodes rows) equals its batch row, pad rows included.
    _, alone, _ = _cond(family, folder, pipe, PROMPTS[1:2])
    torch.testing.assert_close(alone["prompt_embeds"][0], outputs["prompt_embeds"][1], rtol=0, atol=1e-6)
    assert not torch.allclose(outputs["prompt_embeds"][0], outputs["prompt_embeds"][1])  # captions matter


def test_dev_tokenizer_loads_from_a_pixtral_processor_folder(folders, tmp_path):
    """FLUX.2-dev's tokenizer folder is a PixtralProcessor's, whose chat template lives in the
    processor's files: the family's loader takes it from there (AutoTokenizer alone has none)."""
    from transformers import AutoTokenizer

    from diffusers_zero3.families import FLUX2

    folder = shutil.copytree(folders["dev"] / "tokenizer", tmp_path / "tokenizer")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor"}))
    assert not AutoTokenizer.from_pretrained(folder).chat_template
    tokenizers = {"text_encoder": FLUX2.load_tokenizer(folder)}
    original = FLUX2.load_tokenizers(folders["dev"])
    for key, value in FLUX2.tokenize(tokenizers, PROMPTS, LENGTH).items():
        assert torch.equal(value, FLUX2.tokenize(original, PROMPTS, LENGTH)[key])


@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_batches_run_one_dummy_row(variant, folders, pipes):
    """Neither the encoder nor the transformer takes B=0: both run one dummy row, none returned."""
    family, pipe = _family(variant), pipes[variant]
    ids = family.tokenize(family.load_tokenizers(folders[variant]), [], LENGTH)
    with torch.no_grad():
        outputs = family.encode_texts({"text_encoder": pipe.text_encoder}, ids)
        cond = family.conditioning(outputs)
        assert cond["encoder_hidden_states"].shape == (0, LENGTH, 48) and cond["txt_ids"].shape == (
            0,
            LENGTH,
            4,
        )
        pred = family.predict(
            pipe.transformer, torch.zeros(0, 16, 4, 4), torch.zeros(0), cond, guidance_scale=3.5
        )
    assert pred.shape == (0, 16, 4, 4)


# ---------------------------------------------------------------------------------- denoiser


@pytest.mark.parametrize("variant", VARIANTS)
def test_prediction_is_the_pipelines_transformer_call(variant, folders, pipes):
    from diffusers import Flux2Pipeline

    from diffusers_zero3.families.flux2 import latent_ids, pack_latents, unpack_latents

    family, folder, pipe = _family(variant), folders[variant], pipes[variant]
    guidance = 2.5
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out[0].detach().clone())), with_kwargs=True
    )
    try:
        pipe(prompt=PROMPTS[:2], num_inference_steps=2, height=32, width=48, max_sequence_length=LENGTH,
             guidance_scale=guidance, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == (2 if variant == "dev" else 4)  # klein's base model: CFG's two calls per step
    h, w = 32 // 4, 48 // 4  # the tiny VAE downsamples 2x, then 2x2 patches
    _, _, cond = _cond(family, folder, pipe, PROMPTS[:2])
    _, _, uncond = _cond(family, folder, pipe, ["", ""])
    for kwargs, expected in calls:
        tokens = kwargs["hidden_states"]
        noisy = unpack_latents(tokens, h, w)
        assert torch.equal(noisy, Flux2Pipeline._unpack_latents_with_ids(tokens, kwargs["img_ids"]))
        assert torch.equal(pack_latents(noisy), tokens)
        assert torch.equal(latent_ids(2, h, w), kwargs["img_ids"])
        matches = [
            c
            for c in (cond, uncond)
            if torch.allclose(c["encoder_hidden_states"], kwargs["encoder_hidden_states"])
        ]
        assert len(matches) == 1
        assert torch.equal(matches[0]["txt_ids"], kwargs["txt_ids"])
        if variant == "dev":
            assert torch.equal(kwargs["guidance"], torch.full((2,), guidance))
        else:
            assert kwargs["guidance"] is None
        with torch.no_grad():
            ours = family.predict(pipe.transformer, noisy, kwargs["timestep"] * 1000, matches[0],
                                  guidance_scale=guidance)  # fmt: skip
        assert ours.shape == (2, 16, h, w)
        torch.testing.assert_close(ours, unpack_latents(expected[:, : h * w], h, w))
    if variant == "dev":  # the guidance value reaches the model
        with torch.no_grad():
            other = family.predict(
                pipe.transformer, noisy, kwargs["timestep"] * 1000, cond, guidance_scale=5.0
            )
        assert not torch.allclose(other, ours)


# ---------------------------------------------------------------------------------- objective


def _script_sigmas(noise_scheduler_copy, timesteps, n_dim=4, dtype=torch.float32):
    """train_dreambooth_lora_flux2.py:1810-1818 (get_sigmas)."""
    sigmas = noise_scheduler_copy.sigmas.to(dtype=dtype)
    schedule_timesteps = noise_scheduler_copy.timesteps
    step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
    sigma = sigmas[step_indices].flatten()
    while len(sigma.shape) < n_dim:
        sigma = sigma.unsqueeze(-1)
    return sigma


@pytest.mark.parametrize("weighting_scheme", ["none", "logit_normal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_objective_is_diffusers_flux2_dreambooth_loss(variant, weighting_scheme, folders, pipes):
    """``family.loss`` against the lines of ``train_dreambooth_lora_flux2.py`` (klein: the
    ``_klein`` script, the same lines but guidance only with ``guidance_embeds``): bn statistics
    of the fp32 VAE (1209-1211), ``latent_dist.mode()``, patchify, normalise (1857-1860),
    noise then u (1862-1877), sigmas (1810-1818, 1881-1882), the packed call (1885-1903),
    weighting, target ``noise - latents`` and the loss (1907-1932), under one seed."""
    import copy

    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from diffusers_zero3.families.objectives import ObjectiveSettings

    family, folder, pipe = _family(variant), folders[variant], pipes[variant]
    noise_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    vae = AutoencoderKLFlux2.from_pretrained(folder, subfolder="vae")
    transformer = pipe.transformer
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        # the script's text conditioning: encode_prompt's embeddings and text ids (the klein script
        # defaults --text_encoder_out_layers to 10 20 30; the pipeline's 9 18 27 are used here)
        prompt_embeds, text_ids = pipe.encode_prompt(PROMPTS[:2], device="cpu", max_sequence_length=LENGTH)
        latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
        latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        model_input = vae.encode(pixels).latent_dist.mode()
        model_input = Flux2Pipeline._patchify_latents(model_input)
        model_input = (model_input - latents_bn_mean) / latents_bn_std
        ours_latents = family.latent_normalizer(vae.config, folder / "vae")(
            family.latents_of(family.latent_distribution(vae, pixels))
        )
        torch.testing.assert_close(ours_latents, model_input, rtol=0, atol=0)

        model_input_ids = Flux2Pipeline._prepare_latent_ids(model_input)
        torch.manual_seed(7)
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme=weighting_scheme, batch_size=bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
        )
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices]
        sigmas = _script_sigmas(
            noise_scheduler_copy, timesteps, n_dim=model_input.ndim, dtype=model_input.dtype
        )
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed_noisy_model_input = Flux2Pipeline._pack_latents(noisy_model_input)
        if transformer.config.guidance_embeds:
            guidance = torch.full([1], 3.5).expand(bsz)
        else:
            guidance = None
        model_pred = transformer(
            hidden_states=packed_noisy_model_input,
            timestep=timesteps / 1000,
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=model_input_ids,
            return_dict=False,
        )[0]
        model_pred = model_pred[:, : packed_noisy_model_input.size(1) :]
        model_pred = Flux2Pipeline._unpack_latents_with_ids(model_pred, model_input_ids)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
        ).mean()

        _, _, cond = _cond(family, folder, pipe, PROMPTS[:2])
        torch.manual_seed(7)
        ours = family.loss(transformer, noise_scheduler, ours_latents, cond, ObjectiveSettings(
            weighting_scheme=weighting_scheme, guidance_scale=3.5))  # fmt: skip
        torch.manual_seed(7)
        other = family.loss(transformer, noise_scheduler, ours_latents, cond, ObjectiveSettings(
            weighting_scheme=weighting_scheme, guidance_scale=1.0))  # fmt: skip
    torch.testing.assert_close(ours, loss)
    assert loss.item() > 0.01  # a real loss, not a zero that any prediction would give
    assert (other.item() != ours.item()) == (variant == "dev")  # only dev embeds the guidance value


# ---------------------------------------------------------------------------------- latents


@pytest.mark.parametrize("variant", VARIANTS)
def test_latent_statistics_are_fp32_from_the_vae_files_when_the_vae_runs_in_bf16(variant, folders, pipes):
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline

    family, folder, pipe = _family(variant), folders[variant], pipes[variant]
    reference = AutoencoderKLFlux2.from_pretrained(folder, subfolder="vae")
    mean32, var32 = reference.bn.running_mean, reference.bn.running_var
    vae = AutoencoderKLFlux2.from_pretrained(folder, subfolder="vae").to(torch.bfloat16)
    assert vae.bn.running_mean.dtype == torch.bfloat16 and not torch.equal(
        vae.bn.running_mean.float(), mean32
    )
    normalize = family.latent_normalizer(vae.config, folder / "vae")
    assert normalize.mean.dtype == normalize.std.dtype == torch.float32
    assert torch.equal(normalize.mean, mean32)
    assert torch.equal(normalize.std, torch.sqrt(var32 + vae.config.batch_norm_eps))

    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        z = family.latents_of(family.latent_distribution(vae, pixels.to(torch.bfloat16)))
        ours = normalize(z)
        # the script: fp32 statistics read before the cast, applied to the bf16 VAE's mode
        expected = (Flux2Pipeline._patchify_latents(z) - mean32.view(1, -1, 1, 1)) / torch.sqrt(
            var32.view(1, -1, 1, 1) + vae.config.batch_norm_eps
        )
        rounded = (Flux2Pipeline._patchify_latents(z) - vae.bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(
            vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps
        )
        assert ours.dtype == torch.float32 and ours.shape == (2, 16, 8, 8)
        assert torch.equal(ours, expected) and not torch.allclose(ours, rounded.float(), rtol=0, atol=1e-4)
        # in fp32, the pipeline's own image encoding (mode, patchify, bn) is the same map
        fp32 = pipe._encode_vae_image(pixels, generator=None)
        ours32 = normalize(family.latents_of(family.latent_distribution(pipe.vae, pixels)))
        torch.testing.assert_close(ours32, fp32, rtol=0, atol=0)
    assert family.latent_multiple(vae.config) == 4  # 2x down, 2x2 patches
    assert family.latent_multiple({"block_out_channels": (128, 256, 512, 512)}) == 16


# ---------------------------------------------------------------------------------- published


PUBLISHED_COUNTS = {  # /tmp/specs/flux2.md section 6, from the published configs on the meta device
    "black-forest-labs/FLUX.2-dev": {
        "transformer": 32_223_281_152,
        "text_encoder": 24_011_361_280,  # Mistral Small 3 24B: text 22.90 B + lm_head + Pixtral + projector
        "vae": 84_046_115,
    },
    "black-forest-labs/FLUX.2-klein-4B": {
        "transformer": 3_875_544_576,
        "text_encoder": 4_022_468_096,  # Qwen3-4B, tied embeddings ("4.0B")
        "vae": 84_046_115,
    },
    "black-forest-labs/FLUX.2-klein-9B": {
        "transformer": 9_078_581_248,
        "text_encoder": 8_190_735_360,  # Qwen3-8B ("8.2B")
        "vae": 84_046_115,
    },
}


def test_published_configs_give_the_exact_parameter_counts():
    from diffusers_zero3.families import FLUX2, FLUX2_KLEIN
    from diffusers_zero3.placement.plan import build_on_meta

    counts = {}
    for family in (FLUX2, FLUX2_KLEIN):
        for published in family.published():
            assert published.pipeline_class == family.pipeline_class
            counts[published.hub_id] = {
                name: sum(p.numel() for p in build_on_meta(library, cls, config).parameters())
                for name, (library, cls, config) in published.components.items()
            }
    assert counts == PUBLISHED_COUNTS
    (dev,) = FLUX2.published()
    assert "vision tower" in dev.note


@pytest.mark.parametrize("variant", VARIANTS)
def test_published_encoders_give_the_transformers_joint_attention_width_on_the_meta_device(variant):
    """What the planner runs to size a cached row: ``encode_text`` on the meta device, whose
    rows are the transformer's ``joint_attention_dim`` wide (three stacked layers)."""
    from diffusers_zero3.placement.plan import build_on_meta

    family = _family(variant)
    for published in family.published():
        encoder = build_on_meta(*published.components["text_encoder"])
        ids = torch.zeros(1, 512, dtype=torch.long, device="meta")
        with torch.no_grad():
            (rows,) = family.encode_text("text_encoder", encoder, ids).values()
        width = published.components["transformer"][2]["joint_attention_dim"]
        assert rows.shape == (1, 512, width), published.hub_id


@pytest.mark.parametrize(
    "hub_id, modules, params",  # train_dreambooth_lora_flux2(_klein).py's targets at --rank 4
    [
        ("black-forest-labs/FLUX.2-dev", 128, 19_267_584),
        ("black-forest-labs/FLUX.2-klein-4B", 60, 4_177_920),
        ("black-forest-labs/FLUX.2-klein-9B", 80, 6_946_816),
    ],  # fmt: skip
)
def test_lora_targets_give_the_scripts_adapters_on_the_published_transformers(hub_id, modules, params):
    from diffusers_zero3.families import FLUX2, FLUX2_KLEIN
    from diffusers_zero3.placement.plan import build_on_meta
    from diffusers_zero3.training.lora import add_lora_adapters

    family = FLUX2 if hub_id.endswith("dev") else FLUX2_KLEIN
    (published,) = [p for p in family.published() if p.hub_id == hub_id]
    transformer = build_on_meta(*published.components["transformer"])
    adapters = add_lora_adapters(transformer, rank=4, target_modules=family.lora_target_modules)
    assert len(adapters) == 2 * modules and sum(p.numel() for p in adapters) == params


# ---------------------------------------------------------------------------------- tiny pipelines


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_pipeline_generates_and_takes_lora_at_the_scripts_targets(variant, folders, pipes):
    from diffusers import Flux2Transformer2DModel

    from diffusers_zero3.training.lora import add_lora_adapters

    family, folder, pipe = _family(variant), folders[variant], pipes[variant]
    image = pipe(prompt="a red circle", num_inference_steps=2, height=32, width=32,
                 **family.validation_kwargs(LENGTH, 3.5)).images[0]  # fmt: skip
    assert image.size == (32, 32)
    transformer = Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    x = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    _, _, cond = _cond(family, folder, pipe, ["a red circle"])
    with torch.no_grad():
        before = family.predict(transformer, x, torch.tensor([500.0]), cond, guidance_scale=3.5)
    adapters = add_lora_adapters(transformer, rank=4, target_modules=family.lora_target_modules)
    # A and B of the double block's to_q/k/v/out.0 and the single block's to_qkv_mlp_proj and to_out
    assert len(adapters) == 2 * 6
    assert [n for n, p in transformer.named_parameters() if p.requires_grad] == [
        n for n, p in transformer.named_parameters() if "lora_" in n
    ]
    with torch.no_grad():
        after = family.predict(transformer, x, torch.tensor([500.0]), cond, guidance_scale=3.5)
        torch.testing.assert_close(after, before, rtol=0, atol=0)  # LoRA B starts at zero
        for p in adapters:
            p.add_(0.1)
        moved = family.predict(transformer, x, torch.tensor([500.0]), cond, guidance_scale=3.5)
    assert not torch.allclose(moved, before)  # the adapters are on the prediction's path


def test_klein_distillation_is_the_folders(folders, pipes, tmp_path):
    """``is_distilled`` is ``Flux2KleinPipeline``'s config (``model_index.json``): a step-distilled
    folder's validation pipeline runs no CFG, as the folder's own pipeline, and GRPO's decision
    reads it too."""
    import diffusers

    from diffusers_zero3.families import FLUX2_KLEIN, detect_family

    pipe = pipes["klein"]
    out = tmp_path / "klein-distilled"
    diffusers.Flux2KleinPipeline(**pipe.components, is_distilled=True).save_pretrained(out)
    family = detect_family(out)
    validation = family.pipeline(
        pipe.transformer, pipe.vae, {"text_encoder": pipe.text_encoder}, {"text_encoder": pipe.tokenizer},
        pipe.scheduler,
    )  # fmt: skip
    assert validation.config.is_distilled is True
    assert family.name == FLUX2_KLEIN.name and family.is_distilled is True
    index = json.loads((out / "model_index.json").read_text())
    assert not family.classifier_free_guidance(index, dict(pipe.transformer.config), 4.0)
    assert FLUX2_KLEIN.classifier_free_guidance({}, dict(pipe.transformer.config), 4.0)  # the base default
    assert detect_family(folders["klein"]) is FLUX2_KLEIN
