"""Qwen-Image (``QwenImagePipeline``): a 20 B MMDiT conditioned on the last hidden states of a
frozen Qwen2.5-VL 7 B (text path only) after a prompt template whose first 34 tokens are
dropped; a causal video VAE (``AutoencoderKLQwenImage``, 5-D latents with one frame) with
per-channel latent mean and std; 2x2-packed latents; flow matching as diffusers'
``train_dreambooth_lora_qwen_image.py`` (uniform timesteps by default)."""

from __future__ import annotations

import torch

from .base import ChannelMeanStd, Family
from .common import SequenceLengthValidation, llm_text_encoder, run_args
from .published import published_config
from .wan import PUBLISHED_VAE_21

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROPPED_TEMPLATE_TOKENS = 34  # QwenImagePipeline.prompt_template_encode_start_idx


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's 2x2 patches of one-frame latents: (N, C, 1, H, W) -> (N, H/2 * W/2, 4C), as
    ``QwenImagePipeline._pack_latents``."""
    n, c, _, h, w = latents.shape
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of ``pack_latents`` for latents of ``height`` x ``width`` (latent sides)."""
    n, _, d = packed.shape
    x = packed.view(n, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, d // 4, 1, height, width)


class QwenImage(SequenceLengthValidation, Family):
    """Qwen-Image: templated Qwen2.5-VL states with their mask; one-frame packed latents."""

    def token_length(self, spec, tokenizer, max_sequence_length=None):
        # the pipeline tokenizes template + caption to max_length + the dropped template tokens
        return DROPPED_TEMPLATE_TOKENS + self.sequence_length(spec, tokenizer, max_sequence_length)

    def prompt_text(self, spec, caption, tokenizer=None):
        return PROMPT_TEMPLATE.format(caption)

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """The last hidden states (the decoder's final norm) after the dropped template tokens,
        zero where the caption is padded, with their mask. The whole model is called (under
        ZeRO-3 its root forward ends each trace), with logits for one position only."""
        out = encoder(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1
        )
        if attention_mask is None:  # every token valid (the planner sizes outputs so, on the meta device)
            attention_mask = torch.ones_like(input_ids)
        hidden = out.hidden_states[-1][:, DROPPED_TEMPLATE_TOKENS:]
        mask = attention_mask[:, DROPPED_TEMPLATE_TOKENS:].long()
        return {"prompt_embeds": hidden * mask[..., None].to(hidden.dtype), "prompt_embeds_mask": mask}

    def conditioning(self, outputs):
        """Trimmed to the batch's longest caption, as the pipeline pads a batch."""
        mask = outputs["prompt_embeds_mask"]
        length = max(1, int(mask.sum(dim=1).max())) if mask.numel() else mask.shape[1]
        return {
            "encoder_hidden_states": outputs["prompt_embeds"][:, :length],
            "encoder_hidden_states_mask": mask[:, :length],
        }

    def latent_normalizer(self, vae_config, vae_folder=None):
        return ChannelMeanStd(vae_config)

    def latent_distribution(self, vae, pixels):
        return vae.encode(pixels.unsqueeze(2)).latent_dist  # a video VAE: one frame

    def latent_multiple(self, vae_config):
        return 2 * 2 ** len(vae_config["temperal_downsample"])  # spatial downsampling, then 2x2 packing

    def vae_scale_factor(self, vae_config):
        return 2 ** len(vae_config["temperal_downsample"])  # QwenImagePipeline.vae_scale_factor

    def denoiser_latent_shape(self, vae_config, height, width):
        """One frame of the video VAE's latents: ``(z_dim, 1, h, w)``."""
        f = self.vae_scale_factor(vae_config)
        return (vae_config["z_dim"], 1, height // f, width // f)

    def sampling_sigmas(self, steps):
        """``QwenImagePipeline``'s ``numpy.linspace(1, 1 / steps, steps)``."""
        import numpy

        return numpy.linspace(1.0, 1 / steps, steps).tolist()

    def guided_velocity(self, v_uncond, v_cond, guidance_scale):
        """``QwenImagePipeline``'s true CFG: the combination rescaled, per packed token, to the
        norm of the prompt's prediction (``comb * |cond| / |comb|`` over each token's 4C values)."""
        h, w = v_cond.shape[-2:]
        cond = pack_latents(v_cond)
        comb = pack_latents(v_uncond + guidance_scale * (v_cond - v_uncond))
        scale = torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True)
        return unpack_latents(comb * scale, h, w)

    def decode_latents(self, vae, normalize, latents):
        """The one frame ``vae.decode`` gives (``[:, :, 0]``), as the pipeline takes it."""
        return super().decode_latents(vae, normalize, latents)[:, :, 0]

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        n, _, _, h, w = noisy_latents.shape
        packed = denoiser(
            hidden_states=pack_latents(noisy_latents),
            timestep=(timesteps / 1000).to(noisy_latents.dtype),
            guidance=None,  # Qwen-Image is not guidance-distilled
            encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * n,
            return_dict=False,
        )[0]
        return unpack_latents(packed, h, w)

    def published(self):
        components = self.published_parts(PUBLISHED_TRANSFORMER, PUBLISHED_TEXT_ENCODER, vae=PUBLISHED_VAE)
        return self.published_as(components, ("Qwen/Qwen-Image", "Qwen-Image"))


QWENIMAGE = QwenImage(
    name="qwenimage",
    title="Qwen-Image",
    pipeline_class="QwenImagePipeline",
    text_encoders=(llm_text_encoder("Qwen2_5_VLForConditionalGeneration"),),
    denoiser_class="QwenImageTransformer2DModel",
    vae_class="AutoencoderKLQwenImage",
    default_max_sequence_length=512,  # the pipeline's and train_dreambooth_lora_qwen_image.py's
    lora_target_modules=("to_k", "to_q", "to_v", "to_out.0"),  # train_dreambooth_lora_qwen_image.py
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=32),
)

# Qwen/Qwen-Image's configs: the keys that set parameter shapes.
PUBLISHED_TRANSFORMER = published_config("qwenimage/transformer")
PUBLISHED_VAE = PUBLISHED_VAE_21  # AutoencoderKLQwenImage: Wan 2.1's VAE, its shapes
# Qwen2.5-VL-7B-Instruct: Qwen2-VL-7B's text model (``published.QWEN2_VL_7B``), longer mRoPE
PUBLISHED_TEXT_ENCODER = published_config("qwenimage/qwen2_5_vl_7b")

# The published Qwen/Qwen-Image scheduler (dynamic shifting: training's sigmas stay linear).
QWEN_IMAGE_SCHEDULER = published_config("qwenimage/scheduler")
