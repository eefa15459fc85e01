"""LTX-2 (``LTX2Pipeline``, text to video with its sound): one transformer
(``LTX2VideoTransformer3DModel``) denoises video latents and audio latents together, each
stream attending to the other, conditioned on a frozen Gemma 3 through frozen ``connectors``.

Frozen components, each placed on its own (``frozen_components``):

- ``text_encoder``: Gemma 3 (``Gemma3ForConditionalGeneration``, the whole VLM as the pipeline
  loads it; its text path runs) on the stripped caption, left-padded to ``max_sequence_length``
  (the pipeline's 1024): every hidden state (the embeddings and each layer's) stacked per token,
  ``(N, L, H x (layers + 1))``, with the mask.
- ``connectors`` (``LTX2TextConnectors``): those stacked states normalised per layer and
  projected, then a 1-D transformer per stream: the video and audio text embeddings and their
  mask. The family runs it right after the encoder (``text_stage``), so the cache keeps its
  outputs (``(N, L, 3840)`` twice at the published size), never the stacked states (188,160
  features a token). A cached encoder caches the connectors with it (``settle_placements``).
- ``audio_vae`` (``AutoencoderKLLTX2Audio``): encodes each clip's log-mel spectrogram
  (``data.audio``: the clip's own time span of its audio track) to ``(C, L, M)`` latents, packed
  to ``(L, C x M)`` tokens and normalised with its ``latents_mean`` / ``latents_std``, as
  ``LTX2Pipeline.prepare_audio_latents`` does with given latents. Live only (never cached).
- ``vocoder`` (``LTX2Vocoder``): mel to waveform, for validation videos with sound.
- ``vae`` (``AutoencoderKLLTX2Video``): latents ``(x - latents_mean) * scaling_factor /
  latents_std`` with its per-channel statistics (weights, read from its files in fp32).

The objective is the pipeline's flow convention for both streams at one sigma per sample
(``noisy = (1 - s) x + s noise``, the transformer's outputs are the flows ``noise - x``); a
sample's loss is its video loss plus its audio loss. diffusers has no training script for
LTX-2; the timesteps are Wan's (logit-normal on the scheduler's table). A clip without an
audio stream trains video only, as the pipeline generates video beside any audio: its audio
tokens are pure noise at sigma 1 (``audio_timestep`` 1000) and add no loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..runtime.library_internals import ltx2_pack_audio_latents, ltx2_pack_latents, ltx2_unpack_latents
from .base import Family, PublishedConfig, VideoLatents, read_vae_tensors
from .common import llm_text_encoder, run_args
from .published import published_config

# LTX2Pipeline.__call__'s defaults
FRAME_RATE = 24.0  # frame_rate (the published clips' playback rate)
TOKENIZER_MAX_LENGTH = 1024  # max_sequence_length
CONNECTOR_SCALE_FACTOR = 8  # connectors' masked mean/range normalisation (LTX-2.0)
PIPELINE_SIDE_MULTIPLE = 32  # check_inputs: height and width divisible by 32


class LTX2Latents:
    """LTX-2's video latent normalisation, ``LTX2Pipeline._normalize_latents``:
    ``(z - latents_mean[c]) * scaling_factor / latents_std[c]`` over dimension 1 of ``(N, C, F,
    H, W)`` latents, the statistics read from the VAE's weights in fp32."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, scaling_factor: float):
        self.mean = mean.to(torch.float32)  # CPU: moved per call
        self.std = std.to(torch.float32)  # CPU: moved per call
        self.scaling_factor = scaling_factor

    @classmethod
    def from_folder(cls, vae_config: dict, vae_folder: str | os.PathLike) -> LTX2Latents:
        stats = read_vae_tensors(vae_folder, ("latents_mean", "latents_std"))
        return cls(stats["latents_mean"], stats["latents_std"], vae_config.get("scaling_factor", 1.0))

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1, *([1] * (latents.ndim - 2)))
        mean = self.mean.to(latents.device, latents.dtype).view(shape)
        return mean, self.std.to(latents.device, latents.dtype).view(shape)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return (latents - mean) * self.scaling_factor / std

    def inverse(self, latents: torch.Tensor) -> torch.Tensor:
        """``LTX2Pipeline._denormalize_latents``: ``z * std[c] / scaling_factor + mean[c]``."""
        mean, std = self._stats(latents)
        return latents * std / self.scaling_factor + mean


