"""The Krea 2 family against ``Krea2Pipeline`` and diffusers' ``train_dreambooth_lora_krea2.py``:
prompt encoding (the fixed-length ``[prefix | caption | pad | suffix]`` block, valid-token
positions, the twelve selected hidden states, the mask) against ``encode_prompt``, the
transformer call against the pipeline's, the objective against the script's lines, in fp32 and
bf16; the published parameter counts; the tiny pipeline with the script's LoRA targets; a
pipeline whose registered config (``text_encoder_select_layers``, ``patch_size``,
``is_distilled``) is not the published one, read from its ``model_index.json``."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = [
    "a red circle",
    "a photo of the blue square on a green shape, yellow",
    "",
    "a " * 40,  # longer than 32 tokens: truncated before the suffix, as the pipeline does
]


def load(folder, dtype=torch.float32):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def family_outputs(pipe, folder, prompts, max_sequence_length, encoder=None, family=None):
    """The family's (default ``KREA2``) tokenization and encoding of ``prompts`` (with
    ``encoder``, default the pipeline's)."""
    from diffusers_zero3.families import KREA2

    family = family or KREA2
    ids = family.tokenize(family.load_tokenizers(folder), prompts, max_sequence_length)
    with torch.no_grad():
        outputs = family.encode_texts({"text_encoder": encoder or pipe.text_encoder}, ids)
    return ids, outputs


