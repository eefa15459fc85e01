"""The HunyuanVideo 1.5 family against diffusers' own code: both encoders' conditioning (Qwen2.5-VL
template, 108 dropped tokens, ``hidden_states[-3]``, masks; ByT5 on the quoted glyph text, zeros
without it) against ``HunyuanVideo15Pipeline.encode_prompt``, the transformer call against the
pipeline's (forward hook), in fp32 and bf16; the video latents' arithmetic against the VAE and
``prepare_latents``; the flow-matching loss written out; the tiny pipeline and LoRA targets."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

# quoted glyph text (twice, and in curly quotes), a caption without any, the empty caption
PROMPTS = ['a sign that reads "OPEN" and \u201cCAFE\u201d on a red wall', "a blue square moving left", ""]


@pytest.fixture(scope="module")
def pipe(tiny_hunyuanvideo15):
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(tiny_hunyuanvideo15[0])
    pipeline.set_progress_bar_config(disable=True)
    pipeline.tokenizer_max_length = 48  # what --max_sequence_length 48 sets for the family
    return pipeline


def _cond(folder, encoders, prompts, max_sequence_length=48):
    from diffusers_zero3.families import HUNYUANVIDEO15

    tokenizers = HUNYUANVIDEO15.load_tokenizers(folder)
    ids = HUNYUANVIDEO15.tokenize(tokenizers, prompts, max_sequence_length)
    with torch.no_grad():
        outputs = HUNYUANVIDEO15.encode_texts(encoders, ids)
    return ids, outputs, HUNYUANVIDEO15.conditioning(outputs)


def _encoders(pipeline) -> dict:
    return {"text_encoder": pipeline.text_encoder, "text_encoder_2": pipeline.text_encoder_2}


def _in(pipeline, dtype):
    """The module's pipeline (fp32), or a copy of it cast to ``dtype`` (the shared one stays fp32)."""
    import copy

    return pipeline if dtype == torch.float32 else copy.deepcopy(pipeline).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conditioning_equals_the_pipelines_encode_prompt(tiny_hunyuanvideo15, pipe, dtype):
    from diffusers import HunyuanVideo15Pipeline

    from diffusers_zero3.families import HUNYUANVIDEO15, detect_family
    from diffusers_zero3.families.hunyuanvideo15 import glyph_text

    folder = tiny_hunyuanvideo15[0]
    assert detect_family(folder) is HUNYUANVIDEO15
    assert pipe.prompt_template_encode_start_idx == 108 and pipe.tokenizer_2_max_length == 256
    assert glyph_text(PROMPTS[0]) == 'Text "OPEN". Text "CAFE". ' and glyph_text(PROMPTS[1]) is None
    pipe = _in(pipe, dtype)
    encoders = _encoders(pipe)
    ids, outputs, cond = _cond(folder, encoders, PROMPTS)
    # fixed lengths per row (108 template tokens + 48; ByT5 256), so that each row can be cached alone
    assert ids["input_ids"].shape == (3, 108 + 48) and ids["input_ids_2"].shape == (3, 256)
    with torch.no_grad():
        embeds, mask, embeds_2, mask_2 = HunyuanVideo15Pipeline.encode_prompt(
            pipe, PROMPTS, device="cpu", dtype=dtype, batch_size=3
        )
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds, rtol=0, atol=0)
    torch.testing.assert_close(cond["encoder_hidden_states_2"], embeds_2, rtol=0, atol=0)
    assert torch.equal(cond["encoder_attention_mask"].to(dtype), mask)
    assert torch.equal(cond["encoder_attention_mask_2"].to(dtype), mask_2)
    assert len(set(mask.sum(dim=1).tolist())) == 3  # three caption lengths: the mask matters
    # the glyph path: 'Text "OPEN". Text "CAFE". ' is 26 bytes and </s>; no quotes: zeros, no tokens
    assert mask_2.sum(dim=1).tolist() == [27, 0, 0]
    assert embeds_2[0].abs().sum() > 0 and not embeds_2[1:].any()
    # hidden_states[-3] of the 3-layer encoder: not the last layer's, not the embeddings'
    with torch.no_grad():
        states = encoders["text_encoder"](
            input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], output_hidden_states=True
        ).hidden_states
    assert len(states) == 4 and torch.equal(outputs["prompt_embeds"], states[1][:, 108:])
    assert not torch.equal(states[1], states[-1])
    # One row encoded alone (as the cache encodes) equals its row in the batch.
    _, alone, _ = _cond(folder, encoders, PROMPTS[:1])
    valid = mask[0].bool()
    torch.testing.assert_close(alone["prompt_embeds"][0][valid], outputs["prompt_embeds"][0][valid])
    torch.testing.assert_close(alone["prompt_embeds_2"][0], outputs["prompt_embeds_2"][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prediction_is_the_pipelines_transformer_call(tiny_hunyuanvideo15, pipe, dtype):
    from diffusers_zero3.families import HUNYUANVIDEO15

    pipe = _in(pipe, dtype)
    transformer = pipe.transformer
    calls = []
    hook = transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out[0].detach().clone())), with_kwargs=True
    )
    try:
        with torch.no_grad():
            pipe(PROMPTS[:2], num_inference_steps=2, height=32, width=48, num_frames=5,
                 generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 4  # 2 steps x (prompt, empty prompt): the published guider's CFG
    kwargs, expected = calls[-2]  # the last step's conditional call
    hidden = kwargs["hidden_states"]
    assert hidden.shape == (2, 9, 2, 4, 6)  # 5 frames -> 2 latent frames; 8x spatial; 4 + 4 + 1 channels
    assert not hidden[:, 4:].any()  # the t2v condition latents and mask are zeros
    _, _, cond = _cond(tiny_hunyuanvideo15[0], _encoders(pipe), PROMPTS[:2])
    noisy = hidden[:, :4]
    # the scheduler's timestep (sigma x 1000); the pipeline hands it over in the latents' dtype
    timesteps = pipe.scheduler.timesteps[-1:].expand(2)
    assert torch.equal(timesteps.to(dtype), kwargs["timestep"])
    with torch.no_grad():
        ours = HUNYUANVIDEO15.predict(transformer, noisy, timesteps, cond)
    assert ours.shape == noisy.shape and ours.dtype == dtype
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_video_latents_frames_and_normalisation(tiny_hunyuanvideo15, pipe):
    """A batch of clips encodes as each clip alone (diffusers' VAE attention cannot take a batch:
    the family's does), latents scale by ``scaling_factor`` and decode as the pipeline decodes;
    frame and side arithmetic as ``prepare_latents``."""
    from diffusers_zero3.data.video import check_video_shape
    from diffusers_zero3.families import HUNYUANVIDEO15

    vae, config = pipe.vae, pipe.vae.config
    clips = torch.rand(2, 3, 5, 32, 48) * 2 - 1
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            vae.encode(clips)  # diffusers 0.42: the (B, L, L) mask broadcasts to (B, B, L, L)
        batch = HUNYUANVIDEO15.latent_distribution(vae, clips).mode()
        for i in range(2):
            torch.testing.assert_close(batch[i : i + 1], vae.encode(clips[i : i + 1]).latent_dist.mode())
    assert batch.shape == (2, 4, HUNYUANVIDEO15.latent_frames(5, config), 4, 6)
    shape = pipe.prepare_latents(
        1, 4, 32, 48, 5, torch.float32, "cpu", torch.Generator().manual_seed(0)
    ).shape
    assert shape[2] == HUNYUANVIDEO15.latent_frames(5, config) == 2
    assert (HUNYUANVIDEO15.frame_multiple(config), HUNYUANVIDEO15.latent_multiple(config)) == (4, 8)
    check_video_shape(9, 32, 48, HUNYUANVIDEO15, config)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        check_video_shape(6, 32, 32, HUNYUANVIDEO15, config)
    normalize = HUNYUANVIDEO15.latent_normalizer(config)
    assert config.scaling_factor == 0.75
    torch.testing.assert_close(normalize(batch), batch * 0.75)
    with torch.no_grad():
        video = HUNYUANVIDEO15.decode_latents(vae, normalize, normalize(batch[:1]))
        # the pipeline's: latents / scaling_factor, then vae.decode
        expected = vae.decode(normalize(batch[:1]) / config.scaling_factor, return_dict=False)[0]
    torch.testing.assert_close(video, expected)
    assert video.shape == (1, 3, 5, 32, 48)


def test_objective_is_flow_matching_on_the_pipelines_transformer_call(tiny_hunyuanvideo15, pipe):
    """``HUNYUANVIDEO15.loss`` written out: noise, logit-normal u on the scheduler's shifted table,
    ``(1 - sigma) x + sigma noise``, the transformer as the pipeline calls it, target ``noise -
    latents``, same seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from diffusers_zero3.families import HUNYUANVIDEO15
    from diffusers_zero3.families.objectives import ObjectiveSettings

    folder = tiny_hunyuanvideo15[0]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    assert HUNYUANVIDEO15.load_noise_scheduler(folder).config.shift == scheduler.config.shift == 5.0
    _, _, cond = _cond(folder, _encoders(pipe), PROMPTS[:2])
    latents = torch.randn(2, 4, 2, 4, 4)
    with torch.no_grad():
        torch.manual_seed(7)
        noise = torch.randn_like(latents)
        u = compute_density_for_timestep_sampling("logit_normal", 2, 0.0, 1.0, 1.29)
        indices = (u * 1000).long()
        timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices].view(-1, 1, 1, 1, 1)
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        pred = pipe.transformer(
            hidden_states=torch.cat([noisy, torch.zeros(2, 5, 2, 4, 4)], dim=1),
            image_embeds=torch.zeros(2, 729, 12),
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_attention_mask=cond["encoder_attention_mask"].float(),
            encoder_hidden_states_2=cond["encoder_hidden_states_2"],
            encoder_attention_mask_2=cond["encoder_attention_mask_2"].float(),
            return_dict=False,
        )[0]
        expected = ((pred - (noise - latents)) ** 2).reshape(2, -1).mean(1).mean()
        torch.manual_seed(7)
        settings = ObjectiveSettings(weighting_scheme=HUNYUANVIDEO15.default_weighting_scheme)
        ours = HUNYUANVIDEO15.loss(pipe.transformer, scheduler, latents, cond, settings)
    torch.testing.assert_close(ours, expected)
    assert expected.item() > 0.01


def test_tiny_pipeline_generates_a_video_and_takes_lora_at_the_default_targets(tiny_hunyuanvideo15, pipe):
    from diffusers_zero3.families import HUNYUANVIDEO15
    from diffusers_zero3.training.lora import add_lora_adapters

    frames = pipe("a red circle", num_inference_steps=2, height=32, width=32,
                  **HUNYUANVIDEO15.validation_kwargs(None, None)).frames[0]  # fmt: skip
    assert len(frames) == 5 and frames[0].size == (32, 32)
    transformer = type(pipe.transformer).from_pretrained(tiny_hunyuanvideo15[0], subfolder="transformer")
    x = torch.randn(1, 4, 2, 4, 4)
    _, _, cond = _cond(tiny_hunyuanvideo15[0], _encoders(pipe), ["a red circle"])
    with torch.no_grad():
        before = HUNYUANVIDEO15.predict(transformer, x, torch.tensor([500.0]), cond)
    adapters = add_lora_adapters(transformer, rank=4, target_modules=HUNYUANVIDEO15.lora_target_modules)
    assert len(adapters) == 2 * (2 * 8 + 4)  # A and B: 8 projections in 2 blocks, 4 in the text refiner
    with torch.no_grad():
        after = HUNYUANVIDEO15.predict(transformer, x, torch.tensor([500.0]), cond)
    torch.testing.assert_close(after, before)  # LoRA B starts at zero


def test_a_rank_without_samples_still_calls_every_model(tiny_hunyuanvideo15, pipe):
    """Qwen2.5-VL, T5 and the transformer cannot take an empty batch: each runs one dummy row and
    returns none of it (a sharded model stays in lockstep); the calls are counted."""
    from diffusers_zero3.families import HUNYUANVIDEO15

    calls = []
    models = (pipe.text_encoder, pipe.text_encoder_2, pipe.transformer)
    hooks = [m.register_forward_hook(lambda m, a, o: calls.append(type(m).__name__)) for m in models]
    try:
        ids, outputs, cond = _cond(tiny_hunyuanvideo15[0], _encoders(pipe), [])
        with torch.no_grad():
            pred = HUNYUANVIDEO15.predict(pipe.transformer, torch.zeros(0, 4, 2, 4, 4), torch.zeros(0), cond)
    finally:
        for h in hooks:
            h.remove()
    assert sorted(calls) == sorted(type(m).__name__ for m in models)
    assert outputs["prompt_embeds"].shape == (0, 48, 16) and outputs["prompt_embeds_2"].shape == (0, 256, 32)
    assert pred.shape == (0, 4, 2, 4, 4)
