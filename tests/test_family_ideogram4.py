"""The Ideogram 4 family against ``Ideogram4Pipeline`` and diffusers'
``train_dreambooth_lora_ideogram4.py``: prompt encoding (chat template, left padding, the thirteen
raw decoder-layer outputs interleaved per feature, the packed ids) against ``encode_prompt``, both
transformer calls against the pipeline's, the latents and the objective against the script's
lines, in fp32 and bf16; empty batches and the meta device; the published parameter counts."""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = ["a red circle", "a photo of the blue square on a green shape, yellow", ""]
LENGTH = 32


@functools.lru_cache(maxsize=2)
def load(folder, dtype=torch.float32):
    """The tiny pipeline, loaded once per dtype (the tests only read it; hooks are removed)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def family_outputs(pipe, folder, prompts, length=LENGTH, encoder=None):
    from diffusers_zero3.families import IDEOGRAM4

    ids = IDEOGRAM4.tokenize(IDEOGRAM4.load_tokenizers(folder), prompts, length)
    with torch.no_grad():
        outputs = IDEOGRAM4.encode_texts({"text_encoder": encoder or pipe.text_encoder}, ids)
    return ids, outputs


class Capture:
    """Keyword inputs and first outputs of every call of a module (a forward hook)."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        first = output[0] if isinstance(output, tuple) else output
        kept = {k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)}
        self.calls.append((kept, first.detach().clone() if torch.is_tensor(first) else None))

    def close(self):
        self.handle.remove()


@pytest.fixture(scope="module")
def folder(tiny_ideogram4):
    return tiny_ideogram4[0]


# --------------------------------------------------------------------------- a. prompts


def test_conditioning_equals_the_pipelines_encode_prompt(folder):
    from diffusers_zero3.families import IDEOGRAM4, detect_family
    from diffusers_zero3.families.ideogram4 import ACTIVATION_LAYERS, packed_ids

    assert detect_family(folder) is IDEOGRAM4
    pipe = load(folder)
    with torch.no_grad():
        embeds, position_ids, segment_ids, indicator = pipe.encode_prompt(
            list(PROMPTS), grid_h=2, grid_w=3, max_sequence_length=LENGTH, device="cpu"
        )
    ids, outputs = family_outputs(pipe, folder, PROMPTS)
    cond = IDEOGRAM4.conditioning(outputs)
    states, mask = cond["encoder_hidden_states"], cond["encoder_attention_mask"]
    assert states.shape == (3, LENGTH, 13 * 16)
    torch.testing.assert_close(states, embeds[:, :LENGTH], rtol=0, atol=0)
    assert not embeds[:, LENGTH:].any()  # the image rows carry no text
    lengths = mask.sum(dim=1).tolist()
    assert len(set(lengths)) == 3 and not mask[:, -1].eq(0).any()  # left padding, three lengths
    for got, expected in zip(packed_ids(mask, 2, 3), (position_ids, segment_ids, indicator)):
        assert torch.equal(got, expected)

    # the taps: raw outputs of decoder layers 0, 3, ..., 33, 35 (hidden_states[i + 1]; the last
    # one before the final norm), interleaved per feature
    with torch.no_grad():
        hidden = pipe.text_encoder(
            input_ids=ids["input_ids"],
            attention_mask=ids["attention_mask"],
            position_ids=IDEOGRAM4_positions(ids["attention_mask"]),
            output_hidden_states=True,
        ).hidden_states
    per_layer = states.view(3, LENGTH, 16, 13)
    m = mask.unsqueeze(-1).float()
    for k, layer in enumerate(ACTIVATION_LAYERS[:-1]):
        torch.testing.assert_close(per_layer[..., k], hidden[layer + 1] * m, rtol=0, atol=0)
    assert not torch.allclose(per_layer[..., -1], hidden[-1] * m)  # not the normed last state

    # each caption alone (as the cache encodes rows) equals its row in the batch
    for i, prompt in enumerate(PROMPTS):
        _, alone = family_outputs(pipe, folder, [prompt])
        torch.testing.assert_close(alone["prompt_embeds"][0], outputs["prompt_embeds"][i])

    # a caption longer than the block keeps the template's closing tokens (the pipeline refuses it)
    long = IDEOGRAM4.tokenize(IDEOGRAM4.load_tokenizers(folder), ["a " * 40], LENGTH)
    tokenizer = pipe.tokenizer
    assert int(long["attention_mask"].sum()) == LENGTH
    assert tokenizer.decode(long["input_ids"][0, -5:]).endswith("<|im_start|>assistant\n")


def IDEOGRAM4_positions(mask):
    from diffusers_zero3.families.ideogram4 import text_positions

    return text_positions(mask).unsqueeze(0).expand(4, -1, -1)


