"""The NucleusMoE-Image family against ``NucleusMoEImagePipeline``: prompt encoding (the system
prompt in Qwen3-VL's chat template, ``hidden_states[-8]``, the mask, the batch padded to its
longest prompt rounded up to 8) against ``encode_prompt``, the transformer call against the
pipeline's (negated: the pipeline steps with ``-noise_pred``), in fp32 and bf16; the objective
against the pipeline's flow-matching convention at the scheduler's sigmas (diffusers has no
training script for it); the published parameter counts; LoRA on the tiny pipeline."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = [
    "a red circle",
    "a photo of the blue square on a green shape, yellow",
    "",
    "a " * 40,  # longer than 96 tokens with the system prompt: truncated, as the pipeline does
]
LENGTH = 96  # --max_sequence_length of the tests: the system prompt (65 tokens here) and a caption


def load(folder, dtype=torch.float32):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def family_outputs(pipe, folder, prompts, max_sequence_length=LENGTH):
    """The family's tokenization and encoding of ``prompts`` with the pipeline's encoder."""
    from diffusers_zero3.families import NUCLEUSMOE

    ids = NUCLEUSMOE.tokenize(NUCLEUSMOE.load_tokenizers(folder), prompts, max_sequence_length)
    with torch.no_grad():
        outputs = NUCLEUSMOE.encode_texts({"text_encoder": pipe.text_encoder}, ids)
    return ids, outputs


class Capture:
    """Keyword inputs and first outputs of every call of a module (a forward hook)."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        first = output[0] if isinstance(output, tuple) else output
        kept = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
        self.calls.append((kept, first.detach().clone() if torch.is_tensor(first) else first))

    def close(self):
        self.handle.remove()


@pytest.fixture(scope="module")
def folder(tiny_nucleusmoe):
    return tiny_nucleusmoe[0]


# --------------------------------------------------------------------------- a. prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conditioning_equals_the_pipelines_encode_prompt(folder, dtype):
    from diffusers.pipelines.nucleusmoe_image import pipeline_nucleusmoe_image as upstream

    from diffusers_zero3.families import NUCLEUSMOE, detect_family
    from diffusers_zero3.families.nucleusmoe import PROMPT_TEMPLATE, RETURN_INDEX, SYSTEM_PROMPT

    assert detect_family(folder) is NUCLEUSMOE
    assert SYSTEM_PROMPT == upstream.DEFAULT_SYSTEM_PROMPT
    pipe = load(folder, dtype)
    assert pipe.default_return_index == RETURN_INDEX == -8
    assert pipe._format_prompt("a red circle") == PROMPT_TEMPLATE.format("a red circle")
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(list(PROMPTS), device="cpu", max_sequence_length=LENGTH)
        alone, alone_mask = pipe.encode_prompt(PROMPTS[0], device="cpu", max_sequence_length=LENGTH)
    ids, outputs = family_outputs(pipe, folder, PROMPTS)
    assert ids["input_ids"].shape == (len(PROMPTS), LENGTH)  # a fixed row per caption: cached alone
    cond = NUCLEUSMOE.conditioning(outputs)
    assert set(cond) == {"encoder_hidden_states", "encoder_hidden_states_mask"}
    lengths = mask.sum(dim=1).tolist()
    assert lengths[3] == LENGTH > lengths[1] > lengths[0] > lengths[2] > 60  # truncated; the system prompt
    assert embeds.shape == cond["encoder_hidden_states"].shape == (len(PROMPTS), LENGTH, 16)
    assert embeds.dtype == cond["encoder_hidden_states"].dtype == dtype
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds, rtol=0, atol=0)
    assert torch.equal(cond["encoder_hidden_states_mask"], mask)

    # one prompt alone: the pipeline pads it to a multiple of 8 (its mask then drops to None
    # only when the prompt fills them: ``predict`` passes None then, as the pipeline)
    one = NUCLEUSMOE.conditioning({k: v[:1] for k, v in outputs.items()})
    assert alone.shape[1] % 8 == 0 and alone.shape[1] - 8 < lengths[0] < alone.shape[1]
    assert one["encoder_hidden_states"].shape == alone.shape
    # encoded at 96 tokens, not 72: the same states up to the rounding of other matrix shapes
    close = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(one["encoder_hidden_states"], alone, **close)
    assert torch.equal(one["encoder_hidden_states_mask"], alone_mask)

    if dtype != torch.float32:
        return
    # the state is hidden_states[-8] of the 36-layer encoder: neither the embeddings nor the last
    with torch.no_grad():
        states = pipe.text_encoder(
            input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], output_hidden_states=True
        ).hidden_states
    assert len(states) == 37
    torch.testing.assert_close(outputs["prompt_embeds"], states[29], rtol=0, atol=0)
    assert not torch.allclose(outputs["prompt_embeds"], states[-1])


