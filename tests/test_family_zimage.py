"""The Z-Image family against ``ZImagePipeline`` and diffusers' ``train_dreambooth_lora_z_image.py``:
prompt encoding (chat template, ``hidden_states[-2]``, valid tokens only), the transformer
call, the objective, the published parameter counts, and the tiny pipeline with a LoRA."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = [
    "a red circle",
    "a photo of the blue square on a green shape, yellow",
    "",
    "a " * 40,  # longer than 32 tokens: truncated, template tail included, as the pipeline does
]


@pytest.fixture(scope="module")
def tiny_zimage(tmp_path_factory):
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import ZIMAGE

    return str(save_tiny_pipeline(ZIMAGE, tmp_path_factory.mktemp("zimage") / "tiny-zimage"))


def load(folder):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def family_conditioning(pipe, folder, prompts, max_sequence_length):
    from diffusers_zero3.families import ZIMAGE

    ids = ZIMAGE.tokenize(ZIMAGE.load_tokenizers(folder), prompts, max_sequence_length)
    with torch.no_grad():
        outputs = ZIMAGE.encode_texts({"text_encoder": pipe.text_encoder}, ids)
    return outputs, ZIMAGE.conditioning(outputs)


class Capture:
    """Positional inputs and outputs of every call of a module (a forward hook)."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        x, t, caps = args
        out = output[0] if isinstance(output, tuple) else output.sample
        self.calls.append(
            (
                [a.detach().clone() for a in x],
                t.detach().clone(),
                [c.detach().clone() for c in caps],
                [o.detach().clone() for o in out],
            )
        )

    def close(self):
        self.handle.remove()


# --------------------------------------------------------------------------- a. prompts


@pytest.mark.parametrize("max_sequence_length", [32, None])  # None: the family's and the pipeline's 512
def test_conditioning_equals_the_pipelines_encode_prompt(tiny_zimage, max_sequence_length):
    from diffusers_zero3.families import ZIMAGE, detect_family

    assert detect_family(tiny_zimage) is ZIMAGE
    pipe = load(tiny_zimage)
    length = max_sequence_length or 512
    with torch.no_grad():
        # a copy: the pipeline overwrites its prompt list with the templated texts
        expected, negative = pipe.encode_prompt(
            list(PROMPTS), device="cpu", do_classifier_free_guidance=False, max_sequence_length=length
        )
    assert negative == []
    outputs, cond = family_conditioning(pipe, tiny_zimage, PROMPTS, max_sequence_length)
    assert outputs["prompt_embeds"].shape == (len(PROMPTS), length, 16)
    assert set(cond) == {"cap_feats", "cap_mask"} and all(torch.is_tensor(v) for v in cond.values())
    # the valid-token selection: template + caption, the long caption truncated at the fixed length
    lengths = [e.shape[0] for e in expected]
    assert cond["cap_mask"].sum(dim=1).tolist() == lengths
    assert (
        lengths[2] == 8
        and max(lengths) == (32 if max_sequence_length else lengths[3]) > lengths[1] > lengths[0]
    )
    assert cond["cap_feats"].shape[1] == max(lengths)  # trimmed to the longest caption
    for i, e in enumerate(expected):
        torch.testing.assert_close(cond["cap_feats"][i][cond["cap_mask"][i].bool()], e, rtol=0, atol=0)
        assert not cond["cap_feats"][i][lengths[i] :].any()  # padding zeroed (cached rows are clean)

    # the per-sample lists as predict hands them to the transformer
    capture = Capture(pipe.transformer)
    with torch.no_grad():
        ZIMAGE.predict(
            pipe.transformer, torch.randn(len(PROMPTS), 16, 4, 4), torch.full((len(PROMPTS),), 500.0), cond
        )
    capture.close()
    ((_, _, captions, _),) = capture.calls
    assert [c.shape[0] for c in captions] == lengths
    for got, e in zip(captions, expected):
        torch.testing.assert_close(got, e, rtol=0, atol=0)

    # each caption alone (as the cache encodes rows) equals its row in the batch
    for i, prompt in enumerate(PROMPTS):
        alone, _ = family_conditioning(pipe, tiny_zimage, [prompt], max_sequence_length)
        torch.testing.assert_close(alone["prompt_embeds"][0], outputs["prompt_embeds"][i])
        assert torch.equal(alone["prompt_embeds_mask"][0], outputs["prompt_embeds_mask"][i])


def test_prompt_text_is_the_tokenizers_chat_template(tiny_zimage):
    from diffusers_zero3.families import ZIMAGE

    spec = ZIMAGE.text_encoders[0]
    tokenizer = ZIMAGE.load_tokenizers(tiny_zimage)["text_encoder"]
    text = ZIMAGE.prompt_text(spec, "dance monkey", tokenizer)
    assert text == "<|im_start|>user\ndance monkey<|im_end|>\n<|im_start|>assistant\n"
    assert ZIMAGE.prompt_text(spec, "dance monkey") == text  # without a tokenizer: Qwen3's rendering
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == "<|endoftext|>"


