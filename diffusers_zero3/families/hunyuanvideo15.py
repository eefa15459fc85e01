"""HunyuanVideo 1.5 (``HunyuanVideo15Pipeline``, text-to-video): an 8.3 B dual-stream video DiT
(``HunyuanVideo15Transformer3DModel``) conditioned on two frozen encoders, a causal video VAE
(``AutoencoderKLHunyuanVideo15``: 16x spatial, 4x temporal, 32 channels, latents times
``scaling_factor``) and flow matching (target ``noise - latents``) at the scheduler's shift.

- ``text_encoder``: Qwen2.5-VL 7 B's text model (``Qwen2_5_VLTextModel``) on the chat template
  (the pipeline's system message, the caption as the user turn, the generation prompt), padded
  to ``108 + max_sequence_length`` tokens (the pipeline's 1000); the hidden state two layers
  below the last (``hidden_states[-3]``), its first 108 positions dropped, with its mask.
- ``text_encoder_2``: the ByT5 glyph encoder (``T5EncoderModel``) on the byte tokens of the
  quoted text in the caption (``Text "..."``. ``extract_glyph_texts``), padded to 256; a caption
  without quoted text gets zeros and an all-zero mask, as the pipeline gives it.

The transformer reads ``[latents | zero condition latents | zero mask]`` (65 channels), zero
image embeddings (t2v: 729 x 1152, which it masks out) and every padded row of both encoders
with their masks (the pipeline's lengths: nothing trimmed). diffusers has no training script
for it: the objective is the pipeline's flow convention as for Wan (posterior mean latents, as
the image-to-video pipeline encodes its image; logit-normal timesteps on the shifted table).

``AutoencoderKLHunyuanVideo15``'s mid-block attention builds a ``(B, L, L)`` causal mask that
broadcasts against ``(B, 1, L, C)`` queries as ``(B, B, L, L)``: more than one clip per call
fails in diffusers 0.42. ``batched_vae_attention`` builds it ``(L, L)`` (the same mask for each
clip) while this family's VAE calls run, so a batch encodes as its clips one at a time do.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..runtime.library_internals import hunyuanvideo15_causal_mask
from .base import Family, ScaleShift, TextEncoderSpec, VideoLatents
from .common import llm_text_encoder, run_args
from .published import T5_V11_ENCODER, published_config
from .qwenimage import PUBLISHED_TEXT_ENCODER as QWEN25_VL_7B

# HunyuanVideo15Pipeline.__init__ (the system message as the pipeline's source writes it, its
# line continuations' indentation included)
# fmt: off
SYSTEM_MESSAGE = "You are a helpful assistant. Describe the video by detailing the following aspects: \
        1. The main content and theme of the video. \
        2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \
        3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \
        4. background environment, light, style and atmosphere. \
        5. camera angles, movements, and transitions used in the video."
# fmt: on
DROPPED_TEMPLATE_TOKENS = 108  # prompt_template_encode_start_idx
TOKENIZER_MAX_LENGTH = 1000  # tokenizer_max_length: the caption's tokens after the dropped ones
GLYPH_MAX_LENGTH = 256  # tokenizer_2_max_length: ByT5 tokens of the glyph text
HIDDEN_STATES_SKIPPED = 2  # _get_mllm_prompt_embeds' num_hidden_layers_to_skip: hidden_states[-3]
VISION_TOKENS = 729  # vision_num_semantic_tokens: the zero image embeddings of text-to-video
GUIDANCE_SCALE = 6.0  # the published 480p/720p t2v guider's (ClassifierFreeGuidance)


def glyph_text(caption: str) -> str | None:
    """The ByT5 text of a caption: its quoted parts as ``Text "a". Text "b". `` (None without
    any), ``extract_glyph_texts`` of the pipeline."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

    return extract_glyph_texts(caption)


