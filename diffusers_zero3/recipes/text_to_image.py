"""The text-to-image trainer behind ``scripts/train_text_to_image.py`` (and the base of the
DreamBooth, ControlNet and DPO trainers): ``TextToImageTrainer(args)`` with ``setup()``,
``train()``, ``save()``, for every family and for LoRA.

The trainer composes parts it owns, each in its own module:

* the job (``text_to_image_job.TextToImageJob``): the family, the accelerator, the placements,
  context parallelism, settled and checked from the settings before any model loads;
* the data (``training.data.TrainingData``: rows, buckets, clips, streams, the loader, the
  position a checkpoint saves), built from one ``data.pixels.RowsToPixels``;
* the frozen side (``placement.frozen_inputs.FrozenInputs``): a batch's latents and
  conditioning from live frozen models or a cache;
* the trained side (``training.steps.TrainedParts``): the denoisers this job trains, the
  family's ``DenoiserSchedule`` picking one per step (Wan 2.2's experts, Ideogram 4's twin),
  the other trained models, their backward, optimizer and EMA steps;
* the objective (``Family.objective`` with ``ObjectiveSettings``, for the step's denoiser;
  ``Family.objective_loss``) and the step's records
  (``training.steps.StepTally``).

A recipe built on it (DreamBooth, ControlNet, DPO) supplies parts through public methods,
each with the text-to-image part as its default: the models the loop trains
(``load_trained_models``), the data (``load_data``), the other trained parts
(``extra_trained_parts``), the objective (``loss``) and the outputs (``validate``, ``save``).

Every method runs on every rank (collectives inside: loading, frozen forwards, checkpoints,
validation, the final save).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path

import torch

from ..data.pixels import RowsToPixels
from ..families.base import DenoiserSchedule
from ..families.objectives import (
    ObjectiveSettings,
    latent_loss_weights,
    objective_settings,
    sample_generators,
)
from ..placement.frozen_inputs import CacheRequest, FrozenInputs, place_frozen_models
from ..runtime.context_parallel import group_loader
from ..runtime.distributed import log_rank_zero
from ..runtime.memory import MemoryLog, model_state_bytes
from ..runtime.phases import reached
from ..state.ema import ShardedEMA
from ..state.pipeline_io import generate_validation_images, given_components, save_final_pipeline
from ..state.resume import resume_training, save_training_checkpoint
from ..training.data import (
    TrainingData,
    audio_of_clips,
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
from ..training.faults import NonFiniteUpdates, StopSignals, parse_signals
from ..training.job import finish_trackers
from ..training.lora import LORA_WEIGHT_NAME, lora_loader_hint, save_lora_zero3
from ..training.parts import TrainedModel, adamw, prepare_first_part, set_micro_batch_size
from ..training.report import StepOutput, log_run_outputs, log_training_end, write_validation
from ..training.schedule import (
    epoch_batches,
    epochs_for,
    job_learning_rate,
    lr_schedule,
    updates_per_epoch,
)
from ..training.steps import StepTally, TrainedParts
from .text_to_image_job import TextToImageJob, check_context_parallel_shapes, pipeline_card, resolve_job
from .text_to_image_settings import TextToImageSettings

logger = logging.getLogger("diffusers_zero3.recipes.text_to_image")


class TextToImageTrainer:
    """setup() -> train() -> save(); each step is a short method. All ranks call each.

    ``args`` is a ``TextToImageSettings`` (or a subclass's). The parts a recipe supplies:
    ``load_trained_models`` (its checks and other models may come first), ``load_data``,
    ``extra_trained_parts``, ``loss`` (which may leave per-micro-batch ``batch_metrics``,
    logged per step beside the loss, averaged over ranks), ``validate`` and ``save``.
    """

    # Frozen outputs depend on the data alone (crops and flips are cached too): the planner
    # may cache them (--*_placement auto). A trainer whose inputs change sets this False.
    cacheable_data = True
    # Whether this trainer reads ImageCaptionDataset rows (load_data), to which aspect-ratio
    # buckets and loss masks apply; a subclass with data of its own sets this False.
    image_caption_rows = True

    # -- the job: setup, before any model loads; the fields the subclasses read copied from it
    args: TextToImageSettings
    job: TextToImageJob  # also: the context-parallel groups, the plan, the loaders' settings
    source: str
    family: object  # families.base.Family
    component_sources: dict[str, Path]
    accelerator: object
    placements: dict[str, str]
    # -- the objective and the trained models: setup, load_trained_models
    noise_scheduler: object
    objective_settings: ObjectiveSettings  # the loss's flags: timestep density, weights, SNR, DREAM
    tokenizers: dict
    pixels: RowsToPixels  # how a row becomes pixels and token ids: the datasets' and the cache's
    schedule: DenoiserSchedule  # which trained denoiser each step trains
    trained_folder: str | None  # the first trained model's folder (its part's name)
    denoiser: object  # the first trained model: its engine after _prepare_training
    second_denoiser: torch.nn.Module | None  # Wan 2.2's low-noise expert / Ideogram 4's twin, when both train
    # -- the data and the frozen side: load_data, _place_frozen
    data: TrainingData
    frozen: FrozenInputs
    # -- the optimisation: _prepare_training
    parts: TrainedParts  # every trained model, the schedule, their steps
    denoiser_part: TrainedModel  # parts.first
    extra_parts: list[TrainedModel]  # parts.others: extra_trained_parts (DreamBooth's encoders)
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
        self.trained_folder, self.second_denoiser = None, None

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        self.job = job = resolve_job(self.args, type(self))
        self.source, self.family, self.accelerator = job.source, job.family, job.accelerator
        self.component_sources, self.placements = job.component_sources, job.placements
        self.memory.mark("accelerator built")
        args, src = self.args, self.source
        self.noise_scheduler = self.family.load_noise_scheduler(src)
        self.objective_settings = objective_settings(args, self.family, self.noise_scheduler)
        self.tokenizers = self.family.load_tokenizers(src, self.component_sources)
        tokenize = functools.partial(_tokenize, self.family, self.tokenizers, args.max_sequence_length)
        live_pixels = self.placements.get("vae") != "cache"
        self.pixels = RowsToPixels.from_settings(args, tokenize, live_pixels=live_pixels)
        self.schedule = self.family.denoiser_schedule(
            job.trained_folders, src, self.noise_scheduler, self.objective_settings, args.seed or 0
        )
        trained = self.load_trained_models()
        (self.trained_folder, self.denoiser), *second = trained.items()
        self.second_denoiser = second[0][1] if second else None
        self.memory.mark("models loaded")
        self.data = self.load_data()
        shapes = self.data.buckets or [(self.args.resolution, self.args.resolution)]
        check_context_parallel_shapes(job, dict(self.denoiser.config), shapes)
        self._place_frozen()
        self.memory.mark("frozen models placed")
        self._prepare_training()
        self.memory.mark("prepared")

    # ------------------------------------------------------------------ the parts a recipe supplies

    def load_trained_models(self) -> dict[str, torch.nn.Module]:
        """The models the loop trains, by folder name, the first the loop's first (it gets the
        first engine; at most two): the denoiser(s) this job trains (with LoRA adapters under
        ``--rank``), partitioned under ZeRO-3. A recipe's checks and its other models (trained
        ones, a reference) come here too: after the tokenizers and the noise scheduler, before
        the data and the frozen models' placement. Every rank."""
        folders = self.job.trained_folders
        models = load_trained_denoisers(
            self.accelerator, self.family, self.source, folders, self.component_sources, self.args
        )
        described = self.schedule.describe()
        if described:
            log_rank_zero(described)
        return dict(zip(folders, models))

    def load_data(self) -> TrainingData:
        """The rows to train on: an image family's (or its editing pairs), a stream, or a video
        family's clips. Every rank (buckets read each rank's share of image headers)."""
        args, family, pixels = self.args, self.family, self.pixels
        if family.video:
            audio = audio_of_clips(family, self.source, self.component_sources)
            return load_clip_rows(args, family, pixels, self.job.data_processes, self.job.vae_config(), audio)
        if args.streaming:
            return load_streamed_rows(args, pixels, self.job.data_processes, self.job.loading.num_workers)
        return load_image_rows(args, family, pixels, self.job.data_processes, self.job.vae_config())

    def _place_frozen(self) -> None:
        """Frozen models by placement; 'cache' ones are run once over the data, then freed."""
        args, data = self.args, self.data
        cache = CacheRequest(
            data.dataset, args.frozen_cache_dir or os.path.join(args.output_dir, "frozen_cache"), self.tokenizers,
            max_sequence_length=args.max_sequence_length, batch_size=args.train_batch_size,
            clips=data.rows if self.family.video else None,
        )  # fmt: skip
        placements = {name: self.placements.get(name) for name in self.family.frozen_components}
        pixels = self.pixels.with_rows(data.image_column, data.caption_column, data.buckets, data.row_buckets)
        self.frozen = place_frozen_models(
            self.accelerator, self.family, self.source, placements, pixels=pixels, cache=cache,
            variant=args.variant, component_sources=self.component_sources,
        )  # fmt: skip
        if self.frozen.cache is not None:
            data.rows.unreadable_rows = set(self.frozen.cache.skipped_rows)

    def _prepare_training(self) -> None:
        args, acc = self.args, self.accelerator
        trained = [m for m in (self.denoiser, self.second_denoiser) if m is not None]
        set_denoiser_kernels(trained, args.attention_backend, self.job.cp, acc)
        self.learning_rate = job_learning_rate(args, self.job.data_processes)
        optimizer = adamw(self.denoiser, args, self.learning_rate)  # the adapters alone under LoRA
        loader = self.data.loader(self.job.loading)
        plugin = acc.state.deepspeed_plugin
        if self.data.bucket_sampler is not None and plugin is not None:
            # a loader with a batch sampler has no batch_size, from which accelerate fills "auto"
            if plugin.is_auto("train_micro_batch_size_per_gpu"):
                plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.train_batch_size
        accumulation = args.gradient_accumulation_steps
        if args.max_train_steps is None:
            per_epoch = updates_per_epoch(math.ceil(len(loader) / self.job.data_processes), accumulation)
            args.max_train_steps = args.num_train_epochs * per_epoch
        scheduler = lr_schedule(args, optimizer, acc.num_processes)  # accelerate steps it once per process
        # The denoiser first: accelerate's backward drives the first engine it prepared.
        # Context parallelism: the loader dealt out to the groups, not to every rank.
        # A stream: dealt out per rank too, so that each rank decodes its own rows (accelerate's
        # prepare would dispatch it from rank 0, which then decodes every row).
        deal_here = self.job.cp is not None or args.streaming
        if deal_here:
            set_micro_batch_size(acc, args.train_batch_size)
        self.denoiser_part, self.loader = prepare_first_part(
            acc, self.trained_folder, self.denoiser, optimizer, scheduler,
            dataloader=None if deal_here else loader, max_grad_norm=args.max_grad_norm,
            ema=("cpu" if args.offload_ema else True) if args.use_ema else False,
        )  # fmt: skip
        if deal_here:
            self.loader = group_loader(loader, acc, self.job.data_processes, self.job.data_rank)
        part = self.denoiser_part
        self.denoiser, self.optimizer, self.lr_scheduler, self.ema = part.engine, part.optimizer, part.lr_scheduler, part.ema  # fmt: skip
        # a stream's epochs end when the stream does: its steps bound the run
        if not args.streaming:
            args.num_train_epochs = epochs_for(
                args.max_train_steps, updates_per_epoch(len(self.loader), accumulation)
            )
        else:
            args.num_train_epochs = args.max_train_steps
        if acc.is_main_process and args.report_to != "none":
            acc.init_trackers(args.tracker_project_name, args.scalars())
        self.extra_parts = self.extra_trained_parts()
        self.parts = TrainedParts(part, self.extra_parts, self.schedule, self.job.cp)
        resumed = resume_training(
            acc, args.output_dir, args.resume_from_checkpoint, ema=self.ema,
            check=self.data.check_resumable,  # before anything is loaded: where would the data resume?
            parts=self.extra_parts, fallback=args.resume_fallback,
        )  # fmt: skip
        if resumed is not None:
            path, state = resumed
            self.global_step, self.first_epoch = state["global_step"], state["epoch"]
            self.data.resume(state, path)
            log_rank_zero(f"resumed from {path} at step {self.global_step}")
        elif args.resume_from_checkpoint:
            log_rank_zero("no checkpoint to resume from yet: starting a new run")

    def extra_trained_parts(self) -> list[TrainedModel]:
        """The job's other trained models, each with its optimizer (and engine under ZeRO-3),
        built after the first model's engine and before a resume: the second trained denoiser
        when two train. Every rank."""
        if self.second_denoiser is None:
            return []
        name, args = self.job.trained_folders[1], self.args
        return [
            prepare_second_denoiser(
                self.accelerator, name, self.second_denoiser, args, self.learning_rate, self.denoiser
            )
        ]

    # ------------------------------------------------------------------ training

    def loss(self, batch: dict) -> torch.Tensor:
        """The family's loss of one micro-batch with the denoiser this step trains, under its
        objective (the schedule's ``objective_kwargs``: Wan 2.2's expert on its side of the
        boundary) and loss arguments (``loss_kwargs``: Ideogram 4's transformer of the turn)."""
        # Each sample draws from its own generator (seed, epoch, dataset index): the same draws
        # whichever rank trains it, so a run resumed on another number of processes continues.
        generators = sample_generators(self.args.seed or 0, self.epoch, batch["index"])
        latents, cond, _ = self.frozen(batch, self.accelerator.device, generators)
        masked = {}
        if "loss_mask" in batch:  # --mask_column: each latent pixel weighs what it encodes of the mask
            masked["loss_weights"] = latent_loss_weights(batch["loss_mask"], latents)
        name = self.schedule.of_step(self.global_step)
        denoiser = self.parts.denoiser_of_step(self.global_step)
        objective = self.family.objective(
            self.noise_scheduler, self.objective_settings, **self.schedule.objective_kwargs(name)
        )
        kwargs = {**self.schedule.loss_kwargs(name), **masked}

        def loss_of(cond: dict) -> torch.Tensor:
            return self.family.objective_loss(denoiser, objective, latents, cond, generators, **kwargs)

        cp = self.job.cp  # a masked text of the batch's length: padded to split K ways
        return cp.split_loss(cond, latents, loss_of) if cp is not None else loss_of(cond)

    def train(self) -> list[float]:
        """The training loop; returns the logged per-step losses (all ranks call it).

        Per step, a ``step N loss X`` line (with the objective's metrics): on a terminal only
        into ``OUTPUT_DIR/<logging_dir>/train.log`` beside a progress bar, elsewhere printed as
        well (``training.report.StepOutput``)."""
        with StepOutput.of_run(self.args, self.accelerator, self.global_step) as steps, self.stop_signals:
            if self.global_step >= self.args.max_train_steps:
                log_rank_zero(f"the run is complete at step {self.global_step}: no step to train")
                return []
            losses = self._train_epochs(steps)
            steps.close()  # the bar ends before the memory table prints
            states = self.model_states or model_state_bytes(self.denoiser, self.optimizer, self.ema)
            self.model_states = log_training_end(self.memory, states, losses)
            self.data.log_end(self.accelerator)
        return losses

    def _train_epochs(self, steps: StepOutput) -> list[float]:
        args, acc = self.args, self.accelerator
        losses = []
        resumed_at, tally = self.global_step, StepTally(args.gradient_accumulation_steps)
        epochs = self.data.epochs_to_run(
            self.first_epoch,
            self.global_step,
            args.max_train_steps,
            self.loader,
            args.gradient_accumulation_steps,
        )
        for epoch in epochs:
            self.epoch = epoch
            self.data.set_epoch(epoch)
            done_in_epoch = self.data.resume_batches if epoch == self.first_epoch else 0
            for batch in epoch_batches(acc, self.loader, epoch, done_in_epoch):
                self._micro_batch(batch, tally)
                done_in_epoch += 1
                if not acc.sync_gradients:
                    continue
                losses.append(self._end_step(tally.close(), steps))
                if self.global_step % args.checkpointing_steps == 0:
                    self._checkpoint(epoch, done_in_epoch)
                if args.validation_steps and self.global_step % args.validation_steps == 0:
                    self.validate()
                if tally.stop:  # every rank: the step is done, its checkpoint published, then the job stops
                    self.stop_signals.checkpoint_and_stop(
                        "at step", self.global_step, args.checkpointing_steps,
                        functools.partial(self._checkpoint, epoch, done_in_epoch),
                    )  # fmt: skip
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
        return losses

    def _micro_batch(self, batch: dict, tally: StepTally) -> None:
        """One micro-batch: loss, gathered records, backward, optimizer steps (every rank)."""
        acc, parts, first = self.accelerator, self.parts, not self.memory.has("first forward")
        with acc.accumulate(self.denoiser, *(p.engine for p in self.extra_parts if not p.own_engine)):
            loss = self.loss(batch)
            if first:
                self.memory.mark("first forward")
            tally.add(acc, loss, len(batch["index"]), self.stop_signals.flag(), self.batch_metrics)
            reached("train_step")
            tally.note_applied(parts.backward(acc, loss, self.global_step))
            if first:
                self.memory.mark("first backward")
            tally.note_applied(
                parts.step_first(acc, self.global_step, self._first_step_measures if first else None)
            )

    def _end_step(self, record, steps: StepOutput) -> float:
        """An optimizer step's end: the EMA steps of an applied update, the step's line and
        trackers' scalars; returns its loss (every rank)."""
        if self.nonfinite.record(record.applied, self.global_step + 1, record.bad_ranks):
            self.parts.step_emas(self.global_step)
        self.global_step += 1
        self.trained_steps += 1
        self.metric_history.append(record.metrics)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.accelerator.log({"train_loss": record.loss, "lr": lr, **record.metrics}, step=self.global_step)
        extra = "".join(f" {k} {v:.6f}" for k, v in record.metrics.items())
        line = f"step {self.global_step} loss {record.loss:.6f}{extra}"
        steps.step(line, loss=f"{record.loss:.4f}", lr=f"{lr:.2e}")
        return record.loss

    def _first_step_measures(self) -> None:
        """After the first optimizer step, before zero_grad (a plain optimizer's gradients still
        exist): the memory mark and the trained model's state bytes."""
        self.memory.mark("first optimizer step")
        self.model_states = model_state_bytes(self.denoiser, self.optimizer, self.ema)

    def _checkpoint(self, epoch: int, done_in_epoch: int) -> None:
        reached("checkpoint")
        path = save_training_checkpoint(
            self.accelerator, self.args.output_dir, self.global_step,
            self.data.position(epoch, done_in_epoch, self.loader), ema=self.ema,
            total_limit=self.args.checkpoints_total_limit, parts=self.extra_parts,
        )  # fmt: skip
        log_rank_zero(f"saved {path}")

    def validate(self) -> None:
        """Images for --validation_prompts from the (EMA) weights (an editing family's edits of
        --validation_image, written under their sources); every rank, rank 0 writes."""
        args, acc, family = self.args, self.accelerator, self.family
        if not args.validation_prompts:
            return
        reached("validation")
        sources = validation_sources(args, self.job.reads_pairs)  # an editing family's, read once
        with self.frozen.validation_modules(acc) as modules, self.parts.averaged_weights():
            extra = {part.name: part.module for part in self.extra_parts}  # encoders, a second denoiser
            modules.update(extra)
            trained = {self.trained_folder: getattr(self.denoiser, "module", self.denoiser), **extra}
            with pipeline_denoisers(
                acc, family, self.source, self.component_sources, trained, args, self.frozen.dtype
            ) as denoiser:
                scheduler = family.sampling_scheduler(self.noise_scheduler)
                pipeline = family.pipeline(denoiser, modules["vae"], modules, self.tokenizers, scheduler)
                pipeline = family.prepare_validation_pipeline(pipeline, args.resolution)
                images = generate_validation_images(
                    pipeline, args.validation_prompts, size=(args.height or args.resolution, args.width or args.resolution),
                    num_inference_steps=args.num_validation_inference_steps, seed=args.seed or 0,
                    dtype=self.frozen.dtype, sources=sources,
                    **family.validation_kwargs(args.max_sequence_length, args.guidance_scale),
                )  # fmt: skip
        if acc.is_main_process:
            write_validation(images, sources, args.output_dir, self.global_step, acc.trackers)

    # ------------------------------------------------------------------ output

    def save(self) -> None:
        """The final pipeline folder, or the LoRA weights under ``--rank`` (every rank); kept as
        is when resuming a finished run trained no step and the folder is complete."""
        args, family = self.args, self.family
        reached("final_save")
        marker = LORA_WEIGHT_NAME if args.rank is not None else "model_index.json"
        if self.trained_steps == 0 and (Path(args.output_dir) / marker).exists():
            log_rank_zero(f"output: {os.path.abspath(args.output_dir)} (already complete)")
            finish_trackers(self.accelerator)
            return
        if args.rank is not None:
            with self.parts.averaged_weights():
                others = {p.name: p.engine for p in self.extra_parts}
                path = save_lora_zero3(self.denoiser, family, args.output_dir, others=others)
            finish_trackers(self.accelerator)
            log_run_outputs(("LoRA weights", path, lora_loader_hint(family)), args, family.video)
            return
        save_final_pipeline(
            self.source, args.output_dir, self.denoiser, ema=self.ema, readme=pipeline_card(args, family),
            denoiser_name=self.trained_folder,
            given=given_components(self.source, self.component_sources, family, self.tokenizers),
            trained={part.name: (part.engine, part.ema) for part in self.extra_parts},
        )  # fmt: skip
        finish_trackers(self.accelerator)
        weights = ("pipeline", args.output_dir, f"{family.pipeline_class}.from_pretrained")
        log_run_outputs(weights, args, family.video)


def _tokenize(family, tokenizers: dict, max_sequence_length: int | None, captions: list[str]) -> dict:
    """The family's token ids of ``captions`` at ``--max_sequence_length``."""
    return family.tokenize(tokenizers, captions, max_sequence_length)