def test_encode_on_meta_and_on_empty_batches(folder):
    from diffusers_zero3.families import NUCLEUSMOE
    from diffusers_zero3.placement.plan import build_on_meta

    pipe = load(folder)
    # the planner encodes on the meta device (no mask) to size the cache
    meta = build_on_meta(
        "transformers", "Qwen3VLForConditionalGeneration", pipe.text_encoder.config.to_dict()
    )
    out = NUCLEUSMOE.encode_text(
        "text_encoder", meta, torch.zeros(1, LENGTH, dtype=torch.long, device="meta")
    )
    assert out["prompt_embeds"].shape == (1, LENGTH, 16) and out["prompt_embeds_mask"].shape == (1, LENGTH)

    # a rank with no samples: one dummy row runs through each model, nothing comes back
    empty = NUCLEUSMOE.tokenize(NUCLEUSMOE.load_tokenizers(folder), [], LENGTH)
    encoder_calls, transformer_calls = Capture(pipe.text_encoder), Capture(pipe.transformer)
    with torch.no_grad():
        out = NUCLEUSMOE.encode_texts({"text_encoder": pipe.text_encoder}, empty)
        cond = NUCLEUSMOE.conditioning(out)
        pred = NUCLEUSMOE.predict(pipe.transformer, torch.randn(0, 4, 1, 8, 8), torch.zeros(0), cond)
    encoder_calls.close()
    transformer_calls.close()
    assert out["prompt_embeds"].shape == (0, LENGTH, 16) and pred.shape == (0, 4, 1, 8, 8)
    assert [c[0]["input_ids"].shape[0] for c in encoder_calls.calls] == [1]
    assert [c[0]["hidden_states"].shape[0] for c in transformer_calls.calls] == [1]


# --------------------------------------------------------------------------- b. the transformer call


