"""Model families: everything that differs between Stable Diffusion 1.x/2.x and SDXL, in one place.

A ``Family`` answers, for one kind of pipeline: which folder holds the trained denoiser and
its class, which frozen text encoders (and tokenizers) condition it, the VAE's dtype rule,
how a prompt is encoded (which hidden state, which pooled output), the extra conditioning
(SDXL's ``time_ids``), the denoiser's keyword arguments, and the pipeline class used for
validation and for the final output. Everything else in the package (placements, the
cache, EMA, checkpoints, load/save, lockstep, the loop) is written once and asks the family.

``detect_family(folder)`` picks the family from the pipeline's ``model_index.json``
(``_class_name``); an unsupported pipeline gets one ``CheckpointError`` listing the supported
ones.

Each text encoder's outputs have names of their own (``encode_text`` returns a dict), so an
encoder can be placed on its own (replicate, shard, offload, cache) and its cached outputs
are found by name; ``conditioning`` combines them for the denoiser.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..pretrained import CheckpointError


@dataclass(frozen=True)
class TextEncoderSpec:
    """A frozen text encoder of a family: its folder, class and tokenizer folder."""

    name: str  # folder in the pipeline, e.g. "text_encoder_2"
    model_class: str  # transformers class name
    tokenizer: str  # tokenizer folder, e.g. "tokenizer_2"
    input_key: str  # the batch key of its token ids, e.g. "input_ids_2"


@dataclass(frozen=True)
class Family:
    """What a training script needs to know about one kind of pipeline (see module doc)."""

    name: str
    pipeline_class: str
    text_encoders: tuple[TextEncoderSpec, ...]
    denoiser: str = "unet"
    denoiser_class: str = "UNet2DConditionModel"
    vae_in_fp32: bool = False  # SDXL's VAE overflows in fp16
    uses_time_ids: bool = False
    supports_dream: bool = True

    # ------------------------------------------------------------------ components

    @property
    def frozen_components(self) -> tuple[str, ...]:
        """Folders of the frozen models, each placed on its own: text encoders, then VAE."""
        return (*(e.name for e in self.text_encoders), "vae")

    def denoiser_cls(self):
        import diffusers

        return getattr(diffusers, self.denoiser_class)

    def component_class(self, name: str):
        """The class of a frozen component folder (``vae`` or a text encoder)."""
        if name == "vae":
            from diffusers import AutoencoderKL

            return AutoencoderKL
        import transformers

        return getattr(transformers, self._encoder(name).model_class)

    def _encoder(self, name: str) -> TextEncoderSpec:
        for spec in self.text_encoders:
            if spec.name == name:
                return spec
        raise KeyError(f"{self.name} has no text encoder {name!r}")

    def component_dtype(self, name: str, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype a frozen component runs in: the training dtype, except a VAE the family
        keeps in fp32."""
        return torch.float32 if name == "vae" and self.vae_in_fp32 else weight_dtype

    def load_tokenizers(self, source: str | os.PathLike) -> dict[str, Any]:
        """``{encoder name: tokenizer}`` from the pipeline folder."""
        from transformers import AutoTokenizer

        return {e.name: AutoTokenizer.from_pretrained(Path(source) / e.tokenizer) for e in self.text_encoders}

    # ------------------------------------------------------------------ prompts

    def tokenize(self, tokenizers: dict[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        """Token ids of ``captions`` for every encoder, padded to each tokenizer's max length
        (an empty batch of the right width for no captions)."""
        out = {}
        for spec in self.text_encoders:
            tok = tokenizers[spec.name]
            if not captions:  # a rank with no samples still calls the encoders (lockstep)
                out[spec.input_key] = torch.zeros(0, tok.model_max_length, dtype=torch.long)
                continue
            out[spec.input_key] = tok(
                list(captions),
                max_length=tok.model_max_length,
                padding="max_length",
                truncation=True,
                return_tensors="pt",
            ).input_ids
        return out

    def encode_text(self, name: str, encoder, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """One encoder's outputs, named for the cache. Collective when ``encoder`` is sharded."""
        raise NotImplementedError

    def encode_texts(self, encoders: dict[str, Any], ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The named outputs of the given encoders (any subset of the family's, by folder
        name) for a batch of token ids (``tokenize``'s dict), each on its encoder's device.
        Collective when an encoder is sharded."""
        outputs = {}
        for spec in self.text_encoders:
            if encoders.get(spec.name) is not None:
                encoder = encoders[spec.name]
                outputs.update(self.encode_text(spec.name, encoder, ids[spec.input_key].to(encoder.device)))
        return outputs

    def conditioning(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Combine the encoders' named outputs into ``encoder_hidden_states`` (and the pooled
        ``text_embeds`` for SDXL)."""
        raise NotImplementedError

    def denoiser_kwargs(self, cond: dict[str, torch.Tensor], time_ids: torch.Tensor | None) -> dict[str, Any]:
        """Keyword arguments of the denoiser call beyond (latents, timesteps, hidden states)."""
        return {}

    # ------------------------------------------------------------------ pipelines

    def pipeline(self, denoiser, vae, text_encoders: dict[str, Any], tokenizers: dict[str, Any], scheduler):
        """The family's diffusers pipeline around these (already placed) modules."""
        raise NotImplementedError


def time_ids(
    original_size: torch.Tensor, crop_top_left: torch.Tensor, resolution: int | tuple[int, int]
) -> torch.Tensor:
    """SDXL's micro-conditioning, one row per image: original (h, w), crop top-left (y, x)
    and target (h, w), as diffusers' SDXL training script and pipeline build it."""
    target = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    target_t = torch.tensor(target, dtype=torch.float32).expand(original_size.shape[0], 2)
    return torch.cat([original_size.float(), crop_top_left.float(), target_t], dim=1)


class StableDiffusion(Family):
    """SD 1.x / 2.x: one CLIP text encoder, its last hidden state."""

    def encode_text(self, name, encoder, input_ids):
        return {"encoder_hidden_states": encoder(input_ids, return_dict=False)[0]}

    def conditioning(self, outputs):
        return {"encoder_hidden_states": outputs["encoder_hidden_states"]}

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler):
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline(
            unet=denoiser,
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=tokenizers["text_encoder"],
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )


class StableDiffusionXL(Family):
    """SDXL: the penultimate hidden states of CLIP-L and OpenCLIP-bigG, concatenated; the
    second encoder's pooled (projected) output as ``text_embeds``; ``time_ids`` per image."""

    def encode_text(self, name, encoder, input_ids):
        out = encoder(input_ids, output_hidden_states=True, return_dict=False)
        hidden = out[-1][-2]  # hidden_states, penultimate layer
        if name == "text_encoder_2":
            return {"prompt_embeds_2": hidden, "text_embeds": out[0]}
        return {"prompt_embeds_1": hidden}

    def conditioning(self, outputs):
        return {
            "encoder_hidden_states": torch.cat(
                [outputs["prompt_embeds_1"], outputs["prompt_embeds_2"]], dim=-1
            ),
            "text_embeds": outputs["text_embeds"],
        }

    def denoiser_kwargs(self, cond, time_ids):
        return {"added_cond_kwargs": {"text_embeds": cond["text_embeds"], "time_ids": time_ids}}

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer=tokenizers["text_encoder"],
            tokenizer_2=tokenizers["text_encoder_2"],
            unet=denoiser,
            scheduler=scheduler,
            add_watermarker=False,
        )


SD = StableDiffusion(
    name="sd",
    pipeline_class="StableDiffusionPipeline",
    text_encoders=(TextEncoderSpec("text_encoder", "CLIPTextModel", "tokenizer", "input_ids"),),
)
SDXL = StableDiffusionXL(
    name="sdxl",
    pipeline_class="StableDiffusionXLPipeline",
    text_encoders=(
        TextEncoderSpec("text_encoder", "CLIPTextModel", "tokenizer", "input_ids"),
        TextEncoderSpec("text_encoder_2", "CLIPTextModelWithProjection", "tokenizer_2", "input_ids_2"),
    ),
    vae_in_fp32=True,
    uses_time_ids=True,
    supports_dream=False,  # diffusers' DREAM helper calls the UNet without added_cond_kwargs
)
FAMILIES: dict[str, Family] = {f.pipeline_class: f for f in (SD, SDXL)}


def detect_family(source: str | os.PathLike) -> Family:
    """The family of the pipeline folder ``source``, from ``model_index.json``'s ``_class_name``.

    Raises ``CheckpointError`` naming the class and the supported pipelines when it is not
    one of them.
    """
    index_file = Path(source) / "model_index.json"
    try:
        class_name = json.loads(index_file.read_text()).get("_class_name")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {index_file} ({type(e).__name__}: {e})") from e
    if class_name not in FAMILIES:
        raise CheckpointError(
            f"{source} is a {class_name} pipeline; supported pipelines: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[class_name]
