"""Ideogram 4 (``Ideogram4Pipeline``): two single-stream DiTs (``Ideogram4Transformer2DModel``):
``transformer`` (conditional) and ``unconditional_transformer`` (the negative branch of its
asymmetric CFG, which sees the image tokens only), conditioned per token on thirteen hidden
states of a frozen Qwen3-VL 8 B (``Qwen3VLModel``, text path only: the raw outputs of decoder
layers 0, 3, ..., 33 and 35, interleaved per feature); Flux.2's VAE (``AutoencoderKLFlux2``:
the latent mode, 2x2 patches packed ``(dy, dx, c)`` with ``c`` fastest, batch-normalised by the
VAE's stored statistics); flow matching as diffusers' ``train_dreambooth_lora_ideogram4.py``:
sigma drawn directly from a resolution-aware logit-normal (mean ``0.5 log(pixels / 512^2)``, std
1.5), model time ``1 - sigma``, target ``x0 - noise`` (``predict`` returns its negation, the
objective's ``noise - latents``).

The prompt is the tokenizer's chat template of one user turn, left-padded to
``max_sequence_length`` (pad id 0, text positions ``0..n-1`` on the real tokens, as
``Ideogram4Pipeline.encode_prompt``); the transformer reads one packed sequence
``[left-pad | text | image tokens]`` with 3-axis positions, segment ids and role indicators
(``packed_ids``). ``--train_denoisers`` picks what trains: ``transformer`` (default: the
script's), ``unconditional`` (``unconditional_transformer`` on the same loss, called as the
pipeline's negative branch: the image tokens alone, zero text features) or ``both`` (each its
own ZeRO-3 engine, one of them a step, alternating). A denoiser not trained, and an optional
``prompt_enhancer_head``, are copied unchanged into the output; validation reloads the
untrained denoiser (``pipeline_denoisers``).

Neither Qwen3-VL nor the transformer takes an empty batch: for one, ``encode_text`` and
``predict`` call their model on one dummy row and return none of it (lockstep kept).
"""

from __future__ import annotations

import math

import torch

from .base import DenoiserSchedule, Family
from .common import llm_text_encoder, run_args
from .flux2 import PUBLISHED_VAE as FLUX2_VAE
from .flux2 import BatchNormLatents, pack_latents, unpack_latents
from .objectives import Objective, _per_sample, rectified_flow_loss, sample_noise
from .published import QWEN3_VL_8B, published_config

# pipeline_ideogram4.QWEN3_VL_ACTIVATION_LAYERS: decoder layers whose raw outputs are stacked
ACTIVATION_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 35)
PATCH_SIZE = 2  # Ideogram4Pipeline.patch_size
# Pixels per image token of the published VAE (8x) and patches (2x): the resolution-aware mean
# of the sigma density reads the image size from the token grid with it.
PATCH_PIXELS = 16
UNCONDITIONAL = "unconditional_transformer"
# --train_denoisers: the denoiser folders each choice trains (the script trains transformer)
TRAIN_DENOISERS = {
    "transformer": ("transformer",),
    "unconditional": (UNCONDITIONAL,),
    "both": ("transformer", UNCONDITIONAL),
}
# transformer_ideogram4's role indicators and image position offset
SEQUENCE_PADDING_INDICATOR, OUTPUT_IMAGE_INDICATOR, LLM_TOKEN_INDICATOR = -1, 2, 3
IMAGE_POSITION_OFFSET = 65536
# What Qwen3-VL's chat template renders for one user turn and the generation prompt.
CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPT_SUFFIX = CHAT_PROMPT.split("{}")[1]


# -------------------------------------------------------------------------------- latents