def test_encode_texts_in_bf16_and_empty_batches(tiny_zimage):
    from diffusers_zero3 import prepare_frozen
    from diffusers_zero3.families import ZIMAGE
    from diffusers_zero3.placement.frozen_inputs import conditioning_on

    pipe = load(tiny_zimage)
    outputs, _ = family_conditioning(pipe, tiny_zimage, PROMPTS, 32)
    ids = ZIMAGE.tokenize(ZIMAGE.load_tokenizers(tiny_zimage), PROMPTS, 32)
    # a frozen bf16 placement casts the weights, not the rotary table computed in __init__
    encoder = prepare_frozen(copy.deepcopy(pipe.text_encoder), "replicate", dtype=torch.bfloat16).module
    assert encoder.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        bf16 = ZIMAGE.encode_texts({"text_encoder": encoder}, ids)
    assert bf16["prompt_embeds"].dtype == torch.bfloat16
    assert torch.equal(bf16["prompt_embeds_mask"], outputs["prompt_embeds_mask"])
    torch.testing.assert_close(bf16["prompt_embeds"].float(), outputs["prompt_embeds"], rtol=2e-2, atol=2e-3)
    cond = conditioning_on(ZIMAGE, bf16, torch.device("cpu"), torch.bfloat16)
    assert cond["cap_feats"].dtype == torch.bfloat16 and cond["cap_mask"].dtype == torch.long

    # a rank with no samples: one dummy row runs through each model, nothing comes back
    empty = ZIMAGE.tokenize(ZIMAGE.load_tokenizers(tiny_zimage), [], 32)
    calls = Capture(pipe.transformer)
    with torch.no_grad():
        out = ZIMAGE.encode_texts({"text_encoder": pipe.text_encoder}, empty)
        cond = ZIMAGE.conditioning(out)
        pred = ZIMAGE.predict(pipe.transformer, torch.randn(0, 16, 4, 4), torch.zeros(0), cond)
    calls.close()
    assert out["prompt_embeds"].shape == (0, 32, 16) and out["prompt_embeds_mask"].shape == (0, 32)
    assert pred.shape == (0, 16, 4, 4)
    assert len(calls.calls) == 1 and len(calls.calls[0][0]) == 1  # the transformer saw one sample, not zero


# --------------------------------------------------------------------------- b. the transformer call


def test_predict_is_the_pipelines_transformer_call(tiny_zimage):
    from diffusers_zero3.families import ZIMAGE

    pipe = load(tiny_zimage)
    prompts = PROMPTS[:2]
    capture = Capture(pipe.transformer)
    with torch.no_grad():
        pipe(
            list(prompts),
            height=32,
            width=40,  # 16x20 latents: 80 patches, padded to 96 inside the transformer
            num_inference_steps=2,
            guidance_scale=0.0,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    pipeline_calls, capture.calls = capture.calls, []
    assert len(pipeline_calls) == 2
    _, cond = family_conditioning(pipe, tiny_zimage, prompts, 32)
    sigmas = pipe.scheduler.sigmas
    for i, ((x, t_model, captions, out), t) in enumerate(zip(pipeline_calls, pipe.scheduler.timesteps)):
        latents = torch.stack(x).squeeze(2)
        assert latents.shape == (2, 16, 16, 20)
        with torch.no_grad():
            ours = ZIMAGE.predict(pipe.transformer, latents, t.expand(2), cond)
        ((our_x, our_t, our_captions, _),) = capture.calls
        capture.calls = []
        # the same transformer inputs: latents, 1 - sigma, the valid caption rows
        assert all(torch.equal(a, b) for a, b in zip(our_x, x))
        torch.testing.assert_close(our_t, t_model, rtol=0, atol=0)
        torch.testing.assert_close(t_model, (1 - sigmas[i]).expand(2))  # 0 = pure noise, 1 = clean
        assert all(torch.equal(a, b) for a, b in zip(our_captions, captions))
        # the pipeline's post-processing: stacked, squeezed and negated
        expected = -torch.stack([o.float() for o in out]).squeeze(2)
        assert ours.shape == expected.shape == (2, 16, 16, 20)
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    capture.close()


# --------------------------------------------------------------------------- c. the objective


@pytest.mark.parametrize("scheme", ["none", "logit_normal"])
def test_objective_is_the_training_scripts(tiny_zimage, scheme):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from diffusers_zero3.families import ZIMAGE
    from diffusers_zero3.families.objectives import ObjectiveSettings

    pipe = load(tiny_zimage)
    vae, transformer = pipe.vae, pipe.transformer
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_zimage, subfolder="scheduler")
    assert scheduler.config.shift == 3.0
    _, cond = family_conditioning(pipe, tiny_zimage, PROMPTS[:2], 32)
    torch.manual_seed(0)
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1

    with torch.no_grad():
        # the family's latents, as FrozenInputs makes them
        distribution = ZIMAGE.latent_distribution(vae, pixels)
        latents = ZIMAGE.latent_normalizer(dict(vae.config), vae)(ZIMAGE.latents_of(distribution))
        # train_dreambooth_lora_z_image.py: `model_input = vae.encode(pixel_values).latent_dist.mode()`,
        # then `model_input = (model_input - vae_config_shift_factor) * vae_config_scaling_factor`
        # (S:1721-1727 at diffusers 58eb52c0)
        model_input = vae.encode(pixels).latent_dist.mode()
        model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(latents, model_input, rtol=0, atol=0)
    assert not torch.allclose(ZIMAGE.latent_normalizer(dict(vae.config))(distribution.sample()), model_input)
    assert ZIMAGE.latent_multiple(dict(vae.config)) == pipe.image_processor.config.vae_scale_factor == 4

    with torch.no_grad():
        torch.manual_seed(123)
        ours = ZIMAGE.loss(transformer, scheduler, latents, cond, ObjectiveSettings(weighting_scheme=scheme))

        # the script's training step (S:1694-1703 get_sigmas, S:1729-1790 the loss), same RNG draws:
        noise_scheduler_copy = copy.deepcopy(scheduler)
        prompt_embeds = [
            cond["cap_feats"][i][cond["cap_mask"][i].bool()] for i in range(2)
        ]  # encode_prompt's list
        torch.manual_seed(123)
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme=scheme, batch_size=bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
        )
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices]
        schedule_timesteps = noise_scheduler_copy.timesteps
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigmas = noise_scheduler_copy.sigmas[step_indices].flatten().view(bsz, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        timestep_normalized = (1000 - timesteps) / 1000
        noisy_model_input_list = list(noisy_model_input.unsqueeze(2).unbind(dim=0))
        model_pred_list = transformer(
            noisy_model_input_list, timestep_normalized, prompt_embeds, return_dict=False
        )[0]
        model_pred = -torch.stack(model_pred_list, dim=0).squeeze(2)  # "z-Image negates the prediction"
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
        ).mean()
    assert loss.item() > 0.1
    torch.testing.assert_close(ours, loss, rtol=0, atol=0)


