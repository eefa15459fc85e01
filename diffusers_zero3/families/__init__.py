"""Model families: everything that differs between SD 1.x/2.x, SDXL, SD3 and Flux.1, in one place.

A ``Family`` answers, for one kind of pipeline: which folder holds the trained denoiser and
its class, which frozen text encoders (and tokenizers) condition it, the VAE's dtype rule,
how a prompt is encoded (which hidden state, which pooled output), the extra conditioning
(SDXL's ``time_ids``), the objective (DDPM noise prediction for the UNets, flow matching
for the SD3 and Flux transformers) and how the denoiser is called (Flux packs its latents
and takes ``img_ids``/``txt_ids`` and a guidance value), and the pipeline class used for
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
    uses_max_sequence_length: bool = False  # T5: --max_sequence_length tokens, else the tokenizer's length


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
    flow_matching: bool = False  # SD3/Flux: flow matching with FlowMatchEulerDiscreteScheduler's sigmas
    default_max_sequence_length: int = 77  # T5 tokens, as diffusers' training scripts default
    default_weighting_scheme: str = "none"  # flow matching's timestep density and loss weighting
    # LoRA targets of diffusers' LoRA scripts for this family (--lora_layers overrides them)
    lora_target_modules: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")

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

    def sequence_length(
        self, spec: TextEncoderSpec, tokenizer, max_sequence_length: int | None = None
    ) -> int:
        """Tokens per caption for one encoder: ``max_sequence_length`` (default: the family's)
        for a T5 encoder, the tokenizer's own length (77 for CLIP) otherwise."""
        if spec.uses_max_sequence_length:
            return max_sequence_length or self.default_max_sequence_length
        return tokenizer.model_max_length

    def tokenize(
        self, tokenizers: dict[str, Any], captions: list[str], max_sequence_length: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Token ids of ``captions`` for every encoder of ``tokenizers`` (any subset of the
        family's, by encoder folder name), padded to each encoder's sequence length
        (``sequence_length``; an empty batch of that width for no captions)."""
        out = {}
        for spec in self.text_encoders:
            if spec.name not in tokenizers:
                continue
            tok = tokenizers[spec.name]
            length = self.sequence_length(spec, tok, max_sequence_length)
            if not captions:  # a rank with no samples still calls the encoders (lockstep)
                # CPU: like the tokenizer's ids; encode_texts moves ids to each encoder's device
                out[spec.input_key] = torch.zeros(0, length, dtype=torch.long)
                continue
            out[spec.input_key] = tok(
                list(captions),
                max_length=length,
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
        """Keyword arguments of the UNet call beyond (latents, timesteps, hidden states)."""
        return {}

    def predict(
        self,
        denoiser,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        cond: dict[str, torch.Tensor],
        *,
        guidance_scale: float | None = None,
    ) -> torch.Tensor:
        """The flow-matching families' denoiser output for ``noisy_latents`` (N, C, H, W), in
        the latents' shape. ``timesteps`` are the scheduler's (sigma x 1000)."""
        raise NotImplementedError(f"{self.name} is not a flow-matching family")

    def noise_scheduler_class(self):
        """The scheduler class of training (and validation) for this family."""
        import diffusers

        return diffusers.FlowMatchEulerDiscreteScheduler if self.flow_matching else diffusers.DDPMScheduler

    def latent_multiple(self, vae_config: dict) -> int:
        """Image sides must be a multiple of this: the VAE's downsampling (x2 for Flux's 2x2
        latent packing)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    def validation_kwargs(
        self, max_sequence_length: int | None, guidance_scale: float | None
    ) -> dict[str, Any]:
        """Extra keyword arguments of the family's pipeline call for validation images."""
        return {}

    # ------------------------------------------------------------------ pipelines

    def pipeline(self, denoiser, vae, text_encoders: dict[str, Any], tokenizers: dict[str, Any], scheduler):
        """The family's diffusers pipeline around these (already placed) modules."""
        raise NotImplementedError


def time_ids(
    original_size: torch.Tensor, crop_top_left: torch.Tensor, resolution: int | tuple[int, int]
) -> torch.Tensor:
    """SDXL's micro-conditioning, one row per image: original (h, w), crop top-left (y, x)
    and target (h, w), as diffusers' SDXL training script and pipeline build it; on the device
    of ``original_size`` (a prepared data loader's batch is on the accelerator's device)."""
    target = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    target_t = torch.tensor(target, dtype=torch.float32, device=original_size.device)
    target_t = target_t.expand(original_size.shape[0], 2)
    return torch.cat([original_size.float(), crop_top_left.to(original_size.device).float(), target_t], dim=1)


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


def _clip_hidden_and_pooled(encoder, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CLIP encoder with projection: (penultimate hidden states, projected pooled output)."""
    out = encoder(input_ids, output_hidden_states=True, return_dict=False)
    return out[-1][-2], out[0]


class StableDiffusion3(Family):
    """SD3: the penultimate hidden states of CLIP-L and CLIP-G, concatenated and zero-padded to
    T5's width, then T5's states appended along the sequence; pooled = both CLIPs' projected
    outputs, concatenated. Flow matching."""

    def encode_text(self, name, encoder, input_ids):
        if name == "text_encoder_3":
            return {"t5_embeds": encoder(input_ids, return_dict=False)[0]}
        hidden, pooled = _clip_hidden_and_pooled(encoder, input_ids)
        k = 1 if name == "text_encoder" else 2
        return {f"prompt_embeds_{k}": hidden, f"pooled_{k}": pooled}

    def conditioning(self, outputs):
        clip = torch.cat([outputs["prompt_embeds_1"], outputs["prompt_embeds_2"]], dim=-1)
        t5 = outputs["t5_embeds"]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "encoder_hidden_states": torch.cat([clip, t5.to(clip.dtype)], dim=-2),
            "pooled_projections": torch.cat([outputs["pooled_1"], outputs["pooled_2"]], dim=-1),
        }

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        return denoiser(
            hidden_states=noisy_latents,
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            return_dict=False,
        )[0]

    def validation_kwargs(self, max_sequence_length, guidance_scale):
        return {"max_sequence_length": max_sequence_length or self.default_max_sequence_length}

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(
            transformer=denoiser,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=tokenizers["text_encoder"],
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer_2=tokenizers["text_encoder_2"],
            text_encoder_3=text_encoders["text_encoder_3"],
            tokenizer_3=tokenizers["text_encoder_3"],
        )


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """Flux's 2x2 patches: (N, C, H, W) -> (N, H/2 * W/2, 4C), as ``FluxPipeline`` packs."""
    n, c, h, w = latents.shape
    return (
        latents.view(n, c, h // 2, 2, w // 2, 2)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(n, (h // 2) * (w // 2), c * 4)
    )


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of ``pack_latents`` for latents of ``height`` x ``width``."""
    n, _, c4 = packed.shape
    c = c4 // 4
    return (
        packed.view(n, height // 2, width // 2, c, 2, 2)
        .permute(0, 3, 1, 4, 2, 5)
        .reshape(n, c, height, width)
    )


def latent_image_ids(height: int, width: int, device=None, dtype=None) -> torch.Tensor:
    """Flux's rotary position ids of the packed latents, (H/2 * W/2, 3): (0, row, column)."""
    ids = torch.zeros(height // 2, width // 2, 3, device=device)
    ids[..., 1] = torch.arange(height // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(width // 2, device=device)[None, :]
    return ids.reshape(-1, 3).to(dtype=dtype)


class Flux(Family):
    """Flux.1: CLIP-L's pooled output as ``pooled_projections``, T5's hidden states as
    ``encoder_hidden_states``; 2x2-packed latents with ``img_ids``/``txt_ids``, the timestep
    as sigma, and a guidance value when the transformer has ``guidance_embeds``."""

    def encode_text(self, name, encoder, input_ids):
        if name == "text_encoder_2":
            return {"encoder_hidden_states": encoder(input_ids, return_dict=False)[0]}
        return {"pooled_projections": encoder(input_ids, output_hidden_states=False, return_dict=False)[1]}

    def conditioning(self, outputs):
        return {
            "encoder_hidden_states": outputs["encoder_hidden_states"],
            "pooled_projections": outputs["pooled_projections"],
        }

    def latent_multiple(self, vae_config):
        return 2 * super().latent_multiple(vae_config)

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        n, _, h, w = noisy_latents.shape
        states = cond["encoder_hidden_states"]
        config = getattr(denoiser, "module", denoiser).config
        guidance = None
        if config.guidance_embeds:
            guidance = torch.full((n,), float(guidance_scale or 1.0), device=noisy_latents.device)
        packed = denoiser(
            hidden_states=pack_latents(noisy_latents),
            timestep=timesteps / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=states,
            txt_ids=torch.zeros(states.shape[1], 3, device=states.device, dtype=states.dtype),
            img_ids=latent_image_ids(h, w, noisy_latents.device, noisy_latents.dtype),
            return_dict=False,
        )[0]
        return unpack_latents(packed, h, w)

    def validation_kwargs(self, max_sequence_length, guidance_scale):
        kwargs = {"max_sequence_length": max_sequence_length or self.default_max_sequence_length}
        if guidance_scale is not None:
            kwargs["guidance_scale"] = guidance_scale
        return kwargs

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler):
        from diffusers import FluxPipeline

        return FluxPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=tokenizers["text_encoder"],
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer_2=tokenizers["text_encoder_2"],
            transformer=denoiser,
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
SD3 = StableDiffusion3(
    name="sd3",
    pipeline_class="StableDiffusion3Pipeline",
    text_encoders=(
        TextEncoderSpec("text_encoder", "CLIPTextModelWithProjection", "tokenizer", "input_ids"),
        TextEncoderSpec("text_encoder_2", "CLIPTextModelWithProjection", "tokenizer_2", "input_ids_2"),
        TextEncoderSpec(
            "text_encoder_3", "T5EncoderModel", "tokenizer_3", "input_ids_3", uses_max_sequence_length=True
        ),
    ),
    denoiser="transformer",
    denoiser_class="SD3Transformer2DModel",
    supports_dream=False,
    flow_matching=True,
    default_max_sequence_length=77,  # diffusers' train_dreambooth_sd3.py
    default_weighting_scheme="logit_normal",
    lora_target_modules=(  # train_dreambooth_lora_sd3.py
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ),  # fmt: skip
)
FLUX = Flux(
    name="flux",
    pipeline_class="FluxPipeline",
    text_encoders=(
        TextEncoderSpec("text_encoder", "CLIPTextModel", "tokenizer", "input_ids"),
        TextEncoderSpec(
            "text_encoder_2", "T5EncoderModel", "tokenizer_2", "input_ids_2", uses_max_sequence_length=True
        ),
    ),
    denoiser="transformer",
    denoiser_class="FluxTransformer2DModel",
    supports_dream=False,
    flow_matching=True,
    default_max_sequence_length=512,  # diffusers' train_dreambooth_flux.py
    default_weighting_scheme="none",
    lora_target_modules=(  # train_dreambooth_lora_flux.py
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ),  # fmt: skip
)
FAMILIES: dict[str, Family] = {f.pipeline_class: f for f in (SD, SDXL, SD3, FLUX)}


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