def patchify_latents(latents: torch.Tensor) -> torch.Tensor:
    """2x2 patches into channels, (N, C, H, W) -> (N, 4C, H/2, W/2), channel ``(dy*2 + dx)*C + c``
    (the script's ``patchify_latents``; Flux.2 orders them ``c*4 + dy*2 + dx``)."""
    n, c, h, w = latents.shape
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(n, 4 * c, h // 2, w // 2)


def unpatchify_latents(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of ``patchify_latents`` (the pipeline's decode permutation)."""
    n, c4, h, w = latents.shape
    x = latents.reshape(n, 2, 2, c4 // 4, h, w).permute(0, 3, 4, 1, 5, 2)
    return x.reshape(n, c4 // 4, h * 2, w * 2)


class PatchBatchNormLatents(BatchNormLatents):
    """Flux.2's batch-norm statistics over Ideogram 4's patch layout: ``(z - mean) / std`` of the
    patchified latents in fp32 (the script's fp32 statistics promote them); ``inverse``: ``z * std
    + mean`` in ``latents``' dtype, then unpatchified (the pipeline's decode)."""

    patchify = staticmethod(patchify_latents)
    unpatchify = staticmethod(unpatchify_latents)


# -------------------------------------------------------------------------------- the packed sequence


def text_positions(mask: torch.Tensor) -> torch.Tensor:
    """``0..n-1`` on each row's real tokens and 0 on its padding, (B, L): the pipeline's text
    position ids (left padding)."""
    mask = mask.long()
    return torch.where(mask.bool(), mask.cumsum(dim=-1) - 1, torch.zeros_like(mask))


def image_positions(grid_height: int, grid_width: int, device) -> torch.Tensor:
    """``(0, row, column) + IMAGE_POSITION_OFFSET`` of the image tokens, (h*w, 3) int64."""
    rows = torch.arange(grid_height, device=device).view(-1, 1).expand(grid_height, grid_width).reshape(-1)
    cols = torch.arange(grid_width, device=device).view(1, -1).expand(grid_height, grid_width).reshape(-1)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1) + IMAGE_POSITION_OFFSET


def packed_ids(mask: torch.Tensor, grid_height: int, grid_width: int) -> tuple[torch.Tensor, ...]:
    """``(position_ids, segment_ids, indicator)`` of ``[left-pad | text | image]`` for text masks
    ``(B, L)`` (left-padded): ``Ideogram4Pipeline._prepare_ids`` without its host loop."""
    b, length = mask.shape
    device, real = mask.device, mask.bool()
    text = text_positions(mask).unsqueeze(-1).expand(b, length, 3)
    image = image_positions(grid_height, grid_width, device).unsqueeze(0).expand(b, -1, -1)
    position_ids = torch.cat([text, image], dim=1)
    n_image = grid_height * grid_width
    pad = torch.full_like(mask, SEQUENCE_PADDING_INDICATOR, dtype=torch.long)
    one = torch.ones(b, n_image, dtype=torch.long, device=device)
    segment_ids = torch.cat([torch.where(real, torch.ones_like(pad), pad), one], dim=1)
    text_role = torch.where(real, torch.full_like(pad, LLM_TOKEN_INDICATOR), torch.zeros_like(pad))
    indicator = torch.cat([text_role, one * OUTPUT_IMAGE_INDICATOR], dim=1)
    return position_ids, segment_ids, indicator


def resolution_aware_mu(height: int, width: int, base_mu: float) -> float:
    """``base_mu + 0.5 log(pixels / 512^2)`` (the pipeline's ``_resolution_aware_mu``)."""
    return base_mu + 0.5 * math.log(height * width / (512 * 512))


# -------------------------------------------------------------------------------- objective


class Ideogram4Objective(Objective):
    """The script's flow matching: sigma drawn from ``compute_density_for_timestep_sampling``
    (the resolution-aware logit mean of the token grid) and used directly (no scheduler grid),
    ``(1 - sigma) x0 + sigma noise``, ``compute_loss_weighting_for_sd3``, target
    ``noise - latents`` (``predict`` negates the transformer's ``x0 - noise``); the noise is drawn
    in the script's token layout. The timesteps
    handed to ``predict`` are ``sigma * 1000`` and the sigma used is read back from them, so the
    noisy input and the model time ``1 - t / 1000`` agree exactly."""

    def sigmas(self, latents: torch.Tensor, generators=None) -> torch.Tensor:
        """One sigma per sample (this rank's RNG, or each sample's generator), in fp32 on the
        latents' device."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        s = self.settings
        h, w = latents.shape[-2] * PATCH_PIXELS, latents.shape[-1] * PATCH_PIXELS
        density = s.density(logit_mean=resolution_aware_mu(h, w, s.logit_mean))
        if generators is not None:
            # CPU: drawn with each sample's CPU generator, then moved (_per_sample)
            return _per_sample(
                lambda g: compute_density_for_timestep_sampling(batch_size=1, generator=g, **density)[0],
                generators,
                latents.device,
                torch.float32,
            )
        return compute_density_for_timestep_sampling(
            batch_size=latents.shape[0], device=latents.device, **density
        )

    def loss(self, predict, latents, generators=None, reduction="mean", loss_weights=None):
        """Noise, then sigmas; one value per sample with ``reduction="none"``."""
        s = self.settings
        # drawn in the script's token layout (N, h*w, C), so the same RNG gives the same noise
        tokens = pack_latents(latents)
        noise = sample_noise(tokens, 0.0, generators)  # contiguous, as the script's randn_like
        noise = unpack_latents(noise, *latents.shape[-2:])
        timesteps = self.sigmas(latents, generators).float() * 1000
        sigmas = (timesteps / 1000).to(latents.dtype).view(-1, *([1] * (latents.ndim - 1)))
        return rectified_flow_loss(
            predict, latents, noise, timesteps, sigmas,
            weighting_scheme=s.weighting_scheme, reduction=reduction, loss_weights=loss_weights,
        )  # fmt: skip


# -------------------------------------------------------------------------------- family


class TrainedInTurn(DenoiserSchedule):
    """Ideogram 4's trained transformers, one optimizer step each in turn; the loss names it."""

    def loss_kwargs(self, name: str) -> dict:
        return {"trained": name}

    def describe(self) -> str:
        return f"denoisers trained: {', '.join(self.folders)}"


class Ideogram4(Family):
    """Ideogram 4: thirteen interleaved Qwen3-VL states per token, left-padded; one packed
    text+image sequence; the script's logit-normal sigmas."""

    # the denoisers an Ideogram4Pipeline holds (validation reloads the one not trained)
    pipeline_denoisers: tuple[str, ...] = ("transformer", UNCONDITIONAL)

    denoiser_choice_flag = "--train_denoisers"

    def trained_denoisers(self, choice: str | None) -> tuple[str, ...]:
        """The denoiser folders ``--train_denoisers`` trains (default ``transformer``, the script's)."""
        return TRAIN_DENOISERS[choice or "transformer"]

    def denoiser_schedule(self, folders, source, noise_scheduler, settings, seed):
        """Both trained: the steps in turn; each loss says which one it trains (``trained``)."""
        return TrainedInTurn(folders)

    def component_library(self, name):
        if name in self.pipeline_denoisers:
            return "diffusers", self.denoiser_class
        return super().component_library(name)

    # ------------------------------------------------------------------ prompts

    def prompt_text(self, spec, caption, tokenizer=None):
        """The chat template of one user turn with a text part and the generation prompt (the
        pipeline's ``apply_chat_template``); without a tokenizer, what Qwen3-VL's renders."""
        if tokenizer is None:
            return CHAT_PROMPT.format(caption)
        messages = [{"role": "user", "content": [{"type": "text", "text": caption}]}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def tokenize(self, tokenizers, captions, max_sequence_length=None):
        """Each rendered prompt tokenized without special tokens and left-padded with id 0 to
        ``max_sequence_length``, as ``encode_prompt``; a longer one (the pipeline refuses it)
        keeps its head and the template's closing tokens."""
        spec = self.text_encoders[0]
        if spec.name not in tokenizers or not captions:
            return super().tokenize(tokenizers, captions, max_sequence_length)
        tokenizer = tokenizers[spec.name]
        length = self.token_length(spec, tokenizer, max_sequence_length)
        suffix = len(tokenizer(PROMPT_SUFFIX, add_special_tokens=False)["input_ids"])
        # CPU: like the tokenizer's ids; encode_texts moves ids to the encoder's device
        ids = torch.zeros(len(captions), length, dtype=torch.long)
        mask = torch.zeros(len(captions), length, dtype=torch.long)  # CPU: as the ids
        for b, caption in enumerate(captions):
            text = self.prompt_text(spec, caption, tokenizer)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(tokens) > length:
                tokens = tokens[: length - suffix] + tokens[len(tokens) - suffix :]
            ids[b, length - len(tokens) :] = torch.as_tensor(tokens)
            mask[b, length - len(tokens) :] = 1
        return {spec.input_key: ids, spec.mask_key: mask}

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """The raw outputs of the thirteen activation layers (forward hooks: the last one is the
        final decoder layer before the norm) interleaved per feature, ``(B, L, 13 H)``
        (``stack(...).permute(1, 2, 3, 0)``), zero on the padding, with the mask: the pipeline's
        ``encode_prompt`` text features. The whole model is called (under ZeRO-3 its root
        forward ends each trace)."""
        n = input_ids.shape[0]
        if n == 0:  # Qwen3-VL cannot take an empty batch: one dummy row keeps a sharded encoder in lockstep
            input_ids, attention_mask = input_ids.new_zeros(1, input_ids.shape[1]), None
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        meta = input_ids.is_meta
        model = getattr(encoder, "module", encoder)
        layers = model.language_model.layers
        captured: dict[int, torch.Tensor] = {}

        def keep(index):
            def hook(module, args, output):
                captured[index] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [layers[i].register_forward_hook(keep(i)) for i in ACTIVATION_LAYERS]
        try:
            positions = text_positions(mask)
            encoder(
                input_ids=input_ids,
                attention_mask=None if meta else mask,
                position_ids=positions.unsqueeze(0).expand(4, -1, -1),
                use_cache=meta,
            )
        finally:
            for handle in handles:
                handle.remove()
        stacked = torch.stack([captured[i] for i in ACTIVATION_LAYERS], dim=0).permute(1, 2, 3, 0)
        features = stacked.reshape(*stacked.shape[:2], -1)
        features = features * mask.to(features.dtype).unsqueeze(-1)
        return {"prompt_embeds": features[:n], "prompt_embeds_mask": mask[:n].long()}

    def conditioning(self, outputs):
        """The text rows and their (integer) mask; ``predict`` packs them with the image."""
        return {
            "encoder_hidden_states": outputs["prompt_embeds"],
            "encoder_attention_mask": outputs["prompt_embeds_mask"],
        }

    # ------------------------------------------------------------------ latents

    def latent_normalizer(self, vae_config, vae_folder=None):
        if vae_folder is None:
            raise ValueError(f"{self.title}'s latent statistics are VAE weights: the VAE folder is needed")
        return PatchBatchNormLatents.from_folder(vae_config, vae_folder)

    def latent_multiple(self, vae_config):
        return PATCH_SIZE * super().latent_multiple(vae_config)

    def denoiser_latent_shape(self, vae_config, height, width):
        f = PATCH_SIZE * self.vae_scale_factor(vae_config)
        return (4 * vae_config["latent_channels"], height // f, width // f)

    def image_seq_len(self, latent_shape, vae_config, denoiser_config):
        return latent_shape[-2] * latent_shape[-1]

    def objective(self, noise_scheduler, settings):
        return Ideogram4Objective(noise_scheduler, settings)

    # ------------------------------------------------------------------ denoiser

    def objective_loss(self, denoiser, objective, latents, cond, generators=None, reduction="mean",
                       loss_weights=None, *, trained: str = "transformer", **denoiser_kwargs):  # fmt: skip
        """``Family.objective_loss`` for ``trained`` (a folder): ``transformer`` called as
        ``predict``, or ``unconditional_transformer`` on the same noisy latents and sigmas called
        as the pipeline's negative branch (``predict_unconditional``: the image alone, zero text
        features): the loss that makes it the velocity the pipeline's asymmetric CFG blends in.
        ``Family.loss`` passes ``trained`` on. Collective when the denoiser is sharded."""
        if trained != UNCONDITIONAL:
            return super().objective_loss(
                denoiser, objective, latents, cond, generators, reduction, loss_weights, **denoiser_kwargs
            )
        return objective.loss(
            lambda noisy, t: self.predict_unconditional(denoiser, noisy, t),
            latents,
            generators,
            reduction,
            loss_weights=loss_weights,
        )

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """As the script (and the pipeline's conditional pass) call ``transformer``: zero latent
        rows for the text region, then the packed image tokens; the text features then zero rows
        for the image; ``timestep = 1 - t / 1000``; ``packed_ids``; inputs in the transformer's
        dtype (the script's ``--disable_training_autocast``). The image rows of the output, the
        velocity ``x0 - noise``, are returned negated (``noise - x0``) and unpacked. No embedded
        guidance (``guidance_scale`` is unused)."""
        n, c, h, w = noisy_latents.shape
        dtype = getattr(denoiser, "module", denoiser).dtype
        states, mask = cond["encoder_hidden_states"], cond["encoder_attention_mask"]
        length = states.shape[1]
        t = (1.0 - timesteps.float() / 1000).expand(n)
        tokens = pack_latents(noisy_latents)
        if n == 0:  # the transformer cannot take an empty batch: one dummy row, then none of it
            tokens, t = tokens.new_zeros(1, h * w, c), t.new_ones(1)
            states, mask = states.new_zeros(1, *states.shape[1:]), mask.new_ones(1, length)
        rows = tokens.shape[0]
        hidden = torch.cat([tokens.new_zeros(rows, length, c), tokens], dim=1).to(dtype)
        text = torch.cat([states, states.new_zeros(rows, h * w, states.shape[-1])], dim=1).to(dtype)
        position_ids, segment_ids, indicator = packed_ids(mask, h, w)
        out = denoiser(
            hidden_states=hidden,
            timestep=t.to(dtype),
            encoder_hidden_states=text,
            position_ids=position_ids,
            segment_ids=segment_ids,
            indicator=indicator,
            return_dict=False,
        )[0]
        return -unpack_latents(out[:n, length:], h, w)

    def predict_unconditional(self, denoiser, noisy_latents, timesteps):
        """As the pipeline calls ``unconditional_transformer``: the image tokens alone with zero
        text features, image positions, one segment, the image indicator; returned as
        ``predict`` returns (``noise - x0``, unpacked)."""
        n, c, h, w = noisy_latents.shape
        module = getattr(denoiser, "module", denoiser)
        dtype, device = module.dtype, noisy_latents.device
        rows = max(n, 1)  # one dummy row for an empty batch
        tokens = pack_latents(noisy_latents) if n else noisy_latents.new_zeros(1, h * w, c)
        t = (1.0 - timesteps.float() / 1000).expand(n) if n else timesteps.new_ones(1, dtype=torch.float32)
        out = denoiser(
            hidden_states=tokens.to(dtype),
            timestep=t.to(dtype),
            encoder_hidden_states=torch.zeros(
                rows, h * w, module.config.llm_features_dim, dtype=dtype, device=device
            ),
            position_ids=image_positions(h, w, device).unsqueeze(0).expand(rows, -1, -1),
            segment_ids=torch.ones(rows, h * w, dtype=torch.long, device=device),
            indicator=torch.full((rows, h * w), OUTPUT_IMAGE_INDICATOR, dtype=torch.long, device=device),
            return_dict=False,
        )[0]
        return -unpack_latents(out[:n], h, w)

    def validation_kwargs(self, max_sequence_length, guidance_scale):
        """The pipeline's call with one constant guidance (its default is a 48-step schedule)."""
        return {
            "max_sequence_length": max_sequence_length or self.default_max_sequence_length,
            "guidance_scale": 7.0 if guidance_scale is None else guidance_scale,
            "guidance_schedule": None,
        }

    # ------------------------------------------------------------------ pipelines

    def pipeline(
        self, denoiser, vae, text_encoders, tokenizers, scheduler, *, unconditional_transformer=None
    ):
        """``Ideogram4Pipeline`` around these modules; ``denoiser`` is ``transformer``, or a dict
        of both denoisers (validation). No ``prompt_enhancer_head`` (training never runs it)."""
        import diffusers

        if isinstance(denoiser, dict):
            denoiser, unconditional_transformer = (
                denoiser.get("transformer"),
                denoiser.get(UNCONDITIONAL, unconditional_transformer),
            )
        if denoiser is None or unconditional_transformer is None:
            raise ValueError(f"a {self.title} pipeline needs both transformer and {UNCONDITIONAL}")
        return diffusers.Ideogram4Pipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=tokenizers["text_encoder"],
            transformer=denoiser,
            unconditional_transformer=unconditional_transformer,
        )

    def published(self):
        components = self.published_parts(PUBLISHED_TRANSFORMER, PUBLISHED_TEXT_ENCODER, vae=FLUX2_VAE)
        note = (
            "text_encoder is Qwen3-VL-8B-Instruct's Qwen3VLModel (no lm_head), counted whole: its vision tower "
            "never runs; unconditional_transformer (transformer's shapes) is not planned: by default it is copied "
            "into the output, and --train_denoisers both makes it a second engine of transformer's size"
        )
        return self.published_as(components, ("ideogram-ai/ideogram-v4", "Ideogram 4"), note=note)


IDEOGRAM4 = Ideogram4(
    name="ideogram4",
    title="Ideogram 4",
    pipeline_class="Ideogram4Pipeline",
    text_encoders=(llm_text_encoder("Qwen3VLModel"),),
    denoiser_class="Ideogram4Transformer2DModel",
    vae_class="AutoencoderKLFlux2",
    sample_latents=False,  # the script encodes with latent_dist.mode()
    default_max_sequence_length=2048,  # the pipeline's and the script's
    default_weighting_scheme="logit_normal",  # the script's (its sigma density)
    # train_dreambooth_lora_ideogram4.py's default targets
    lora_target_modules=("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"),
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=32),
)

# ideogram-ai/ideogram-v4's transformer: Ideogram4Transformer2DModel's defaults (34 blocks at width
# 4608; text features 13 x 4096).
PUBLISHED_TRANSFORMER = published_config("ideogram4/transformer")
PUBLISHED_TEXT_ENCODER = QWEN3_VL_8B  # as a head-less Qwen3VLModel