class Capture:
    """Keyword inputs and first outputs of every call of a module (a forward hook)."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        first = output[0] if isinstance(output, tuple) else output
        kept = {k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)}
        hidden = getattr(first, "hidden_states", None)
        self.calls.append((kept, first.detach().clone() if torch.is_tensor(first) else hidden))

    def close(self):
        self.handle.remove()


@pytest.fixture(scope="module")
def folder(tiny_krea2):
    return tiny_krea2[0]


# --------------------------------------------------------------------------- a. prompts


@pytest.mark.parametrize("max_sequence_length", [32, None])  # None: the family's and the pipeline's 512
def test_conditioning_equals_the_pipelines_encode_prompt(folder, max_sequence_length):
    from diffusers_zero3.families import KREA2, detect_family
    from diffusers_zero3.families.krea2 import TEXT_ENCODER_SELECT_LAYERS

    assert detect_family(folder) is KREA2
    pipe = load(folder)
    assert pipe.text_encoder_select_layers == TEXT_ENCODER_SELECT_LAYERS
    length = max_sequence_length or 512
    encoder_calls = Capture(pipe.text_encoder)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(list(PROMPTS), device="cpu", max_sequence_length=length)
    ids, outputs = family_outputs(pipe, folder, PROMPTS, max_sequence_length)
    encoder_calls.close()
    (pipeline_in, _), (our_in, _) = encoder_calls.calls
    # the encoder's inputs: the same ids, boolean mask and valid-token mRoPE positions
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(our_in[key], pipeline_in[key]), key
    assert ids["input_ids"].shape == (len(PROMPTS), 34 + length)  # a fixed block per row: cached alone
    positions = our_in["position_ids"]
    assert positions.shape == (3, len(PROMPTS), 34 + length) and torch.equal(positions[0], positions[2])
    assert int(positions[0, 0, -1]) == int(ids["attention_mask"][0].sum()) - 1  # the suffix skips the padding

    cond = KREA2.conditioning(outputs)
    assert set(cond) == {"encoder_hidden_states", "encoder_attention_mask"}
    assert embeds.shape == cond["encoder_hidden_states"].shape == (len(PROMPTS), length, 12, 16)
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds, rtol=0, atol=0)
    assert torch.equal(cond["encoder_attention_mask"].bool(), mask)
    lengths = mask.sum(dim=1).tolist()
    assert len(set(lengths)) == len(PROMPTS)  # four lengths: the mask matters
    assert lengths[2] == 5 and all(mask[:, -5:].flatten())  # "" is the suffix alone, always valid
    assert lengths[3] == (length if max_sequence_length else lengths[3]) > lengths[1] > lengths[0]

    # the selected layers: hidden_states[2], [5], ..., [35] of the 36-layer encoder, after the prefix
    with torch.no_grad():
        states = pipe.text_encoder(
            input_ids=our_in["input_ids"],
            attention_mask=our_in["attention_mask"],
            position_ids=our_in["position_ids"],
            output_hidden_states=True,
        ).hidden_states
    assert len(states) == 37
    for k, layer in enumerate(TEXT_ENCODER_SELECT_LAYERS):
        torch.testing.assert_close(embeds[:, :, k], states[layer][:, 34:], rtol=0, atol=0)
    assert not torch.allclose(embeds[:, :, -1], states[-1][:, 34:])  # not the last layer (nor its norm)

    # each caption alone (as the cache encodes rows) equals its row in the batch
    for i, prompt in enumerate(PROMPTS[:3]):
        _, alone = family_outputs(pipe, folder, [prompt], max_sequence_length)
        torch.testing.assert_close(alone["prompt_embeds"][0], outputs["prompt_embeds"][i])
        assert torch.equal(alone["prompt_embeds_mask"][0], outputs["prompt_embeds_mask"][i])


def test_encode_texts_in_bf16_on_meta_and_on_empty_batches(folder):
    from diffusers_zero3 import prepare_frozen
    from diffusers_zero3.families import KREA2
    from diffusers_zero3.placement.frozen_inputs import conditioning_on
    from diffusers_zero3.placement.plan import build_on_meta

    pipe = load(folder)
    _, fp32 = family_outputs(pipe, folder, PROMPTS, 32)
    # a frozen bf16 placement casts the weights, not the rotary table computed in __init__
    encoder = prepare_frozen(copy.deepcopy(pipe.text_encoder), "replicate", dtype=torch.bfloat16).module
    assert encoder.language_model.rotary_emb.inv_freq.dtype == torch.float32
    _, bf16 = family_outputs(pipe, folder, PROMPTS, 32, encoder=encoder)
    assert bf16["prompt_embeds"].dtype == torch.bfloat16
    assert torch.equal(bf16["prompt_embeds_mask"], fp32["prompt_embeds_mask"])
    torch.testing.assert_close(bf16["prompt_embeds"].float(), fp32["prompt_embeds"], rtol=5e-2, atol=2e-2)
    # the pipeline in bf16 gives the same embeddings as the family with the pipeline's bf16 encoder
    pipe16 = load(folder, torch.bfloat16)
    with torch.no_grad():
        embeds16, _ = pipe16.encode_prompt(list(PROMPTS), device="cpu", max_sequence_length=32)
    _, ours16 = family_outputs(pipe16, folder, PROMPTS, 32)
    torch.testing.assert_close(ours16["prompt_embeds"], embeds16, rtol=0, atol=0)
    cond = conditioning_on(KREA2, bf16, torch.device("cpu"), torch.bfloat16)
    assert cond["encoder_hidden_states"].dtype == torch.bfloat16
    assert cond["encoder_attention_mask"].dtype == torch.long

    # the planner encodes on the meta device (no mask) to size the cache
    config = dict(pipe.text_encoder.config.to_dict())
    meta = build_on_meta("transformers", "Qwen3VLModel", config)
    ids = torch.zeros(1, 34 + 32, dtype=torch.long, device="meta")
    out = KREA2.encode_text("text_encoder", meta, ids)
    assert out["prompt_embeds"].shape == (1, 32, 12, 16) and out["prompt_embeds_mask"].shape == (1, 32)

    # a rank with no samples: one dummy row runs through each model, nothing comes back
    empty = KREA2.tokenize(KREA2.load_tokenizers(folder), [], 32)
    encoder_calls, transformer_calls = Capture(pipe.text_encoder), Capture(pipe.transformer)
    with torch.no_grad():
        out = KREA2.encode_texts({"text_encoder": pipe.text_encoder}, empty)
        pred = KREA2.predict(
            pipe.transformer, torch.randn(0, 4, 1, 8, 8), torch.zeros(0), KREA2.conditioning(out)
        )
    encoder_calls.close()
    transformer_calls.close()
    assert out["prompt_embeds"].shape == (0, 32, 12, 16) and out["prompt_embeds_mask"].shape == (0, 32)
    assert pred.shape == (0, 4, 1, 8, 8)
    assert [c[0]["input_ids"].shape[0] for c in encoder_calls.calls] == [1]
    assert [c[0]["hidden_states"].shape[0] for c in transformer_calls.calls] == [1]


# --------------------------------------------------------------------------- b. the transformer call


@pytest.mark.parametrize(  # 4.5: CFG, the first of each step's two calls
    "guidance_scale,dtype", [(0.0, torch.float32), (4.5, torch.float32), (0.0, torch.bfloat16)]
)
def test_predict_is_the_pipelines_transformer_call(folder, guidance_scale, dtype):
    """The same transformer inputs and output as the pipeline's call; in bf16 the pipeline rounds
    ``t / 1000`` to bf16 where the script (and ``predict``) keep it fp32: close, not equal."""
    from diffusers import Krea2Pipeline

    from diffusers_zero3.families import KREA2
    from diffusers_zero3.families.qwenimage import unpack_latents

    pipe = load(folder, dtype)
    prompts = PROMPTS[:2]
    capture = Capture(pipe.transformer)
    with torch.no_grad():
        pipe(list(prompts), height=32, width=48, num_inference_steps=2, guidance_scale=guidance_scale,
             max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    pipeline_calls, capture.calls = capture.calls, []
    assert len(pipeline_calls) == (4 if guidance_scale else 2)
    _, outputs = family_outputs(pipe, folder, prompts, 32)
    cond = KREA2.conditioning(outputs)
    h, w = 32 // 4, 48 // 4  # the tiny VAE downsamples 4x
    assert KREA2.latent_multiple(dict(pipe.vae.config)) == pipe.vae_scale_factor * pipe.patch_size == 8
    conditional = pipeline_calls[:: 2 if guidance_scale else 1]
    for (kwargs, expected), t in zip(conditional, pipe.scheduler.timesteps):
        noisy = unpack_latents(kwargs["hidden_states"], h, w)
        with torch.no_grad():
            ours = KREA2.predict(pipe.transformer, noisy, t.expand(2), cond)
        ((our_kwargs, _),) = capture.calls
        capture.calls = []
        for key in ("hidden_states", "encoder_hidden_states", "encoder_attention_mask", "position_ids"):
            assert torch.equal(our_kwargs[key], kwargs[key]), key
        assert our_kwargs["encoder_attention_mask"].dtype == torch.bool
        exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=0)
        torch.testing.assert_close(our_kwargs["timestep"], kwargs["timestep"].float(), **exact)
        assert our_kwargs["timestep"].dtype == torch.float32  # the script's t / 1000
        assert torch.equal(
            our_kwargs["position_ids"], Krea2Pipeline.prepare_position_ids(32, h // 2, w // 2, "cpu")
        )
        assert ours.shape == (2, 4, 1, h, w) and ours.dtype == dtype
        close = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(ours, unpack_latents(expected, h, w), **close)
    capture.close()


# --------------------------------------------------------------------------- c. the objective


def script_loss(transformer, scheduler, model_input, prompt_embeds, prompt_embeds_mask, scheme, seed):
    """``train_dreambooth_lora_krea2.py``'s training step (diffusers 58eb52c0, lines 1779-1788
    ``get_sigmas`` and 1841-1932 the loss), after its latents, with the RNG seeded as given."""
    from diffusers import Krea2Pipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    noise_scheduler_copy = copy.deepcopy(scheduler)

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    torch.manual_seed(seed)
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(
        weighting_scheme=scheme, batch_size=bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
    )
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    noisy_model_input = noisy_model_input.permute(0, 2, 1, 3, 4)
    bsz_pack, c_pack = model_input.shape[0], model_input.shape[1]
    h_pack, w_pack, p_pack = model_input.shape[3], model_input.shape[4], 2
    packed = noisy_model_input.view(bsz_pack, c_pack, h_pack // p_pack, p_pack, w_pack // p_pack, p_pack)
    packed = packed.permute(0, 2, 4, 1, 3, 5)
    packed = packed.reshape(bsz_pack, (h_pack // p_pack) * (w_pack // p_pack), c_pack * p_pack * p_pack)
    latent_height, latent_width = model_input.shape[3], model_input.shape[4]
    position_ids = Krea2Pipeline.prepare_position_ids(
        prompt_embeds.shape[1], latent_height // 2, latent_width // 2, model_input.device
    )
    model_pred = transformer(
        hidden_states=packed,
        encoder_hidden_states=prompt_embeds,
        timestep=timesteps / 1000,
        position_ids=position_ids,
        encoder_attention_mask=prompt_embeds_mask,
        return_dict=False,
    )[0]
    p_un = 2
    bsz_un, _, ch_un = model_pred.shape
    model_pred = model_pred.view(bsz_un, latent_height // p_un, latent_width // p_un, ch_un // 4, p_un, p_un)
    model_pred = model_pred.permute(0, 3, 1, 4, 2, 5)
    model_pred = model_pred.reshape(bsz_un, ch_un // 4, 1, latent_height, latent_width)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean(
        (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
    )
    return loss.mean()


@pytest.mark.parametrize(
    "scheme,dtype", [("none", torch.float32), ("logit_normal", torch.float32), ("none", torch.bfloat16)]
)
def test_objective_is_the_training_scripts(folder, scheme, dtype):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusers_zero3.families import KREA2
    from diffusers_zero3.families.objectives import ObjectiveSettings
    from diffusers_zero3.placement.frozen_inputs import conditioning_on

    pipe = load(folder, dtype)
    vae, transformer = pipe.vae, pipe.transformer
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    assert scheduler.config.use_dynamic_shifting  # the training sigmas stay linear
    _, outputs = family_outputs(pipe, folder, PROMPTS[:2], 32)
    cond = conditioning_on(KREA2, outputs, torch.device("cpu"), dtype)
    torch.manual_seed(0)
    pixels = (torch.rand(2, 3, 32, 32) * 2 - 1).to(dtype)

    with torch.no_grad():
        # the family's latents (FrozenInputs) against the script's: a sample of the latent distribution
        # of vae.encode(pixel_values[:, :, None]), then (z - latents_mean) * (1 / latents_std) (S:1839-1842)
        torch.manual_seed(5)
        latents = KREA2.latent_normalizer(dict(vae.config))(
            KREA2.latents_of(KREA2.latent_distribution(vae, pixels))
        ).to(dtype)
        torch.manual_seed(5)
        z = vae.encode(pixels.unsqueeze(2)).latent_dist.sample()
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
        model_input = ((z - mean) * inv_std).to(dtype=dtype)
    torch.testing.assert_close(latents, model_input, rtol=0, atol=0)
    assert latents.shape == (2, 4, 1, 8, 8)

    with torch.no_grad():
        torch.manual_seed(123)
        ours = KREA2.loss(
            transformer, scheduler, model_input, cond, ObjectiveSettings(weighting_scheme=scheme)
        )
        mask = cond["encoder_attention_mask"].bool()  # encode_prompt's boolean mask
        expected = script_loss(
            transformer, scheduler, model_input, cond["encoder_hidden_states"], mask, scheme, seed=123
        )
    assert expected.item() > 0.1  # a real loss, not a zero that any prediction would give
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- d. published configs


def test_published_configs_give_the_published_parameter_counts():
    from diffusers_zero3.families import KREA2
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import build_on_meta

    published = KREA2.published()
    assert [p.hub_id for p in published] == ["krea/Krea-2-Raw", "krea/Krea-2-Turbo"]
    assert all(KNOWN_PIPELINES[p.hub_id]["_class_name"] == "Krea2Pipeline" for p in published)
    modules = {
        name: build_on_meta(library, cls, config)
        for name, (library, cls, config) in published[0].components.items()
    }
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}
    # 12.82 B (the model cards' "12.9B"); Qwen3-VL-4B-Instruct whole; Qwen-Image's VAE
    assert counts == {"transformer": 12_820_073_036, "text_encoder": 4_437_815_808, "vae": 126_892_531}
    text = modules["text_encoder"]
    assert sum(p.numel() for p in text.language_model.parameters()) == 4_022_468_096  # Qwen3-4B's
    assert text.config.text_config.num_hidden_layers + 1 == 37  # hidden_states[35] is a real tap


# --------------------------------------------------------------------------- e. tiny pipeline and LoRA


def test_tiny_pipeline_generates_and_takes_lora_at_the_scripts_targets(folder):
    from diffusers_zero3.families import KREA2
    from diffusers_zero3.training.lora import add_lora_adapters

    pipe = load(folder)
    assert type(pipe).__name__ == "Krea2Pipeline"
    image = pipe(
        "a red circle",
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        **KREA2.validation_kwargs(None, 3.5),  # CFG at the pipeline's default scale, 512 tokens
    ).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all() and image.std() > 0

    _, outputs = family_outputs(pipe, folder, PROMPTS[:2], 32)
    cond = KREA2.conditioning(outputs)
    torch.manual_seed(0)
    latents, timesteps = torch.randn(2, 4, 1, 8, 8), torch.tensor([250.0, 750.0])
    with torch.no_grad():
        before = KREA2.predict(pipe.transformer, latents, timesteps, cond)
    params = add_lora_adapters(pipe.transformer, rank=4, target_modules=KREA2.lora_target_modules)
    wrapped = {n.split(".lora_")[0] for n, _ in pipe.transformer.named_parameters() if "lora_" in n}
    # 7 linears (q, k, v, out, gate, ff.up, ff.down) in 2 blocks and 4 text-fusion blocks, and
    # img_in, final_layer.linear, the projector, txt_in's two, time_embed's two, time_mod_proj
    assert len(wrapped) == 7 * (2 + 4) + 8 and len(params) == 2 * len(wrapped)
    assert "text_fusion.projector" in wrapped and "time_mod_proj" in wrapped
    with torch.no_grad():
        after = KREA2.predict(pipe.transformer, latents, timesteps, cond)
    torch.testing.assert_close(after, before)  # LoRA B starts at zero (peft's sums reorder the fp32 adds)
    lora_b = [p for n, p in pipe.transformer.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        lora_b[0].fill_(0.5)  # a LoRA that has learnt something changes the prediction
        changed = KREA2.predict(pipe.transformer, latents, timesteps, cond)
    assert (changed - before).abs().max() > 1e-4


# --------------------------------------------------------------------------- f. the pipeline's registered config


def resaved(folder, out, **config):
    """The tiny pipeline's components (those of ``config`` replacing theirs) saved again as a
    ``Krea2Pipeline`` with the registered values of ``config``; the reloaded pipeline."""
    from diffusers import Krea2Pipeline

    Krea2Pipeline(**{**load(folder).components, **config}).save_pretrained(out, safe_serialization=True)
    return load(out)


def rebuilt(family, pipe):
    """The family's pipeline (validation's) around ``pipe``'s modules."""
    return family.pipeline(
        pipe.transformer,
        pipe.vae,
        {"text_encoder": pipe.text_encoder},
        {"text_encoder": pipe.tokenizer},
        pipe.scheduler,
    )


