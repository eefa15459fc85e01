"""What every family answers, and the answers most families share.

A ``Family`` is everything that differs between kinds of pipeline, in one object: its
components (the trained denoiser, each frozen text encoder with its tokenizer, the VAE, by
library and class), how captions become token ids and attention masks (templates included),
what each encoder's outputs are called and how they combine into the denoiser's conditioning,
how images become normalised latents (scale and shift, per-channel mean and std, or the
VAE's own statistics), the objective (DDPM noise prediction or flow matching) behind one
signature, the denoiser call (packing, position ids, guidance), what its modules need under
ZeRO-3, its pipeline class and its published configs (tiny pipelines of each family, which
are test and demo fixtures, live in ``diffusers_zero3.demo``).

Each family lives in a module of its own (``sd.py``, ``sdxl.py``, ...) as a subclass that
overrides only what differs from the defaults here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

# -------------------------------------------------------------------------------- components


@dataclass(frozen=True)
class TextEncoderSpec:
    """A frozen text encoder of a family: its folder, class and tokenizer folder."""

    name: str  # folder in the pipeline, e.g. "text_encoder_2"
    model_class: str  # class name in ``library``
    tokenizer: str  # tokenizer folder, e.g. "tokenizer_2"
    input_key: str  # the batch key of its token ids, e.g. "input_ids_2"
    uses_max_sequence_length: bool = False  # T5, LLMs: --max_sequence_length tokens, else the tokenizer's
    library: str = "transformers"

    @property
    def mask_key(self) -> str:
        """The batch key of its attention mask, e.g. ``attention_mask_2``."""
        return self.input_key.replace("input_ids", "attention_mask")


@dataclass(frozen=True)
class PublishedConfig:
    """A published pipeline's shapes, for the planner where there is no hub.

    ``components`` maps each component folder to ``(library, class, config keys)``: the keys
    that set parameter shapes (the others keep their library defaults, which equal the
    published ones for shapes). ``note`` is said beside the plan (e.g. that a VLM encoder is
    counted whole although only its text path runs).
    """

    hub_id: str
    title: str
    pipeline_class: str
    components: dict[str, tuple[str, str, dict]]
    note: str = ""


# -------------------------------------------------------------------------------- latents


class ScaleShift:
    """Latent normalisation ``(latents - shift_factor) * scaling_factor`` (SD, SDXL, SD3, Flux)."""

    def __init__(self, vae_config: dict):
        self.scaling_factor = vae_config["scaling_factor"]
        self.shift_factor = vae_config.get("shift_factor")

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        if self.shift_factor is not None:
            latents = latents - self.shift_factor
        return latents * self.scaling_factor

    def inverse(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents of denoiser latents: ``latents / scaling_factor + shift_factor``, as
        the pipelines write it before ``vae.decode``."""
        return latents / self.scaling_factor + (self.shift_factor or 0.0)


