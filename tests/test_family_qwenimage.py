"""The Qwen-Image family against diffusers' own code: prompt encoding (template, dropped
tokens, masks) against ``QwenImagePipeline.encode_prompt``, the denoiser call against the
pipeline's, the objective against ``train_dreambooth_lora_qwen_image.py``, latents against
the VAE, and the tiny pipeline."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = ["a red circle", "a blue square on a big green tree in the sky", ""]


@pytest.fixture(scope="module")
def pipe(tiny_qwenimage):
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(tiny_qwenimage[0])
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _cond(folder, pipeline, prompts, max_sequence_length=64):
    from diffusers_zero3.families import QWENIMAGE

    tokenizers = QWENIMAGE.load_tokenizers(folder)
    ids = QWENIMAGE.tokenize(tokenizers, prompts, max_sequence_length)
    with torch.no_grad():
        outputs = QWENIMAGE.encode_texts({"text_encoder": pipeline.text_encoder}, ids)
    return ids, outputs, QWENIMAGE.conditioning(outputs)


def test_conditioning_equals_the_pipelines_encode_prompt(tiny_qwenimage, pipe):
    from diffusers_zero3.families import QWENIMAGE, detect_family

    folder = tiny_qwenimage[0]
    assert detect_family(folder) is QWENIMAGE
    ids, outputs, cond = _cond(folder, pipe, PROMPTS)
    # fixed length per row (34 template tokens + 64), so that each row can be cached alone
    assert ids["input_ids"].shape == (3, 34 + 64) and outputs["prompt_embeds"].shape[1] == 64
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=64)
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds)
    assert mask is not None and torch.equal(cond["encoder_hidden_states_mask"], mask)
    assert len(set(mask.sum(dim=1).tolist())) == 3  # three lengths: the mask matters
    # One row encoded alone (as the cache encodes) equals its row in the batch, on its valid tokens.
    _, alone, _ = _cond(folder, pipe, PROMPTS[1:2])
    torch.testing.assert_close(alone["prompt_embeds"][0], outputs["prompt_embeds"][1])
    # A batch of equal lengths: the pipeline drops its all-ones mask, an all-ones mask is equivalent.
    _, _, same = _cond(folder, pipe, ["a red circle", "a red square"])
    assert bool(same["encoder_hidden_states_mask"].all())


def test_text_encoder_in_bf16_keeps_its_rotary_table_in_fp32(tiny_qwenimage):
    """A cast to bf16 rounds the non-persistent rotary ``inv_freq``; the package recomputes it
    (the control: a bare cast leaves it bf16)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from diffusers_zero3 import prepare_frozen

    def load():
        return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwenimage[0], subfolder="text_encoder")

    reference = {n: b.clone() for n, b in load().named_buffers() if n.endswith("inv_freq")}
    bare = load().to(torch.bfloat16)
    assert any(b.dtype == torch.bfloat16 for n, b in bare.named_buffers() if n.endswith("inv_freq"))
    placed = prepare_frozen(load(), "replicate", dtype=torch.bfloat16, name="text_encoder").module
    assert placed.dtype == torch.bfloat16
    buffers = dict(placed.named_buffers())
    text_tables = [n for n in reference if "visual" not in n]
    assert text_tables
    for name in text_tables:
        assert buffers[name].dtype == torch.float32 and torch.equal(buffers[name], reference[name]), name


