"""NucleusMoE-Image (``NucleusMoEImagePipeline``): a 17 B sparse single-stream DiT
(``NucleusMoEImageTransformer2DModel``: 32 blocks, all but the first three with a mixture of 64
SwiGLU experts and a shared one, expert-choice routing) whose image tokens cross-attend to one
hidden state of a frozen Qwen3-VL 8 B (``Qwen3VLForConditionalGeneration``, text path only):
``hidden_states[-8]`` of the prompt in a chat template with the pipeline's system prompt, with
its mask. Qwen-Image's VAE, packing, latent statistics, sampling sigmas, rescaled CFG and decode
(``qwenimage.QwenImage``, which this family extends).

diffusers has no training script for it, so the objective follows the pipeline's flow-matching
convention: the pipeline steps ``FlowMatchEulerDiscreteScheduler`` with ``-transformer(...)``,
so the transformer predicts ``latents - noise`` and ``predict`` returns its negation, the
velocity ``noise - latents`` that the objective's target is (uniform timesteps by default, the
timestep given as ``t / 1000`` in the latents' dtype, as the pipeline's loop).

Routing: each expert takes its top-``C`` tokens (``C = ceil(capacity_factor * S / experts)``), so
every expert runs on every call whatever the data, and all experts of a block live in two packed
parameters of one module (``SwiGLUExperts``): the modules ZeRO-3 gathers, and their order, are the
same on every rank. Unlike HiDream's token-choice MoE no leaf module is needed for correctness
(tested: ``tests/test_moe.py``, ranks routing their tokens apart).

Neither Qwen3-VL nor the transformer takes an empty batch: for one, ``encode_text`` and
``predict`` call their model on one dummy row and return none of it (lockstep kept).
"""

from __future__ import annotations

import math

import torch

from .common import llm_text_encoder, run_args
from .flux2 import load_flux2_tokenizer
from .published import QWEN3_VL_8B, published_config
from .qwenimage import PUBLISHED_VAE as QWEN_IMAGE_VAE
from .qwenimage import QWEN_IMAGE_SCHEDULER, QwenImage, pack_latents, unpack_latents

