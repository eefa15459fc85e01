"""Krea 2 (``Krea2Pipeline``): a 12.8 B single-stream MMDiT (``Krea2Transformer2DModel``) whose
text conditioning is a stack of twelve hidden states of a frozen Qwen3-VL 4 B (``Qwen3VLModel``,
text path only) per token, fused inside the transformer; Qwen-Image's causal video VAE
(``AutoencoderKLQwenImage``: 5-D latents of one frame, per-channel mean and std); 2x2-packed
latents; flow matching as diffusers' ``train_dreambooth_lora_krea2.py`` (uniform timesteps by
default, target ``noise - latents``, the transformer's output taken as is).

What ``Krea2Pipeline`` registers in its config (``model_index.json``) is read from the pipeline
folder (``detect_family``): ``text_encoder_select_layers`` (the taps), ``patch_size`` (the
packing) and ``is_distilled`` (validation's schedule); the published values are only the
pipeline's defaults (``KREA2``).

The prompt is Qwen-Image's chat template tokenized as the pipeline's fixed-length block
(``Krea2Pipeline.get_text_hidden_states``): ``[prefix | caption | pad | suffix]``, the padding in
the middle, text positions counting valid tokens only (cumulative mask, the same on the three
mRoPE axes), the 34 prefix tokens dropped from the outputs. The transformer reads every one of
the ``max_sequence_length`` rows with their mask (no trimming), as the pipeline and the script.

Neither Qwen3-VL nor the transformer can take an empty batch: for one, ``encode_text`` and
``predict`` call their model on one dummy row and return none of it (lockstep kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ChannelMeanStd, Family
from .common import SequenceLengthValidation, llm_text_encoder, run_args
from .published import QWEN3_VL_4B, published_config
from .qwenimage import PROMPT_TEMPLATE
from .qwenimage import PUBLISHED_VAE as QWEN_IMAGE_VAE

# Krea2Pipeline.__init__: the Qwen-Image template split around the caption, the prefix dropped.
PROMPT_PREFIX = PROMPT_TEMPLATE.split("{}")[0]
PROMPT_SUFFIX = PROMPT_TEMPLATE.split("{}")[1]  # "<|im_end|>\n<|im_start|>assistant\n"
DROPPED_PREFIX_TOKENS = 34  # Krea2Pipeline.prompt_template_encode_start_idx
SUFFIX_TOKENS = 5  # Krea2Pipeline.prompt_template_encode_num_suffix_tokens
# Krea2Pipeline's default text_encoder_select_layers (a registered config value: a pipeline folder
# may set others): indices into Qwen3-VL-4B's hidden_states (0 is the embeddings' output), one
# every 3 layers from the 2nd to the 35th of 36.
TEXT_ENCODER_SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
PATCH_SIZE = 2  # Krea2Pipeline's default patch_size (registered; the script packs 2x2 patches too)


def pack_latents(latents: torch.Tensor, patch_size: int = PATCH_SIZE) -> torch.Tensor:
    """One-frame latents in ``patch_size``-square patches: (N, C, 1, H, W) -> (N, H/p * W/p, C p^2),
    as ``Krea2Pipeline._pack_latents``."""
    n, c, _, h, w = latents.shape
    p = patch_size
    x = latents.view(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // p) * (w // p), c * p * p)


def unpack_latents(
    packed: torch.Tensor, height: int, width: int, patch_size: int = PATCH_SIZE
) -> torch.Tensor:
    """The inverse of ``pack_latents`` for latents of ``height`` x ``width`` (latent sides)."""
    n, _, d = packed.shape
    p = patch_size
    x = packed.view(n, height // p, width // p, d // (p * p), p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, d // (p * p), 1, height, width)


def text_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's position ids of a Krea 2 prompt block, ``(3, B, L)``: the index among the
    row's valid tokens (padding takes no position, so the suffix after the padding continues
    the caption), the same on the three mRoPE axes, as ``get_text_hidden_states`` builds them."""
    positions = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    return positions.unsqueeze(0).expand(3, -1, -1)


def position_ids(text_length: int, grid_height: int, grid_width: int, device) -> torch.Tensor:
    """The transformer's rotary coordinates ``(text_length + grid_height * grid_width, 3)``:
    text rows at the origin, image tokens at ``(0, row, column)`` of the packed grid, as
    ``Krea2Pipeline.prepare_position_ids``."""
    text = torch.zeros(text_length, 3, device=device)
    image = torch.zeros(grid_height, grid_width, 3, device=device)
    image[..., 1] = torch.arange(grid_height, device=device)[:, None]
    image[..., 2] = torch.arange(grid_width, device=device)[None, :]
    return torch.cat([text, image.reshape(grid_height * grid_width, 3)], dim=0)