# --------------------------------------------------------------------------- d. published configs


def test_published_configs_give_the_published_parameter_counts():
    from diffusers_zero3.families import ZIMAGE
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import build_on_meta

    published = ZIMAGE.published()
    assert [p.hub_id for p in published] == ["Tongyi-MAI/Z-Image-Turbo", "Tongyi-MAI/Z-Image"]
    assert all(KNOWN_PIPELINES[p.hub_id]["_class_name"] == "ZImagePipeline" for p in published)
    counts = {
        name: sum(p.numel() for p in build_on_meta(library, cls, config).parameters())
        for name, (library, cls, config) in published[0].components.items()
    }
    assert counts == {"transformer": 6_154_908_736, "text_encoder": 4_022_468_096, "vae": 83_819_683}


# --------------------------------------------------------------------------- e. tiny pipeline and LoRA


def test_tiny_pipeline_generates_and_takes_a_lora(tiny_zimage):
    from diffusers_zero3.families import ZIMAGE
    from diffusers_zero3.training.lora import add_lora_adapters

    pipe = load(tiny_zimage)
    assert type(pipe).__name__ == "ZImagePipeline"
    image = pipe(
        "a red circle",
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        **ZIMAGE.validation_kwargs(None, 3.5),  # CFG at the pipeline's default scale, 512 tokens
    ).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all() and image.std() > 0

    _, cond = family_conditioning(pipe, tiny_zimage, PROMPTS[:2], 32)
    torch.manual_seed(0)
    latents, timesteps = torch.randn(2, 16, 4, 4), torch.tensor([250.0, 750.0])
    with torch.no_grad():
        before = ZIMAGE.predict(pipe.transformer, latents, timesteps, cond)
    params = add_lora_adapters(pipe.transformer, rank=4, target_modules=ZIMAGE.lora_target_modules)
    wrapped = {n.split(".lora_")[0] for n, _ in pipe.transformer.named_parameters() if "lora_" in n}
    # to_q/k/v/out.0 of every block: 2 layers, 1 noise refiner, 1 context refiner
    assert len(wrapped) == 16 and len(params) == 32 and sum(p.numel() for p in params) == 4096
    assert all(not p.requires_grad for n, p in pipe.transformer.named_parameters() if "lora_" not in n)
    lora_b = [p for n, p in pipe.transformer.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 16 and all(not p.any() for p in lora_b)
    with torch.no_grad():
        after = ZIMAGE.predict(pipe.transformer, latents, timesteps, cond)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    with torch.no_grad():
        lora_b[0].fill_(0.5)  # a LoRA that has learnt something changes the prediction
        changed = ZIMAGE.predict(pipe.transformer, latents, timesteps, cond)
    assert (changed - before).abs().max() > 1e-4
