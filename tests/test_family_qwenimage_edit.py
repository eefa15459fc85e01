"""The Qwen-Image-Edit-Plus family against ``QwenImageEditPlusPipeline``: the token ids, pixels
and grids Qwen2.5-VL gets (against the pipeline's processor call), the conditioning (against
``encode_prompt`` given the same condition images, one or two sources), the transformer call
(the target's tokens then each source's, ``img_shapes``; captured with a forward hook in a real
pipeline call) in fp32 and bf16, the loss on the target's tokens (Qwen-Image's flow-matching
lines with the sources appended), and the tiny pipeline's tokenizer and processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = ["make the circle blue", "turn the red square into a green one and keep the background as it is"]


@pytest.fixture(scope="module")
def folder(tiny_qwenimage_edit):
    return tiny_qwenimage_edit[0]


_PIPES: dict = {}


def load(folder, dtype=torch.float32):
    """The tiny pipeline in ``dtype``, loaded once per module (the tests only read it)."""
    from diffusers import QwenImageEditPlusPipeline

    if (folder, dtype) not in _PIPES:
        pipe = QwenImageEditPlusPipeline.from_pretrained(folder, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[folder, dtype] = pipe
    return _PIPES[folder, dtype]


def sources(n: int, k: int, height: int, width: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    """``(N, K, 3, H, W)`` pixels in [-1, 1] as the paired dataset makes them, and the PIL images."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    arrays = rng.integers(0, 256, (n, k, height, width, 3), dtype=np.uint8)
    pixels = torch.from_numpy(arrays.astype(np.float32) / 127.5 - 1.0).permute(0, 1, 4, 2, 3)
    return pixels, [[Image.fromarray(a) for a in row] for row in arrays]