def pack_video(latents: torch.Tensor, patch_size: int = 1, patch_size_t: int = 1) -> torch.Tensor:
    """``(N, C, F, H, W)`` latents as the transformer's ``(N, tokens, C p_t p p)`` tokens
    (``LTX2Pipeline._pack_latents``)."""
    return ltx2_pack_latents(latents, patch_size, patch_size_t)


def unpack_video(
    tokens: torch.Tensor, frames: int, height: int, width: int, patch_size: int = 1, patch_size_t: int = 1
) -> torch.Tensor:
    """The inverse of ``pack_video`` (``LTX2Pipeline._unpack_latents``): ``(N, C, F, H, W)``."""
    return ltx2_unpack_latents(
        tokens, frames // patch_size_t, height // patch_size, width // patch_size, patch_size, patch_size_t
    )


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """Audio latents ``(N, C, L, M)`` as ``(N, L, C x M)`` tokens (``_pack_audio_latents``)."""
    return ltx2_pack_audio_latents(latents)


@dataclass(frozen=True)
class LTX2Family(VideoLatents, Family):
    """LTX-2 text to video with audio (see the module doc)."""

    validation_num_frames: int = 9  # short validation videos (1 + 8k frames at the published VAE)

    # ------------------------------------------------------------------ components

    @property
    def frozen_components(self) -> tuple[str, ...]:
        return ("text_encoder", "connectors", "audio_vae", "vocoder", "vae")

    @property
    def text_stage(self) -> tuple[str, ...]:
        """The encoder, then the connectors on its stacked states (one stage: see the module doc)."""
        return ("text_encoder", "connectors")

    def component_library(self, name):
        classes = {
            "connectors": ("diffusers.pipelines.ltx2", "LTX2TextConnectors"),
            "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio"),
            "vocoder": ("diffusers.pipelines.ltx2.vocoder", "LTX2Vocoder"),
        }
        return classes.get(name) or super().component_library(name)

    @property
    def never_cached(self):
        """The audio VAE (each step encodes its clips' sound), the vocoder (validation only), the
        video VAE (the clips' audio is read beside their frames each step) and the connectors
        (cached with the text encoder, never alone)."""
        return ("connectors", "audio_vae", "vocoder", "vae")

    def settle_placements(self, placements):
        """A cached text encoder caches the connectors' outputs: the connectors are then cached
        with it (whatever their flag said: they run once, to encode); never cached alone."""
        placements = dict(placements)
        connectors = placements.pop("connectors", None)
        if placements.get("text_encoder") == "cache":
            connectors = "cache"
        elif connectors == "cache":
            raise ValueError(
                "LTX-2's connectors run on the text encoder's stacked states: cache both with "
                "--text_encoder_placement cache, or neither"
            )
        settled = super().settle_placements(placements)  # the others' never_cached
        return {**settled, "connectors": connectors} if connectors else settled

    def load_tokenizer(self, folder):
        """Gemma's tokenizer, left-padded with its EOS where it has no pad token (the pipeline's
        ``_get_gemma_prompt_embeds``)."""
        tokenizer = super().load_tokenizer(folder)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    # ------------------------------------------------------------------ prompts

    def prompt_text(self, spec, caption, tokenizer=None):
        return caption.strip()  # the pipeline strips each prompt

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """Gemma's hidden states (the embeddings and every layer's) stacked per token and
        flattened, ``(N, L, H x (layers + 1))`` in the encoder's dtype, with the mask.
        Collective when ``encoder`` is sharded.

        On the meta device (the planner sizing the cache) it gives what the cache holds in their
        place: the connectors' two streams and mask (``encode_texts``), each of the encoder's
        width."""
        n = input_ids.shape[0]
        if input_ids.is_meta:
            width = encoder.config.get_text_config().hidden_size
            embeds = torch.empty(n, input_ids.shape[1], width, device="meta")
            return {
                "prompt_embeds": embeds,
                "audio_prompt_embeds": embeds,
                "prompt_attention_mask": input_ids,
            }
        given = attention_mask
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if n == 0:  # one dummy row keeps a sharded encoder in lockstep with ranks that have samples
            out = encoder(input_ids=input_ids.new_zeros(1, input_ids.shape[1]), output_hidden_states=True)
        else:
            out = encoder(input_ids=input_ids, attention_mask=given, output_hidden_states=True)
        stacked = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)[:n]
        return {"text_hidden_states": stacked, "text_attention_mask": attention_mask.long()}

    def encode_texts(self, encoders, ids):
        """The connectors' video and audio text embeddings and mask of a batch (``text_stage``):
        Gemma's stacked states, then the connectors (left padding, as the pipeline). Collective
        when either is sharded."""
        out = super().encode_texts(encoders, ids)
        connectors = encoders.get("connectors")
        if connectors is None or "text_hidden_states" not in out:
            raise ValueError("LTX-2's text encoder and connectors run together (settle_placements)")
        states = out.pop("text_hidden_states").to(connectors.device, connectors.dtype)
        mask = out.pop("text_attention_mask").to(connectors.device)
        video, audio, connector_mask = connectors(
            states, mask, padding_side="left", scale_factor=CONNECTOR_SCALE_FACTOR
        )
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": connector_mask}

    def conditioning(self, outputs):
        return {
            "encoder_hidden_states": outputs["prompt_embeds"],
            "audio_encoder_hidden_states": outputs["audio_prompt_embeds"],
            "encoder_attention_mask": outputs["prompt_attention_mask"],
        }

    # ------------------------------------------------------------------ latents

    def latent_normalizer(self, vae_config, vae_folder=None):
        if vae_folder is None:
            raise ValueError("LTX-2's latent statistics are VAE weights: the VAE folder is needed")
        return LTX2Latents.from_folder(vae_config, vae_folder)

    def latent_distribution(self, vae, pixels):
        """The video VAE's distribution of clips ``(N, 3, F, H, W)`` (an image is a clip of one
        frame). Collective when the VAE is sharded."""
        return vae.encode(pixels if pixels.ndim == 5 else pixels.unsqueeze(2)).latent_dist

    def latent_multiple(self, vae_config):
        """Sides are multiples of 32 (``LTX2Pipeline.check_inputs``; the published VAE's
        compression) and of the VAE's compression."""
        import math

        return math.lcm(PIPELINE_SIDE_MULTIPLE, self.vae_scale_factor(vae_config))

    def vae_scale_factor(self, vae_config):
        """The video VAE's spatial compression (``spatial_compression_ratio``)."""
        return _ltx2_vae_ratios(vae_config)[0]

    def frame_multiple(self, vae_config: dict) -> int:
        """Frames must be ``1 + frame_multiple * k`` (the causal VAE's temporal compression)."""
        return _ltx2_vae_ratios(vae_config)[1]

    def audio_spec(self, audio_vae_config: dict):
        """How clips' sound is read for the audio VAE (``data.audio.AudioSpec``)."""
        from ..data.audio import AudioSpec

        return AudioSpec.from_audio_vae_config(audio_vae_config)

    def other_latents(self, models, batch, device, dtype) -> dict[str, torch.Tensor]:
        """``audio_latents`` ``(N, L, C x M)`` of a batch's clips (the live audio VAE's posterior
        mean of each clip's log-mel spectrogram, packed and normalised as
        ``LTX2Pipeline.prepare_audio_latents``), ``has_audio`` ``(N,)`` and each clip's
        ``frame_rate``. Collective when the audio VAE is sharded."""
        audio_vae = models["audio_vae"]
        mel = batch["audio_mel"].to(device, audio_vae.dtype)
        latents = pack_audio(audio_vae.encode(mel).latent_dist.mode())
        mean = audio_vae.latents_mean.to(latents.device, latents.dtype)
        std = audio_vae.latents_std.to(latents.device, latents.dtype)
        rates = batch.get("frame_rate")
        return {
            "audio_latents": ((latents - mean) / std).to(dtype),
            "has_audio": batch["has_audio"].to(device).bool(),
            "frame_rate": (
                rates.to(device, torch.float32) if rates is not None
                else torch.full((mel.shape[0],), FRAME_RATE, device=device)
            ),
        }  # fmt: skip

    # ------------------------------------------------------------------ objective and denoiser call

    def sampling_sigmas(self, steps):
        """The pipeline's ``numpy.linspace(1, 1 / steps, steps)``."""
        import numpy

        return numpy.linspace(1.0, 1 / steps, steps).tolist()

    def predict_audiovisual(
        self,
        denoiser,
        noisy_latents: torch.Tensor,
        noisy_audio: torch.Tensor,
        timesteps: torch.Tensor,
        cond: dict[str, torch.Tensor],
        audio_timesteps: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer as the pipeline's loop calls it (``isolate_modalities=False``, no STG,
        ``use_cross_timestep=True``, ``sigma`` = the timestep): the video latents ``(N, C, F, H,
        W)`` packed, the audio tokens ``(N, L, D)``, the scheduler's timestep (sigma x 1000) in
        the latents' dtype (``audio_timesteps`` for the audio stream where it differs), each
        clip's coordinates at its frame rate. Returns the flows ``(video (N, C, F, H, W), audio
        (N, L, D))``. Collective when sharded."""
        n, _, f, h, w = noisy_latents.shape
        dtype, device = noisy_latents.dtype, noisy_latents.device
        module = getattr(denoiser, "module", denoiser)  # an engine's module
        p, pt = module.config.patch_size, module.config.patch_size_t
        timestep = (timesteps.expand(n) if timesteps.ndim == 0 else timesteps).to(device, dtype)
        audio_timestep = None if audio_timesteps is None else audio_timesteps.to(device, dtype)
        rates = cond.get("frame_rate")
        rates = [FRAME_RATE] * n if rates is None else rates.tolist()
        video_coords = torch.cat(
            [module.rope.prepare_video_coords(1, f, h, w, device, fps=r) for r in rates]
        )  # fmt: skip
        audio_coords = module.audio_rope.prepare_audio_coords(n, noisy_audio.shape[1], device)
        video, audio = denoiser(
            hidden_states=pack_video(noisy_latents, p, pt),
            audio_hidden_states=noisy_audio.to(dtype),
            encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
            audio_encoder_hidden_states=cond["audio_encoder_hidden_states"].to(dtype),
            timestep=timestep,
            audio_timestep=audio_timestep,
            sigma=timestep,
            audio_sigma=audio_timestep,
            encoder_attention_mask=cond["encoder_attention_mask"],
            audio_encoder_attention_mask=cond["encoder_attention_mask"],
            num_frames=f,
            height=h,
            width=w,
            audio_num_frames=noisy_audio.shape[1],
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=False,
            use_cross_timestep=True,
            attention_kwargs=kwargs.get("attention_kwargs"),
            return_dict=False,
        )
        return unpack_video(video, f, h, w, p, pt), audio

    def objective_loss(
        self,
        denoiser,
        objective,
        latents,
        cond,
        generators=None,
        reduction="mean",
        loss_weights=None,
        **denoiser_kwargs,
    ):
        """Each sample's video flow loss (the objective's noise, timestep and weighting) plus its
        audio flow loss at the same sigma (audio noise drawn after the video's, from the same
        generators); zero audio loss, and audio at sigma 1, for a clip without sound
        (``has_audio``). ``loss_weights`` mask the video. Collective when sharded."""
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        from .objectives import sample_noise

        noise_scheduler, settings = objective.noise_scheduler, objective.settings
        audio = cond["audio_latents"]
        has_audio = cond["has_audio"].to(audio.device).view(-1, 1, 1)
        audio_losses = {}

        def predict(noisy, timesteps):
            scale = noise_scheduler.config.num_train_timesteps
            sigma = (timesteps.to(audio.device, torch.float32) / scale).view(-1, 1, 1)
            sigma = torch.where(has_audio, sigma, torch.ones_like(sigma))  # no sound: pure noise
            noise = sample_noise(audio, 0.0, generators) if generators else torch.randn_like(audio)
            noisy_audio = ((1.0 - sigma) * audio.float() + sigma * noise.float()).to(audio.dtype)
            video, audio_flow = self.predict_audiovisual(
                denoiser, noisy, noisy_audio, timesteps, cond, (sigma.flatten() * scale), **denoiser_kwargs
            )
            weighting = compute_loss_weighting_for_sd3(settings.weighting_scheme, sigmas=sigma)
            error = weighting.float() * (audio_flow.float() - (noise.float() - audio.float())) ** 2
            audio_losses["per_sample"] = error.mean(dim=(1, 2)) * has_audio.flatten().float()
            return video

        video_losses = objective.loss(predict, latents, generators, "none", loss_weights=loss_weights)
        per_sample = video_losses + audio_losses["per_sample"]
        return per_sample if reduction == "none" else per_sample.mean()

    def validation_kwargs(self, max_sequence_length, guidance_scale, num_frames: int | None = None):
        """Short videos (``num_frames``, default ``validation_num_frames``) as PIL frames with
        their sound (the pipeline's guidance defaults; Gemma reads ``max_sequence_length`` tokens)."""
        kwargs = {"num_frames": num_frames or self.validation_num_frames, "frame_rate": FRAME_RATE,
                  "output_type": "pil"}  # fmt: skip
        if max_sequence_length:
            kwargs["max_sequence_length"] = max_sequence_length
        return kwargs

    # ------------------------------------------------------------------ pipelines

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler):
        """``LTX2Pipeline`` around these modules (``text_encoders`` holds every frozen module by
        folder: the encoder, connectors, audio VAE and vocoder)."""
        import diffusers

        return diffusers.LTX2Pipeline(
            scheduler=scheduler,
            vae=vae,
            audio_vae=text_encoders["audio_vae"],
            text_encoder=text_encoders["text_encoder"],
            tokenizer=tokenizers["text_encoder"],
            connectors=text_encoders["connectors"],
            transformer=denoiser,
            vocoder=text_encoders["vocoder"],
        )

    def published(self):
        return (
            PublishedConfig(
                "Lightricks/LTX-2",
                "LTX-2",
                self.pipeline_class,
                {
                    "transformer": ("diffusers", "LTX2VideoTransformer3DModel", {}),
                    "text_encoder": ("transformers", "Gemma3ForConditionalGeneration", PUBLISHED_GEMMA3_12B),
                    "connectors": ("diffusers.pipelines.ltx2", "LTX2TextConnectors", {}),
                    "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio", {}),
                    "vocoder": ("diffusers.pipelines.ltx2.vocoder", "LTX2Vocoder", {}),
                    "vae": ("diffusers", "AutoencoderKLLTX2Video", {}),
                },
                "the diffusers classes' defaults are LTX-2's published shapes (scripts/convert_ltx2_to_diffusers.py); "
                "Gemma 3 12B counted whole (its vision tower too) as the pipeline loads it",
            ),
        )


