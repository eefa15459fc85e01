"""HiDream-I1 (``HiDreamImagePipeline``): a 17 B sparse DiT (16 double- and 32 single-stream
blocks, each feed-forward a mixture of 4 routed SwiGLU experts, 2 per token, plus a shared one)
conditioned on the projected pooled outputs of two CLIPs (``pooled_embeds``), T5-XXL's states
(``encoder_hidden_states_t5``) and every decoder layer of a Llama-3.1-8B (supplied from its own
folder: ``--component text_encoder_4=...``), stacked (``encoder_hidden_states_llama3``); Flux.1's
VAE, unpacked latents (the model patchifies), the timestep as sigma x 1000, flow matching.

The MoE runs its ordinary train/eval path. diffusers' ``train_dreambooth_lora_hidream.py``
loads the transformer with ``force_inference_output=True``, so that training runs the
inference routing (``moe_infer``, under ``torch.no_grad``): same loss, but no gradient reaches
the routed experts or the gate, and LoRA gradients reach earlier blocks only through the
shared expert. That suits its LoRA (attention only); full fine-tuning needs gradients through
every expert and the gate, so here train mode calls every expert (lockstep-safe under ZeRO-3;
the blocks are leaf modules anyway, for the data-dependent eval path) and ``predict`` maps its
``(N, C, S, p*p)`` output back to the latents' shape. The gate's auxiliary loss is dropped, as
by diffusers' model and script.
"""

from __future__ import annotations

import inspect

import torch

from .base import Family, TextEncoderSpec
from .common import GuidedValidation, run_args
from .published import CLIP_BIGG, CLIP_L, T5_XXL, VAE_16, published_config

CLIP_MAX_TOKENS = 218  # HiDreamImagePipeline._get_clip_prompt_embeds: min(max_sequence_length, 218)
CLIP_ENCODERS = ("text_encoder", "text_encoder_2")
TRAINING_SHIFT = 3.0  # train_dreambooth_lora_hidream.py: FlowMatchEulerDiscreteScheduler(shift=3.0)


def unpatchify_training_output(out: torch.Tensor, height: int, width: int, patch_size: int) -> torch.Tensor:
    """The transformer's train-mode output ``(N, C, S, p*p)`` (S the patches, or ``max_seq``
    zero-padded ones for non-square latents) as its eval output ``(N, C, H, W)``: the same
    patch order as ``HiDreamImageTransformer2DModel.unpatchify``'s eval branch."""
    n, c = out.shape[:2]
    ph, pw = height // patch_size, width // patch_size
    return (
        out[:, :, : ph * pw]
        .reshape(n, c, ph, pw, patch_size, patch_size)
        .permute(0, 1, 2, 4, 3, 5)
        .reshape(n, c, height, width)
    )


def _takes(module, argument: str) -> bool:
    """Whether the forward of ``module`` (or of the model a wrapper holds) names ``argument``."""
    model = getattr(module, "module", module)
    return argument in inspect.signature(type(model).forward).parameters


