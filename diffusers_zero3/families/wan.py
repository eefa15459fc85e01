"""Wan 2.1 and Wan 2.2 (``WanPipeline``): video DiTs (``WanTransformer3DModel``) cross-attending
to umT5-XXL's last hidden states, kept to each caption's tokens and zero-padded to 512; a causal
video VAE (``AutoencoderKLWan``: 5-D latents, 1 + 4k frames, per-channel mean and std), trained on
its posterior mean; flow matching (target ``noise - latents``) at the published scheduler's shift
with logit-normal timesteps (musubi-tuner's Wan recipe). Wan 2.2 A14B holds two experts:
``transformer`` for ``t >= boundary_ratio * 1000``, ``transformer_2`` below; TI2V-5B, per-token t."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from .base import ChannelMeanStd, DenoiserSchedule, Family, PublishedConfig, TextEncoderSpec
from .common import GuidedValidation, run_args
from .objectives import (
    WEIGHTING_SCHEMES,
    Objective,
    flow_matching_loss,
    rectified_flow_loss,
    sample_noise,
    table_indices,
    table_points,
)
from .published import T5_V11_ENCODER, published_config

HIGH, LOW = "transformer", "transformer_2"  # Wan 2.2's high-noise and low-noise experts
TRAIN_EXPERTS = {"high": (HIGH,), "low": (LOW,), "both": (HIGH, LOW)}  # --train_experts
MAX_REDRAWS = 10_000  # rejection sampling of an expert's timesteps gives up after this many rounds

# diffusers' scripts/convert_wan_to_diffusers.py writes this scheduler into every T2V folder
# (flow_shift 5.0 for TI2V-5B); the training scheduler takes its shift.
WAN_SCHEDULER = published_config("wan/scheduler")


# -------------------------------------------------------------------------------- folders


def _model_index(folder: str | os.PathLike) -> dict:
    return json.loads((Path(folder) / "model_index.json").read_text())


def is_two_expert(folder: str | os.PathLike) -> bool:
    """True for a Wan 2.2 A14B folder: its ``model_index.json`` names a ``transformer_2`` (a Wan
    2.1 or TI2V-5B folder has no such key, or ``[null, null]``, the value ``save_pretrained``
    writes for an absent optional component)."""
    entry = _model_index(folder).get(LOW)
    return isinstance(entry, list) and len(entry) == 2 and all(entry)


def wan_family(folder: str | os.PathLike) -> Wan:
    """The Wan family of a ``WanPipeline`` folder: ``WAN22`` with two experts, ``WAN22_5B``
    when the pipeline expands timesteps per token (``expand_timesteps``), ``WAN`` otherwise
    (``Wan.matches``)."""
    index = _model_index(folder)
    return next(f for f in (WAN22, WAN22_5B, WAN) if f.matches(index))


def boundary_timestep(boundary_ratio: float | None, num_train_timesteps: int = 1000) -> float | None:
    """The timestep where Wan 2.2 switches experts, as ``WanPipeline.__call__`` computes it."""
    return None if boundary_ratio is None else boundary_ratio * num_train_timesteps


def expert_for(timesteps: torch.Tensor, boundary: float | None) -> list[str]:
    """Which expert denoises each timestep: ``transformer`` where ``t >= boundary`` (high noise,
    and every timestep without a boundary), ``transformer_2`` below it, as the pipeline's loop."""
    if boundary is None:
        return [HIGH] * len(timesteps)
    return [HIGH if float(t) >= boundary else LOW for t in timesteps]


def expert_of_step(seed: int, step: int, p_high: float) -> str:
    """The expert that ``--train_experts both`` trains at optimizer step ``step`` (every
    micro-batch of the step: each expert is its own engine, whose gradient accumulation counts
    micro-batches): the same on every rank (drawn from ``(seed, step)``, so that each ZeRO-3
    engine is called in lockstep), the high one with probability ``p_high``
    (``Wan.expert_probability``), so that over the steps the timesteps follow the unrestricted
    density."""
    import hashlib
    import random

    digest = hashlib.sha256(f"{seed}-{step}-expert".encode()).digest()
    return HIGH if random.Random(digest).random() < p_high else LOW