def pipeline_condition_images(pipe, images):
    """The lines of ``QwenImageEditPlusPipeline.__call__`` that make its condition images."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        CONDITION_IMAGE_SIZE,
        calculate_dimensions,
    )

    out = []
    for img in images:
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, img.size[0] / img.size[1])
        out.append(pipe.image_processor.resize(img, h, w))
    return out


def ours(folder, pipe, prompts, pixels, max_sequence_length=64, dtype=torch.float32):
    from diffusers_zero3.families import QWENIMAGE_EDIT
    from diffusers_zero3.placement.frozen_inputs import conditioning_on

    ids = QWENIMAGE_EDIT.tokenize(QWENIMAGE_EDIT.load_tokenizers(folder), prompts, max_sequence_length)
    with torch.no_grad():
        outputs = QWENIMAGE_EDIT.encode_texts(
            {"text_encoder": pipe.text_encoder}, {**ids, "source_pixel_values": pixels}
        )
    return ids, conditioning_on(QWENIMAGE_EDIT, outputs, torch.device("cpu"), dtype)


def test_vl_inputs_equal_the_pipelines_processor_call(folder):
    from diffusers_zero3.families import QWENIMAGE_EDIT
    from diffusers_zero3.families.qwenimage_edit import PICTURE_TEMPLATE, PROMPT_TEMPLATE, vision_inputs

    pipe = load(folder)
    ids = QWENIMAGE_EDIT.tokenize(QWENIMAGE_EDIT.load_tokenizers(folder), PROMPTS, 64)
    for k, (h, w) in ((1, (32, 32)), (2, (32, 48))):
        pixels, images = sources(2, k, h, w, seed=k)
        got = vision_inputs(pipe.text_encoder.config, ids["input_ids"], ids["attention_mask"], pixels)
        for r, prompt in enumerate(PROMPTS):
            blocks = "".join(PICTURE_TEMPLATE.format(i + 1) for i in range(k))
            ref = pipe.processor(
                text=[PROMPT_TEMPLATE.format(blocks + prompt)],
                images=pipeline_condition_images(pipe, images[r]),
                padding=True,
                return_tensors="pt",
            )
            n = int(ref["attention_mask"].sum())
            assert torch.equal(got["input_ids"][r, :n], ref["input_ids"][0]), (k, r)
            assert int(got["attention_mask"][r].sum()) == n
            rows = slice(r * k, (r + 1) * k)
            assert torch.equal(got["image_grid_thw"][rows], ref["image_grid_thw"])
            patches = int(got["image_grid_thw"][: r * k].prod(-1).sum())
            torch.testing.assert_close(got["pixel_values"][patches : patches + len(ref["pixel_values"])],
                                       ref["pixel_values"], rtol=0, atol=1e-6)  # fmt: skip
        assert got["image_grid_thw"][0].tolist() == ([1, 28, 28] if k == 1 else [1, 22, 34])
    with pytest.raises(ValueError, match="1 to 3 source images"):
        vision_inputs(
            pipe.text_encoder.config, ids["input_ids"], ids["attention_mask"], sources(2, 4, 32, 32)[0]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conditioning_equals_the_pipelines_encode_prompt(folder, dtype):
    pipe = load(folder, dtype)
    pixels, images = sources(2, 2, 32, 48)
    _, cond = ours(folder, pipe, PROMPTS, pixels, dtype=dtype)
    states, mask = cond["encoder_hidden_states"], cond["encoder_hidden_states_mask"]
    lengths = []
    for r, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            embeds, ref_mask = pipe.encode_prompt([prompt], image=pipeline_condition_images(pipe, images[r]))
        n = embeds.shape[1]
        lengths.append(n)
        assert ref_mask is None  # one prompt: all valid, the pipeline drops the mask
        torch.testing.assert_close(states[r, :n], embeds[0], rtol=0, atol=0)
        assert bool(mask[r, :n].all()) and not bool(mask[r, n:].any())
        assert not bool(states[r, n:].any())
    assert states.shape[1] == max(lengths) and lengths[0] != lengths[1]  # trimmed to the longest row
    assert states.dtype == dtype


def source_latents(pipe, pixels):
    """The sources' latents as ``FrozenInputs.source_latents`` makes them: (N, K, C, 1, h, w)."""
    from diffusers_zero3.families import QWENIMAGE_EDIT

    n, k = pixels.shape[:2]
    normalize = QWENIMAGE_EDIT.latent_normalizer(pipe.vae.config)
    flat = pixels.flatten(0, 1).to(pipe.vae.dtype)
    with torch.no_grad():
        latents = normalize(QWENIMAGE_EDIT.latent_distribution(pipe.vae, flat).mode())
    return latents.reshape(n, k, *latents.shape[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predict_is_the_pipelines_transformer_call(folder, dtype):
    from diffusers_zero3.families import QWENIMAGE_EDIT
    from diffusers_zero3.families.qwenimage import pack_latents, unpack_latents

    pipe = load(folder, dtype)
    pixels, images = sources(1, 2, 32, 64, seed=3)  # sides the pipeline's 32-multiples keep
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda m, a, kw, out: calls.append((dict(kw), out[0].detach().clone())), with_kwargs=True
    )
    try:
        QWENIMAGE_EDIT.prepare_validation_pipeline(pipe, 32)(
            image=images[0], prompt=PROMPTS[1], num_inference_steps=2, height=32, width=64,
            generator=torch.Generator().manual_seed(0), output_type="latent",
        )  # fmt: skip
    finally:
        hook.remove()
    kwargs, expected = calls[-1]
    h, w = 32 // 4, 64 // 4
    target = (h // 2) * (w // 2)
    assert kwargs["img_shapes"] == [[(1, h // 2, w // 2)] * 3]  # the target, then two sources at its size
    sources_packed = torch.cat([pack_latents(s) for s in source_latents(pipe, pixels)[0].unsqueeze(1)], 1)
    torch.testing.assert_close(kwargs["hidden_states"][:, target:], sources_packed,
                               **({} if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)))  # fmt: skip
    _, cond = ours(folder, pipe, PROMPTS[1:], pixels, dtype=dtype)
    torch.testing.assert_close(cond["encoder_hidden_states"], kwargs["encoder_hidden_states"], rtol=0, atol=0)
    cond["source_latents"] = unpack_sources(kwargs["hidden_states"][:, target:], 2, h, w)
    noisy = unpack_latents(kwargs["hidden_states"][:, :target], h, w)
    seen = []
    ours_hook = pipe.transformer.register_forward_hook(
        lambda m, a, kw, out: seen.append(kw), with_kwargs=True
    )
    try:
        with torch.no_grad():
            pred = QWENIMAGE_EDIT.predict(pipe.transformer, noisy, kwargs["timestep"] * 1000, cond)
    finally:
        ours_hook.remove()
    assert seen[0]["img_shapes"] == kwargs["img_shapes"]
    assert torch.equal(seen[0]["hidden_states"], kwargs["hidden_states"])
    assert pred.shape == noisy.shape and pred.dtype == dtype
    torch.testing.assert_close(pred, unpack_latents(expected[:, :target], h, w), rtol=0, atol=0)


def unpack_sources(packed, k, h, w):
    """Packed sources (N, K * h/2 * w/2, 4C) back to (N, K, C, 1, h, w)."""
    from diffusers_zero3.families.qwenimage import unpack_latents

    return torch.stack([unpack_latents(p, h, w) for p in packed.chunk(k, dim=1)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_is_qwen_images_objective_on_the_targets_tokens(folder, dtype):
    """``QWENIMAGE_EDIT.loss`` against ``train_dreambooth_lora_qwen_image.py``'s lines with the
    sources' packed latents appended to the noisy tokens and the prediction cut to the target's."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from diffusers_zero3.families import QWENIMAGE_EDIT
    from diffusers_zero3.families.objectives import ObjectiveSettings

    pipe = load(folder, dtype)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    pixels, _ = sources(2, 1, 32, 32, seed=5)
    _, cond = ours(folder, pipe, PROMPTS, pixels, dtype=dtype)
    cond["source_latents"] = source_latents(pipe, pixels).to(dtype)
    model_input = torch.randn(2, 4, 1, 8, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        torch.manual_seed(7)
        noise = torch.randn_like(model_input)
        bsz, c, _, h, w = model_input.shape
        u = compute_density_for_timestep_sampling("none", bsz, 0.0, 1.0, 1.29)
        indices = (u * scheduler.config.num_train_timesteps).long()
        timesteps = scheduler.timesteps[indices]
        sigmas = scheduler.sigmas[indices].view(-1, 1, 1, 1, 1).to(dtype)
        noisy = (1.0 - sigmas) * model_input + sigmas * noise
        packed = QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), bsz, c, h, w)
        source = cond["source_latents"][:, 0]
        packed_source = QwenImagePipeline._pack_latents(source.permute(0, 2, 1, 3, 4), bsz, c, h, w)
        pred = pipe.transformer(
            hidden_states=torch.cat([packed, packed_source], dim=1),
            timestep=(timesteps / 1000).to(dtype),
            guidance=None,
            encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
            img_shapes=[[(1, h // 2, w // 2), (1, h // 2, w // 2)]] * bsz,
            return_dict=False,
        )[0][:, : packed.shape[1]]
        pred = QwenImagePipeline._unpack_latents(pred, 32, 32, 4)
        weighting = compute_loss_weighting_for_sd3("none", sigmas)
        expected = torch.mean(
            (weighting.float() * (pred.float() - (noise - model_input).float()) ** 2).reshape(bsz, -1), 1
        ).mean()
        torch.manual_seed(7)
        loss = QWENIMAGE_EDIT.loss(pipe.transformer, scheduler, model_input, cond, ObjectiveSettings())
        # the sources matter: without them the loss differs
        torch.manual_seed(7)
        plain = {k: v for k, v in cond.items() if k != "source_latents"}
        without = QWENIMAGE_EDIT.loss(pipe.transformer, scheduler, model_input, plain, ObjectiveSettings())
    torch.testing.assert_close(loss, expected)
    assert expected.item() > 0.01 and not torch.allclose(loss, without)


def test_tiny_pipeline_tokenizer_processor_and_family(folder):
    from transformers import AutoTokenizer

    from diffusers_zero3.families import QWENIMAGE_EDIT, detect_family
    from diffusers_zero3.families import qwenimage_edit as edit

    assert detect_family(folder) is QWENIMAGE_EDIT and QWENIMAGE_EDIT.edits
    tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
    assert len(tokenizer(edit.PROMPT_TEMPLATE.split("{}")[0]).input_ids) == edit.DROPPED_TEMPLATE_TOKENS
    assert len(tokenizer(edit.PICTURE_TEMPLATE.format(2)).input_ids) == edit.PICTURE_TOKENS
    processor = QWENIMAGE_EDIT.load_tokenizers(folder)["text_encoder"]
    assert type(processor).__name__ == edit.PROCESSOR_CLASS
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision
    ids = QWENIMAGE_EDIT.tokenize({"text_encoder": processor}, PROMPTS, 32)
    assert ids["input_ids"].shape == (2, 64 + 3 * 8 + 32)
    with pytest.raises(ValueError, match="cannot be cached"):
        QWENIMAGE_EDIT.encode_texts({"text_encoder": load(folder).text_encoder}, ids)