class HiDream(GuidedValidation, Family):
    """HiDream-I1: pooled CLIPs, T5 states, all Llama layers; a mixture-of-experts DiT."""

    def load_tokenizers(self, source, sources=None):
        """As the base, with the Llama tokenizer padding with its EOS token (``<|eot_id|>``):
        Llama-3 has no pad token, and the pipeline (``__init__``) and the script set it so."""
        tokenizers = super().load_tokenizers(source, sources)
        llama = tokenizers.get("text_encoder_4")
        if llama is not None:
            llama.pad_token = llama.eos_token
        return tokenizers

    def sequence_length(self, spec, tokenizer, max_sequence_length=None):
        """``--max_sequence_length`` (default 128) for every encoder, at most 218 for the CLIPs
        (the pipeline pads them to ``min(max_sequence_length, 218)``, not to their tokenizers'
        77). The pipeline also caps T5 and Llama at their tokenizers' ``model_max_length``
        (512 and 131072 for the published ones); that cap is left out, as the planner passes
        a placeholder length for encoders without tokenizer files."""
        length = max_sequence_length or self.default_max_sequence_length
        return min(length, CLIP_MAX_TOKENS) if spec.name in CLIP_ENCODERS else length

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """Each encoder as the pipeline calls it, the root module each time (under ZeRO-3 its
        forward ends each trace). CLIPs: the projected pooled output (no mask: the pooled
        token is the first EOS, and attention is causal, so padding does not reach it). T5:
        every position of the last hidden states, with its mask. Llama: the outputs of all
        decoder layers (the last one after the final norm), with its mask, stacked
        batch-first ``(N, layers, L, D)`` so that rows cache alone; logits for one position
        only."""
        if name in CLIP_ENCODERS:
            k = 1 if name == "text_encoder" else 2
            return {f"pooled_{k}": encoder(input_ids=input_ids).text_embeds}
        if name == "text_encoder_3":
            return {
                "t5_embeds": encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            }
        extra = {"logits_to_keep": 1} if _takes(encoder, "logits_to_keep") else {}
        out = encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **extra)
        return {"llama_embeds": torch.stack(out.hidden_states[1:], dim=1)}

    def conditioning(self, outputs):
        """The transformer's text inputs: ``pooled_embeds`` (both CLIPs concatenated),
        ``encoder_hidden_states_t5`` and ``encoder_hidden_states_llama3`` (layers first, the
        batch on dimension 1, as the pipeline stacks them)."""
        return {
            "pooled_embeds": torch.cat([outputs["pooled_1"], outputs["pooled_2"]], dim=-1),
            "encoder_hidden_states_t5": outputs["t5_embeds"],
            "encoder_hidden_states_llama3": outputs["llama_embeds"].transpose(0, 1),
        }

    def latent_multiple(self, vae_config):
        return 2 * super().latent_multiple(vae_config)  # the transformer's 2x2 patches

    def load_noise_scheduler(self, source):
        """The training scheduler as diffusers' script builds it: flow-matching Euler with
        shift 3.0, whatever the folder's scheduler is (HiDream-I1-Full ships UniPC)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(
            source, subfolder="scheduler", shift=TRAINING_SHIFT
        )

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """``-transformer(...)`` (it predicts ``latents - noise``; the pipeline and the script
        negate it), timesteps as given (0 to 1000: the model embeds them unscaled), the
        train-mode layout mapped back to the latents' shape."""
        _, _, h, w = noisy_latents.shape
        out = denoiser(
            hidden_states=noisy_latents,
            timesteps=timesteps,
            encoder_hidden_states_t5=cond["encoder_hidden_states_t5"],
            encoder_hidden_states_llama3=cond["encoder_hidden_states_llama3"],
            pooled_embeds=cond["pooled_embeds"],
            return_dict=False,
        )[0]
        model = getattr(denoiser, "module", denoiser)
        if model.training and not model.config.force_inference_output:
            out = unpatchify_training_output(out, h, w, model.config.patch_size)
        return -out

    def prepare_validation_pipeline(self, pipeline, resolution: int):
        """The pipeline set to generate ``resolution`` x ``resolution`` images: it rescales
        every request to the area ``(default_sample_size * vae_scale_factor)^2`` (1024^2),
        so the default sample size becomes the training resolution in latent pixels."""
        pipeline.default_sample_size = max(1, resolution // pipeline.vae_scale_factor)
        return pipeline

    def published(self):
        components = self.published_parts(
            PUBLISHED_TRANSFORMER, PUBLISHED_CLIP_L, PUBLISHED_CLIP_G, T5_XXL, PUBLISHED_LLAMA, vae=VAE_16
        )
        return self.published_as(
            components,
            ("HiDream-ai/HiDream-I1-Full", "HiDream-I1-Full"),
            note="text_encoder_4 (Llama-3.1-8B-Instruct, 8.03 B with its lm_head, which never runs) is not "
            "in the HiDream-I1 repos: give it with --component text_encoder_4=meta-llama/Llama-3.1-8B-Instruct "
            "(tokenizer_4 comes with it); the transformer is a mixture of experts, 17.11 B parameters in all "
            "(all trained and sharded), 12.01 B active per token (2 of 4 routed experts in each of 48 blocks)",
        )


HIDREAM = HiDream(
    name="hidream",
    title="HiDream-I1",
    pipeline_class="HiDreamImagePipeline",
    text_encoders=(
        TextEncoderSpec(
            "text_encoder",
            "CLIPTextModelWithProjection",
            "tokenizer",
            "input_ids",
            uses_max_sequence_length=True,
        ),
        TextEncoderSpec(
            "text_encoder_2",
            "CLIPTextModelWithProjection",
            "tokenizer_2",
            "input_ids_2",
            uses_max_sequence_length=True,
        ),
        TextEncoderSpec(
            "text_encoder_3", "T5EncoderModel", "tokenizer_3", "input_ids_3", uses_max_sequence_length=True
        ),
        TextEncoderSpec(
            "text_encoder_4", "LlamaForCausalLM", "tokenizer_4", "input_ids_4", uses_max_sequence_length=True
        ),
    ),
    denoiser_class="HiDreamImageTransformer2DModel",
    default_max_sequence_length=128,  # the pipeline's and train_dreambooth_lora_hidream.py's
    lora_target_modules=("to_k", "to_q", "to_v", "to_out"),  # train_dreambooth_lora_hidream.py
    default_run_args=run_args(
        text_encoder="replicate",
        text_encoder_2="replicate",
        text_encoder_3="shard",
        text_encoder_4="shard",
        vae="replicate",
        max_sequence_length=32,
    )
    + ("--component", "text_encoder_4={pipeline}-llama"),
)

# HiDream-ai/HiDream-I1-Full (Dev and Fast share the shapes): the keys that set parameter shapes.
# caption_channels: T5-XXL's d_model, Llama-3.1-8B's hidden size; text_emb_dim: CLIP-L's projection
# + CLIP-G's; llama_layers: one Llama layer per block (16 double + 32 single).
PUBLISHED_TRANSFORMER = published_config("hidream/transformer")
PUBLISHED_CLIP_L = dict(CLIP_L, max_position_embeddings=248)  # HiDream's longer CLIPs (128-token prompts)
PUBLISHED_CLIP_G = dict(CLIP_BIGG, max_position_embeddings=248)
PUBLISHED_LLAMA = published_config("hidream/llama_3_1_8b")  # meta-llama/Llama-3.1-8B-Instruct