class ExpertSchedule(DenoiserSchedule):
    """Wan's trained experts: with both (``--train_experts both``) each optimizer step draws
    one, the high one with probability ``p_high`` (``expert_of_step``); each expert's loss draws
    its timesteps on its side of ``boundary`` (its objective: ``objective_kwargs``)."""

    def __init__(self, folders: tuple[str, ...], boundary: float | None, p_high: float, seed: int):
        super().__init__(folders)
        self.boundary, self.p_high, self.seed = boundary, p_high, seed

    def of_step(self, step: int) -> str:
        if len(self.folders) == 1:
            return self.folders[0]
        return expert_of_step(self.seed, step, self.p_high)

    def objective_kwargs(self, name: str) -> dict:
        return {"expert": name, "boundary": self.boundary}

    def describe(self) -> str:
        return f"experts trained: {', '.join(self.folders)} (boundary at timestep {self.boundary:g})"


# -------------------------------------------------------------------------------- objective


class ExpertFlowMatchingObjective(Objective):
    """``objectives.FlowMatchingObjective`` with timesteps kept on one side of Wan 2.2's boundary:
    draws of the density that land on the other side are drawn again (rejection: the density
    restricted to the expert's timesteps, its shape kept, as musubi-tuner's
    ``--min_timestep/--max_timestep --preserve_distribution_shape``). ``allowed`` is a bool
    per entry of the scheduler's table (``Wan.expert_timesteps``); None is the whole table,
    and then the loss is ``objectives.flow_matching_loss`` itself."""

    def __init__(self, noise_scheduler, settings, allowed: torch.Tensor | None = None):
        super().__init__(noise_scheduler, settings)
        self.allowed = allowed
        if allowed is not None and not bool(allowed.any()):
            raise ValueError(
                "the expert has no timestep of the scheduler's table on its side of the boundary"
            )

    def draw_u(self, n: int, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """``n`` draws of the density in [0, 1) on the expert's side (each sample's from its own
        generator, after its noise, as ``flow_matching_loss`` draws)."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        density = self.settings.density()
        num_steps = self.noise_scheduler.config.num_train_timesteps
        allowed = self.allowed

        def ok(u: torch.Tensor) -> torch.Tensor:
            return (
                torch.ones_like(u, dtype=torch.bool)
                if allowed is None
                else allowed[table_indices(u, num_steps)]
            )

        if generators is not None:
            draws = []
            for g in generators:
                for _ in range(MAX_REDRAWS):
                    u = compute_density_for_timestep_sampling(batch_size=1, generator=g, **density)
                    if bool(ok(u)[0]):
                        break
                else:
                    raise RuntimeError("no timestep drawn on the expert's side of the boundary")
                draws.append(u[0])
            return torch.stack(draws)  # CPU: the generators are CPU ones (objectives.sample_generators)
        u = compute_density_for_timestep_sampling(batch_size=n, **density)
        for _ in range(MAX_REDRAWS):
            bad = ~ok(u)
            if not bool(bad.any()):
                return u
            u[bad] = compute_density_for_timestep_sampling(batch_size=int(bad.sum()), **density)
        raise RuntimeError("no timestep drawn on the expert's side of the boundary")

    def loss(
        self, predict, latents: torch.Tensor, generators=None, reduction: str = "mean", loss_weights=None
    ) -> torch.Tensor:
        """Noise (this rank's RNG or each sample's generator), then timesteps on the expert's side,
        then the rectified-flow loss of ``objectives.flow_matching_loss``."""
        s = self.settings
        noise = sample_noise(latents, 0.0, generators) if generators else torch.randn_like(latents)
        if self.allowed is None:
            return flow_matching_loss(
                predict, self.noise_scheduler, latents, noise, settings=s, generators=generators,
                reduction=reduction, loss_weights=loss_weights,
            )  # fmt: skip
        if s.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(
                f"weighting scheme must be one of {WEIGHTING_SCHEMES}, got {s.weighting_scheme!r}"
            )
        timesteps, sigmas = table_points(
            self.noise_scheduler, self.draw_u(latents.shape[0], generators), latents
        )
        return rectified_flow_loss(
            predict, latents, noise, timesteps, sigmas,
            weighting_scheme=s.weighting_scheme, reduction=reduction, loss_weights=loss_weights,
        )  # fmt: skip


# -------------------------------------------------------------------------------- family


def vae_compression(vae_config: dict) -> tuple[int, int]:
    """``(temporal, spatial)`` compression of an ``AutoencoderKLWan`` config: its
    ``scale_factor_temporal`` / ``scale_factor_spatial`` (what the pipeline reads), else what
    the architecture gives (an older config without them)."""
    down = vae_config.get("temperal_downsample", [False, True, True])
    temporal = vae_config.get("scale_factor_temporal") or 2 ** sum(bool(d) for d in down)
    spatial = vae_config.get("scale_factor_spatial") or 2 ** len(down) * (vae_config.get("patch_size") or 1)
    return int(temporal), int(spatial)


@dataclass(frozen=True)
class Wan(GuidedValidation, Family):
    """Wan: masked umT5 states zero-padded to the sequence length; 5-D video latents; one or two
    experts (``experts``), switched at ``boundary_ratio``; per-token timesteps for TI2V-5B."""

    # WanPipeline's registered values (model_index.json; detect_family reads them): the boundary
    # of the folder, not the published one, in validation's pipeline too
    registered_config: ClassVar[tuple[str, ...]] = ("boundary_ratio", "expand_timesteps")
    experts: tuple[str, ...] = (HIGH,)  # denoiser folders, high noise first
    boundary_ratio: float | None = None  # the published pipelines' (A14B T2V: 0.875)
    expand_timesteps: bool = False  # TI2V-5B: one timestep per latent token (WanPipeline's flag)
    validation_num_frames: int = 5  # short validation videos (1 + 4k frames)

    # ------------------------------------------------------------------ components

    def matches(self, model_index):
        """One pipeline class for all three: Wan 2.2 A14B names a ``transformer_2`` (Wan 2.1 and
        TI2V-5B have none, or ``[null, null]``), TI2V-5B expands its timesteps per token."""
        if model_index.get("_class_name") != self.pipeline_class:
            return False
        entry = model_index.get(LOW)
        two = isinstance(entry, list) and len(entry) == 2 and all(entry)
        if len(self.experts) > 1:
            return two
        return not two and bool(model_index.get("expand_timesteps")) == bool(self.expand_timesteps)

    @property
    def pipeline_denoisers(self) -> tuple[str, ...]:
        return self.experts

    @property
    def denoiser_choice_flag(self) -> str | None:
        return "--train_experts" if len(self.experts) > 1 else None

    def trained_denoisers(self, choice: str | None) -> tuple[str, ...]:
        """``--train_experts`` (default both, the high-noise expert first) for Wan 2.2 A14B."""
        return TRAIN_EXPERTS[choice or "both"] if len(self.experts) > 1 else self.experts

    def denoiser_schedule(self, folders, source, noise_scheduler, settings, seed):
        """Wan 2.2 A14B: ``ExpertSchedule`` at the folder's boundary; one expert otherwise."""
        if len(self.experts) < 2:
            return DenoiserSchedule(folders)
        boundary = self.boundary(source)
        p_high = self.expert_probability(noise_scheduler, settings, boundary) if len(folders) > 1 else 1.0
        return ExpertSchedule(folders, boundary, p_high, seed)

    def component_library(self, name):
        if name in self.experts:
            return "diffusers", self.denoiser_class
        return super().component_library(name)

    def boundary(self, source: str | os.PathLike | None = None) -> float | None:
        """The expert boundary timestep of a pipeline folder (its ``boundary_ratio`` times its
        scheduler's ``num_train_timesteps``), or of the published pipeline without one."""
        ratio, steps = self.boundary_ratio, 1000
        if source is not None and (Path(source) / "model_index.json").is_file():
            ratio = _model_index(source).get("boundary_ratio", ratio)
            scheduler_config = Path(source) / "scheduler" / "scheduler_config.json"
            if scheduler_config.is_file():
                steps = json.loads(scheduler_config.read_text()).get("num_train_timesteps", steps)
        return boundary_timestep(ratio, steps)

    # ------------------------------------------------------------------ prompts

    def prompt_text(self, spec, caption, tokenizer=None):
        """The caption cleaned as ``WanPipeline._get_t5_prompt_embeds`` cleans it (ftfy when
        installed, HTML entities, whitespace)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        return prompt_clean(caption)

    def encode_text(self, name, encoder, input_ids, attention_mask=None):
        """umT5's last hidden state (the encoder called with the mask, as the pipeline calls it),
        kept for each caption's first ``mask.sum()`` tokens and zero after them: the pipeline's
        ``u[:v]`` then zero padding to ``max_sequence_length``. The mask comes along (the cache
        keeps it; the denoiser takes none)."""
        hidden = encoder(input_ids, attention_mask).last_hidden_state
        if attention_mask is None:  # every token valid (the planner sizes outputs so, on the meta device)
            attention_mask = torch.ones_like(input_ids)
        seq_lens = attention_mask.gt(0).sum(dim=1).long()
        keep = (
            torch.arange(hidden.shape[1], device=hidden.device)[None, :] < seq_lens.to(hidden.device)[:, None]
        )
        embeds = torch.where(keep[..., None], hidden, hidden.new_zeros(()))
        return {"prompt_embeds": embeds, "prompt_embeds_mask": attention_mask.long()}

    def conditioning(self, outputs):
        """The whole zero-padded sequence: the pipeline hands the transformer all
        ``max_sequence_length`` rows (the zeros pass through its text projection and are
        attended to), so nothing is trimmed."""
        return {"encoder_hidden_states": outputs["prompt_embeds"]}

    # ------------------------------------------------------------------ latents

    def latent_normalizer(self, vae_config, vae_folder=None):
        return ChannelMeanStd(vae_config)  # the pipeline decodes latents * std + mean

    def latent_distribution(self, vae, pixels):
        """The VAE's distribution of videos ``(N, 3, F, H, W)`` (an image batch ``(N, 3, H, W)``
        is a video of one frame)."""
        return vae.encode(pixels if pixels.ndim == 5 else pixels.unsqueeze(2)).latent_dist

    def vae_scale_factor(self, vae_config: dict) -> int:
        """``AutoencoderKLWan``'s spatial compression (8 for Wan 2.1, 16 for Wan 2.2's VAE)."""
        return vae_compression(vae_config)[1]

    def denoiser_latent_shape(self, vae_config, height, width):
        """One frame's latents ``(z_dim, 1, h, w)`` (``sample_latent_shape``: a clip's)."""
        f = self.vae_scale_factor(vae_config)
        return (vae_config["z_dim"], 1, height // f, width // f)

    def image_seq_len(self, latent_shape, vae_config, denoiser_config):
        """The transformer's tokens: its ``patch_size`` (1, 2, 2) over ``(F, h, w)``."""
        pt, ph, pw = denoiser_config.get("patch_size") or (1, 2, 2)
        return (latent_shape[-3] // pt) * (latent_shape[-2] // ph) * (latent_shape[-1] // pw)

    def latent_multiple(self, vae_config):
        """Height and width: the VAE's spatial compression times the transformer's 2x2 patches
        (16 for Wan 2.1's VAE, 32 for Wan 2.2's), what the pipeline rounds sides down to."""
        return 2 * vae_compression(vae_config)[1]

    def frame_multiple(self, vae_config: dict) -> int:
        """Frames must be ``1 + frame_multiple * k``: the VAE encodes the first frame alone, then
        each ``scale_factor_temporal`` (4) frames into one latent frame, and drops a remainder
        (``AutoencoderKLWan._encode``); the pipeline rounds ``num_frames`` the same way."""
        return vae_compression(vae_config)[0]

    def latent_frames(self, num_frames: int, vae_config: dict) -> int:
        """Latent frames of ``num_frames`` video frames, as ``WanPipeline.prepare_latents``."""
        return (num_frames - 1) // self.frame_multiple(vae_config) + 1

    # ------------------------------------------------------------------ objective and denoiser call

    def load_noise_scheduler(self, source):
        """``FlowMatchEulerDiscreteScheduler`` with the folder's shift: a published Wan folder
        holds a UniPC scheduler whose ``flow_shift`` is the shift (3.0 for T2V, 5.0 for TI2V-5B)."""
        import diffusers

        config = diffusers.FlowMatchEulerDiscreteScheduler.load_config(source, subfolder="scheduler")
        if config.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
            return diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
        return diffusers.FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=config.get("num_train_timesteps", 1000), shift=config.get("flow_shift", 1.0)
        )

    def sampling_sigmas(self, steps: int) -> list[float]:
        """The sigmas online RL samples at (``recipes.grpo``; the training scheduler shifts them by
        its ``flow_shift``): ``linspace(1, 1 / steps, steps)``, from exactly 1 as DanceGRPO's Wan
        schedule (``sd3_time_shift`` of ``linspace(1, 0)``). Not the pipeline's: UniPC's first
        flow sigma is ``1 - 1e-6``, where Flow-GRPO's SDE std ``sqrt(sigma / (1 - sigma))`` is
        1000 x its noise level and the first step's drift multiplies the latents by about -1e4."""
        return [1 - i / steps for i in range(steps)]

    def sampling_scheduler(self, noise_scheduler):
        """The published pipelines' sampler for validation videos: UniPC on flow sigmas
        (``flow_prediction``) at the training scheduler's shift."""
        import diffusers

        return diffusers.UniPCMultistepScheduler(
            **dict(
                WAN_SCHEDULER,
                num_train_timesteps=noise_scheduler.config.num_train_timesteps,
                flow_shift=noise_scheduler.config.shift,
            )
        )

    def expert_timesteps(
        self, noise_scheduler, expert: str | None, boundary: float | None
    ) -> torch.Tensor | None:
        """Which entries of the training scheduler's table ``expert`` trains (a bool per entry):
        ``t >= boundary`` for ``transformer``, ``t < boundary`` for ``transformer_2``; None (the
        whole table) without an expert or a boundary."""
        if expert is None or boundary is None:
            return None
        if expert not in (HIGH, LOW):
            raise ValueError(f"expert must be {HIGH!r} or {LOW!r}, got {expert!r}")
        high = noise_scheduler.timesteps >= boundary
        return high if expert == HIGH else ~high

    def expert_probability(self, noise_scheduler, settings, boundary: float | None) -> float:
        """The density's mass on the high expert's timesteps (``--train_experts both`` picks the
        high expert that often: ``expert_of_step``). Exact for ``none`` and ``logit_normal``;
        ``mode`` by quadrature."""
        if boundary is None:
            return 1.0
        num_steps = noise_scheduler.config.num_train_timesteps
        # the table descends, so the high expert's entries are its first k; an index is < k for u < k/N
        k = int((noise_scheduler.timesteps >= boundary).sum())
        cut = k / num_steps
        if settings.weighting_scheme == "logit_normal":
            if cut <= 0 or cut >= 1:
                return float(cut >= 1)
            z = (math.log(cut / (1 - cut)) - settings.logit_mean) / settings.logit_std
            return 0.5 * (1 + math.erf(z / math.sqrt(2)))
        if settings.weighting_scheme == "mode":
            # CPU: a quadrature of a scalar probability, computed once per job
            u0 = (torch.arange(100_000, dtype=torch.float64) + 0.5) / 100_000
            u = 1 - u0 - settings.mode_scale * (torch.cos(math.pi * u0 / 2) ** 2 - 1 + u0)
            return float((table_indices(u, num_steps) < k).double().mean())
        return cut

    def objective(self, noise_scheduler, settings, expert: str | None = None, boundary: float | None = None):
        """Flow matching at the scheduler's sigmas; with ``expert`` (``HIGH`` or ``LOW``, the
        folder a loss trains) and ``boundary`` (``Wan.boundary``), on that expert's side of the
        boundary only (``ExpertFlowMatchingObjective``): ``objective_loss`` then trains it there.

        Example:
            >>> objective = WAN22.objective(scheduler, settings, LOW, 875.0)
            >>> loss = WAN22.objective_loss(denoiser, objective, latents, cond)
        """
        return ExpertFlowMatchingObjective(
            noise_scheduler, settings, self.expert_timesteps(noise_scheduler, expert, boundary)
        )

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None, **kwargs):
        """``WanTransformer3DModel`` on the 5-D latents with the scheduler's timesteps (sigma x
        1000, not divided), ``encoder_hidden_states`` the padded umT5 states, as the pipeline's
        loop calls it (TI2V-5B: the timestep repeated for each latent token of ``[:, ::2, ::2]``,
        as the pipeline expands it). Its output is the flow ``noise - latents`` (the scheduler's
        ``flow_prediction``)."""
        timestep = timesteps.expand(noisy_latents.shape[0]) if timesteps.ndim == 0 else timesteps
        if self.expand_timesteps:
            tokens = noisy_latents[0, 0][:, ::2, ::2].numel()
            timestep = timestep[:, None].expand(-1, tokens)
        return denoiser(
            hidden_states=noisy_latents,
            timestep=timestep,
            encoder_hidden_states=cond["encoder_hidden_states"],
            attention_kwargs=kwargs.get("attention_kwargs"),
            return_dict=False,
        )[0]

    def validation_kwargs(self, max_sequence_length, guidance_scale, num_frames: int | None = None):
        """Short videos (``num_frames``, default ``validation_num_frames``) as PIL frames, with the
        training's umT5 length (the denoiser saw that many padded rows)."""
        return {
            **super().validation_kwargs(max_sequence_length, guidance_scale),
            "num_frames": num_frames or self.validation_num_frames,
            "output_type": "pil",
        }

    # ------------------------------------------------------------------ pipelines

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler, *, transformer_2=None):
        """``WanPipeline`` around these modules; Wan 2.2 needs both experts (``denoiser`` is the
        high-noise one, or a dict ``{"transformer": ..., "transformer_2": ...}``)."""
        import diffusers

        if isinstance(denoiser, dict):
            denoiser, transformer_2 = denoiser.get(HIGH), denoiser.get(LOW, transformer_2)
        if LOW in self.experts and (denoiser is None or transformer_2 is None):
            raise ValueError(f"a {self.title} pipeline needs both experts ({HIGH} and {LOW})")
        return diffusers.WanPipeline(
            tokenizer=tokenizers["text_encoder"],
            text_encoder=text_encoders["text_encoder"],
            vae=vae,
            scheduler=scheduler,
            transformer=denoiser,
            transformer_2=transformer_2 if LOW in self.experts else None,
            boundary_ratio=self.boundary_ratio if LOW in self.experts else None,
            expand_timesteps=self.expand_timesteps,
        )

    def published(self):
        if LOW in self.experts:
            return (
                PublishedConfig(
                    "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                    "Wan 2.2 T2V A14B",
                    self.pipeline_class,
                    {
                        HIGH: ("diffusers", "WanTransformer3DModel", PUBLISHED_TRANSFORMER_14B),
                        LOW: ("diffusers", "WanTransformer3DModel", PUBLISHED_TRANSFORMER_14B),
                        "text_encoder": ("transformers", "UMT5EncoderModel", PUBLISHED_UMT5_XXL),
                        "vae": ("diffusers", "AutoencoderKLWan", PUBLISHED_VAE_21),
                    },
                    "two 14 B experts (27 B in all, 14 B per step: Wan 2.2's model card); a step runs "
                    "one, switched at t = 875; --train_experts trains one or both",
                ),
            )
        if self.expand_timesteps:
            return (
                PublishedConfig(
                    "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                    "Wan 2.2 TI2V 5B",
                    self.pipeline_class,
                    {
                        HIGH: ("diffusers", "WanTransformer3DModel", PUBLISHED_TRANSFORMER_5B),
                        "text_encoder": ("transformers", "UMT5EncoderModel", PUBLISHED_UMT5_XXL),
                        "vae": ("diffusers", "AutoencoderKLWan", PUBLISHED_VAE_22),
                    },
                    "Wan 2.2's VAE: 16x spatial, 4x temporal, 48 channels; timesteps per token",
                ),
            )
        encoder = ("transformers", "UMT5EncoderModel", PUBLISHED_UMT5_XXL)
        vae = ("diffusers", "AutoencoderKLWan", PUBLISHED_VAE_21)
        return (
            PublishedConfig(
                "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                "Wan 2.1 T2V 1.3B",
                self.pipeline_class,
                {
                    HIGH: ("diffusers", "WanTransformer3DModel", PUBLISHED_TRANSFORMER_1_3B),
                    "text_encoder": encoder,
                    "vae": vae,
                },
                "the umT5-XXL encoder (5.7 B) is four times the denoiser: shard or cache it",
            ),
            PublishedConfig(
                "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                "Wan 2.1 T2V 14B",
                self.pipeline_class,
                {
                    HIGH: ("diffusers", "WanTransformer3DModel", PUBLISHED_TRANSFORMER_14B),
                    "text_encoder": encoder,
                    "vae": vae,
                },
            ),
        )