@pytest.mark.parametrize(  # 4.0: CFG (the pipeline's default), the first of each step's two calls
    "guidance_scale,dtype", [(1.0, torch.float32), (4.0, torch.float32), (1.0, torch.bfloat16)]
)
def test_predict_is_the_pipelines_transformer_call_negated(folder, guidance_scale, dtype):
    from diffusers_zero3.families import NUCLEUSMOE
    from diffusers_zero3.families.qwenimage import unpack_latents

    pipe = load(folder, dtype)
    prompts = PROMPTS[:2]
    capture = Capture(pipe.transformer)
    with torch.no_grad():
        pipe(list(prompts), height=32, width=48, num_inference_steps=2, guidance_scale=guidance_scale,
             max_sequence_length=LENGTH, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    pipeline_calls, capture.calls = capture.calls, []
    assert len(pipeline_calls) == (4 if guidance_scale > 1 else 2)
    _, outputs = family_outputs(pipe, folder, prompts)
    cond = NUCLEUSMOE.conditioning(outputs)
    h, w = 32 // 4, 48 // 4  # the tiny VAE downsamples 4x
    assert NUCLEUSMOE.latent_multiple(dict(pipe.vae.config)) == pipe.vae_scale_factor * 2 == 8
    conditional = pipeline_calls[:: 2 if guidance_scale > 1 else 1]
    for (kwargs, expected), t in zip(conditional, pipe.scheduler.timesteps):
        noisy = unpack_latents(kwargs["hidden_states"], h, w)
        with torch.no_grad():
            ours = NUCLEUSMOE.predict(pipe.transformer, noisy, t, cond)
        ((our_kwargs, _),) = capture.calls
        capture.calls = []
        for key in ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"):
            assert torch.equal(our_kwargs[key], kwargs[key]), key
        assert our_kwargs["timestep"].dtype == dtype  # t in the latents' dtype, then / 1000
        assert our_kwargs["img_shapes"] == kwargs["img_shapes"] == [(1, h // 2, w // 2)] * 2
        assert ours.shape == (2, 4, 1, h, w) and ours.dtype == dtype
        torch.testing.assert_close(ours, -unpack_latents(expected, h, w), rtol=0, atol=0)
    capture.close()


# --------------------------------------------------------------------------- c. the objective


@pytest.mark.parametrize("scheme", ["none", "logit_normal"])
def test_objective_follows_the_pipelines_flow_matching_convention(folder, scheme):
    """No diffusers training script exists for NucleusMoE-Image: the loss is flow matching at the
    scheduler's sigmas (``x = (1 - sigma) latents + sigma noise``, timestep ``sigma * 1000``,
    target ``noise - latents``: the velocity the pipeline's Euler step takes), with the
    prediction the pipeline's ``-transformer(...)``, written here from the scheduler's table."""
    from diffusers import FlowMatchEulerDiscreteScheduler, NucleusMoEImagePipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from diffusers_zero3.families import NUCLEUSMOE
    from diffusers_zero3.families.objectives import ObjectiveSettings

    pipe = load(folder)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    assert scheduler.config.use_dynamic_shifting  # the training sigmas stay linear
    cond = NUCLEUSMOE.conditioning(family_outputs(pipe, folder, PROMPTS[:2])[1])
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        torch.manual_seed(5)
        model_input = NUCLEUSMOE.latent_normalizer(pipe.vae.config)(
            NUCLEUSMOE.latents_of(NUCLEUSMOE.latent_distribution(pipe.vae, pixels))
        )
        # the inverse is the pipeline's decode arithmetic: latents / (1 / std) + mean
        z = NUCLEUSMOE.latent_normalizer(pipe.vae.config).inverse(model_input)
        torch.manual_seed(5)
        torch.testing.assert_close(z, pipe.vae.encode(pixels[:, :, None]).latent_dist.sample())

        torch.manual_seed(7)
        noise = torch.randn_like(model_input)
        bsz, c, _, h, w = model_input.shape
        u = compute_density_for_timestep_sampling(scheme, bsz, 0.0, 1.0, 1.29)
        indices = (u * scheduler.config.num_train_timesteps).long()
        timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices].view(-1, 1, 1, 1, 1)
        noisy = (1.0 - sigmas) * model_input + sigmas * noise
        packed = NucleusMoEImagePipeline._pack_latents(noisy[:, :, 0], bsz, c, h, w, 2)
        out = pipe.transformer(
            hidden_states=packed,
            timestep=timesteps / scheduler.config.num_train_timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
            img_shapes=[(1, h // 2, w // 2)] * bsz,
            return_dict=False,
        )[0]
        velocity = -NucleusMoEImagePipeline._unpack_latents(out, 32, 32, 2, 4)  # the pipeline's step input
        weighting = compute_loss_weighting_for_sd3(scheme, sigmas)
        target = noise - model_input
        expected = torch.mean(
            (weighting.float() * (velocity.float() - target.float()) ** 2).reshape(bsz, -1), 1
        ).mean()

        torch.manual_seed(7)
        ours = NUCLEUSMOE.loss(
            pipe.transformer, scheduler, model_input, cond, ObjectiveSettings(weighting_scheme=scheme)
        )
    assert expected.item() > 0.1  # a real loss, not a zero that any prediction would give
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- d. published configs


def test_published_configs_give_the_published_parameter_counts():
    from diffusers_zero3.families import NUCLEUSMOE
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import build_on_meta

    (published,) = NUCLEUSMOE.published()
    assert published.hub_id == "NucleusAI/Nucleus-Image"
    assert KNOWN_PIPELINES[published.hub_id]["_class_name"] == "NucleusMoEImagePipeline"
    modules = {
        name: build_on_meta(lib, cls, config) for name, (lib, cls, config) in published.components.items()
    }
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}
    assert counts == PUBLISHED_COUNTS, counts
    transformer = modules["transformer"]
    moe = [b.img_mlp for b in transformer.transformer_blocks if b.moe_enabled]
    assert len(moe) == 29 and all(m.experts.gate_up_proj.shape == (64, 2048, 2688) for m in moe)
    text = modules["text_encoder"]
    assert sum(p.numel() for p in text.model.language_model.parameters()) == QWEN3_8B_LANGUAGE_MODEL
    assert text.config.text_config.num_hidden_layers + 1 + NUCLEUSMOE_RETURN_INDEX == 29


NUCLEUSMOE_RETURN_INDEX = -8
# 16.92 B (the model card's "17B total"; 15.33 B of it routed experts, 528 M per MoE block);
# Qwen3-VL-8B-Instruct whole (8.77 B: the vision tower 576 M, lm_head 622 M); Qwen-Image's VAE
PUBLISHED_COUNTS = {"transformer": 16_922_679_296, "text_encoder": 8_767_123_696, "vae": 126_892_531}
QWEN3_8B_LANGUAGE_MODEL = 7_568_405_504


# --------------------------------------------------------------------------- e. tiny pipeline and LoRA


def test_tiny_pipeline_takes_lora_at_the_familys_targets(folder):
    from diffusers_zero3.families import NUCLEUSMOE
    from diffusers_zero3.training.lora import add_lora_adapters

    pipe = load(folder)
    assert type(pipe).__name__ == "NucleusMoEImagePipeline"
    cond = NUCLEUSMOE.conditioning(family_outputs(pipe, folder, PROMPTS[:2])[1])
    torch.manual_seed(0)
    latents, timesteps = torch.randn(2, 4, 1, 8, 8), torch.tensor([250.0, 750.0])
    with torch.no_grad():
        before = NUCLEUSMOE.predict(pipe.transformer, latents, timesteps, cond)
    params = add_lora_adapters(pipe.transformer, rank=4, target_modules=NUCLEUSMOE.lora_target_modules)
    wrapped = {n.split(".lora_")[0] for n, _ in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(wrapped) == 6 * 5 and len(params) == 2 * len(wrapped)  # q, k, v, added k, v, out in 5 blocks
    with torch.no_grad():
        after = NUCLEUSMOE.predict(pipe.transformer, latents, timesteps, cond)
    torch.testing.assert_close(after, before)  # LoRA B starts at zero
    with torch.no_grad():
        next(p for n, p in pipe.transformer.named_parameters() if "lora_B" in n).fill_(0.5)
        changed = NUCLEUSMOE.predict(pipe.transformer, latents, timesteps, cond)
    assert (changed - before).abs().max() > 1e-4