# NucleusMoEImagePipeline's DEFAULT_SYSTEM_PROMPT (tests check it is the pipeline's)
SYSTEM_PROMPT = (
    "You are an image generation assistant. Follow the user's prompt literally. Pay careful attention to "
    "spatial layout: objects described as on the left must appear on the left, on the right on the right. "
    "Match exact object counts and assign colors to the correct objects."
)
# What Qwen3-VL's chat template renders for [system, user] with the generation prompt
PROMPT_TEMPLATE = (
    "<|im_start|>system\n"
    + SYSTEM_PROMPT
    + "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
RETURN_INDEX = -8  # NucleusMoEImagePipeline.default_return_index: hidden_states[-8]
PAD_MULTIPLE = 8  # the pipeline pads a batch to its longest prompt, rounded up to a multiple of 8


def trimmed_length(mask: torch.Tensor) -> int:
    """The pipeline's text length for a batch of masks ``(B, L)``: its longest prompt rounded up
    to a multiple of 8 (``padding="longest", pad_to_multiple_of=8``), at most ``L``."""
    if not mask.numel():
        return mask.shape[1]
    longest = max(1, int(mask.sum(dim=1).max()))
    return min(mask.shape[1], PAD_MULTIPLE * math.ceil(longest / PAD_MULTIPLE))


class NucleusMoE(QwenImage):
    """NucleusMoE-Image: one Qwen3-VL hidden state with its mask; Qwen-Image's latents."""

    def load_tokenizer(self, folder):
        """The text tokenizer of the ``processor`` folder (a ``Qwen3VLProcessor``), with the
        processor's chat template (the validation pipeline renders prompts with it)."""
        return load_flux2_tokenizer(folder)

    # ------------------------------------------------------------------ prompts

    def token_length(self, spec, tokenizer, max_sequence_length=None):
        # template + caption, truncated to max_sequence_length (the system prompt included)
        return self.sequence_length(spec, tokenizer, max_sequence_length)

    def prompt_text(self, spec, caption, tokenizer=None):
        """The pipeline's ``_format_prompt``: the system prompt and the caption in Qwen3-VL's chat
        template, with the generation prompt."""
        return PROMPT_TEMPLATE.format(caption)

    def tokenize(self, tokenizers, captions, max_sequence_length=None):
        """Template and caption truncated to ``max_sequence_length`` tokens as the pipeline's
        processor call, padded on the tokenizer's side to that length rounded up to a multiple
        of 8 (so that ``conditioning``'s trim to the batch's longest, rounded up, is the
        pipeline's padding)."""
        spec = self.text_encoders[0]
        if spec.name not in tokenizers or not captions:
            return super().tokenize(tokenizers, captions, max_sequence_length)
        tokenizer = tokenizers[spec.name]
        encoded = tokenizer(
            [self.prompt_text(spec, c, tokenizer) for c in captions],
            max_length=self.token_length(spec, tokenizer, max_sequence_length),
            padding="max_length",
            pad_to_multiple_of=PAD_MULTIPLE,
            truncation=True,
            return_tensors="pt",
        )
        return {spec.input_key: encoded.input_ids, spec.mask_key: encoded.attention_mask}

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """``hidden_states[-8]`` of every row with its mask, as the pipeline's ``encode_prompt``
        (text-only positions: ``arange``, the model's own without images; the padded rows kept).
        The whole model is called (under ZeRO-3 its root forward ends each trace), with logits
        for one position only."""
        n = input_ids.shape[0]
        if n == 0:  # Qwen3-VL cannot take an empty batch: one dummy row keeps a sharded encoder in lockstep
            input_ids = input_ids.new_zeros(1, input_ids.shape[1])
            attention_mask = None
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        meta = input_ids.is_meta  # transformers cannot inspect a mask on the meta device (the planner)
        out = encoder(
            input_ids=input_ids,
            attention_mask=None if meta else mask,
            output_hidden_states=True,
            use_cache=meta,  # on the meta device only transformers' cache path skips inspecting the mask
            logits_to_keep=1,
        )
        return {"prompt_embeds": out.hidden_states[RETURN_INDEX][:n], "prompt_embeds_mask": mask[:n].long()}

    def conditioning(self, outputs):
        """Trimmed to the batch's longest prompt rounded up to a multiple of 8, as the pipeline
        pads a batch (the mask kept as integers; ``predict`` drops it when every row is valid,
        as the pipeline)."""
        mask = outputs["prompt_embeds_mask"]
        length = trimmed_length(mask)
        return {
            "encoder_hidden_states": outputs["prompt_embeds"][:, :length],
            "encoder_hidden_states_mask": mask[:, :length],
        }

    # ------------------------------------------------------------------ denoiser

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """``-transformer(...)`` as the pipeline calls it: 2x2-packed latents, ``timestep`` cast to
        the latents' dtype then divided by 1000, the text states with their boolean mask (None
        when every row is valid), ``img_shapes``; the output unpacked and negated (the pipeline
        steps the scheduler with ``-noise_pred``). No embedded guidance (``guidance_scale``
        unused)."""
        n, _, _, h, w = noisy_latents.shape
        states = cond["encoder_hidden_states"]
        mask = cond["encoder_hidden_states_mask"].bool()
        hidden = pack_latents(noisy_latents)
        t = timesteps.to(noisy_latents.dtype).expand(n) / 1000
        if n == 0:  # the transformer cannot take an empty batch: one dummy row, then none of it
            hidden = hidden.new_zeros(1, *hidden.shape[1:])
            states = states.new_zeros(1, *states.shape[1:])
            mask, t = mask.new_ones(1, mask.shape[1]), t.new_ones(1)
        out = denoiser(
            hidden_states=hidden,
            timestep=t,
            encoder_hidden_states=states,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[(1, h // 2, w // 2)] * hidden.shape[0],
            return_dict=False,
        )[0]
        return -unpack_latents(out[:n], h, w)

    # ------------------------------------------------------------------ pipelines

    def published(self):
        components = self.published_parts(PUBLISHED_TRANSFORMER, PUBLISHED_TEXT_ENCODER, vae=QWEN_IMAGE_VAE)
        note = (
            "text_encoder is Qwen3-VL-8B-Instruct, counted whole: its vision tower and lm_head never run, "
            "and prompts take hidden_states[-8], so its last 7 decoder layers run for nothing; the "
            "transformer is a mixture of experts (64 routed experts and a shared one in 29 of its 32 "
            "blocks, expert-choice routing), all of it trained and sharded"
        )
        return self.published_as(components, ("NucleusAI/Nucleus-Image", "NucleusMoE-Image"), note=note)


NUCLEUSMOE = NucleusMoE(
    name="nucleusmoe",
    title="NucleusMoE-Image",
    pipeline_class="NucleusMoEImagePipeline",
    text_encoders=(llm_text_encoder("Qwen3VLForConditionalGeneration", "processor"),),
    denoiser_class="NucleusMoEImageTransformer2DModel",
    vae_class="AutoencoderKLQwenImage",
    default_max_sequence_length=1024,  # NucleusMoEImagePipeline.default_max_sequence_length
    # no diffusers LoRA script: the attention projections of both streams (image queries, text keys/values)
    lora_target_modules=("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj", "to_out.0"),
    # 96 tokens: the system prompt takes about 60, the rest is room for the caption
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=96),
)

# NucleusAI/Nucleus-Image's transformer/config.json: the keys that set parameter shapes
PUBLISHED_TRANSFORMER = published_config("nucleusmoe/transformer")
PUBLISHED_TEXT_ENCODER = QWEN3_VL_8B
# The scheduler of the tiny pipeline: Qwen-Image's published one (the pipeline computes mu from
# its bounds; training's sigmas stay linear under dynamic shifting)
NUCLEUSMOE_SCHEDULER = QWEN_IMAGE_SCHEDULER