@pytest.mark.parametrize("variant", ["other_taps", "shallow_encoder"])
def test_conditioning_reads_the_pipelines_select_layers(folder, tmp_path, variant):
    """``text_encoder_select_layers`` is ``Krea2Pipeline``'s config (``model_index.json``), the
    published taps only its default: twelve other taps of the same 36-layer encoder (the published
    ones would train on layers the pipeline never reads), and a 12-layer encoder read at all twelve
    (the published taps reach ``hidden_states[35]``: an ``IndexError``)."""
    from transformers import Qwen3VLModel

    from diffusers_zero3.families import KREA2, detect_family
    from diffusers_zero3.families.krea2 import TEXT_ENCODER_SELECT_LAYERS
    from diffusers_zero3.placement.plan import pipeline_components

    if variant == "other_taps":
        layers, extra = tuple(range(0, 36, 3)), {}
    else:
        config = copy.deepcopy(load(folder).text_encoder.config)
        config.text_config.num_hidden_layers = 12
        torch.manual_seed(1)
        layers, extra = tuple(range(1, 13)), {"text_encoder": Qwen3VLModel(config).eval()}
    assert layers != TEXT_ENCODER_SELECT_LAYERS and len(layers) == len(TEXT_ENCODER_SELECT_LAYERS)
    out = tmp_path / "pipe"
    pipe = resaved(folder, out, text_encoder_select_layers=layers, **extra)
    assert pipe.text_encoder_select_layers == layers
    family = detect_family(out)
    assert family.name == KREA2.name and family.text_encoder_select_layers == layers
    assert pipeline_components(out)[0].text_encoder_select_layers == layers  # the planner's family too

    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(list(PROMPTS), device="cpu", max_sequence_length=32)
    _, outputs = family_outputs(pipe, out, PROMPTS, 32, family=family)
    cond = family.conditioning(outputs)
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds, rtol=0, atol=0)
    assert torch.equal(cond["encoder_attention_mask"].bool(), mask)
    # validation's pipeline reads the same taps
    assert rebuilt(family, pipe).text_encoder_select_layers == layers
    if variant == "shallow_encoder":  # taps beyond the encoder: one line naming them, not an IndexError
        with pytest.raises(ValueError, match="text_encoder_select_layers"):
            family_outputs(pipe, out, PROMPTS[:1], 32, family=KREA2)