def test_encode_on_meta_and_on_empty_batches(folder):
    from diffusers_zero3.families import IDEOGRAM4
    from diffusers_zero3.placement.plan import build_on_meta

    pipe = load(folder)
    meta = build_on_meta("transformers", "Qwen3VLModel", dict(pipe.text_encoder.config.to_dict()))
    out = IDEOGRAM4.encode_text("text_encoder", meta, torch.zeros(1, LENGTH, dtype=torch.long, device="meta"))
    assert out["prompt_embeds"].shape == (1, LENGTH, 13 * 16)

    empty = IDEOGRAM4.tokenize(IDEOGRAM4.load_tokenizers(folder), [], LENGTH)
    calls = [Capture(m) for m in (pipe.text_encoder, pipe.transformer, pipe.unconditional_transformer)]
    with torch.no_grad():
        out = IDEOGRAM4.encode_texts({"text_encoder": pipe.text_encoder}, empty)
        pred = IDEOGRAM4.predict(
            pipe.transformer, torch.randn(0, 16, 2, 2), torch.zeros(0), IDEOGRAM4.conditioning(out)
        )
        uncond = IDEOGRAM4.predict_unconditional(
            pipe.unconditional_transformer, torch.randn(0, 16, 2, 2), torch.zeros(0)
        )
    for c in calls:
        c.close()
    assert out["prompt_embeds"].shape == (0, LENGTH, 13 * 16) and pred.shape == uncond.shape == (0, 16, 2, 2)
    assert [len(c.calls) for c in calls] == [1, 1, 1]  # one dummy row each: lockstep kept