def _ltx2_vae_ratios(vae_config: dict) -> tuple[int, int]:
    """``(spatial, temporal)`` compression of an ``AutoencoderKLLTX2Video`` config, as its
    ``__init__`` sets them (the pipeline reads them from the VAE): the config's own ratios, else
    ``patch_size`` (``patch_size_t``) times 2 for each scaling down block."""
    import inspect

    from diffusers import AutoencoderKLLTX2Video

    defaults = {k: v.default for k, v in inspect.signature(AutoencoderKLLTX2Video).parameters.items()}
    cfg = {**defaults, **{k: v for k, v in vae_config.items() if k in defaults}}
    scaling = 2 ** sum(bool(x) for x in cfg["spatio_temporal_scaling"])
    spatial = cfg["spatial_compression_ratio"] or cfg["patch_size"] * scaling
    temporal = cfg["temporal_compression_ratio"] or cfg["patch_size_t"] * scaling
    return int(spatial), int(temporal)


LTX2 = LTX2Family(
    name="ltx2",
    title="LTX-2",
    pipeline_class="LTX2Pipeline",
    text_encoders=(llm_text_encoder("Gemma3ForConditionalGeneration"),),  # fmt: skip
    denoiser_class="LTX2VideoTransformer3DModel",
    vae_class="AutoencoderKLLTX2Video",
    sample_latents=False,  # the posterior mean of both VAEs
    video=True,
    sound=True,
    default_max_sequence_length=TOKENIZER_MAX_LENGTH,
    default_weighting_scheme="logit_normal",
    lora_target_modules=("to_k", "to_q", "to_v", "to_out.0"),  # video and audio attention alike
    default_run_args=run_args(
        text_encoder="shard",
        connectors="replicate",
        audio_vae="replicate",
        vocoder="replicate",
        vae="replicate",
        max_sequence_length=32,
        num_frames=9,
    ),
)

# google/gemma-3-12b-it (text: 48 layers of 3840, 16 heads of 256 with 8 KV heads; SigLIP
# so400m vision tower at 896 px): keys that set shapes
PUBLISHED_GEMMA3_12B = published_config("ltx2/gemma3_12b")