def _umt5_spec() -> tuple[TextEncoderSpec, ...]:
    return (
        TextEncoderSpec(
            "text_encoder", "UMT5EncoderModel", "tokenizer", "input_ids", uses_max_sequence_length=True
        ),
    )


_COMMON = dict(
    pipeline_class="WanPipeline",
    text_encoders=_umt5_spec(),
    denoiser=HIGH,
    denoiser_class="WanTransformer3DModel",
    vae_class="AutoencoderKLWan",
    vae_in_fp32=True,  # diffusers' Wan examples load the VAE in fp32 beside a bf16 transformer
    sample_latents=False,  # Wan's VAE encode returns the posterior mean (Wan2.1 wan/modules/vae.py)
    video=True,
    supports_dream=False,
    flow_matching=True,
    default_max_sequence_length=512,  # WanPipeline.__call__'s default, Wan's text_len
    # musubi-tuner's Wan recipe (docs/wan.md: --timestep_sampling shift): sigmoid(N(0, 1)) then the
    # shift, which the scheduler's shifted table applies; no loss weighting
    default_weighting_scheme="logit_normal",
    # Wan LoRAs' targets (DiffSynth-Studio's q,k,v,o,ffn.0,ffn.2; musubi-tuner's lora_wan) in the
    # names diffusers' WanLoraLoaderMixin converts them to, self- and cross-attention alike
    lora_target_modules=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
    default_run_args=run_args(text_encoder="shard", vae="replicate", max_sequence_length=32, num_frames=5),
)