def _causal_mask(n_frame: int, n_hw: int, dtype, device, batch_size: int | None = None) -> torch.Tensor:
    """``HunyuanVideo15AttnBlock.prepare_causal_attention_mask`` without the batch axis: one
    ``(L, L)`` frame-causal mask that broadcasts over every clip and head."""
    seq_len = n_frame * n_hw
    frame = torch.arange(seq_len, device=device) // n_hw
    keep = frame[None, :] <= frame[:, None]
    return torch.zeros(seq_len, seq_len, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))


@contextlib.contextmanager
def batched_vae_attention():
    """While open, ``AutoencoderKLHunyuanVideo15``'s attention takes batches of clips (its causal
    mask built once per call as ``(L, L)``, equal to the per-clip mask: see the module doc)."""
    with hunyuanvideo15_causal_mask(_causal_mask):
        yield


@dataclass(frozen=True)
class HunyuanVideo15(VideoLatents, Family):
    """HunyuanVideo 1.5 text-to-video (see the module doc)."""

    validation_num_frames: int = 5  # short validation videos (1 + 4k frames)

    # ------------------------------------------------------------------ prompts

    def sequence_length(self, spec, tokenizer, max_sequence_length=None):
        """Qwen2.5-VL: ``max_sequence_length`` (the pipeline's 1000); ByT5: the pipeline's 256."""
        if spec.name == "text_encoder_2":
            return GLYPH_MAX_LENGTH
        return super().sequence_length(spec, tokenizer, max_sequence_length)

    def token_length(self, spec, tokenizer, max_sequence_length=None):
        """The pipeline tokenizes the template and caption to ``max_length + 108``."""
        extra = DROPPED_TEMPLATE_TOKENS if spec.name == "text_encoder" else 0
        return extra + self.sequence_length(spec, tokenizer, max_sequence_length)

    def prompt_text(self, spec, caption, tokenizer=None):
        """Qwen2.5-VL: the chat template of ``format_text_input`` (an empty caption becomes a
        space) with the generation prompt; ByT5: the glyph text (``""`` without one)."""
        if spec.name == "text_encoder_2":
            return glyph_text(caption) or ""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

        conversation = format_text_input([caption], SYSTEM_MESSAGE)[0]
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)

    def tokenize(self, tokenizers, captions, max_sequence_length=None):
        """``Family.tokenize``; a caption without quoted text gets an all-zero ByT5 mask (the
        pipeline runs no ByT5 for it: ``encode_text`` then gives zeros)."""
        out = super().tokenize(tokenizers, captions, max_sequence_length)
        if "attention_mask_2" in out and captions:
            has_glyph = torch.tensor([glyph_text(c) is not None for c in captions])  # CPU: as the ids
            out["attention_mask_2"] = out["attention_mask_2"] * has_glyph[:, None].long()
        return out

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """Qwen2.5-VL: ``hidden_states[-3]`` after the 108 dropped template tokens, with their
        mask (the pipeline keeps the padded rows' states; the transformer zeroes them). ByT5: the
        last hidden state (the mask given as floats, as the pipeline), zero with a zero mask for
        a caption without glyph text. Collective when ``encoder`` is sharded."""
        given = attention_mask  # None on the meta device (the planner: every token valid, no mask read)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        n = input_ids.shape[0]
        if name == "text_encoder_2":
            if n == 0:  # nor can T5: a dummy row, as for Qwen2.5-VL below
                hidden = encoder(input_ids=input_ids.new_zeros(1, input_ids.shape[1]))[0][:0]
            else:
                hidden = encoder(
                    input_ids=input_ids, attention_mask=None if given is None else given.float()
                )[0]
            has_glyph = attention_mask.gt(0).any(dim=1)
            embeds = torch.where(has_glyph[:, None, None], hidden, hidden.new_zeros(()))
            return {"prompt_embeds_2": embeds, "prompt_embeds_mask_2": attention_mask.long()}
        if n == 0:  # Qwen2.5-VL cannot take an empty batch: one dummy row keeps a sharded encoder in lockstep
            out = encoder(input_ids=input_ids.new_zeros(1, input_ids.shape[1]), output_hidden_states=True)
        else:
            out = encoder(input_ids=input_ids, attention_mask=given, output_hidden_states=True)
        # contiguous, as the pipeline's repeat/view copies it (a strided view takes another bf16 kernel)
        hidden = out.hidden_states[-(HIDDEN_STATES_SKIPPED + 1)][:n, DROPPED_TEMPLATE_TOKENS:].contiguous()
        return {
            "prompt_embeds": hidden,
            "prompt_embeds_mask": attention_mask[:, DROPPED_TEMPLATE_TOKENS:].long(),
        }

    def conditioning(self, outputs):
        """Both encoders' padded states and masks, as the pipeline hands them to the transformer."""
        return {
            "encoder_hidden_states": outputs["prompt_embeds"],
            "encoder_attention_mask": outputs["prompt_embeds_mask"],
            "encoder_hidden_states_2": outputs["prompt_embeds_2"],
            "encoder_attention_mask_2": outputs["prompt_embeds_mask_2"],
        }

    # ------------------------------------------------------------------ latents

    def latent_normalizer(self, vae_config, vae_folder=None):
        return ScaleShift(vae_config)  # latents * scaling_factor; the pipeline decodes / scaling_factor

    def latent_distribution(self, vae, pixels):
        """The VAE's distribution of videos ``(N, 3, F, H, W)`` (an image batch is a video of one
        frame), a batch at once (``batched_vae_attention``). Collective when the VAE is sharded."""
        with batched_vae_attention():
            return vae.encode(pixels if pixels.ndim == 5 else pixels.unsqueeze(2)).latent_dist

    def decode_latents(self, vae, normalize, latents):
        with batched_vae_attention():
            return super().decode_latents(vae, normalize, latents)

    def latent_multiple(self, vae_config):
        """Height and width: the VAE's spatial compression (the transformer's patches are 1x1)."""
        return int(vae_config.get("spatial_compression_ratio", 16))

    def vae_scale_factor(self, vae_config):
        return int(vae_config.get("spatial_compression_ratio", 16))

    def frame_multiple(self, vae_config: dict) -> int:
        """Frames must be ``1 + frame_multiple * k``: the VAE keeps the first frame alone and
        folds each ``temporal_compression_ratio`` (4) frames after it into one latent frame."""
        return int(vae_config.get("temporal_compression_ratio", 4))

    # ------------------------------------------------------------------ objective and denoiser call

    def sampling_sigmas(self, steps):
        """The pipeline's ``numpy.linspace(1, 0, steps + 1)[:-1]``."""
        import numpy

        return numpy.linspace(1.0, 0.0, steps + 1)[:-1].tolist()

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None, **kwargs):
        """The transformer as the pipeline's loop calls it: the latents with zero condition
        latents and a zero mask channel, the scheduler's timestep (sigma x 1000) in the latents'
        dtype, zero image embeddings, both encoders' states with their masks in the latents'
        dtype. Its output is the flow ``noise - latents``. Collective when sharded."""
        n, c, f, h, w = noisy_latents.shape
        dtype, device = noisy_latents.dtype, noisy_latents.device
        zeros = noisy_latents.new_zeros(n, c + 1, f, h, w)  # cond latents (c) and the mask (1)
        timestep = (timesteps.expand(n) if timesteps.ndim == 0 else timesteps).to(device, dtype)
        image_dim = getattr(denoiser, "module", denoiser).config.image_embed_dim  # an engine's module
        inputs = {
            "hidden_states": torch.cat([noisy_latents, zeros], dim=1),
            "timestep": timestep,
            "encoder_hidden_states": cond["encoder_hidden_states"].to(dtype),
            "encoder_attention_mask": cond["encoder_attention_mask"].to(dtype),
            "encoder_hidden_states_2": cond["encoder_hidden_states_2"].to(dtype),
            "encoder_attention_mask_2": cond["encoder_attention_mask_2"].to(dtype),
        }
        if (
            n == 0
        ):  # the transformer cannot stack an empty batch: one dummy row (masks all ones), then none of it
            inputs = {k: v.new_ones(1, *v.shape[1:]) for k, v in inputs.items()}
        image_embeds = torch.zeros(max(n, 1), VISION_TOKENS, image_dim, dtype=dtype, device=device)
        out = denoiser(
            **inputs,
            image_embeds=image_embeds,
            attention_kwargs=kwargs.get("attention_kwargs"),
            return_dict=False,
        )[0]
        return out[:n]

    def validation_kwargs(self, max_sequence_length, guidance_scale, num_frames: int | None = None):
        """Short videos (``num_frames``, default ``validation_num_frames``) as PIL frames (the
        pipeline encodes its own 1000 Qwen tokens; the masks make the padding inert)."""
        return {"num_frames": num_frames or self.validation_num_frames, "output_type": "pil"}

    # ------------------------------------------------------------------ pipelines

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler, *, guider=None):
        """``HunyuanVideo15Pipeline`` around these modules, with ``guider`` (default: the published
        t2v guider, classifier-free guidance at 6.0)."""
        import diffusers
        from diffusers.guiders import ClassifierFreeGuidance

        return diffusers.HunyuanVideo15Pipeline(
            text_encoder=text_encoders["text_encoder"],
            tokenizer=tokenizers["text_encoder"],
            transformer=denoiser,
            vae=vae,
            scheduler=scheduler,
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer_2=tokenizers["text_encoder_2"],
            guider=guider or ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
        )

    def published(self):
        components = self.published_parts(
            PUBLISHED_TRANSFORMER, PUBLISHED_TEXT_ENCODER, PUBLISHED_BYT5, vae=PUBLISHED_VAE
        )
        return self.published_as(
            components,
            ("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "HunyuanVideo 1.5 480p T2V"),
            note="Qwen2.5-VL 7 B's text model (7.1 B) is near the denoiser's size: shard or cache it; "
            "ByT5's vocabulary counted without Glyph-SDXL-v2's added color and font tokens",
        )


HUNYUANVIDEO15 = HunyuanVideo15(
    name="hunyuanvideo15",
    title="HunyuanVideo 1.5",
    pipeline_class="HunyuanVideo15Pipeline",
    text_encoders=(
        llm_text_encoder("Qwen2_5_VLTextModel"),
        TextEncoderSpec("text_encoder_2", "T5EncoderModel", "tokenizer_2", "input_ids_2"),
    ),
    denoiser_class="HunyuanVideo15Transformer3DModel",
    vae_class="AutoencoderKLHunyuanVideo15",
    vae_in_fp32=True,  # as Wan's: the video VAE decodes in fp32 beside a bf16 transformer
    sample_latents=False,  # the posterior mean, as the image-to-video pipeline encodes (argmax)
    video=True,
    default_max_sequence_length=TOKENIZER_MAX_LENGTH,
    default_weighting_scheme="logit_normal",  # as Wan: sigmoid(N(0, 1)) on the shifted table
    # the dual-stream blocks' image and text projections (HunyuanVideo LoRA targets)
    lora_target_modules=(
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    ),  # fmt: skip
    default_run_args=run_args(
        text_encoder="shard",
        text_encoder_2="replicate",
        vae="replicate",
        max_sequence_length=32,
        num_frames=5,
    ),
)

# Published configs (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py: the classes'
# defaults; Qwen/Qwen2.5-VL-7B-Instruct's text model; google/byt5-small): keys that set shapes.
PUBLISHED_TRANSFORMER = published_config("hunyuanvideo15/transformer")
PUBLISHED_TEXT_ENCODER = dict(QWEN25_VL_7B["text_config"])
PUBLISHED_BYT5 = dict(T5_V11_ENCODER, vocab_size=384, d_model=1472, d_ff=3584, num_layers=12, num_heads=6)
PUBLISHED_VAE = published_config("hunyuanvideo15/vae")
