"""The text-to-image trainer behind ``scripts/train_text_to_image.py`` (and the base of the
DreamBooth, ControlNet and DPO trainers): ``TextToImageTrainer(args)`` with ``setup()``,
``train()``, ``save()``, for every family and for LoRA.

The trainer composes parts it owns: the data side (``training.data.TrainingData``: rows,
buckets, loader, the position a checkpoint saves), the trained denoisers (``training.
denoisers``, with the family's ``DenoiserSchedule`` picking the one each step trains), the
frozen side (``placement.frozen_inputs.FrozenInputs``) and the objective (``Family.loss`` with
``ObjectiveSettings``). A subclass supplies its own data (``_load_data`` returns a
``TrainingData``), its loss (``_loss``), its other trained models (``_prepare_extra_parts``) and
its outputs (``validate``, ``save``).

Every method runs on every rank (collectives inside: loading, frozen forwards, checkpoints,
validation, the final save).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from pathlib import Path

import torch

from ..args import ArgumentError, component_overrides, component_placements, validate_launch
from ..data.loading import LoaderSettings, cpus_per_local_process, loader_settings
from ..data.pairs import gives_edit_pairs
from ..data.pixels import RowsToPixels
from ..families import detect_family
from ..families.base import DenoiserSchedule
from ..families.objectives import (
    ObjectiveSettings,
    latent_loss_weights,
    objective_settings,
    sample_generators,
)
from ..placement.frozen_inputs import (
    CacheRequest,
    FrozenInputs,
    place_frozen_models,
    resolve_component_sources,
)
from ..placement.plan import (
    PlanOptions,
    check_pair_placements,
    live_text_for_caption_dropout,
    resolve_auto_placements,
)
from ..runtime.context_parallel import (
    SPLIT_FAILURE,
    ContextParallel,
    check_token_counts,
    context_parallel_of_flags,
    group_loader,
    pad_text_to_multiple,
    split_failure,
)
from ..runtime.distributed import log_rank_zero
from ..runtime.memory import MemoryLog, model_state_bytes, return_large_frees_to_os
from ..runtime.notices import quiet_library_notices
from ..runtime.phases import reached
from ..state.ema import ShardedEMA
from ..state.pipeline_io import (
    check_output_dir,
    generate_validation_images,
    index_entries,
    model_card,
    pipeline_components,
    save_final_pipeline,
)
from ..state.pretrained import resolve_model_folder
from ..state.resume import resume_training, save_training_checkpoint
from ..training.data import (
    TrainingData,
    audio_of_clips,
    check_data_flags,
    check_video_flags,
    data_state,
    load_clip_rows,
    load_image_rows,
    load_streamed_rows,
    validation_sources,
)
from ..training.denoisers import (
    load_trained_denoisers,
    pipeline_denoisers,
    prepare_second_denoiser,
    set_denoiser_kernels,
)
from ..training.faults import NonFiniteUpdates, StopSignals, nonfinite_ranks, parse_signals
from ..training.job import accelerator_from_args, clear_interrupted_writes, finish_trackers
from ..training.lora import LORA_WEIGHT_NAME, save_lora_zero3
from ..training.parts import TrainedModel, adamw, backward_parts, prepare_first_part, step_part
from ..training.report import (
    StepOutput,
    log_memory_per_rank,
    log_outputs,
    run_outputs,
    step_log_path,
    write_validation,
)
from ..training.schedule import (
    epoch_batches,
    epochs_for,
    first_last_means,
    lr_schedule,
    scaled_learning_rate,
    updates_per_epoch,
)
from .text_to_image_settings import TextToImageSettings, check_resolution, validate_args, validate_family

logger = logging.getLogger("diffusers_zero3.recipes.text_to_image")


class TextToImageTrainer:
    """setup() -> train() -> save(); each step is a short method. All ranks call each.

    ``args`` is a ``TextToImageSettings`` (or a subclass's). A subclass may replace
    ``_load_data`` (returning its ``TrainingData``), ``_loss`` (which may leave per-micro-batch
    ``batch_metrics``, logged per step beside the loss, averaged over ranks),
    ``_prepare_extra_parts`` (its other trained models) and extend ``_load_models``.
    """

    # Frozen outputs depend on the data alone (crops and flips are cached too): the planner
    # may cache them (--*_placement auto). A trainer whose inputs change sets this False.
    cacheable_data = True
    # Whether this trainer reads ImageCaptionDataset rows (_load_data), to which aspect-ratio
    # buckets and loss masks apply; a subclass with data of its own sets this False.
    image_caption_rows = True

    # -- the job: set in setup, before any model loads
    args: TextToImageSettings
    source: str  # the pipeline folder
    family: object  # families.base.Family
    component_sources: dict[str, Path]  # --component overrides and the folders they name
    accelerator: object
    placements: dict[str, str]  # frozen component -> replicate | shard | offload | cache
    plan: object  # placement.plan's plan of this job
    cp: ContextParallel | None  # --context_parallel_size > 1
    loading: LoaderSettings  # the loaders' workers and pinning
    trained_folders: tuple[str, ...]  # the denoisers this job trains, the first one the loop's first
    # -- the objective and the denoisers: _load_models
    noise_scheduler: object
    objective_settings: ObjectiveSettings  # the loss's flags: timestep density, weights, SNR, DREAM
    tokenizers: dict
    schedule: DenoiserSchedule  # which trained denoiser each step trains
    trained_folder: str | None  # the first trained model's folder (its part's name)
    denoiser: object  # the first trained model: its engine after _prepare_training
    second_denoiser: torch.nn.Module | None  # Wan 2.2's low-noise expert / Ideogram 4's twin, when both train
    # -- the data and the frozen side: _load_data, _place_frozen
    data: TrainingData
    frozen: FrozenInputs
    # -- the optimisation: _prepare_training
    denoiser_part: TrainedModel
    extra_parts: list[TrainedModel]  # other trained models, each its own engine (DreamBooth's encoders)
    optimizer: object
    lr_scheduler: object
    ema: ShardedEMA | None
    loader: object
    learning_rate: float
    # -- the loop's position and records
    global_step: int
    first_epoch: int
    epoch: int
    trained_steps: int  # steps this process trained (0: a resumed finished run)
    batch_metrics: dict[str, torch.Tensor]
    metric_history: list[dict[str, float]]
    memory: MemoryLog
    nonfinite: NonFiniteUpdates  # the updates skipped for non-finite values (--max_nonfinite_steps)
    stop_signals: StopSignals  # --save_on_signal: noted while train() runs
    model_states: dict[str, int] | None  # bytes by kind, measured at the first step

    def __init__(self, args: TextToImageSettings):
        self.args = args
        self.global_step = self.first_epoch = self.epoch = self.trained_steps = 0
        self.batch_metrics, self.metric_history = {}, []
        self.memory, self.model_states = MemoryLog(), None
        self.extra_parts = []
        self.nonfinite = NonFiniteUpdates(args.max_nonfinite_steps)
        self.stop_signals = StopSignals(parse_signals(args.save_on_signal))
        self.trained_folder, self.second_denoiser, self.cp = None, None, None
        self._cuts: list = []  # per micro-batch: (part, kept outputs, cut outputs) to backward through

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        from accelerate.utils import set_seed

        args = self.args
        quiet_library_notices()  # before the first pipeline module is imported
        # Everything that can be checked before anything is written is checked first.
        validate_args(args)
        if args.return_freed_memory:
            return_large_frees_to_os()
        self.source = resolve_model_folder(
            args.pretrained_model_name_or_path, None, args.revision, args.cache_dir
        )
        check_output_dir(args.output_dir, self.source)
        pipeline_components(self.source)  # a readable model_index.json with plain component names
        self.family = detect_family(self.source)
        editing = self.family.editing_variant()  # Flux.2: generation, or editing given pairs
        if editing is not None and self.image_caption_rows:
            columns = (args.source_image_column, args.edit_prompt_column)
            if gives_edit_pairs(*columns, args.dataset_name, args.train_data_dir):
                self.family = editing
        validate_family(args, self.family)
        self.trained_folders = self.family.trained_denoisers(args.train_experts or args.train_denoisers)
        self.component_sources = resolve_component_sources(
            self.family, self.source, component_overrides(args), args.revision, args.cache_dir
        )
        check_resolution(
            args.resolution, self.family, self.component_sources.get("vae", Path(self.source) / "vae")
        )
        if self.family.video:
            check_video_flags(args, self.family, self._vae_config(), self.trained_folders)
        check_data_flags(args, self.family, self.image_caption_rows, type(self).__name__)
        self.accelerator = acc = accelerator_from_args(args)
        self.placements, self.plan = self._placements()
        validate_launch(
            args,
            deepspeed_active=acc.state.deepspeed_plugin is not None,
            on_cpu=acc.device.type == "cpu",
            placements=self.placements,
            use_8bit_adam=args.use_8bit_adam,
        )
        self.cp = context_parallel_of_flags(args.context_parallel_size, args.context_parallel_mode, acc)
        # workers and pinned batches on a CUDA host unless --dataloader_num_workers says otherwise
        self.loading = loader_settings(acc.device.type, args.dataloader_num_workers, cpus_per_local_process())
        log_rank_zero(self.loading.describe(acc.device.type, streaming=args.streaming))
        clear_interrupted_writes(args.output_dir)
        set_seed(args.seed if args.seed is not None else 0)
        if args.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
        self.memory.mark("accelerator built")
        self._load_models()
        self.memory.mark("models loaded")
        self.data = self._load_data()
        self._check_context_parallel_shapes()
        self._place_frozen()
        self.memory.mark("frozen models placed")
        self._prepare_training()
        self.memory.mark("prepared")

    def _placements(self) -> tuple[dict[str, str], object]:
        """Each frozen component's placement (``auto`` planned), settled by the caption dropout,
        the family and the data; one error line for a combination that cannot train."""
        args, acc = self.args, self.accelerator
        try:
            job = PlanOptions(
                # editing pairs: the VAE encodes each step's sources, and a text encoder that reads
                # them too (Qwen-Image-Edit): "auto" never chooses the cache for them
                fixed_data=self.cacheable_data and not args.streaming and not self.family.edits,
                use_ema=args.use_ema,
                rank=args.rank,
                resolution=args.resolution,
                max_sequence_length=args.max_sequence_length,
                height=args.height,
                width=args.width,
                num_frames=args.num_frames or 1,
            )
            placements, plan = resolve_auto_placements(component_placements(args), self.source, acc, job)
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        cached = sorted(name for name, placement in placements.items() if placement == "cache")
        if args.streaming and cached:
            raise ArgumentError(
                f"--streaming reads each row once per epoch as it trains; nothing to cache {', '.join(cached)} from: "
                "give those placements replicate, shard or offload"
            )
        placements = live_text_for_caption_dropout(
            placements, component_placements(args), self.family, args.proportion_empty_prompts,
            live="shard" if acc.state.deepspeed_plugin is not None else "replicate",
        )  # fmt: skip
        try:
            placements = self.family.settle_placements(placements)
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        check_pair_placements(placements, self.family, self._reads_pairs, args.mask_column)
        return placements, plan

    def _check_context_parallel_shapes(self) -> None:
        """One error line at start for a training image shape (the resolution, or each bucket)
        whose tokens the context-parallel groups cannot split (a video's and an editing pair's
        are checked at their first batch). Not a collective."""
        if self.cp is None or self.family.video:
            return
        vae_config, denoiser_config = self._vae_config(), dict(self.denoiser.config)
        shapes = self.data.buckets or [(self.args.resolution, self.args.resolution)]
        counts = {
            f"a {h}x{w} image": self.family.image_seq_len(
                self.family.denoiser_latent_shape(vae_config, h, w), vae_config, denoiser_config
            )
            for h, w in shapes
        }
        try:
            check_token_counts(counts, self.cp.size)
        except ValueError as e:
            raise ArgumentError(str(e)) from None

    @property
    def data_processes(self) -> int:
        """The ranks that take different samples: all of them, or the context-parallel groups."""
        return self.cp.data_parallel_size if self.cp is not None else self.accelerator.num_processes

    @property
    def _reads_pairs(self) -> bool:
        """Whether this trainer reads editing pairs (an editing family's image-caption rows)."""
        return self.family.edits and self.image_caption_rows

    def _validation_call(self) -> dict:
        """Validation's pipeline call besides the prompt, the source image and the generator, as
        the family's pipeline class takes it (``family.size_kwargs``): the model card's usage."""
        args = self.args
        size = self.family.size_kwargs(args.height or args.resolution, args.width or args.resolution)
        return {"num_inference_steps": args.num_validation_inference_steps, **size,
                **self.family.validation_kwargs(args.max_sequence_length, args.guidance_scale)}  # fmt: skip

    def _vae_config(self) -> dict:
        """The VAE's config (its folder, or the one ``--component vae=PATH`` gives)."""
        return self.family.component_class("vae").load_config(
            self.component_sources.get("vae", Path(self.source) / "vae")
        )

    def _tokenize(self, captions: list[str]) -> dict:
        """The family's token ids of ``captions`` at ``--max_sequence_length``."""
        return self.family.tokenize(self.tokenizers, captions, self.args.max_sequence_length)

    def _load_models(self) -> None:
        args, src = self.args, self.source
        self.noise_scheduler = self.family.load_noise_scheduler(src)
        self.objective_settings = objective_settings(args, self.family, self.noise_scheduler)
        self.tokenizers = self.family.load_tokenizers(src, self.component_sources)
        self.schedule = self.family.denoiser_schedule(
            self.trained_folders, src, self.noise_scheduler, self.objective_settings, args.seed or 0
        )
        self._load_trained_model()

    def _load_trained_model(self) -> None:
        """The trained denoiser(s): ``self.denoiser`` (the first, with LoRA adapters under
        ``--rank``) and ``self.second_denoiser`` when two train, partitioned under ZeRO-3."""
        models = load_trained_denoisers(
            self.accelerator,
            self.family,
            self.source,
            self.trained_folders,
            self.component_sources,
            self.args,
        )
        self.trained_folder = self.trained_folders[0]
        self.denoiser, self.second_denoiser = models[0], (models[1] if len(models) > 1 else None)
        described = self.schedule.describe()
        if described:
            log_rank_zero(described)

    @functools.cached_property
    def pixels(self) -> RowsToPixels:
        """How a row becomes pixels and token ids (``data.pixels.RowsToPixels``), from the
        settings, built once: the datasets read with it, and the cache with its columns and
        buckets (``_place_frozen``). Needs the tokenizers and the VAE's placement."""
        live_pixels = self.placements.get("vae") != "cache"
        return RowsToPixels.from_settings(self.args, self._tokenize, live_pixels=live_pixels)

    def _load_data(self) -> TrainingData:
        """The rows to train on: an image family's (or its editing pairs), a stream, or a video
        family's clips. Collective (buckets read each rank's share of image headers)."""
        args, family, pixels = self.args, self.family, self.pixels
        if family.video:
            audio = audio_of_clips(family, self.source, self.component_sources)
            return load_clip_rows(args, family, pixels, self.data_processes, self._vae_config(), audio)
        if args.streaming:
            return load_streamed_rows(args, pixels, self.data_processes, self.loading.num_workers)
        return load_image_rows(args, family, pixels, self.data_processes, self._vae_config())

    def _place_frozen(self) -> None:
        """Frozen models by placement; 'cache' ones are run once over the data, then freed."""
        args, data = self.args, self.data
        cache = CacheRequest(
            data.dataset,
            args.frozen_cache_dir or os.path.join(args.output_dir, "frozen_cache"),
            self.tokenizers,
            max_sequence_length=args.max_sequence_length,
            batch_size=args.train_batch_size,
            clips=data.rows if self.family.video else None,
        )
        self.frozen = place_frozen_models(
            self.accelerator,
            self.family,
            self.source,
            {name: self.placements.get(name) for name in self.family.frozen_components},
            pixels=self.pixels.with_rows(
                data.image_column, data.caption_column, data.buckets, data.row_buckets
            ),
            cache=cache,
            variant=args.variant,
            component_sources=self.component_sources,
        )
        if self.frozen.cache is not None:
            data.rows.unreadable_rows = set(self.frozen.cache.skipped_rows)

    def _prepare_training(self) -> None:
        args, acc = self.args, self.accelerator
        trained = [m for m in (self.denoiser, self.second_denoiser) if m is not None]
        set_denoiser_kernels(trained, args.attention_backend, self.cp, acc)
        lr = args.learning_rate
        if args.scale_lr:
            lr = scaled_learning_rate(
                lr,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                train_batch_size=args.train_batch_size,
                num_processes=self.data_processes,
            )
        self.learning_rate = lr
        optimizer = adamw(self.denoiser, args, lr)  # the adapters alone under LoRA
        loader = self.data.loader(self.loading)
        plugin = acc.state.deepspeed_plugin
        if self.data.bucket_sampler is not None and plugin is not None:
            # a loader with a batch sampler has no batch_size, from which accelerate fills "auto"
            if plugin.is_auto("train_micro_batch_size_per_gpu"):
                plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.train_batch_size
        if args.max_train_steps is None:
            steps = updates_per_epoch(
                math.ceil(len(loader) / self.data_processes), args.gradient_accumulation_steps
            )
            args.max_train_steps = args.num_train_epochs * steps
        scheduler = lr_schedule(args, optimizer, acc.num_processes)  # accelerate steps it once per process
        # The denoiser first: accelerate's backward drives the first engine it prepared.
        # Context parallelism: the loader dealt out to the groups, not to every rank.
        # A stream: dealt out per rank too, so that each rank decodes its own rows (accelerate's
        # prepare would dispatch it from rank 0, which then decodes every row).
        deal_here = self.cp is not None or args.streaming
        self.denoiser_part, self.loader = prepare_first_part(
            acc, self.trained_folder, self.denoiser, optimizer, scheduler,
            dataloader=None if deal_here else loader,
            micro_batch_size=args.train_batch_size if deal_here else None,
            max_grad_norm=args.max_grad_norm, use_ema=bool(args.use_ema),
            ema_device="cpu" if args.offload_ema else None,
        )  # fmt: skip
        if self.cp is not None:
            self.loader = group_loader(loader, acc, self.cp.data_parallel_size, self.cp.data_parallel_rank)
        elif args.streaming:
            self.loader = group_loader(loader, acc, acc.num_processes, acc.process_index)
        part = self.denoiser_part
        self.denoiser, self.optimizer, self.lr_scheduler, self.ema = (
            part.engine,
            part.optimizer,
            part.lr_scheduler,
            part.ema,
        )
        if args.streaming:  # epochs end when the stream does; the steps bound the run
            args.num_train_epochs = args.max_train_steps
        else:
            args.num_train_epochs = epochs_for(
                args.max_train_steps, updates_per_epoch(len(self.loader), args.gradient_accumulation_steps)
            )
        if acc.is_main_process and args.report_to != "none":
            config = args.scalars()
            acc.init_trackers(args.tracker_project_name, config)
        self._prepare_extra_parts()
        self._maybe_resume()

    def _prepare_extra_parts(self) -> None:
        """Build the job's other trained models (``self.extra_parts``), after the denoiser's
        engine and before a resume (every rank): the second trained denoiser when two train."""
        if self.second_denoiser is not None:
            self.extra_parts.append(
                prepare_second_denoiser(
                    self.accelerator,
                    self.trained_folders[1],
                    self.second_denoiser,
                    self.args,
                    self.learning_rate,
                    self.denoiser,
                )  # fmt: skip
            )

    def _second_part(self) -> TrainedModel | None:
        """The second trained denoiser's part (None when one trains)."""
        return next((p for p in self.extra_parts if p.extra.get("denoiser")), None)

    def _maybe_resume(self) -> None:
        resumed = resume_training(
            self.accelerator,
            self.args.output_dir,
            self.args.resume_from_checkpoint,
            ema=self.ema,
            check=self.data.check_resumable,  # before anything is loaded: where would the data resume?
            parts=self.extra_parts,
            fallback=self.args.resume_fallback,
        )
        if resumed is None:
            if self.args.resume_from_checkpoint:
                log_rank_zero("no checkpoint to resume from yet: starting a new run")
            return
        path, state = resumed
        self.global_step = state["global_step"]
        self.first_epoch = state["epoch"]
        self.data.resume(state)
        processes = self.data_processes
        if int(data_state(state)["world_size"]) != processes:
            log_rank_zero(
                f"{path} was written by {state['world_size']} processes; resharded for {processes} "
                f"(batch {self.data.resume_batches} of epoch {self.first_epoch} next)"
            )
        log_rank_zero(f"resumed from {path} at step {self.global_step}")

    # ------------------------------------------------------------------ training

    def _loss(self, batch: dict) -> torch.Tensor:
        # Each sample draws from its own generator (seed, epoch, dataset index): the same draws
        # whichever rank trains it, so a run resumed on another number of processes continues.
        generators = sample_generators(self.args.seed or 0, self.epoch, batch["index"])
        latents, cond, _ = self.frozen(batch, self.accelerator.device, generators)
        if self.cp is not None:  # a masked text of the batch's length: padded to split K ways
            cond = pad_text_to_multiple(cond, self.cp.size)
            try:
                return self._family_loss(batch, latents, cond, generators)
            except AssertionError as e:  # diffusers' sharder, on a length it cannot split
                if SPLIT_FAILURE not in str(e):
                    raise
                raise ArgumentError(split_failure(cond, latents, self.cp.size)) from None
        return self._family_loss(batch, latents, cond, generators)

    def _family_loss(self, batch: dict, latents: torch.Tensor, cond: dict, generators) -> torch.Tensor:
        """The family's loss of one micro-batch with the denoiser this step trains (Wan 2.2's
        expert on its side of the boundary; Ideogram 4's transformer of the turn)."""
        masked = {}
        if "loss_mask" in batch:  # --mask_column: each latent pixel weighs what it encodes of the mask
            masked["loss_weights"] = latent_loss_weights(batch["loss_mask"], latents)
        name = self.schedule.of_step(self.global_step)
        denoiser = self.denoiser if name == self.trained_folder else self._second_part().engine
        return self.family.loss(
            denoiser, self.noise_scheduler, latents, cond, self.objective_settings, generators,
            **self.schedule.loss_kwargs(name), **masked,
        )  # fmt: skip

    def _backward(self, loss: torch.Tensor) -> bool:
        """The micro-batch's backward: the first trained model's through accelerate, then the
        other parts' from the gradients at their cut outputs (``parts.backward_parts``; under
        DDP the one backward reaches them), then their optimizer steps; on a step of the second
        trained denoiser, that one alone (its backward, and its step at the boundary: its own
        engine under ZeRO-3, accelerate's backward and its own optimizer under DDP). Returns
        whether those parts' updates were applied (``step_part``). Every rank, every micro-batch."""
        if self.cp is not None:  # ZeRO-3 averages over every rank: a group's shares make one sample
            loss = self.cp.group_loss(loss)
        part = self._second_part()
        if part is not None and self.schedule.of_step(self.global_step) == part.name:
            sync = self.accelerator.sync_gradients
            if part.own_engine:
                part.engine.set_gradient_accumulation_boundary(sync)
                part.engine.backward(loss)
            else:  # DDP: only this denoiser's module ran forward, so the one backward reaches it alone
                self.accelerator.backward(loss)
            return step_part(part, self.accelerator, sync)
        backward_parts(self.accelerator, loss, self.denoiser_part, self._cuts)
        self._cuts = []
        return self._step_extra_parts()

    def _trains_this_step(self, part: TrainedModel) -> bool:
        """Whether ``part`` trains on this optimizer step: False only for the trained denoiser
        the step did not pick (``DenoiserSchedule.trains``). Its optimizer step, schedule step
        and EMA step are skipped then: AdamW moves weights even without a gradient (weight
        decay; its moments, where a gradient is zero rather than absent), a schedule stepped
        there runs ahead of the steps the denoiser trained, and an EMA step pulls the average
        toward weights that did not change. Every rank picks the same denoiser, so every rank
        skips alike (each ZeRO-3 engine stays in lockstep)."""
        return self.schedule.trains(part.name, self.global_step)

    def _step_extra_parts(self) -> bool:
        """After the micro-batch's backward: each other trained model's optimizer step (its
        clipping, its schedule); whether all were applied. Every rank, every micro-batch."""
        sync, applied = self.accelerator.sync_gradients, True
        for part in self.extra_parts:
            if not part.extra.get("denoiser"):  # a second denoiser steps on its own steps only (_backward)
                applied &= step_part(part, self.accelerator, sync)
        return applied

    def train(self) -> list[float]:
        """The training loop; returns the logged per-step losses (all ranks call it).

        Per step, a ``step N loss X`` line (with the objective's metrics): on a terminal only
        into ``OUTPUT_DIR/<logging_dir>/train.log`` beside a progress bar, elsewhere printed as
        well (``training.report.StepOutput``)."""
        args, acc = self.args, self.accelerator
        with (
            StepOutput(
                args.max_train_steps,
                initial=self.global_step,
                log_file=step_log_path(args.output_dir, args.logging_dir),
                bar=acc.is_local_main_process,
            ) as steps,
            self.stop_signals,
        ):
            return self._train_epochs(steps)

    def _train_epochs(self, steps: StepOutput) -> list[float]:
        args, acc = self.args, self.accelerator
        losses = []
        if self.global_step >= args.max_train_steps:
            log_rank_zero(f"the run is complete at step {self.global_step}: no step to train")
            return losses
        resumed_at = self.global_step
        epochs = self.data.epochs_to_run(
            self.first_epoch, self.global_step, args.max_train_steps, self.loader,
            args.gradient_accumulation_steps,
        )  # fmt: skip
        for epoch in epochs:
            self.epoch = epoch
            self.data.set_epoch(epoch)
            done_in_epoch = self.data.resume_batches if epoch == self.first_epoch else 0
            accumulated, metrics, applied, bad_ranks, stop = 0.0, {}, True, set(), False
            for batch in epoch_batches(acc, self.loader, epoch, done_in_epoch):
                first = not self.memory.has("first forward")
                ddp_parts = [p.engine for p in self.extra_parts if not p.own_engine]
                with acc.accumulate(self.denoiser, *ddp_parts):
                    loss = self._loss(batch)
                    if first:
                        self.memory.mark("first forward")
                    # per rank: its loss times its samples, their number, whether it got a stop signal
                    n, signalled = float(len(batch["index"])), self.stop_signals.flag()
                    local = loss.new_tensor([n, signalled], dtype=torch.float32)
                    sums = acc.gather(
                        torch.cat([(loss.detach().float() * n).reshape(1), local]).reshape(1, 3)
                    ).tolist()
                    accumulated += sum(s for s, _, _ in sums) / sum(c for _, c, _ in sums)
                    bad_ranks.update(nonfinite_ranks([s for s, _, _ in sums]))
                    stop = stop or any(f for _, _, f in sums)
                    if self.batch_metrics:  # one gather for all of them
                        values = torch.stack([v.detach().float() for v in self.batch_metrics.values()])
                        means = acc.gather(values.unsqueeze(0)).mean(dim=0).tolist()
                        for name, mean in zip(self.batch_metrics, means):
                            metrics[name] = metrics.get(name, 0.0) + mean
                    reached("train_step")
                    applied &= self._backward(loss)
                    if first:
                        self.memory.mark("first backward")
                    # clipped at --max_grad_norm as diffusers' script (DeepSpeed: its gradient_clipping)
                    if self._trains_this_step(self.denoiser_part):
                        applied &= step_part(
                            self.denoiser_part,
                            acc,
                            acc.sync_gradients,
                            self._first_step_measures if first else None,
                        )
                    elif first:
                        self._first_step_measures()
                done_in_epoch += 1
                if not acc.sync_gradients:
                    continue
                if self.nonfinite.record(applied, self.global_step + 1, sorted(bad_ranks)):
                    for part in [self.denoiser_part, *self.extra_parts]:
                        if part.ema is not None and self._trains_this_step(part):
                            part.ema.step()
                applied, bad_ranks = True, set()
                self.global_step += 1
                self.trained_steps += 1
                step_loss = accumulated / args.gradient_accumulation_steps
                step_metrics = {k: v / args.gradient_accumulation_steps for k, v in metrics.items()}
                accumulated, metrics = 0.0, {}
                losses.append(step_loss)
                self.metric_history.append(step_metrics)
                lr = self.lr_scheduler.get_last_lr()[0]
                acc.log({"train_loss": step_loss, "lr": lr, **step_metrics}, step=self.global_step)
                extra = "".join(f" {k} {v:.6f}" for k, v in step_metrics.items())
                line = f"step {self.global_step} loss {step_loss:.6f}{extra}"
                steps.step(line, loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
                if self.global_step % args.checkpointing_steps == 0:
                    self._checkpoint(epoch, done_in_epoch)
                if args.validation_steps and self.global_step % args.validation_steps == 0:
                    self.validate()
                if stop:  # every rank: the step is done, its checkpoint published, then the job stops
                    self._preempt(epoch, done_in_epoch)
                if self.global_step >= args.max_train_steps:
                    break
            if not (resumed_at and epoch == self.first_epoch):  # a stream too short
                self.data.check_epoch_gave_batches(epoch, done_in_epoch)
            if (
                args.validation_prompts
                and args.validation_epochs
                and (epoch + 1) % args.validation_epochs == 0
            ):
                self.validate()
            if self.global_step >= args.max_train_steps:
                break
        steps.close()  # the bar ends before the memory table prints
        self.memory.mark("training done")
        states = self.model_states or model_state_bytes(self.denoiser, self.optimizer, self.ema)
        self.model_states = log_memory_per_rank(self.memory, states)
        if len(losses) >= 2:
            k, first, last = first_last_means(losses)
            log_rank_zero(
                f"loss: mean of the first {k} steps {first:.4f} -> mean of the last {k} steps {last:.4f}"
            )
        self.data.log_end(acc)
        return losses

    def _preempt(self, epoch: int, done_in_epoch: int) -> None:
        """A rank got a ``--save_on_signal`` signal during this step: publish the step's
        checkpoint (unless the schedule just did) and stop every rank (``Preempted``)."""
        step, every = self.global_step, self.args.checkpointing_steps
        self.stop_signals.checkpoint_and_stop(
            "at step", step, every, lambda: self._checkpoint(epoch, done_in_epoch)
        )

    def _first_step_measures(self) -> None:
        """After the first optimizer step, before zero_grad (a plain optimizer's gradients still
        exist): the memory mark and the trained model's state bytes."""
        self.memory.mark("first optimizer step")
        self.model_states = model_state_bytes(self.denoiser, self.optimizer, self.ema)

    def _checkpoint(self, epoch: int, done_in_epoch: int) -> None:
        reached("checkpoint")
        path = save_training_checkpoint(
            self.accelerator,
            self.args.output_dir,
            self.global_step,
            self.data.position(epoch, done_in_epoch, self.loader),
            ema=self.ema,
            total_limit=self.args.checkpoints_total_limit,
            parts=self.extra_parts,
        )
        log_rank_zero(f"saved {path}")

    def validate(self) -> None:
        """Images for --validation_prompts from the (EMA) weights (an editing family's edits of
        --validation_image, written under their sources); every rank, rank 0 writes."""
        args, acc = self.args, self.accelerator
        if not args.validation_prompts:
            return
        reached("validation")
        sources = validation_sources(args, self._reads_pairs)  # an editing family's, read once
        with contextlib.ExitStack() as stack:
            modules = stack.enter_context(self.frozen.validation_modules(acc))
            for ema in [self.ema, *(p.ema for p in self.extra_parts)]:
                if ema is not None:
                    stack.enter_context(ema.averaged_weights())
            extra = {
                part.name: part.module for part in self.extra_parts
            }  # trained encoders, a second denoiser
            modules.update(extra)
            trained = {self.trained_folder: getattr(self.denoiser, "module", self.denoiser), **extra}
            denoiser = stack.enter_context(
                pipeline_denoisers(acc, self.family, self.source, self.component_sources, trained, args,
                                   self.frozen.dtype)
            )  # fmt: skip
            pipeline = self.family.pipeline(
                denoiser,
                modules["vae"],
                modules,
                self.tokenizers,
                self.family.sampling_scheduler(self.noise_scheduler),
            )
            pipeline = self.family.prepare_validation_pipeline(pipeline, args.resolution)
            images = generate_validation_images(
                pipeline,
                args.validation_prompts,
                size=(args.height or args.resolution, args.width or args.resolution),
                num_inference_steps=args.num_validation_inference_steps,
                seed=args.seed or 0,
                dtype=self.frozen.dtype,
                sources=sources,
                **self.family.validation_kwargs(args.max_sequence_length, args.guidance_scale),
            )
        if acc.is_main_process:
            write_validation(images, sources, args.output_dir, self.global_step, acc.trackers)

    # ------------------------------------------------------------------ output

    def save(self) -> None:
        """The final pipeline folder (every rank); kept as is when resuming a finished run
        trained no step and the folder is complete."""
        args = self.args
        reached("final_save")
        marker = LORA_WEIGHT_NAME if args.rank is not None else "model_index.json"
        if self.trained_steps == 0 and (Path(args.output_dir) / marker).exists():
            log_rank_zero(f"output: {os.path.abspath(args.output_dir)} (already complete)")
            finish_trackers(self.accelerator)
            return
        if args.rank is not None:
            with contextlib.ExitStack() as stack:
                for ema in [self.ema, *(p.ema for p in self.extra_parts)]:
                    if ema is not None:
                        stack.enter_context(ema.averaged_weights())
                path = save_lora_zero3(
                    self.denoiser,
                    self.family,
                    args.output_dir,
                    others={p.name: p.engine for p in self.extra_parts},
                )
            finish_trackers(self.accelerator)
            import diffusers

            loader = (  # NucleusMoE-Image's pipeline has no LoRA loader: its transformer's
                f"{self.family.pipeline_class}.load_lora_weights"
                if hasattr(getattr(diffusers, self.family.pipeline_class), "load_lora_weights")
                else f"{self.family.denoiser}.load_lora_adapter, prefix {self.family.denoiser!r}"
            )
            log_outputs([("LoRA weights", path, loader), *self._run_outputs()])
            return
        card = model_card(
            args.pretrained_model_name_or_path,
            args.dataset_name or args.train_data_dir,
            args.scalars(),
            args.validation_prompts,
            self.family.pipeline_class,
            self.family.task,
            self._validation_call(),
        )
        save_final_pipeline(
            self.source,
            args.output_dir,
            self.denoiser,
            ema=self.ema,
            readme=card,
            denoiser_name=self.trained_folder,
            component_sources=self.component_sources,
            index_entries=index_entries(self.source, self.component_sources, self.family, self.tokenizers),
            trained={part.name: (part.engine, part.ema) for part in self.extra_parts},
        )
        finish_trackers(self.accelerator)
        loader = f"{self.family.pipeline_class}.from_pretrained"
        log_outputs([("pipeline", args.output_dir, loader), *self._run_outputs()])

    def _run_outputs(self) -> list[tuple[str, str | Path | None]]:
        """The summary's lines beside the trained weights (``report.run_outputs``)."""
        args = self.args
        return run_outputs(args.output_dir, args.logging_dir, args.report_to, self.family.video)
