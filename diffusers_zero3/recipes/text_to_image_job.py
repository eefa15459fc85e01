"""What a text-to-image job is, settled from its settings before any model loads
(``resolve_job``): the pipeline folder and its family, the denoisers it trains, the component
folders, the accelerator, each frozen component's placement, the context-parallel groups and the
loaders' workers. Everything that can be checked before anything is written is checked here,
with one ``error:`` line for what cannot train. The text-to-image trainer and the DreamBooth,
ControlNet and DPO trainers built on it start from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..args import ArgumentError, component_overrides, component_placements, validate_launch
from ..data.loading import LoaderSettings, cpus_per_local_process, loader_settings
from ..data.pairs import gives_edit_pairs
from ..families import detect_family
from ..families.base import Family
from ..placement.frozen_inputs import component_folder, resolve_component_sources
from ..placement.plan import (
    PlanOptions,
    check_pair_placements,
    live_text_for_caption_dropout,
    resolve_auto_placements,
)
from ..runtime.context_parallel import ContextParallel, check_token_counts, context_parallel_of_flags
from ..runtime.distributed import log_rank_zero
from ..runtime.memory import return_large_frees_to_os
from ..runtime.notices import quiet_library_notices
from ..state.pipeline_io import check_output_dir, model_card, pipeline_components
from ..state.pretrained import resolve_model_folder
from ..training.data import check_data_flags, check_video_flags
from ..training.job import accelerator_from_args, clear_interrupted_writes
from .text_to_image_settings import TextToImageSettings, check_resolution, validate_args, validate_family


@dataclass
class TextToImageJob:
    """A job settled from its settings (``resolve_job``)."""

    source: str  # the pipeline folder
    family: Family  # an editing family when the data gives editing pairs (Flux.2)
    trained_folders: tuple[str, ...]  # the denoisers this job trains, the first one the loop's first
    component_sources: dict[str, Path]  # --component overrides and the folders they name
    accelerator: Any
    placements: dict[str, str]  # frozen component -> replicate | shard | offload | cache
    plan: Any  # placement.plan's plan of this job
    cp: ContextParallel | None  # --context_parallel_size > 1
    loading: LoaderSettings  # the loaders' workers and pinning
    reads_pairs: bool  # whether the trainer reads editing pairs (an editing family's image-caption rows)

    @property
    def data_processes(self) -> int:
        """The ranks that take different samples: all of them, or the context-parallel groups."""
        return self.cp.data_parallel_size if self.cp is not None else self.accelerator.num_processes

    @property
    def data_rank(self) -> int:
        """This rank's place among the ``data_processes`` (its context-parallel group's)."""
        return self.cp.data_parallel_rank if self.cp is not None else self.accelerator.process_index

    def vae_config(self) -> dict:
        """The VAE's config (its folder, or the one ``--component vae=PATH`` gives)."""
        return vae_config(self.family, self.source, self.component_sources)


def vae_config(family: Family, source: str, component_sources: dict[str, Path]) -> dict:
    """The VAE's config of a pipeline folder, or of the folder ``--component vae=PATH`` gives."""
    return family.component_class("vae").load_config(component_folder(source, component_sources, "vae"))


def resolve_job(args: TextToImageSettings, trainer: type) -> TextToImageJob:
    """Check ``args`` and settle the job for the trainer class ``trainer`` (its
    ``image_caption_rows`` and ``cacheable_data``): the family, the trained denoisers, the
    accelerator, the placements (``auto`` planned), context parallelism, the loaders; clears
    an interrupted write of a previous run and seeds. Collective: every rank (the accelerator
    and the context-parallel groups are built here)."""
    from accelerate.utils import set_seed

    quiet_library_notices()  # before the first pipeline module is imported
    validate_args(args)
    if args.return_freed_memory:
        return_large_frees_to_os()
    source = resolve_model_folder(args.pretrained_model_name_or_path, None, args.revision, args.cache_dir)
    check_output_dir(args.output_dir, source)
    pipeline_components(source)  # a readable model_index.json with plain component names
    family = detect_family(source)
    editing = family.editing_variant()  # Flux.2: generation, or editing given pairs
    if editing is not None and trainer.image_caption_rows:
        if gives_edit_pairs(
            args.source_image_column, args.edit_prompt_column, args.dataset_name, args.train_data_dir
        ):
            family = editing
    validate_family(args, family)
    trained_folders = family.trained_denoisers(args.train_experts or args.train_denoisers)
    sources = resolve_component_sources(
        family, source, component_overrides(args), args.revision, args.cache_dir
    )
    check_resolution(args.resolution, family, component_folder(source, sources, "vae"))
    if family.video:
        check_video_flags(args, family, vae_config(family, source, sources), trained_folders)
    check_data_flags(args, family, trainer.image_caption_rows, trainer.__name__)
    acc = accelerator_from_args(args)
    reads_pairs = family.edits and trainer.image_caption_rows
    fixed_data = trainer.cacheable_data and not args.streaming and not family.edits
    placements, plan = job_placements(
        args, family, source, acc, fixed_data=fixed_data, reads_pairs=reads_pairs
    )
    validate_launch(
        args,
        deepspeed_active=acc.state.deepspeed_plugin is not None,
        on_cpu=acc.device.type == "cpu",
        placements=placements,
        use_8bit_adam=args.use_8bit_adam,
    )
    cp = context_parallel_of_flags(args.context_parallel_size, args.context_parallel_mode, acc)
    # workers and pinned batches on a CUDA host unless --dataloader_num_workers says otherwise
    loading = loader_settings(acc.device.type, args.dataloader_num_workers, cpus_per_local_process())
    log_rank_zero(loading.describe(acc.device.type, streaming=args.streaming))
    clear_interrupted_writes(args.output_dir)
    set_seed(args.seed if args.seed is not None else 0)
    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    return TextToImageJob(
        source, family, trained_folders, sources, acc, placements, plan, cp, loading, reads_pairs
    )


