"""The LTX-2 family against diffusers' own code: the conditioning (Gemma 3's stacked hidden states,
left padding, then the connectors) against ``LTX2Pipeline.encode_prompt`` and the pipeline's
connectors call, the transformer call (video and audio streams) against the pipeline's (forward
hook), in fp32 and bf16; video and audio latents against ``_normalize_latents`` and
``prepare_audio_latents``; the audio-video loss written out, with a clip without sound; the tiny
pipeline (video with sound) and LoRA on both streams' attention."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = ["  a red circle moving left  ", "a blue square", ""]  # stripped as the pipeline strips
MAX_LENGTH = 32


@pytest.fixture(scope="module")
def pipe(tiny_ltx2):
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(tiny_ltx2[0])
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _in(pipeline, dtype):
    """The module's pipeline (fp32), or a copy of it cast to ``dtype`` (the shared one stays fp32)."""
    import copy

    return pipeline if dtype == torch.float32 else copy.deepcopy(pipeline).to(dtype)


def _encoders(pipeline) -> dict:
    return {"text_encoder": pipeline.text_encoder, "connectors": pipeline.connectors}


def _cond(folder, encoders, prompts):
    from diffusers_zero3.families import LTX2

    ids = LTX2.tokenize(LTX2.load_tokenizers(folder), prompts, MAX_LENGTH)
    with torch.no_grad():
        outputs = LTX2.encode_texts(encoders, ids)
    return ids, outputs, LTX2.conditioning(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conditioning_equals_the_pipelines_encode_prompt_and_connectors(tiny_ltx2, pipe, dtype):
    from diffusers import LTX2Pipeline

    from diffusers_zero3.families import LTX2, detect_family

    folder = tiny_ltx2[0]
    assert detect_family(folder) is LTX2
    pipe = _in(pipe, dtype)
    ids, outputs, cond = _cond(folder, _encoders(pipe), PROMPTS)
    assert ids["input_ids"].shape == (3, MAX_LENGTH)
    assert ids["attention_mask"][:, 0].tolist() == [0, 0, 0]  # left padding
    with torch.no_grad():
        embeds, mask, _, _ = LTX2Pipeline.encode_prompt(
            pipe, PROMPTS, do_classifier_free_guidance=False, max_sequence_length=MAX_LENGTH, device="cpu"
        )
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side="left")
    assert embeds.shape[-1] == 16 * 4  # every hidden state of the 3-layer Gemma (and the embeddings)
    assert torch.equal(ids["attention_mask"], mask)
    assert len(set(mask.sum(dim=1).tolist())) == 3  # three caption lengths: the mask matters
    torch.testing.assert_close(cond["encoder_hidden_states"], video, rtol=0, atol=0)
    torch.testing.assert_close(cond["audio_encoder_hidden_states"], audio, rtol=0, atol=0)
    assert torch.equal(cond["encoder_attention_mask"], connector_mask)
    assert not torch.equal(video, audio)  # two connectors
    # the stacked states are never kept: the cache holds the connectors' outputs
    assert set(outputs) == {"prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prediction_is_the_pipelines_transformer_call(tiny_ltx2, pipe, dtype):
    from diffusers_zero3.families import LTX2
    from diffusers_zero3.families.ltx2 import pack_video, unpack_video

    pipe = _in(pipe, dtype)
    transformer = pipe.transformer
    calls = []
    hook = transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, [o.detach().clone() for o in out])),
        with_kwargs=True,
    )
    try:
        with torch.no_grad():
            pipe(PROMPTS[:2], num_inference_steps=2, height=32, width=64, num_frames=5, frame_rate=12.0,
                 guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=1.0,
                 audio_modality_scale=1.0, audio_stg_scale=0.0, max_sequence_length=MAX_LENGTH,
                 generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 2  # no guidance: one call a step
    kwargs, (expected_video, expected_audio) = calls[-1]
    hidden, audio = kwargs["hidden_states"], kwargs["audio_hidden_states"]
    f, h, w = 3, 8, 16  # 5 frames at 2x temporal, 4x spatial
    assert hidden.shape == (2, f * h * w, 4)
    # 5 frames at 12 fps: round(5 / 12 * 16000 / 160 / 4) = 10 latent audio frames of 2 x 2 channels
    assert audio.shape == (2, 10, 4)
    _, _, cond = _cond(tiny_ltx2[0], _encoders(pipe), PROMPTS[:2])
    cond["frame_rate"] = torch.tensor([12.0, 12.0])
    timesteps = pipe.scheduler.timesteps[-1:].expand(2)
    assert torch.equal(timesteps.to(dtype), kwargs["timestep"])
    noisy = unpack_video(hidden, f, h, w)
    assert torch.equal(pack_video(noisy), hidden)
    with torch.no_grad():
        video_flow, audio_flow = LTX2.predict_audiovisual(transformer, noisy, audio, timesteps, cond)
    assert video_flow.shape == noisy.shape and video_flow.dtype == dtype
    torch.testing.assert_close(video_flow, unpack_video(expected_video, f, h, w), rtol=0, atol=0)
    torch.testing.assert_close(audio_flow, expected_audio, rtol=0, atol=0)
    # the clip's frame rate is in the coordinates: another one changes the prediction
    cond["frame_rate"] = torch.tensor([24.0, 24.0])
    with torch.no_grad():
        other, _ = LTX2.predict_audiovisual(transformer, noisy, audio, timesteps, cond)
    assert not torch.allclose(other, video_flow)


def test_video_and_audio_latents_as_the_pipeline_normalises_them(tiny_ltx2, pipe):
    from diffusers_zero3.data.video import check_video_shape
    from diffusers_zero3.families import LTX2

    folder = tiny_ltx2[0]
    vae, config = pipe.vae, pipe.vae.config
    assert (LTX2.vae_scale_factor(config), LTX2.frame_multiple(config)) == (
        pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (4, 2)  # fmt: skip
    assert LTX2.latent_multiple(config) == 32  # the pipeline's check_inputs
    check_video_shape(9, 32, 64, LTX2, config)
    with pytest.raises(ValueError):
        check_video_shape(8, 32, 32, LTX2, config)
    clips = torch.rand(2, 3, 5, 32, 48) * 2 - 1
    normalize = LTX2.latent_normalizer(config, f"{folder}/vae")
    with torch.no_grad():
        z = LTX2.latent_distribution(vae, clips).mode()
    expected = pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, config.scaling_factor)
    assert config.scaling_factor == 0.8 and vae.latents_std.unique().numel() == 4
    torch.testing.assert_close(normalize(z), expected)
    torch.testing.assert_close(normalize.inverse(expected), z, rtol=1e-5, atol=1e-5)
    # audio: the mel of each clip through the audio VAE's mean, packed and normalised
    mel = torch.randn(2, 2, 37, 8)
    batch = {
        "audio_mel": mel,
        "has_audio": torch.tensor([True, False]),
        "frame_rate": torch.tensor([8.0, 8.0]),
    }
    with torch.no_grad():
        out = LTX2.other_latents({"audio_vae": pipe.audio_vae}, batch, torch.device("cpu"), torch.float32)
        mode = pipe.audio_vae.encode(mel).latent_dist.mode()
        expected_audio = pipe.prepare_audio_latents(2, 2, mode.shape[2], 8, latents=mode, dtype=torch.float32)
    assert out["audio_latents"].shape == (2, mode.shape[2], 4)
    torch.testing.assert_close(out["audio_latents"], expected_audio)
    assert out["has_audio"].tolist() == [True, False]


def test_objective_adds_the_audio_flow_loss_at_the_videos_sigma(tiny_ltx2, pipe):
    """``LTX2.loss`` written out: video noise, then the timestep, then the audio noise (per-sample
    generators); both streams at that sigma; per-sample video + audio losses; a clip without
    sound gets audio at sigma 1 and no audio loss."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from diffusers_zero3.families import LTX2
    from diffusers_zero3.families.objectives import ObjectiveSettings, sample_generators

    folder = tiny_ltx2[0]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    _, _, cond = _cond(folder, _encoders(pipe), PROMPTS[:2])
    latents, audio = torch.randn(2, 4, 3, 4, 4), torch.randn(2, 7, 4)
    cond.update(
        audio_latents=audio, has_audio=torch.tensor([True, False]), frame_rate=torch.tensor([8.0, 8.0])
    )
    settings = ObjectiveSettings(weighting_scheme="logit_normal")
    with torch.no_grad():
        gens = sample_generators(3, 0, [5, 9])
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in gens])
        u = torch.stack([compute_density_for_timestep_sampling("logit_normal", 1, 0.0, 1.0, generator=g)[0]
                         for g in gens])  # fmt: skip
        audio_noise = torch.stack([torch.randn(audio.shape[1:], generator=g) for g in gens])
        indices = (u * 1000).long()
        timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices]
        s = sigmas.view(-1, 1, 1, 1, 1)
        audio_sigma = torch.tensor([sigmas[0].item(), 1.0]).view(-1, 1, 1)
        noisy_audio = (1 - audio_sigma) * audio + audio_sigma * audio_noise
        video_flow, audio_flow = LTX2.predict_audiovisual(
            pipe.transformer,
            (1 - s) * latents + s * noise,
            noisy_audio,
            timesteps,
            cond,
            audio_sigma.flatten() * 1000,
        )
        video_loss = ((video_flow - (noise - latents)) ** 2).reshape(2, -1).mean(1)
        audio_loss = ((audio_flow - (audio_noise - audio)) ** 2).reshape(2, -1).mean(1) * torch.tensor(
            [1.0, 0.0]
        )
        ours = LTX2.loss(pipe.transformer, scheduler, latents, cond, settings, sample_generators(3, 0, [5, 9]),
                         reduction="none")  # fmt: skip
    torch.testing.assert_close(ours, video_loss + audio_loss)
    assert audio_loss[0] > 0.01 and video_loss.min() > 0.01
    # positive control: the same clip with its sound trains on it (another loss)
    cond["has_audio"] = torch.tensor([True, True])
    with torch.no_grad():
        both = LTX2.loss(pipe.transformer, scheduler, latents, cond, settings, sample_generators(3, 0, [5, 9]),
                         reduction="none")  # fmt: skip
    torch.testing.assert_close(both[0], ours[0])
    assert not torch.allclose(both[1], ours[1])


def test_tiny_pipeline_generates_video_with_sound_and_lora_reaches_both_streams(pipe):
    from diffusers_zero3.families import LTX2
    from diffusers_zero3.training.lora import add_lora_adapters

    with torch.no_grad():
        out = pipe("a red circle", num_inference_steps=2, height=32, width=32, num_frames=9, frame_rate=8.0,
                   max_sequence_length=MAX_LENGTH, generator=torch.Generator().manual_seed(0), output_type="np")  # fmt: skip
    assert out.frames.shape == (1, 9, 32, 32, 3)
    # the vocoder speaks for the clip's length: 9 frames at 8 fps (the causal audio VAE drops 3 mel frames)
    assert out.audio.shape[:2] == (1, 2) and abs(out.audio.shape[-1] - 9 / 8 * 16000) <= 4 * 160 * 4
    import copy

    transformer = copy.deepcopy(pipe.transformer)
    add_lora_adapters(transformer, rank=2, target_modules=LTX2.lora_target_modules)
    names = [n for n, p in transformer.named_parameters() if p.requires_grad]
    assert any(".attn1." in n for n in names) and any(".audio_attn1." in n for n in names)
    assert any("audio_to_video_attn" in n for n in names)