# --------------------------------------------------------------------------- b. the transformer calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predict_is_the_pipelines_transformer_calls(folder, dtype):
    from diffusers_zero3.families import IDEOGRAM4
    from diffusers_zero3.families.flux2 import unpack_latents

    pipe = load(folder, dtype)
    prompts = PROMPTS[:2]
    h, w = 32 // 16, 48 // 16
    cond_calls, uncond_calls = Capture(pipe.transformer), Capture(pipe.unconditional_transformer)
    with torch.no_grad():
        pipe(list(prompts), height=32, width=48, num_inference_steps=2, guidance_scale=4.0, guidance_schedule=None,
             max_sequence_length=LENGTH, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    pipeline_cond, pipeline_uncond = cond_calls.calls, uncond_calls.calls
    cond_calls.calls, uncond_calls.calls = [], []
    assert len(pipeline_cond) == len(pipeline_uncond) == 2
    _, outputs = family_outputs(pipe, folder, prompts)
    cond = {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in IDEOGRAM4.conditioning(outputs).items()
    }
    for (kwargs, expected), (ukwargs, uexpected), t in zip(
        pipeline_cond, pipeline_uncond, pipe.scheduler.timesteps
    ):
        noisy = unpack_latents(kwargs["hidden_states"][:, LENGTH:], h, w)
        with torch.no_grad():
            ours = IDEOGRAM4.predict(pipe.transformer, noisy, t.expand(2), cond)
            ours_u = IDEOGRAM4.predict_unconditional(pipe.unconditional_transformer, noisy, t.expand(2))
        ((our_kwargs, _),), ((our_ukwargs, _),) = cond_calls.calls, uncond_calls.calls
        cond_calls.calls, uncond_calls.calls = [], []
        for ref, got in ((kwargs, our_kwargs), (ukwargs, our_ukwargs)):
            for key in (
                "hidden_states",
                "timestep",
                "encoder_hidden_states",
                "position_ids",
                "segment_ids",
                "indicator",
            ):
                assert got[key].dtype == ref[key].dtype and torch.equal(got[key], ref[key]), key
        assert ours.shape == (2, 16, h, w) and ours.dtype == dtype
        torch.testing.assert_close(ours, -unpack_latents(expected[:, LENGTH:], h, w), rtol=0, atol=0)
        torch.testing.assert_close(ours_u, -unpack_latents(uexpected, h, w), rtol=0, atol=0)
    cond_calls.close()
    uncond_calls.close()


# --------------------------------------------------------------------------- c. latents and the objective


def script_loss(
    transformer, model_input, bundle, weight_dtype, seed, logit_mean=0.0, logit_std=1.5, round_trip=True
):
    """``train_dreambooth_lora_ideogram4.py``'s step after its latents (diffusers 0.42.1, lines
    1936-2023: noise, the resolution-aware logit-normal sigma, the packed sequence, the transformer
    with ``--disable_training_autocast`` when ``weight_dtype`` is bf16, the loss). ``round_trip``:
    sigma read back from ``sigma * 1000`` as the family does (1 ulp at most)."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    prompt_embeds, position_ids, segment_ids, indicator = bundle
    max_sequence_length = LENGTH
    torch.manual_seed(seed)
    bsz, num_image_tokens, latent_dim = model_input.shape
    noise = torch.randn_like(model_input)
    image_height = image_width = 32  # a 2x2 grid of 16 px tokens
    sigmas = compute_density_for_timestep_sampling(
        weighting_scheme="logit_normal", batch_size=bsz,
        logit_mean=_resolution_aware_mu(image_height, image_width, base_mu=logit_mean),
        logit_std=logit_std, mode_scale=1.29, device="cpu",
    )  # fmt: skip
    if round_trip:
        sigmas = (sigmas.float() * 1000) / 1000
    sigmas = sigmas.to(dtype=model_input.dtype).view(bsz, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    text_latent_padding = torch.zeros(bsz, max_sequence_length, latent_dim, dtype=noisy_model_input.dtype)
    packed_hidden_states = torch.cat([text_latent_padding, noisy_model_input], dim=1)
    model_timestep = (1.0 - sigmas).reshape(bsz)
    packed_hidden_states = packed_hidden_states.to(weight_dtype)
    prompt_embeds = prompt_embeds.to(weight_dtype)
    model_timestep = model_timestep.to(weight_dtype)
    model_pred = transformer(
        hidden_states=packed_hidden_states, timestep=model_timestep, encoder_hidden_states=prompt_embeds,
        position_ids=position_ids, segment_ids=segment_ids, indicator=indicator, return_dict=False,
    )[0]  # fmt: skip
    model_pred = model_pred[:, max_sequence_length:]
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="logit_normal", sigmas=sigmas)
    target = model_input - noise
    loss = torch.mean(
        (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
    )
    return loss.mean()


def script_patchify(z, patch_size=2):
    """The script's ``patchify_latents`` (lines 1688-1707)."""
    batch_size, ae_channels = z.shape[0], z.shape[1]
    grid_h, grid_w = z.shape[2] // patch_size, z.shape[3] // patch_size
    z = z.view(batch_size, ae_channels, grid_h, patch_size, grid_w, patch_size)
    z = z.permute(0, 2, 4, 3, 5, 1).contiguous()
    return z.view(batch_size, grid_h * grid_w, patch_size * patch_size * ae_channels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latents_and_objective_are_the_training_scripts(folder, dtype):
    from pathlib import Path

    from diffusers_zero3.families import IDEOGRAM4
    from diffusers_zero3.families.flux2 import pack_latents
    from diffusers_zero3.families.objectives import ObjectiveSettings

    pipe = load(folder, dtype)
    vae = load(folder).vae  # the script keeps the statistics in fp32
    torch.manual_seed(0)
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        ours = IDEOGRAM4.latent_normalizer(dict(vae.config), Path(folder) / "vae")(
            IDEOGRAM4.latents_of(IDEOGRAM4.latent_distribution(vae, pixels))
        )
        z = vae.encode(pixels).latent_dist.mode()
        mean = vae.bn.running_mean.view(1, 1, -1)
        std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1)
        model_input = (script_patchify(z) - mean) / std
    assert ours.shape == (2, 16, 2, 2)
    torch.testing.assert_close(pack_latents(ours), model_input, rtol=0, atol=0)
    # the pipeline's decode undoes it
    torch.testing.assert_close(
        IDEOGRAM4.latent_normalizer(dict(vae.config), Path(folder) / "vae").inverse(ours), z
    )

    _, outputs = family_outputs(pipe, folder, PROMPTS[:2])
    cond = IDEOGRAM4.conditioning(outputs)
    with torch.no_grad():
        bundle = pipe.encode_prompt(
            list(PROMPTS[:2]), grid_h=2, grid_w=2, max_sequence_length=LENGTH, device="cpu"
        )
        settings = ObjectiveSettings(weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.5)
        torch.manual_seed(123)
        loss = IDEOGRAM4.loss(pipe.transformer, None, ours, cond, settings)
        expected = script_loss(pipe.transformer, model_input, bundle, dtype, seed=123)
        raw = script_loss(pipe.transformer, model_input, bundle, dtype, seed=123, round_trip=False)
    assert expected.item() > 0.1
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(loss, raw, rtol=1e-3, atol=0)  # the script's own sigma: 1 ulp apart


# --------------------------------------------------------------------------- d. published configs


def test_published_configs_give_the_published_parameter_counts():
    from diffusers_zero3.families import IDEOGRAM4
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import build_on_meta

    (published,) = IDEOGRAM4.published()
    assert KNOWN_PIPELINES[published.hub_id]["_class_name"] == "Ideogram4Pipeline"
    modules = {n: build_on_meta(lib, cls, cfg) for n, (lib, cls, cfg) in published.components.items()}
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}
    # transformer: 34 blocks at width 4608 reading 13 x 4096 text features; Qwen3-VL-8B head-less; Flux.2's VAE
    assert counts == {"transformer": 9_279_288_448, "text_encoder": 8_144_793_840, "vae": 84_046_115}
    assert sum(p.numel() for p in modules["text_encoder"].language_model.parameters()) == 7_568_405_504
    assert modules["transformer"].config.llm_features_dim == 13 * 4096


