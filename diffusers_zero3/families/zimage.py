"""Z-Image (``ZImagePipeline``): a 6 B single-stream DiT conditioned on the second-to-last
hidden states of a frozen Qwen3-4B (chat template, valid tokens only, one variable-length
list per sample); FLUX's 16-channel VAE, shifted and scaled, training on the latents' mode;
per-sample lists of one-frame latents patchified inside the transformer, the timestep as
``1 - sigma`` and a negated output; flow matching as diffusers'
``train_dreambooth_lora_z_image.py`` (uniform timesteps by default).

Neither the transformer (it reads ``x[0]``) nor Qwen3 can take an empty batch: for one,
``predict`` and ``encode_text`` call their model on one dummy row and return none of it
(lockstep kept), so no model of the family is ever called with B=0.
"""

from __future__ import annotations

import torch

from .base import Family
from .common import SequenceLengthValidation, llm_text_encoder, qwen3_chat_prompt, run_args
from .published import QWEN3_4B, VAE_16, published_config


class ZImage(SequenceLengthValidation, Family):
    """Z-Image: templated Qwen3 states, trimmed per sample; list-of-latents transformer calls.
    Validation at the pipeline's CFG, as the script validates (``SequenceLengthValidation``)."""

    def prompt_text(self, spec, caption, tokenizer=None):
        """The text Qwen3 reads: ``tokenizer``'s chat template applied as
        ``ZImagePipeline._encode_prompt`` applies it (one user message, the generation prompt,
        ``enable_thinking=True``); without a tokenizer, what Qwen3-4B's template renders
        (``common.QWEN3_PROMPT``)."""
        return qwen3_chat_prompt(caption, tokenizer, enable_thinking=True)

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """``hidden_states[-2]`` (the second-to-last decoder layer's output, before the final
        norm) as the pipeline takes it, zero where the caption is padded, with its mask. The
        whole model is called (under ZeRO-3 its root forward ends each trace)."""
        n = input_ids.shape[0]
        if n == 0:  # Qwen3 cannot take an empty batch: one dummy row keeps a sharded encoder in lockstep
            input_ids = input_ids.new_zeros(1, input_ids.shape[1])
            attention_mask = (
                None if attention_mask is None else attention_mask.new_ones(1, input_ids.shape[1])
            )
        hidden = encoder(
            input_ids=input_ids,
            attention_mask=None if attention_mask is None else attention_mask.bool(),
            output_hidden_states=True,
        ).hidden_states[-2][:n]
        # no mask: every token valid (the planner sizes outputs so, on the meta device)
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask)[:n].long()
        return {"prompt_embeds": hidden * mask[..., None].to(hidden.dtype), "prompt_embeds_mask": mask}

    def conditioning(self, outputs):
        """The padded states and their mask, trimmed to the batch's longest caption; ``predict``
        keeps each sample's valid rows (the pipeline's list)."""
        mask = outputs["prompt_embeds_mask"]
        length = max(1, int(mask.sum(dim=1).max())) if mask.numel() else mask.shape[1]
        return {"cap_feats": outputs["prompt_embeds"][:, :length], "cap_mask": mask[:, :length]}

    def latent_multiple(self, vae_config):
        return 2 * super().latent_multiple(vae_config)  # the transformer's 2x2 patches

    def sampling_sigmas(self, steps):
        """``get_default_z_image_sigmas``: ``torch.linspace(1, 1 / steps, steps)`` in fp32."""
        return torch.linspace(1.0, 1 / steps, steps).tolist()  # CPU: a list of floats

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """As ``ZImagePipeline.__call__`` without CFG: one ``(C, 1, H, W)`` latent and one
        ``(L_i, D)`` caption per sample in the transformer's dtype, the timestep ``1 - sigma``,
        the stacked output negated (the transformer predicts ``latents - noise``)."""
        n = noisy_latents.shape[0]
        dtype = getattr(denoiser, "module", denoiser).dtype
        feats, mask = cond["cap_feats"], cond["cap_mask"].bool()
        captions = [feats[i][mask[i]].to(dtype) for i in range(n)]
        latents = list(noisy_latents.to(dtype).unsqueeze(2).unbind(dim=0))
        timestep = (1000 - timesteps.expand(n)) / 1000
        if n == 0:  # the transformer reads x[0]: one dummy sample (a one-token caption), then none of it
            latents = [noisy_latents.new_zeros(noisy_latents.shape[1:], dtype=dtype).unsqueeze(1)]
            captions = [feats.new_zeros(1, feats.shape[-1], dtype=dtype)]
            timestep = timesteps.new_ones(1, dtype=torch.float32)
        out = denoiser(latents, timestep, captions, return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)[:n]

    def published(self):
        components = self.published_parts(PUBLISHED_TRANSFORMER, QWEN3_4B, vae=VAE_16)
        note = (
            "text_encoder is Qwen3-4B's decoder (Qwen3Model, tied embeddings, no lm_head); prompts take its "
            "second-to-last hidden states, so its last layer and final norm (101 M) run for nothing"
        )
        checkpoints = ("Tongyi-MAI/Z-Image-Turbo", "Z-Image-Turbo"), ("Tongyi-MAI/Z-Image", "Z-Image")
        return self.published_as(components, *checkpoints, note=note)


ZIMAGE = ZImage(
    name="zimage",
    title="Z-Image",
    pipeline_class="ZImagePipeline",
    text_encoders=(llm_text_encoder("Qwen3Model"),),
    denoiser_class="ZImageTransformer2DModel",
    sample_latents=False,  # train_dreambooth_lora_z_image.py encodes with latent_dist.mode()
    default_max_sequence_length=512,  # the pipeline's and train_dreambooth_lora_z_image.py's
    lora_target_modules=("to_k", "to_q", "to_v", "to_out.0"),  # train_dreambooth_lora_z_image.py
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=32),
)

# Tongyi-MAI/Z-Image-Turbo's configs (Z-Image base has the same shapes): the keys that set them.
PUBLISHED_TRANSFORMER = published_config("zimage/transformer")
# Tongyi-MAI/Z-Image-Turbo's scheduler (the base model's shift is 6.0).
ZIMAGE_TURBO_SCHEDULER = published_config("zimage/scheduler_turbo")