WAN = Wan(name="wan", title="Wan 2.1", **_COMMON)
WAN22 = Wan(name="wan22", title="Wan 2.2 A14B", experts=(HIGH, LOW), boundary_ratio=0.875, **_COMMON)
WAN22_5B = Wan(name="wan22_5b", title="Wan 2.2 TI2V-5B", expand_timesteps=True, **_COMMON)

# Published configs (scripts/convert_wan_to_diffusers.py in diffusers; google/umt5-xxl): the keys
# that set parameter shapes.
PUBLISHED_TRANSFORMER_1_3B = published_config("wan/transformer_1_3b")  # Wan2.1-T2V-1.3B
# Wan2.1-T2V-14B, and each of Wan2.2-T2V-A14B's two experts
PUBLISHED_TRANSFORMER_14B = published_config("wan/transformer_14b")
PUBLISHED_TRANSFORMER_5B = published_config("wan/transformer_5b")  # Wan2.2-TI2V-5B
PUBLISHED_UMT5_XXL = dict(
    T5_V11_ENCODER, vocab_size=256384, d_model=4096, d_ff=10240, num_layers=24, num_heads=64
)
PUBLISHED_VAE_21 = published_config("wan/vae_21")  # Wan 2.1's VAE
PUBLISHED_VAE_22 = published_config("wan/vae_22")  # Wan 2.2's (TI2V-5B's): 16x spatial, 48 channels
