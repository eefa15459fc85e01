"""Flux.2 [dev] (``Flux2Pipeline``) and Flux.2 [klein] (``Flux2KleinPipeline``): one MMDiT
(``Flux2Transformer2DModel``: double- then single-stream blocks, 4-axis rotary ids, no text
mask) conditioned on three stacked intermediate hidden states of a frozen LLM after its chat
template: dev's Mistral Small 3 24B VLM (layers 10, 20, 30, text path only, left-padded, a
system message) with an embedded guidance value, klein's Qwen3 4B/8B (layers 9, 18, 27,
right-padded, thinking disabled) without one. ``AutoencoderKLFlux2``'s latent mode, 2x2
patchified and batch-normalised by the VAE's stored statistics; flow matching as diffusers'
``train_dreambooth_lora_flux2.py`` / ``..._klein.py`` (uniform timesteps by default).

The DiT attends to every one of the ``max_sequence_length`` text rows, pad rows included, so
the conditioning keeps all of them (fixed length: each row can be cached alone). Neither the
encoders nor the transformer (it reads ``img_ids[0]``) take an empty batch: for one,
``encode_text`` and ``predict`` run one dummy row and return none of it (lockstep kept).

Instruction editing with reference images (``Flux2Pipeline(image=[...])``, klein's too): the
same families with ``edits=True`` (``Flux2.editing_variant``), which the trainer takes when it
is given editing pairs (``data.pairs.gives_edit_pairs``). Each source's latents (the VAE's
mode, patchified and batch-normalised as the target's, as ``_encode_vae_image``) are packed and
appended to the target's noisy tokens with rotary ids ``(10 + 10 k, y, x, 0)`` for source ``k``
(``_prepare_image_ids``), and the prediction is read off the target's tokens alone (the
pipelines' loop and ``train_dreambooth_lora_flux2_klein_img2img.py``; the dev script
``..._flux2_img2img.py`` numbers a batch's sources 10, 20, ... as if they were one sample's:
the pipeline's per-sample ids are kept).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import ClassVar

import torch

from .base import Family, PublishedConfig, read_vae_tensors
from .common import GuidedValidation, llm_text_encoder, qwen3_chat_prompt, run_args
from .published import QWEN3_4B, QWEN3_8B, published_config

# diffusers' pipelines/flux2/system_messages.py SYSTEM_MESSAGE (the dev pipeline's default)
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
DEV_LAYERS = (10, 20, 30)  # Flux2Pipeline.encode_prompt's text_encoder_out_layers
KLEIN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline.encode_prompt's (its training script defaults to 10 20 30)
DEFAULT_GUIDANCE_SCALE = 3.5  # train_dreambooth_lora_flux2.py --guidance_scale
# What Mistral Small 3.1's template renders (used where no tokenizer is at hand).
MISTRAL_PROMPT = "<s>[SYSTEM_PROMPT]" + SYSTEM_MESSAGE + "[/SYSTEM_PROMPT][INST]{}[/INST]"
REFERENCE_TIME = 10  # _prepare_image_ids' scale: reference image k's time coordinate is 10 + 10 k


# -------------------------------------------------------------------------------- latents


def patchify_latents(latents: torch.Tensor) -> torch.Tensor:
    """2x2 patches into channels, (N, C, H, W) -> (N, 4C, H/2, W/2), channel ``c*4 + dy*2 + dx``
    (``Flux2Pipeline._patchify_latents``)."""
    n, c, h, w = latents.shape
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(n, c * 4, h // 2, w // 2)


def unpatchify_latents(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of ``patchify_latents``, (N, 4C, H/2, W/2) -> (N, C, H, W)
    (``Flux2Pipeline._unpatchify_latents``)."""
    n, c4, h, w = latents.shape
    x = latents.reshape(n, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(n, c4 // 4, h * 2, w * 2)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(N, C, h, w) -> (N, h*w, C) tokens in row-major order (``Flux2Pipeline._pack_latents``)."""
    n, c, h, w = latents.shape
    return latents.reshape(n, c, h * w).permute(0, 2, 1)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of ``pack_latents`` (``_unpack_latents_with_ids`` for ``latent_ids``, without
    its host sync)."""
    n, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(n, c, height, width)


def latent_ids(n: int, height: int, width: int, device=None) -> torch.Tensor:
    """Rotary ids ``(t, y, x, l) = (0, y, x, 0)`` of packed latents, (N, h*w, 4) int64
    (``Flux2Pipeline._prepare_latent_ids``)."""
    t, ll = torch.arange(1, device=device), torch.arange(1, device=device)
    ids = torch.cartesian_prod(t, torch.arange(height, device=device), torch.arange(width, device=device), ll)
    return ids.unsqueeze(0).expand(n, -1, -1)


def text_ids(n: int, length: int, device=None) -> torch.Tensor:
    """Rotary ids ``(0, 0, 0, l)`` of ``length`` text rows, (N, L, 4) int64
    (``Flux2Pipeline._prepare_text_ids``)."""
    zero = torch.arange(1, device=device)
    ids = torch.cartesian_prod(zero, zero, zero, torch.arange(length, device=device))
    return ids.unsqueeze(0).expand(n, -1, -1)


def reference_ids(n: int, count: int, height: int, width: int, device=None) -> torch.Tensor:
    """Rotary ids of ``count`` packed reference images of ``height`` x ``width`` latents each,
    (N, count*h*w, 4) int64: image ``k``'s ``(10 + 10 k, y, x, 0)``
    (``Flux2Pipeline._prepare_image_ids``)."""
    rows, columns, ll = (torch.arange(s, device=device) for s in (height, width, 1))
    ids = []
    for k in range(count):
        t = torch.full((1,), REFERENCE_TIME * (k + 1), dtype=torch.int64, device=device)
        ids.append(torch.cartesian_prod(t, rows, columns, ll))
    return torch.cat(ids, dim=0).unsqueeze(0).expand(n, -1, -1)


class BatchNormLatents:
    """Flux.2's latent normalisation: the VAE's latents 2x2 patchified, then
    ``(z - running_mean[c]) / sqrt(running_var[c] + batch_norm_eps)`` with the statistics of
    ``AutoencoderKLFlux2.bn`` (a module no forward calls), in fp32 (fp32 latents out, as the
    scripts' fp32 statistics promote them). A subclass with another patch layout sets
    ``patchify`` and ``unpatchify`` (Ideogram 4's)."""

    patchify = staticmethod(patchify_latents)
    unpatchify = staticmethod(unpatchify_latents)

    def __init__(self, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float):
        self.mean = running_mean.to(torch.float32)  # CPU: moved per call
        self.std = torch.sqrt(running_var.to(torch.float32) + eps)  # CPU: moved per call

    @classmethod
    def from_folder(cls, vae_config: dict, vae_folder: str | os.PathLike) -> BatchNormLatents:
        stats = read_vae_tensors(vae_folder, ("bn.running_mean", "bn.running_var"))
        return cls(stats["bn.running_mean"], stats["bn.running_var"], vae_config.get("batch_norm_eps", 1e-4))

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        z = self.patchify(latents).to(torch.float32)
        mean = self.mean.to(z.device).view(1, -1, 1, 1)
        std = self.std.to(z.device).view(1, -1, 1, 1)
        return (z - mean) / std

    def inverse(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents of denoiser latents in ``latents``' dtype, as ``Flux2Pipeline`` writes
        it before ``vae.decode``: ``z * std[c] + mean[c]``, then unpatchified."""
        mean = self.mean.to(latents.device, latents.dtype).view(1, -1, 1, 1)
        std = self.std.to(latents.device, latents.dtype).view(1, -1, 1, 1)
        return self.unpatchify(latents * std + mean)


# -------------------------------------------------------------------------------- families


def load_flux2_tokenizer(folder: str | os.PathLike):
    """The text tokenizer of a Flux.2 ``tokenizer`` folder, without torchvision: FLUX.2-dev's
    folder holds a ``PixtralProcessor`` (which transformers only builds with torchvision), so
    its tokenizer is loaded alone and the chat template taken from the processor's files
    (``chat_template.jinja``, ``chat_template.json``, ``processor_config.json``) when the
    tokenizer has none. A klein folder holds a plain ``Qwen2Tokenizer``."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not getattr(tokenizer, "chat_template", None):
        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            for name in ("chat_template.json", "processor_config.json"):
                path = folder / name
                if path.is_file():
                    data = json.loads(path.read_text(encoding="utf-8"))
                    if isinstance(data.get("chat_template"), str):
                        template = data["chat_template"]
                        break
        if template is None:
            raise ValueError(f"no chat template in {folder} (a Flux.2 tokenizer renders one)")
        tokenizer.chat_template = template
    return tokenizer


def guidance_values(denoiser, n: int, guidance_scale: float | None, device) -> torch.Tensor | None:
    """The guidance input of a guidance-distilled transformer (``config.guidance_embeds``, dev):
    the scale for every sample, in fp32 (``DEFAULT_GUIDANCE_SCALE`` when none is given); None
    for one without (klein), as the training scripts."""
    config = getattr(denoiser, "module", denoiser).config
    if not config.guidance_embeds:
        return None
    scale = DEFAULT_GUIDANCE_SCALE if guidance_scale is None else float(guidance_scale)
    return torch.full((n,), scale, dtype=torch.float32, device=device)


class Flux2(GuidedValidation, Family):
    """Flux.2 [dev]: Mistral 3's stacked states with a system message; guidance embedded."""

    hidden_layers = DEV_LAYERS
    least_source_side = 64  # the pipelines' check_image_input: reference images of 64 px a side or more

    def editing_variant(self) -> Flux2:
        """This family training instruction editing: ``edits=True`` (the same pipeline class,
        given reference images: ``predict`` reads ``cond["source_latents"]``). The trainer
        takes it in place of the detected family when it is given editing pairs."""
        return dataclasses.replace(self, edits=True)

    def load_tokenizer(self, folder):
        return load_flux2_tokenizer(folder)

    # ------------------------------------------------------------------ prompts

    def prompt_text(self, spec, caption, tokenizer=None):
        """The conversation ``Flux2Pipeline`` renders (``format_input``: the system message, then
        the caption with ``[IMG]`` removed; no generation prompt), with ``tokenizer``'s chat
        template; without a tokenizer, what Mistral Small 3.1's template renders."""
        caption = caption.replace("[IMG]", "")
        if tokenizer is None:
            return MISTRAL_PROMPT.format(caption)
        messages = [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
            {"role": "user", "content": [{"type": "text", "text": caption}]},
        ]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def add_special_tokens(self, tokenizer, texts: list[str]) -> bool:
        """Whether the rendered texts are tokenized with special tokens: not when they start with
        the BOS the template wrote (the processor's rule, transformers processing_utils.py)."""
        bos = tokenizer.bos_token
        return not (bos is not None and texts[0].startswith(bos))

    def tokenize(self, tokenizers, captions, max_sequence_length=None):
        """The rendered template of every caption, padded to ``max_sequence_length`` on the
        tokenizer's side (dev's left, klein's right) and truncated on the right, as the pipeline."""
        spec = self.text_encoders[0]
        if spec.name not in tokenizers or not captions:
            return super().tokenize(tokenizers, captions, max_sequence_length)  # nothing to render
        tokenizer = tokenizers[spec.name]
        texts = [self.prompt_text(spec, c, tokenizer) for c in captions]
        encoded = tokenizer(
            texts,
            max_length=self.token_length(spec, tokenizer, max_sequence_length),
            padding="max_length",
            truncation=True,
            return_tensors="pt",
            add_special_tokens=self.add_special_tokens(tokenizer, texts),
        )
        return {spec.input_key: encoded.input_ids, spec.mask_key: encoded.attention_mask}

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """``hidden_states[k]`` for the family's three layers, stacked as ``[h_a | h_b | h_c]``
        per token: (B, L, 3H), every row (the DiT sees the pad rows too). The whole model is
        called (under ZeRO-3 its root forward ends each trace), with logits for one position."""
        n = input_ids.shape[0]
        if n == 0:  # an LLM cannot take an empty batch: one dummy row keeps a sharded encoder in lockstep
            input_ids, attention_mask = input_ids.new_zeros(1, input_ids.shape[1]), None
        # On the meta device (the planner counts the outputs) transformers cannot inspect a mask,
        # and only its cache path skips that; elsewhere no cache, as the pipelines.
        meta = input_ids.is_meta
        out = encoder(
            input_ids=input_ids,
            attention_mask=None if meta else attention_mask,
            output_hidden_states=True,
            use_cache=meta,
            logits_to_keep=1,
        )
        stacked = torch.stack([out.hidden_states[k] for k in self.hidden_layers], dim=2)  # (B, L, 3, H)
        return {"prompt_embeds": stacked.reshape(*stacked.shape[:2], -1)[:n]}

    def conditioning(self, outputs):
        """All the rows (no mask, no trimming) and their rotary ``txt_ids`` (never cached)."""
        states = outputs["prompt_embeds"]
        return {
            "encoder_hidden_states": states,
            "txt_ids": text_ids(states.shape[0], states.shape[1], states.device),
        }

    # ------------------------------------------------------------------ latents

    def latent_normalizer(self, vae_config, vae_folder=None):
        if vae_folder is None:
            raise ValueError(f"{self.title}'s latent statistics are VAE weights: the VAE folder is needed")
        return BatchNormLatents.from_folder(vae_config, vae_folder)

    def latent_multiple(self, vae_config):
        return 2 * super().latent_multiple(vae_config)  # 2x2 patches

    def denoiser_latent_shape(self, vae_config, height, width):
        """The patchified latents: ``(4C, h / 2, w / 2)``."""
        f = 2 * self.vae_scale_factor(vae_config)
        return (4 * vae_config["latent_channels"], height // f, width // f)

    def image_seq_len(self, latent_shape, vae_config, denoiser_config):
        return latent_shape[-2] * latent_shape[-1]  # one token per patchified latent pixel

    def sampling_sigmas(self, steps):
        """The pipelines' ``numpy.linspace(1, 1 / steps, steps)``."""
        import numpy

        return numpy.linspace(1.0, 1 / steps, steps).tolist()

    def sampling_mu(self, scheduler_config, image_seq_len, steps):
        """The pipelines' ``compute_empirical_mu(image_seq_len, num_steps)`` (not the scheduler
        config's bounds); the scheduler ignores it without ``use_dynamic_shifting``."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps)

    # ------------------------------------------------------------------ denoiser

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """As the training scripts call the transformer: the patchified latents packed into
        tokens with their ids, ``timestep = t / 1000`` (sigma), the guidance value (dev),
        all the text rows with their ids; the output's image tokens unpacked. With
        ``cond["source_latents"]`` ``(N, K, C, h, w)`` (editing), the K sources' packed tokens
        follow the target's with ids ``reference_ids``, as the pipeline's call with ``image=[K
        images]``; the prediction is the target's tokens' alone."""
        n, _, h, w = noisy_latents.shape
        device = noisy_latents.device
        states = cond["encoder_hidden_states"]
        txt = cond.get("txt_ids")
        if txt is None:
            txt = text_ids(n, states.shape[1], states.device)
        hidden, t = pack_latents(noisy_latents), timesteps.expand(n)
        ids = latent_ids(n, h, w, device)
        source = cond.get("source_latents")
        if source is not None and n > 0:  # reference images: their tokens after the target's
            count, (sh, sw) = source.shape[1], source.shape[-2:]
            refs = [pack_latents(source[:, k].to(hidden.dtype)) for k in range(count)]
            hidden = torch.cat([hidden, *refs], dim=1)
            ids = torch.cat([ids, reference_ids(n, count, sh, sw, device)], dim=1)
        if n == 0:  # the transformer reads img_ids[0]: one dummy row, then none of it
            hidden = hidden.new_zeros(1, *hidden.shape[1:])
            states = states.new_zeros(1, *states.shape[1:])
            txt, t = text_ids(1, states.shape[1], states.device), t.new_ones(1)
            ids = latent_ids(1, h, w, device)
        rows = hidden.shape[0]
        out = denoiser(
            hidden_states=hidden,
            timestep=t / 1000,
            guidance=guidance_values(denoiser, rows, guidance_scale, device),
            encoder_hidden_states=states,
            txt_ids=txt,
            img_ids=ids,
            return_dict=False,
        )[0]
        return unpack_latents(out[:n, : h * w], h, w)

    # ------------------------------------------------------------------ pipelines

    def published(self):
        components = self.published_parts(PUBLISHED_TRANSFORMER_DEV, MISTRAL_SMALL_3_24B, vae=PUBLISHED_VAE)
        return self.published_as(
            components,
            ("black-forest-labs/FLUX.2-dev", "FLUX.2 [dev]"),
            note="text_encoder is the whole Mistral Small 3 24B VLM as loaded, counted whole while only its "
            "text path runs: its Pixtral vision tower and projector (439 M) never run, and as prompts take "
            "layers 10, 20 and 30 of 40, its last 10 layers run for nothing and lm_head (671 M) for one position",
        )


@dataclasses.dataclass(frozen=True)
class Flux2Klein(Flux2):
    """Flux.2 [klein]: Qwen3's stacked states after its chat template (thinking disabled); no
    guidance embedding (CFG at inference for the base models). ``--guidance_scale`` is dev's
    embedded guidance: klein validates at the pipeline's CFG, as its script
    (``validation_kwargs``)."""

    hidden_layers = KLEIN_LAYERS
    # Flux2KleinPipeline's registered value (model_index.json; detect_family reads it): a
    # step-distilled model runs no CFG, in validation's pipeline too
    registered_config: ClassVar[tuple[str, ...]] = ("is_distilled",)
    is_distilled: bool = False

    def validation_kwargs(self, max_sequence_length, guidance_scale):
        """The training's ``max_sequence_length`` only: ``--guidance_scale`` is dev's embedded
        guidance, not klein's CFG."""
        return super().validation_kwargs(max_sequence_length, None)

    def prompt_text(self, spec, caption, tokenizer=None):
        """The user turn and generation prompt ``Flux2KleinPipeline`` renders with
        ``enable_thinking=False`` (an empty think block); without a tokenizer, what Qwen3's
        template renders (``common.QWEN3_PROMPT_NO_THINKING``)."""
        return qwen3_chat_prompt(caption, tokenizer, enable_thinking=False)

    def add_special_tokens(self, tokenizer, texts):
        return True  # the pipeline's tokenizer(text) call (Qwen adds no BOS either way)

    def classifier_free_guidance(self, model_index, denoiser_config, guidance_scale):
        """CFG above 1 for a base model; a step-distilled one (``is_distilled`` in
        ``model_index.json``) runs none, as ``Flux2KleinPipeline``."""
        return guidance_scale > 1 and not model_index.get("is_distilled", self.is_distilled)

    def published(self):
        note = (
            "text_encoder is {} as loaded (Qwen3ForCausalLM{}): prompts take layers 9, 18 and 27 of 36, so "
            "the last 9 layers and lm_head (one position) run for nothing"
        )
        return tuple(
            PublishedConfig(
                f"black-forest-labs/FLUX.2-klein-{size}",
                f"FLUX.2 [klein] {size}",
                self.pipeline_class,
                self.published_parts(transformer, text_encoder, vae=PUBLISHED_VAE),
                note=note.format(*about),
            )
            for size, transformer, text_encoder, about in (
                (
                    "4B",
                    PUBLISHED_TRANSFORMER_KLEIN_4B,
                    QWEN3_4B,
                    ("Qwen3-4B", ", lm_head tied to the embeddings"),
                ),
                ("9B", PUBLISHED_TRANSFORMER_KLEIN_9B, QWEN3_8B, ("Qwen3-8B", "")),
            )
        )


def _flux2_lora_targets(num_single_layers: int) -> tuple[str, ...]:
    """train_dreambooth_lora_flux2(_klein).py's default targets: the double blocks' image-stream
    attention, the single blocks' fused projection and output."""
    singles = tuple(f"single_transformer_blocks.{i}.attn.to_out" for i in range(num_single_layers))
    return ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", *singles)


_COMMON = dict(
    denoiser_class="Flux2Transformer2DModel",
    vae_class="AutoencoderKLFlux2",
    sample_latents=False,  # the scripts encode with latent_dist.mode()
    default_max_sequence_length=512,  # the pipelines' and the scripts' --max_sequence_length
)
FLUX2 = Flux2(
    name="flux2",
    title="Flux.2 [dev]",
    pipeline_class="Flux2Pipeline",
    text_encoders=(llm_text_encoder("Mistral3ForConditionalGeneration"),),
    lora_target_modules=_flux2_lora_targets(48),  # train_dreambooth_lora_flux2.py
    # 64 tokens: the system message alone takes about 40
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=64),
    **_COMMON,
)
FLUX2_KLEIN = Flux2Klein(
    name="flux2-klein",
    title="Flux.2 [klein]",
    pipeline_class="Flux2KleinPipeline",
    text_encoders=(llm_text_encoder("Qwen3ForCausalLM"),),
    lora_target_modules=_flux2_lora_targets(24),  # train_dreambooth_lora_flux2_klein.py
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=32),
    **_COMMON,
)

# -------------------------------------------------------------------------------- published configs

# diffusers scripts/convert_flux2_to_diffusers.py (get_flux2_transformer_config): the shape keys.
PUBLISHED_TRANSFORMER_DEV = published_config("flux2/transformer_dev")  # FLUX.2 [dev]
PUBLISHED_TRANSFORMER_KLEIN_4B = published_config("flux2/transformer_klein_4b")  # FLUX.2 [klein] 4B
PUBLISHED_TRANSFORMER_KLEIN_9B = published_config("flux2/transformer_klein_9b")  # FLUX.2 [klein] 9B
PUBLISHED_VAE = published_config("flux2/vae")  # AutoencoderKLFlux2's defaults, which the converter builds
# Mistral-Small-3.2-24B-Instruct-2506 (3.1's shapes): an untied lm_head, as the checkpoint holds
# (Mistral3Config's top-level default would tie it)
MISTRAL_SMALL_3_24B = published_config("flux2/mistral_small_3_24b")

# FLUX.1-dev's scheduler, which convert_flux2_to_diffusers.py gives FLUX.2 (dynamic shifting:
# training's sigmas stay linear).
FLUX2_SCHEDULER = published_config("flux2/scheduler")