class ChannelMeanStd:
    """Per-channel latent normalisation ``(latents - mean[c]) / std[c]`` (Wan's and Qwen-Image's
    VAEs: ``latents_mean`` / ``latents_std`` in the config), over dimension 1 of latents of
    any rank."""

    def __init__(self, vae_config: dict):
        self.mean = torch.tensor(vae_config["latents_mean"], dtype=torch.float32)  # CPU: moved per call
        self.std = torch.tensor(vae_config["latents_std"], dtype=torch.float32)  # CPU: moved per call

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        shape = (1, -1, *([1] * (latents.ndim - 2)))
        mean = self.mean.to(latents.device, latents.dtype).view(shape)
        std = self.std.to(latents.device, latents.dtype).view(shape)
        return (latents - mean) / std

    def inverse(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents of denoiser latents in ``latents``' dtype, as ``QwenImagePipeline``
        (and ``WanPipeline``) write it before ``vae.decode``: ``latents / (1 / std[c]) + mean[c]``."""
        shape = (1, -1, *([1] * (latents.ndim - 2)))
        mean = self.mean.to(latents.device, latents.dtype).view(shape)
        std = self.std.to(latents.device, latents.dtype).view(shape)
        return latents / (1.0 / std) + mean


def read_vae_tensors(folder: str | os.PathLike, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of the VAE weights in ``folder`` (safetensors, sharded or not, any
    variant; else a ``.bin``), in fp32 and on the CPU, whatever dtype a placed VAE runs in: the
    latent statistics a family keeps as weights (Flux.2's batch norm, LTX-2's mean and std)."""
    from safetensors import safe_open

    from ..state.folders import CheckpointError

    folder = Path(folder)
    files = sorted(
        folder.glob("*.safetensors"), key=lambda p: (p.name != "diffusion_pytorch_model.safetensors", p.name)
    )
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in set(names) & set(f.keys()) - set(found):
                found[name] = f.get_tensor(name).to(torch.float32)
        if len(found) == len(names):
            return found
    if not files:
        for path in sorted(folder.glob("*.bin")):
            state = torch.load(path, map_location="cpu", weights_only=True)
            found.update({k: state[k].to(torch.float32) for k in names if k in state and k not in found})
        if len(found) == len(names):
            return found
    missing = ", ".join(sorted(set(names) - set(found)))
    raise CheckpointError(f"the VAE weights in {folder} have no {missing} (the family's latent statistics)")


class VideoLatents:
    """Latent arithmetic of the causal video VAEs whose transformer takes one token per latent
    voxel (HunyuanVideo 1.5, LTX-2): ``1 + frame_multiple * k`` frames (the first frame alone,
    then ``frame_multiple`` frames per latent frame), ``(C, F, h, w)`` denoiser latents. A family
    mixes it in and says ``frame_multiple`` (its VAE's temporal compression)."""

    def frame_multiple(self, vae_config: dict) -> int:
        raise NotImplementedError

    def latent_frames(self, num_frames: int, vae_config: dict) -> int:
        """Latent frames of ``num_frames`` frames, as the pipelines' ``prepare_latents``."""
        return (num_frames - 1) // self.frame_multiple(vae_config) + 1

    def denoiser_latent_shape(self, vae_config, height, width):
        """One frame's latents ``(C, 1, h, w)``."""
        f = self.vae_scale_factor(vae_config)
        return (vae_config["latent_channels"], 1, height // f, width // f)

    def image_seq_len(self, latent_shape, vae_config, denoiser_config):
        """One token per latent voxel (1 x 1 x 1 patches)."""
        return latent_shape[-3] * latent_shape[-2] * latent_shape[-1]


class DenoiserSchedule:
    """The denoisers a job trains and which one each optimizer step trains: the one denoiser
    of most families; Wan 2.2's two experts (``wan.ExpertSchedule``: drawn per step by the
    timestep density's mass on each side of the boundary) or Ideogram 4's two transformers (in
    turn). Every rank picks the same one (each denoiser's ZeRO-3 engine is called in lockstep).
    ``Family.denoiser_schedule`` gives it."""

    def __init__(self, folders: tuple[str, ...]):
        self.folders = tuple(folders)

    def of_step(self, step: int) -> str:
        """The folder of the denoiser that optimizer step ``step`` trains (all its micro-batches)."""
        return self.folders[step % len(self.folders)]

    def trains(self, name: str, step: int) -> bool:
        """Whether the denoiser ``name`` trains at ``step`` (always, when the job trains one):
        an untrained step skips its optimizer, schedule and EMA steps."""
        return len(self.folders) < 2 or name == self.of_step(step)

    def objective_kwargs(self, name: str) -> dict[str, Any]:
        """What ``Family.objective`` takes besides the scheduler and settings for the denoiser
        ``name`` (Wan 2.2's expert and boundary: its timesteps on its side)."""
        return {}

    def loss_kwargs(self, name: str) -> dict[str, Any]:
        """What ``Family.objective_loss`` takes besides the batch for the denoiser ``name``
        (Ideogram 4's ``trained``)."""
        return {}

    def describe(self) -> str | None:
        """One log line for a job that trains several denoisers (None for one)."""
        return f"denoisers trained: {', '.join(self.folders)}" if len(self.folders) > 1 else None


# -------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """What a training script needs to know about one kind of pipeline (see the module doc).

    Subclasses override the methods whose rule differs; the fields say the rest.
    """

    name: str  # the short name: make train MODEL=<name>
    pipeline_class: str
    text_encoders: tuple[TextEncoderSpec, ...]
    # denoiser, flow_matching and supports_dream default to the flow-matching transformers' values
    # (every family but SD's and SDXL's, which declare their UNet's); denoiser_class to SD's UNet
    denoiser: str = "transformer"
    denoiser_class: str = "UNet2DConditionModel"
    vae_class: str = "AutoencoderKL"
    vae_in_fp32: bool = False  # SDXL's VAE overflows in fp16
    sample_latents: bool = True  # False: the latent distribution's mode, as Z-Image's script trains
    video: bool = False  # trains on clips: (N, 3, F, H, W) pixels, --num_frames
    sound: bool = False  # trains on each clip's audio track too (LTX-2: audio_spec, other_latents)
    # instruction editing: trains on (source image(s), instruction) -> target pairs (data.pairs;
    # FrozenInputs adds the sources' latents to the conditioning as "source_latents")
    edits: bool = False
    # the text encoder reads the source images too (Qwen-Image-Edit's VL): it runs live, never cached
    encodes_source_images: bool = False
    uses_time_ids: bool = False
    supports_dream: bool = False  # DREAM (--dream_training), as diffusers' SD text-to-image script
    flow_matching: bool = True  # flow matching with FlowMatchEulerDiscreteScheduler's sigmas
    default_max_sequence_length: int = 77  # tokens of --max_sequence_length encoders, as diffusers' scripts
    default_weighting_scheme: str = "none"  # flow matching's timestep density and loss weighting
    # LoRA targets of diffusers' LoRA scripts for this family (--lora_layers overrides them)
    lora_target_modules: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
    title: str = ""  # e.g. "SD 1.x / 2.x", for tables
    pipeline_kwargs: tuple[tuple[str, Any], ...] = ()  # constant extra arguments of the pipeline class
    # `make train MODEL=<name>`: the placements (and family flags) of its default run;
    # "{pipeline}" stands for the tiny pipeline's folder
    default_run_args: tuple[str, ...] = ()

    # What the pipeline class registers in its config (``register_to_config``, saved in
    # ``model_index.json``) and the family reads: each a field of the same name whose default is
    # the pipeline's own; ``configured`` sets them from a pipeline folder, ``pipeline`` passes them.
    registered_config: ClassVar[tuple[str, ...]] = ()
    # The least side of a source image its pipelines take (Flux.2's check_image_input: 64)
    least_source_side: ClassVar[int] = 0
    # The diffusers pipeline that runs a ControlNet beside this family's denoiser (None: the
    # ControlNet trainer refuses the family)
    controlnet_pipeline_class: ClassVar[str | None] = None
    # One timestep per latent token (Wan 2.2 TI2V-5B's registered flag; the others: one per sample)
    expand_timesteps: ClassVar[bool] = False

    def configured(self, model_index: dict) -> Family:
        """This family with the values a pipeline folder's ``model_index.json`` registers
        (``registered_config``; a JSON list read as a tuple), the defaults for those it lacks;
        ``self`` when none differs. ``detect_family`` and ``family_of_index`` give it."""
        values = {
            key: tuple(value) if isinstance(value, list) else value
            for key, value in model_index.items()
            if key in self.registered_config
        }
        if all(getattr(self, key) == value for key, value in values.items()):
            return self
        return dataclasses.replace(self, **values)

    # ------------------------------------------------------------------ components

    @property
    def frozen_components(self) -> tuple[str, ...]:
        """Folders of the frozen models, each placed on its own: text encoders, then VAE."""
        return (*(e.name for e in self.text_encoders), "vae")

    @property
    def text_stage(self) -> tuple[str, ...]:
        """The frozen models ``encode_texts`` runs on token ids, in order: the text encoders (a
        family whose encoders' outputs go through another model adds it, LTX-2's connectors)."""
        return tuple(e.name for e in self.text_encoders)

    def editing_variant(self) -> Family | None:
        """The family training instruction editing with the same pipeline class (Flux.2 given
        reference images), which the trainer takes when it is given editing pairs; None for a
        family whose pipeline only generates (or only edits)."""
        return None

    @property
    def task(self) -> str:
        """What this family trains its pipeline to do, as the Hub's pipeline tags name it:
        ``"text-to-video"`` (``video``), ``"image-to-image"`` (``edits``: an instruction edits
        source images), else ``"text-to-image"``. A model card's title, tags and usage follow it."""
        if self.video:
            return "text-to-video"
        return "image-to-image" if self.edits else "text-to-image"

    @property
    def pipeline_denoisers(self) -> tuple[str, ...]:
        """The denoiser folders the pipeline holds (Wan 2.2's two experts, Ideogram 4's
        conditional and unconditional transformers; one for the others)."""
        return (self.denoiser,)

    @property
    def denoiser_choice_flag(self) -> str | None:
        """The flag that chooses which of ``pipeline_denoisers`` train (``--train_experts``,
        ``--train_denoisers``), None for a family that trains its one denoiser."""
        return None

    def trained_denoisers(self, choice: str | None) -> tuple[str, ...]:
        """The denoiser folders a job trains, given ``denoiser_choice_flag``'s value (None: the
        default), the first one the loop's first engine."""
        return (self.denoiser,)

    def denoiser_schedule(
        self, folders: tuple[str, ...], source: str | os.PathLike, noise_scheduler, settings, seed: int
    ) -> DenoiserSchedule:
        """Which of ``folders`` (``trained_denoisers``) each optimizer step trains, and the
        objective and loss arguments for each: in turn (one denoiser: always it)."""
        return DenoiserSchedule(folders)

    def frame_multiple(self, vae_config: dict) -> int | None:
        """Frames per latent frame of a video family's VAE (clips of ``1 + k * frame_multiple``
        frames); None for an image family (one frame)."""
        return None

    def latent_frames(self, num_frames: int, vae_config: dict) -> int:
        """Latent frames of ``num_frames`` frames, as the pipeline's ``prepare_latents``: one for
        an image family."""
        return 1

    def sample_latent_shape(
        self, vae_config: dict, height: int, width: int, num_frames: int = 1
    ) -> tuple[int, ...]:
        """One sample's denoiser latents, as the pipeline's ``prepare_latents`` shapes them:
        ``denoiser_latent_shape``, and for a video family (``video``) its latent frames of
        ``num_frames`` frames in the frame axis (third from the end)."""
        shape = list(self.denoiser_latent_shape(vae_config, height, width))
        if self.video:
            shape[-3] = self.latent_frames(num_frames, vae_config)
        return tuple(shape)

    @property
    def never_cached(self) -> tuple[str, ...]:
        """Frozen components whose outputs are never cached (the planner's ``auto`` does not
        choose it; ``settle_placements`` refuses it)."""
        return ()

    def settle_placements(self, placements: dict[str, str]) -> dict[str, str]:
        """The placements (``{component: placement}``) this family trains with: what one
        component's placement implies for another's; ``ValueError`` (one line) for what
        cannot train."""
        for name in self.never_cached:
            if placements.get(name) == "cache":
                raise ValueError(
                    f"--{name}_placement cache is not supported for {self.title}: give replicate, shard or offload"
                )
        return placements

    @property
    def tokenizer_folders(self) -> tuple[str, ...]:
        return tuple(e.tokenizer for e in self.text_encoders)

    def matches(self, model_index: dict) -> bool:
        """Whether a pipeline's ``model_index.json`` is of this family (its ``_class_name``; a
        family that shares its pipeline class with another tells them apart here)."""
        return model_index.get("_class_name") == self.pipeline_class

    def denoiser_cls(self):
        import diffusers

        return getattr(diffusers, self.denoiser_class)

    def component_library(self, name: str) -> tuple[str, str]:
        """``(library, class name)`` of a model folder of the family (denoiser, encoder, VAE)."""
        if name == self.denoiser:
            return "diffusers", self.denoiser_class
        if name == "vae":
            return "diffusers", self.vae_class
        spec = self.text_encoder(name)
        return spec.library, spec.model_class

    def component_class(self, name: str):
        """The class of a model folder of the family (``vae``, a text encoder, the denoiser)."""
        import importlib

        library, class_name = self.component_library(name)
        return getattr(importlib.import_module(library), class_name)

    def text_encoder(self, name: str) -> TextEncoderSpec:
        for spec in self.text_encoders:
            if spec.name == name:
                return spec
        raise KeyError(f"{self.name} has no text encoder {name!r}")

    def component_dtype(self, name: str, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype a frozen component runs in: the training dtype, except a VAE the family
        keeps in fp32."""
        return torch.float32 if name == "vae" and self.vae_in_fp32 else weight_dtype

    def load_tokenizers(
        self, source: str | os.PathLike, sources: dict[str, str | os.PathLike] | None = None
    ) -> dict[str, Any]:
        """``{encoder name: tokenizer}``: each from ``sources[tokenizer folder]`` when given (a
        folder holding the tokenizer itself), else ``source/<tokenizer folder>``."""
        sources = sources or {}
        return {
            e.name: self.load_tokenizer(
                Path(sources[e.tokenizer]) if e.tokenizer in sources else Path(source) / e.tokenizer
            )
            for e in self.text_encoders
        }

    def load_tokenizer(self, folder: Path):
        """One tokenizer folder (a family whose folder holds a processor loads its text part)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)

    # ------------------------------------------------------------------ prompts

    def sequence_length(
        self, spec: TextEncoderSpec, tokenizer, max_sequence_length: int | None = None
    ) -> int:
        """Tokens per caption fed to one encoder: ``max_sequence_length`` (default: the
        family's) for the encoders that take it (T5, LLMs), the tokenizer's own length (77 for
        CLIP) otherwise."""
        if spec.uses_max_sequence_length:
            return max_sequence_length or self.default_max_sequence_length
        return tokenizer.model_max_length

    def tokenize(
        self, tokenizers: dict[str, Any], captions: list[str], max_sequence_length: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Token ids and attention masks of ``captions`` for every encoder of ``tokenizers`` (any
        subset of the family's, by encoder folder name), each padded to a fixed length (an
        empty batch of that width for no captions), under ``spec.input_key`` and
        ``spec.mask_key``. Fixed lengths let every row be cached alone; ``conditioning`` trims
        what a family's pipeline would not have padded."""
        out = {}
        for spec in self.text_encoders:
            if spec.name not in tokenizers:
                continue
            tok = tokenizers[spec.name]
            length = self.token_length(spec, tok, max_sequence_length)
            if not captions:  # a rank with no samples still calls the encoders (lockstep)
                # CPU: like the tokenizer's ids; encode_texts moves ids to each encoder's device
                out[spec.input_key] = torch.zeros(0, length, dtype=torch.long)
                out[spec.mask_key] = torch.zeros(0, length, dtype=torch.long)  # CPU: as the ids
                continue
            encoded = tok(
                [self.prompt_text(spec, c, tok) for c in captions],
                max_length=length,
                padding="max_length",
                truncation=True,
                return_tensors="pt",
            )
            out[spec.input_key] = encoded.input_ids
            out[spec.mask_key] = encoded.attention_mask
        return out

    def token_length(self, spec: TextEncoderSpec, tokenizer, max_sequence_length: int | None = None) -> int:
        """Tokens fed to the encoder: ``sequence_length`` plus any template tokens the family
        drops from the encoder's output."""
        return self.sequence_length(spec, tokenizer, max_sequence_length)

    def prompt_text(self, spec: TextEncoderSpec, caption: str, tokenizer=None) -> str:
        """The text an encoder reads for a caption (a family with a prompt template, or the
        tokenizer's chat template, fills it)."""
        return caption

    def encode_text(
        self, name: str, encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """One encoder's outputs, named for the cache. Collective when ``encoder`` is sharded."""
        raise NotImplementedError

    def encode_texts(self, encoders: dict[str, Any], ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The named outputs of the given encoders (any subset of the family's, by folder
        name) for a batch of token ids and masks (``tokenize``'s dict), each on its encoder's
        device. Collective when an encoder is sharded."""
        outputs = {}
        for spec in self.text_encoders:
            if encoders.get(spec.name) is not None:
                encoder = encoders[spec.name]
                mask = ids.get(spec.mask_key)
                outputs.update(
                    self.encode_text(
                        spec.name,
                        encoder,
                        ids[spec.input_key].to(encoder.device),
                        None if mask is None else mask.to(encoder.device),
                    )
                )
        return outputs

    def conditioning(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Combine the encoders' named outputs into what the denoiser is called with
        (``encoder_hidden_states`` and the family's pooled embeddings or masks)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ latents

    def latent_normalizer(
        self, vae_config: dict, vae_folder: str | os.PathLike | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The map from the VAE's sampled latents to the denoiser's (scale and shift here).
        ``vae_folder`` holds the VAE, for a family whose statistics are weights (read from the
        files in fp32, whatever dtype the placed VAE runs in)."""
        return ScaleShift(vae_config)

    def latent_distribution(self, vae, pixels: torch.Tensor):
        """The VAE's latent distribution of images ``(N, 3, H, W)`` (its ``parameters`` are
        cached, and training samples from it, or takes its mode: ``sample_latents``).
        Collective when the VAE is sharded."""
        return vae.encode(pixels).latent_dist

    def audio_spec(self, audio_vae_config: dict):
        """How a family with ``sound`` reads each clip's audio (``data.audio.AudioSpec``) for an
        audio VAE of ``audio_vae_config``; None for the families without (never read)."""
        return None

    def other_latents(self, models: dict[str, Any], batch: dict, device, dtype) -> dict[str, torch.Tensor]:
        """Conditioning entries of a batch's other streams, from the live frozen models
        (``models`` by folder): LTX-2's audio latents. Collective when such a model is sharded."""
        return {}

    def latents_of(self, distribution, generators=None) -> torch.Tensor:
        """Training latents of a latent distribution: a sample (from this rank's RNG, or one
        generator per sample), or its mode (``sample_latents``)."""
        if not self.sample_latents:
            return distribution.mode()
        from .objectives import sample_latent_distribution

        return sample_latent_distribution(distribution, generators)

    def latent_multiple(self, vae_config: dict) -> int:
        """Image sides must be a multiple of this: the VAE's downsampling (x2 for families
        that pack 2x2 latent patches)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    # ------------------------------------------------------------------ objective and denoiser call

    def noise_scheduler_class(self):
        """The scheduler class of training (and validation) for this family."""
        import diffusers

        return diffusers.FlowMatchEulerDiscreteScheduler if self.flow_matching else diffusers.DDPMScheduler

    def sampling_scheduler(self, noise_scheduler):
        """The scheduler validation images (and DreamBooth's class images) are sampled with, from
        the training scheduler's config: DPM-Solver++ for the DDPM families (DreamBooth's
        default ``--validation_scheduler``; 20 DDPM steps give noise), the training class for
        flow matching."""
        import diffusers

        cls = (
            diffusers.DPMSolverMultistepScheduler if not self.flow_matching else self.noise_scheduler_class()
        )
        return cls.from_config(noise_scheduler.config)

    def load_noise_scheduler(self, source: str | os.PathLike):
        """The training scheduler, from the pipeline folder's ``scheduler`` config (a family whose
        training script builds another one overrides this)."""
        return self.noise_scheduler_class().from_pretrained(source, subfolder="scheduler")

    def objective(self, noise_scheduler, settings):
        """The family's training objective (``objectives.DDPMObjective`` or
        ``objectives.FlowMatchingObjective``) with ``settings`` (``objectives.ObjectiveSettings``)."""
        from . import objectives

        cls = objectives.FlowMatchingObjective if self.flow_matching else objectives.DDPMObjective
        return cls(noise_scheduler, settings)

    def loss(
        self,
        denoiser,
        noise_scheduler,
        latents: torch.Tensor,
        cond: dict,
        settings,
        generators=None,
        reduction: str = "mean",
        loss_weights: torch.Tensor | None = None,
        **denoiser_kwargs,
    ) -> torch.Tensor:
        """The training loss of one micro-batch under the family's objective with ``settings``
        (``objectives.ObjectiveSettings``) over ``noise_scheduler``, the training scheduler:
        ``objective_loss`` of ``self.objective(noise_scheduler, settings)``, which says the rest
        (``generators``, ``reduction``, ``loss_weights``, ``denoiser_kwargs``).
        Collective when the denoiser is sharded.

        Example:
            >>> loss = family.loss(denoiser, scheduler, latents, cond, ObjectiveSettings())
        """
        return self.objective_loss(
            denoiser, self.objective(noise_scheduler, settings), latents, cond, generators, reduction,
            loss_weights, **denoiser_kwargs,
        )  # fmt: skip

    def objective_loss(
        self,
        denoiser,
        objective,
        latents: torch.Tensor,
        cond: dict,
        generators=None,
        reduction: str = "mean",
        loss_weights: torch.Tensor | None = None,
        **denoiser_kwargs,
    ) -> torch.Tensor:
        """The training loss of one micro-batch under ``objective`` (``objectives.Objective``,
        from ``Family.objective``: it holds the scheduler and settings, and for a Wan 2.2 expert
        its side of the boundary): a mean over the batch, or one value per sample with
        ``reduction="none"``; each element's squared error weighed by ``loss_weights``, a mask
        on the latents' grid (``objectives.latent_loss_weights``). Noise and timesteps are drawn
        by the objective (from this rank's RNG, or from each sample's ``generators``:
        ``objectives.sample_generators``); the denoiser is called as the family's pipeline calls
        it (``predict``; ``denoiser_kwargs`` go to that call, e.g. a ControlNet's residuals).
        Collective when the denoiser is sharded.

        Example:
            >>> objective = WAN22.objective(scheduler, settings, "transformer_2", 875.0)
            >>> loss = WAN22.objective_loss(denoiser, objective, latents, cond)  # the low expert's side
        """
        guidance_scale = objective.settings.guidance_scale
        return objective.loss(
            lambda noisy, t: self.predict(
                denoiser, noisy, t, cond, guidance_scale=guidance_scale, **denoiser_kwargs
            ),
            latents,
            generators,
            reduction,
            loss_weights=loss_weights,
        )

    def predict(
        self,
        denoiser,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        cond: dict[str, torch.Tensor],
        *,
        guidance_scale: float | None = None,
    ) -> torch.Tensor:
        """The denoiser's prediction for ``noisy_latents`` in the latents' shape, called as the
        family's pipeline calls it. ``timesteps`` are the scheduler's (for flow matching,
        sigma x 1000), and the prediction follows the objective's convention (noise, velocity
        ``v`` by the scheduler's prediction type, or the flow ``noise - latents``)."""
        raise NotImplementedError

    def validation_kwargs(
        self, max_sequence_length: int | None, guidance_scale: float | None
    ) -> dict[str, Any]:
        """Extra keyword arguments of the family's pipeline call for validation images."""
        return {}

    def size_kwargs(self, height: int, width: int) -> dict[str, Any]:
        """The keyword arguments of a call of the family's own pipeline class (as loaded with
        ``from_pretrained``, not ``prepare_validation_pipeline``'s) that ask for a ``height`` x
        ``width`` output: a model card's usage passes the training size with them."""
        return {"height": height, "width": width}

    def prepare_validation_pipeline(self, pipeline, resolution: int):
        """The family's pipeline set up to generate ``resolution`` x ``resolution`` images
        (a pipeline that rescales every request to its own default area changes that here)."""
        return pipeline

    # ------------------------------------------------------------------ sampling (online RL)

    def vae_scale_factor(self, vae_config: dict) -> int:
        """The VAE's spatial downsampling (the pipeline's ``vae_scale_factor``)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    def denoiser_latent_shape(self, vae_config: dict, height: int, width: int) -> tuple[int, ...]:
        """One sample's denoiser latents for ``height`` x ``width`` images, without the batch: what
        ``predict`` takes and ``latent_normalizer`` gives (``(C, h, w)`` here)."""
        f = self.vae_scale_factor(vae_config)
        return (vae_config["latent_channels"], height // f, width // f)

    def image_seq_len(self, latent_shape: tuple[int, ...], vae_config: dict, denoiser_config: dict) -> int:
        """The denoiser's image tokens for latents of ``latent_shape`` (``denoiser_latent_shape``),
        as the pipeline counts them for its schedule's shift: the transformer's patches (SD3) or
        the family's 2x2 packing (Flux.1, Qwen-Image, Z-Image)."""
        packing = self.latent_multiple(vae_config) // self.vae_scale_factor(vae_config)
        patch = max(denoiser_config.get("patch_size") or 1, packing)
        return (latent_shape[-2] // patch) * (latent_shape[-1] // patch)

    def sampling_sigmas(self, steps: int) -> list[float] | None:
        """The sigmas the pipeline's ``__call__`` gives ``set_timesteps`` by default; None where the
        scheduler spaces them itself (``StableDiffusion3Pipeline``)."""
        return None

    def sampling_mu(self, scheduler_config: dict, image_seq_len: int, steps: int) -> float | None:
        """The pipeline's ``mu`` (the resolution-dependent shift) under ``use_dynamic_shifting``:
        ``calculate_shift`` of the image's tokens with the scheduler config's bounds, as
        ``FluxPipeline`` computes it; None without dynamic shifting (the scheduler ignores it)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        if not scheduler_config.get("use_dynamic_shifting"):
            return None
        return calculate_shift(
            image_seq_len, scheduler_config.get("base_image_seq_len", 256),
            scheduler_config.get("max_image_seq_len", 4096), scheduler_config.get("base_shift", 0.5),
            scheduler_config.get("max_shift", 1.15),
        )  # fmt: skip

    def classifier_free_guidance(
        self, model_index: dict, denoiser_config: dict, guidance_scale: float
    ) -> bool:
        """Whether the pipeline runs CFG at ``guidance_scale`` (a conditional and an empty-prompt
        call per step): above 1, unless the transformer takes the scale as an input
        (``guidance_embeds``, e.g. Flux.1 [dev]). ``model_index`` is the pipeline's
        ``model_index.json``."""
        return guidance_scale > 1 and not denoiser_config.get("guidance_embeds", False)

    def guided_velocity(
        self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float
    ) -> torch.Tensor:
        """CFG's combination of the empty-prompt and the prompt's predictions, as the pipeline's
        loop: ``v_uncond + guidance_scale * (v_cond - v_uncond)``."""
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode_latents(self, vae, normalize, latents: torch.Tensor) -> torch.Tensor:
        """Images ``(N, 3, H, W)`` in about [-1, 1] of denoiser latents, as the pipeline decodes
        them: the normalisation undone (``normalize``: ``latent_normalizer``'s map, its
        ``inverse``) in fp32, then ``vae.decode`` in the VAE's dtype. Collective when the VAE is
        sharded."""
        x = normalize.inverse(latents.float()).to(vae.dtype)
        return vae.decode(x, return_dict=False)[0]

    # ------------------------------------------------------------------ pipelines

    def pipeline(self, denoiser, vae, text_encoders: dict[str, Any], tokenizers: dict[str, Any], scheduler):
        """The family's diffusers pipeline around these (already placed) modules."""
        import diffusers

        kwargs = {self.denoiser: denoiser, "vae": vae, "scheduler": scheduler, **dict(self.pipeline_kwargs)}
        kwargs.update({key: getattr(self, key) for key in self.registered_config})  # the folder's values
        for spec in self.text_encoders:
            kwargs[spec.name] = text_encoders[spec.name]
            kwargs[spec.tokenizer] = tokenizers[spec.name]
        return getattr(diffusers, self.pipeline_class)(**kwargs)

    def published(self) -> tuple[PublishedConfig, ...]:
        """The published pipelines of this family that the planner carries."""
        return ()

    def published_parts(
        self, denoiser: dict, *text_encoders: dict, vae: dict, **more: tuple[str, str, dict]
    ) -> dict[str, tuple[str, str, dict]]:
        """``PublishedConfig.components`` of the family's own classes with these published config
        keys: the denoiser (``denoiser_class``), each text encoder (``text_encoders`` in the order
        of the family's ``TextEncoderSpec``s, their classes), then ``more`` as they are
        (``name=(library, class, config)``), then the VAE (``vae_class``).

        Example: ``FLUX.published_parts(transformer, CLIP_L, T5_XXL, vae=VAE_16)`` is
        ``{"transformer": ("diffusers", "FluxTransformer2DModel", transformer), "text_encoder":
        ("transformers", "CLIPTextModel", CLIP_L), ..., "vae": ("diffusers", "AutoencoderKL", VAE_16)}``.
        """
        if len(text_encoders) != len(self.text_encoders):
            raise ValueError(
                f"{self.name}: {len(self.text_encoders)} text encoder configs, got {len(text_encoders)}"
            )
        parts = {self.denoiser: ("diffusers", self.denoiser_class, denoiser)}
        for spec, config in zip(self.text_encoders, text_encoders):
            parts[spec.name] = (spec.library, spec.model_class, config)
        return {**parts, **more, "vae": ("diffusers", self.vae_class, vae)}

    def published_as(
        self, components: dict, *checkpoints: tuple[str, str], note: str = ""
    ) -> tuple[PublishedConfig, ...]:
        """The ``PublishedConfig`` of each ``(hub_id, title)`` checkpoint of this family's pipeline
        class with the same ``components`` shapes and ``note`` (e.g. a base model and its
        distilled turbo)."""
        return tuple(
            PublishedConfig(hub_id, title, self.pipeline_class, components, note)
            for hub_id, title in checkpoints
        )