def test_patch_size_and_distillation_are_the_pipelines(folder, tmp_path):
    """``patch_size`` and ``is_distilled`` are ``Krea2Pipeline``'s config too: latents packed in
    1x1 patches (a transformer taking 4 channels per token) give the pipeline's transformer call
    and the side multiple; validation's pipeline is built with both."""
    from diffusers import Krea2Transformer2DModel

    from diffusers_zero3.families import detect_family

    torch.manual_seed(2)
    transformer = Krea2Transformer2DModel.from_config({**load(folder).transformer.config, "in_channels": 4})
    out = tmp_path / "pipe"
    pipe = resaved(folder, out, transformer=transformer.eval(), patch_size=1, is_distilled=True)
    family = detect_family(out)
    assert (family.patch_size, family.is_distilled) == (1, True)
    assert family.latent_multiple(dict(pipe.vae.config)) == pipe.vae_scale_factor * pipe.patch_size == 4
    validation = rebuilt(family, pipe)
    assert (validation.patch_size, validation.config.is_distilled) == (1, True)

    capture = Capture(pipe.transformer)
    with torch.no_grad():
        pipe(list(PROMPTS[:2]), height=32, width=48, num_inference_steps=2, guidance_scale=0.0,
             max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    pipeline_calls, capture.calls = capture.calls, []
    assert len(pipeline_calls) == 2
    _, outputs = family_outputs(pipe, out, PROMPTS[:2], 32, family=family)
    cond = family.conditioning(outputs)
    for (kwargs, expected), t in zip(pipeline_calls, pipe.scheduler.timesteps):
        noisy = pipe._unpack_latents(kwargs["hidden_states"], 32, 48)
        assert noisy.shape == (2, 4, 1, 8, 12)
        with torch.no_grad():
            ours = family.predict(pipe.transformer, noisy, t.expand(2), cond)
        ((our_kwargs, _),) = capture.calls
        capture.calls = []
        for key in ("hidden_states", "encoder_hidden_states", "encoder_attention_mask", "position_ids"):
            assert torch.equal(our_kwargs[key], kwargs[key]), key
        torch.testing.assert_close(ours, pipe._unpack_latents(expected, 32, 48), rtol=0, atol=0)
    capture.close()