class ScriptLatentNorm(ChannelMeanStd):
    """``(latents - latents_mean) * (1 / latents_std)`` computed in fp32 and returned in the
    latents' dtype: the script's arithmetic (its statistics are fp32 tensors, the result is cast
    to the training dtype), so bf16 latents match it to the bit."""

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        shape = (1, -1, *([1] * (latents.ndim - 2)))
        mean = self.mean.to(latents.device).view(shape)
        inv_std = (1.0 / self.std).to(latents.device).view(shape)
        return ((latents - mean) * inv_std).to(latents.dtype)


@dataclass(frozen=True)
class Krea2(SequenceLengthValidation, Family):
    """Krea 2: stacked Qwen3-VL states per token (the pipeline's taps) with their mask; one-frame
    packed latents. Validation at the pipeline's CFG (``SequenceLengthValidation``)."""

    registered_config: ClassVar[tuple[str, ...]] = (
        "text_encoder_select_layers",
        "is_distilled",
        "patch_size",
    )
    # Krea2Pipeline's registered values, their defaults the pipeline's (None: its default taps)
    text_encoder_select_layers: tuple[int, ...] | None = TEXT_ENCODER_SELECT_LAYERS
    is_distilled: bool = False  # the pipeline's fixed shift (mu 1.15) at inference: validation's schedule
    patch_size: int = PATCH_SIZE

    def __post_init__(self):
        if self.text_encoder_select_layers is None:  # as Krea2Pipeline.__init__ reads None
            object.__setattr__(self, "text_encoder_select_layers", TEXT_ENCODER_SELECT_LAYERS)

    # ------------------------------------------------------------------ prompts

    def token_length(self, spec, tokenizer, max_sequence_length=None):
        # the pipeline's block: the 34 dropped prefix tokens, then max_sequence_length rows
        return DROPPED_PREFIX_TOKENS + self.sequence_length(spec, tokenizer, max_sequence_length)

    def prompt_text(self, spec, caption, tokenizer=None):
        """The text tokenized before the padding: the template's prefix and the caption (the
        suffix is tokenized apart and appended after the padding)."""
        return PROMPT_PREFIX + caption

    def tokenize(self, tokenizers, captions, max_sequence_length=None):
        """``[prefix + caption, padded and truncated to the block less the suffix | suffix]`` per
        caption, with its mask: ``Krea2Pipeline.get_text_hidden_states``'s ids."""
        spec = self.text_encoders[0]
        if spec.name not in tokenizers or not captions:
            return super().tokenize(tokenizers, captions, max_sequence_length)  # nothing to render
        tokenizer = tokenizers[spec.name]
        length = self.token_length(spec, tokenizer, max_sequence_length)
        text = tokenizer(
            [self.prompt_text(spec, c, tokenizer) for c in captions],
            truncation=True,
            padding="max_length",
            max_length=length - SUFFIX_TOKENS,
            return_tensors="pt",
        )
        suffix = tokenizer([PROMPT_SUFFIX] * len(captions), return_tensors="pt")
        if suffix.input_ids.shape[1] != SUFFIX_TOKENS:
            raise ValueError(
                f"the Krea 2 template suffix {PROMPT_SUFFIX!r} is {suffix.input_ids.shape[1]} tokens "
                f"with this tokenizer, the pipeline expects {SUFFIX_TOKENS}"
            )
        return {
            spec.input_key: torch.cat([text.input_ids, suffix.input_ids], dim=1),
            spec.mask_key: torch.cat([text.attention_mask, suffix.attention_mask], dim=1),
        }

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """``hidden_states[i]`` for the pipeline's selected layers (``text_encoder_select_layers``,
        twelve by default) stacked per token, ``(B, L, layers, H)``,
        after the dropped prefix, with the mask: the pipeline's ``encode_prompt`` (its position
        ids, its boolean mask; the padded rows kept as it keeps them). The whole model is called
        (under ZeRO-3 its root forward ends each trace)."""
        n = input_ids.shape[0]
        if n == 0:  # Qwen3-VL cannot take an empty batch: one dummy row keeps a sharded encoder in lockstep
            input_ids = input_ids.new_zeros(1, input_ids.shape[1])
            attention_mask = None
        # no mask: every token valid (the planner sizes outputs so, on the meta device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        # On the meta device transformers cannot inspect a mask, and only its cache path skips that.
        meta = input_ids.is_meta
        out = encoder(
            input_ids=input_ids,
            attention_mask=None if meta else mask.bool(),
            position_ids=text_position_ids(mask),
            output_hidden_states=True,
            use_cache=meta,
        )
        layers = self.text_encoder_select_layers
        if max(layers) >= len(out.hidden_states) or min(layers) < -len(out.hidden_states):
            raise ValueError(
                f"the Krea 2 pipeline's text_encoder_select_layers {list(layers)} reach beyond the text "
                f"encoder's {len(out.hidden_states)} hidden states"
            )
        stacked = torch.stack([out.hidden_states[i] for i in layers], dim=2)
        return {
            "prompt_embeds": stacked[:n, DROPPED_PREFIX_TOKENS:],
            "prompt_embeds_mask": mask[:n, DROPPED_PREFIX_TOKENS:].long(),
        }

    def conditioning(self, outputs):
        """Every row of the fixed-length block with its mask (kept as integers: cached and cast
        with the batch; ``predict`` hands the transformer a boolean mask)."""
        return {
            "encoder_hidden_states": outputs["prompt_embeds"],
            "encoder_attention_mask": outputs["prompt_embeds_mask"],
        }

    # ------------------------------------------------------------------ latents

    def latent_normalizer(self, vae_config, vae_folder=None):
        return ScriptLatentNorm(vae_config)

    def latent_distribution(self, vae, pixels):
        return vae.encode(pixels.unsqueeze(2)).latent_dist  # a video VAE: one frame

    def latent_multiple(self, vae_config):
        return self.patch_size * 2 ** len(vae_config["temperal_downsample"])  # VAE, then the packing

    # ------------------------------------------------------------------ denoiser

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """As ``train_dreambooth_lora_krea2.py`` calls the transformer (the pipeline's call):
        latents packed in ``patch_size``-square patches (2x2 by default), every text row with its boolean mask, ``timestep = t / 1000`` in fp32
        (the script's; the pipeline casts it to the latents' dtype), the position ids of text and
        grid; the output unpacked (the velocity ``noise - latents``, used as is). Krea 2 has no
        embedded guidance (``guidance_scale`` is unused)."""
        n, _, _, h, w = noisy_latents.shape
        states = cond["encoder_hidden_states"]
        mask = cond["encoder_attention_mask"].bool()
        p = self.patch_size
        hidden, t = pack_latents(noisy_latents, p), (timesteps / 1000).float().expand(n)
        if n == 0:  # the transformer cannot reshape an empty batch: one dummy row, then none of it
            hidden = hidden.new_zeros(1, *hidden.shape[1:])
            states = states.new_zeros(1, *states.shape[1:])
            mask, t = mask.new_ones(1, mask.shape[1]), t.new_ones(1)
        out = denoiser(
            hidden_states=hidden,
            encoder_hidden_states=states,
            timestep=t,
            position_ids=position_ids(states.shape[1], h // p, w // p, noisy_latents.device),
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        return unpack_latents(out[:n], h, w, p)

    # ------------------------------------------------------------------ pipelines

    def published(self):
        components = self.published_parts(PUBLISHED_TRANSFORMER, QWEN3_VL_4B, vae=QWEN_IMAGE_VAE)
        note = (
            "text_encoder is Qwen3-VL-4B-Instruct's Qwen3VLModel, counted whole: its vision tower (415 M) "
            "never runs, and prompts take hidden_states up to index 35, so its last decoder layer and final "
            "norm (101 M) run for nothing"
        )
        checkpoints = ("krea/Krea-2-Raw", "Krea 2 Raw"), ("krea/Krea-2-Turbo", "Krea 2 Turbo")
        return self.published_as(components, *checkpoints, note=note)


KREA2 = Krea2(
    name="krea2",
    title="Krea 2",
    pipeline_class="Krea2Pipeline",
    text_encoders=(llm_text_encoder("Qwen3VLModel"),),
    denoiser_class="Krea2Transformer2DModel",
    vae_class="AutoencoderKLQwenImage",
    default_max_sequence_length=512,  # the pipeline's and train_dreambooth_lora_krea2.py's
    # train_dreambooth_lora_krea2.py's default --lora_layers (the Krea 2 authors' set)
    lora_target_modules=(
        "img_in",
        "final_layer.linear",
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "to_gate",
        "ff.up",
        "ff.down",
        "text_fusion.projector",
        "txt_in.linear_1",
        "txt_in.linear_2",
        "time_embed.linear_1",
        "time_embed.linear_2",
        "time_mod_proj",
    ),
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=32),
)

# krea/Krea-2-Raw's and krea/Krea-2-Turbo's transformer (the same shapes): the keys that set them,
# Krea2Transformer2DModel's defaults (diffusers' docs; 28 blocks at width 6144).
PUBLISHED_TRANSFORMER = published_config("krea2/transformer")
# Krea2Pipeline's scheduler (its docstring): resolution-aware exponential shift at inference;
# training's sigmas stay linear (dynamic shifting), as the script loads it.
KREA2_SCHEDULER = published_config("krea2/scheduler")