def test_prediction_is_the_pipelines_transformer_call(tiny_qwenimage, pipe):
    from diffusers import QwenImagePipeline

    from diffusers_zero3.families import QWENIMAGE
    from diffusers_zero3.families.qwenimage import pack_latents, unpack_latents

    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out[0].detach().clone())), with_kwargs=True
    )
    try:
        pipe(PROMPTS[:2], num_inference_steps=2, height=32, width=48, max_sequence_length=64,
             generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    finally:
        hook.remove()
    kwargs, expected = calls[-1]
    h, w = 32 // 4, 48 // 4  # the tiny VAE downsamples 4x
    x = torch.randn(2, 4, 1, h, w)
    assert torch.equal(pack_latents(x), QwenImagePipeline._pack_latents(x.permute(0, 2, 1, 3, 4), 2, 4, h, w))
    assert torch.equal(unpack_latents(pack_latents(x), h, w), x)
    _, _, cond = _cond(tiny_qwenimage[0], pipe, PROMPTS[:2])
    noisy = unpack_latents(kwargs["hidden_states"], h, w)
    with torch.no_grad():
        ours = QWENIMAGE.predict(pipe.transformer, noisy, kwargs["timestep"] * 1000, cond)
    assert ours.shape == noisy.shape
    torch.testing.assert_close(ours, unpack_latents(expected, h, w))


@pytest.mark.parametrize("weighting_scheme", ["none", "logit_normal"])
def test_objective_is_diffusers_qwen_image_dreambooth_loss(tiny_qwenimage, pipe, weighting_scheme):
    """``QWENIMAGE.loss`` against the lines of ``train_dreambooth_lora_qwen_image.py`` (the
    scheduler loaded with shift=3.0, which dynamic shifting ignores; noise, then u; sigmas of
    the scheduler's table; packed prediction; target noise - latents), same seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from diffusers_zero3.families import QWENIMAGE
    from diffusers_zero3.families.objectives import ObjectiveSettings

    folder = tiny_qwenimage[0]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler", shift=3.0)
    _, _, cond = _cond(folder, pipe, PROMPTS[:2])
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        # the script: vae.encode(pixel_values[:, :, None]).latent_dist.sample(), (z - mean) * (1 / std)
        torch.manual_seed(5)
        z = pipe.vae.encode(pixels[:, :, None]).latent_dist.sample()
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
        model_input = (z - mean) * std
        torch.manual_seed(5)
        ours_latents = QWENIMAGE.latent_normalizer(pipe.vae.config)(
            QWENIMAGE.latents_of(QWENIMAGE.latent_distribution(pipe.vae, pixels))
        )
        torch.testing.assert_close(ours_latents, model_input)

        torch.manual_seed(7)
        noise = torch.randn_like(model_input)
        bsz, c, _, h, w = model_input.shape
        u = compute_density_for_timestep_sampling(weighting_scheme, bsz, 0.0, 1.0, 1.29)
        indices = (u * scheduler.config.num_train_timesteps).long()
        timesteps = scheduler.timesteps[indices]
        sigmas = scheduler.sigmas[indices].view(-1, 1, 1, 1, 1)
        noisy = (1.0 - sigmas) * model_input + sigmas * noise
        packed = QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), bsz, c, h, w)
        pred = pipe.transformer(
            hidden_states=packed,
            timestep=timesteps / 1000,
            guidance=None,
            encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * bsz,
            return_dict=False,
        )[0]
        pred = QwenImagePipeline._unpack_latents(pred, 32, 32, 4)  # (B, C, 1, H, W)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme, sigmas)
        target = noise - model_input
        expected = torch.mean(
            (weighting.float() * (pred.float() - target.float()) ** 2).reshape(bsz, -1), 1
        ).mean()

        torch.manual_seed(7)
        settings = ObjectiveSettings(weighting_scheme=weighting_scheme)
        ours = QWENIMAGE.loss(pipe.transformer, scheduler, model_input, cond, settings)
    torch.testing.assert_close(ours, expected)
    assert expected.item() > 0.01  # a real loss, not a zero that any prediction would give


def test_tiny_pipeline_generates_and_takes_lora_at_the_scripts_targets(tiny_qwenimage, pipe):
    from diffusers_zero3.families import QWENIMAGE
    from diffusers_zero3.training.lora import add_lora_adapters

    image = pipe("a red circle", num_inference_steps=2, height=32, width=32).images[0]
    assert image.size == (32, 32)
    transformer = type(pipe.transformer).from_pretrained(tiny_qwenimage[0], subfolder="transformer")
    x = torch.randn(1, 4, 1, 8, 8)
    _, _, cond = _cond(tiny_qwenimage[0], pipe, ["a red circle"])
    with torch.no_grad():
        before = QWENIMAGE.predict(transformer, x, torch.tensor([500.0]), cond)
    adapters = add_lora_adapters(transformer, rank=4, target_modules=QWENIMAGE.lora_target_modules)
    assert len(adapters) == 2 * 4 * 2  # A and B of 4 projections in 2 blocks
    with torch.no_grad():
        after = QWENIMAGE.predict(transformer, x, torch.tensor([500.0]), cond)
    torch.testing.assert_close(after, before)  # LoRA B starts at zero