# --------------------------------------------------------------------------- e. the unconditional transformer


def test_unconditional_loss_is_the_objective_through_the_pipelines_negative_branch(folder):
    """``--train_denoisers unconditional|both``: ``unconditional_transformer`` trains on the same
    noise and sigma draw as ``transformer``, called as the pipeline's negative branch (the image
    tokens alone: zero text features, image positions, one segment, the image indicator)."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from diffusers_zero3.families import IDEOGRAM4
    from diffusers_zero3.families.flux2 import pack_latents
    from diffusers_zero3.families.ideogram4 import UNCONDITIONAL
    from diffusers_zero3.families.objectives import ObjectiveSettings

    assert IDEOGRAM4.trained_denoisers(None) == ("transformer",)  # the script's
    assert IDEOGRAM4.trained_denoisers("both") == ("transformer", UNCONDITIONAL)
    pipe = load(folder)
    torch.manual_seed(0)
    latents = torch.randn(2, 16, 2, 2)
    settings = ObjectiveSettings(weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.5)
    cond = IDEOGRAM4.conditioning(family_outputs(pipe, folder, PROMPTS[:2])[1])
    with torch.no_grad():
        torch.manual_seed(7)
        ours = IDEOGRAM4.loss(
            pipe.unconditional_transformer, None, latents, cond, settings, trained=UNCONDITIONAL
        )
        torch.manual_seed(7)
        conditional = IDEOGRAM4.loss(pipe.transformer, None, latents, cond, settings)
        # the same draws, the pipeline's negative-branch inputs (pipeline_ideogram4.py, step 4 and its loop)
        torch.manual_seed(7)
        x0 = pack_latents(latents).contiguous()
        noise = torch.randn_like(x0)
        sigmas = compute_density_for_timestep_sampling(
            weighting_scheme="logit_normal", batch_size=2, logit_mean=_resolution_aware_mu(32, 32, 0.0),
            logit_std=1.5, mode_scale=1.29, device="cpu",
        )  # fmt: skip
        sigmas = ((sigmas * 1000) / 1000).view(2, 1, 1)
        position_ids, segment_ids, indicator = pipe._prepare_ids([5, 7], 2, 2, LENGTH, "cpu")
        neg_v = pipe.unconditional_transformer(
            hidden_states=(1.0 - sigmas) * x0 + sigmas * noise,
            timestep=(1.0 - sigmas).reshape(2),
            encoder_hidden_states=torch.zeros(2, 4, 13 * 16),
            position_ids=position_ids[:, LENGTH:],
            segment_ids=segment_ids[:, LENGTH:],
            indicator=indicator[:, LENGTH:],
            return_dict=False,
        )[0]
        expected = ((neg_v - (x0 - noise)) ** 2).reshape(2, -1).mean(1).mean()
    assert expected.item() > 0.1
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert not torch.allclose(ours, conditional)  # another model, another call


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--train_denoisers", "both", "--rank", "4"], "--rank with --train_denoisers both"),
        (
            ["--train_denoisers", "unconditional", "--rank", "4"],
            "--rank with --train_denoisers unconditional",
        ),
    ],
)
def test_train_denoisers_flags(folder, flags, message):
    from diffusers_zero3.args import ArgumentError
    from diffusers_zero3.families import IDEOGRAM4, SD
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings, validate_family

    args = TextToImageSettings.parse(
        ["--pretrained_model_name_or_path", folder, "--train_data_dir", folder, *flags]
    )
    with pytest.raises(ArgumentError, match=message):
        validate_family(args, IDEOGRAM4)
    args = TextToImageSettings.parse(["--pretrained_model_name_or_path", folder, "--train_data_dir", folder,
                                      "--train_denoisers", "both"])  # fmt: skip
    validate_family(args, IDEOGRAM4)  # no LoRA: both train, each its own engine
    with pytest.raises(ArgumentError, match="--train_denoisers applies to Ideogram 4's two transformers"):
        validate_family(args, SD)