def job_placements(
    args: TextToImageSettings,
    family: Family,
    source: str,
    accelerator,
    *,
    fixed_data: bool,
    reads_pairs: bool,
) -> tuple[dict[str, str], Any]:
    """Each frozen component's placement (``auto`` planned; ``fixed_data``: the frozen outputs
    depend on the data alone, so the planner may cache them), settled by the caption dropout,
    the family and the data; one error line for a combination that cannot train. Collective
    (the planner measures the processes' memory)."""
    try:
        job = PlanOptions(
            # editing pairs: the VAE encodes each step's sources, and a text encoder that reads
            # them too (Qwen-Image-Edit): "auto" never chooses the cache for them
            fixed_data=fixed_data,
            use_ema=args.use_ema,
            rank=args.rank,
            resolution=args.resolution,
            max_sequence_length=args.max_sequence_length,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames or 1,
        )
        placements, plan = resolve_auto_placements(component_placements(args), source, accelerator, job)
    except ValueError as e:
        raise ArgumentError(str(e)) from e
    cached = sorted(name for name, placement in placements.items() if placement == "cache")
    if args.streaming and cached:
        raise ArgumentError(
            f"--streaming reads each row once per epoch as it trains; nothing to cache {', '.join(cached)} from: "
            "give those placements replicate, shard or offload"
        )
    placements = live_text_for_caption_dropout(
        placements, component_placements(args), family, args.proportion_empty_prompts,
        live="shard" if accelerator.state.deepspeed_plugin is not None else "replicate",
    )  # fmt: skip
    try:
        placements = family.settle_placements(placements)
    except ValueError as e:
        raise ArgumentError(str(e)) from e
    check_pair_placements(placements, family, reads_pairs, args.mask_column)
    return placements, plan


def check_context_parallel_shapes(
    job: TextToImageJob, denoiser_config: dict, shapes: list[tuple[int, int]]
) -> None:
    """One error line at start for a training image shape (``(height, width)``: the resolution,
    or each bucket) whose tokens the context-parallel groups cannot split (a video's and an
    editing pair's are checked at their first batch). Nothing without context parallelism.
    Not a collective."""
    if job.cp is None or job.family.video:
        return
    family, config = job.family, job.vae_config()
    counts = {
        f"a {h}x{w} image": family.image_seq_len(
            family.denoiser_latent_shape(config, h, w), config, denoiser_config
        )
        for h, w in shapes
    }
    try:
        check_token_counts(counts, job.cp.size)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def pipeline_card(args: TextToImageSettings, family: Family) -> str:
    """The final pipeline's model card (``state.pipeline_io.model_card``): the base, the data,
    the flags, the validation prompts, and the pipeline call that uses it at the size and
    steps validation used (``Family.size_kwargs``, ``Family.validation_kwargs``)."""
    size = family.size_kwargs(args.height or args.resolution, args.width or args.resolution)
    usage = {
        "num_inference_steps": args.num_validation_inference_steps,
        **size,
        **family.validation_kwargs(args.max_sequence_length, args.guidance_scale),
    }
    return model_card(
        args.pretrained_model_name_or_path, args.dataset_name or args.train_data_dir, args.scalars(),
        args.validation_prompts, family.pipeline_class, family.task, usage,
    )  # fmt: skip
