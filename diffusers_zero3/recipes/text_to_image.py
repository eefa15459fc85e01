"""The text-to-image trainer behind ``scripts/train_text_to_image.py`` (and the base of
``scripts/train_dpo.py``): ``TextToImageTrainer(args)`` with ``setup()``, ``train()``,
``save()``, each step a short method that a subclass can replace (``_make_dataset``,
``_loss``, ``_load_models``), for every family and for LoRA.

Every method runs on every rank (collectives inside: loading, frozen forwards, checkpoints,
validation, the final save).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

import torch

from ..args import (
    ArgumentError,
    TextToImageSettings,
    check_resolution,
    component_overrides,
    component_placements,
    validate_args,
    validate_family,
    validate_launch,
)
from ..data.buckets import (
    NO_BUCKET,
    BucketBatchSampler,
    BucketPosition,
    bucket_rows,
    default_buckets,
    describe_buckets,
    parse_buckets,
)
from ..data.images import (
    ImageCaptionDataset,
    check_enough_rows,
    collate,
    load_image_caption_dataset,
    prepare_image_column,
    resolve_columns,
)
from ..data.loading import cpus_per_local_process, loader_settings
from ..data.pairs import (
    SOURCE_COLUMN,
    PairedImageDataset,
    check_source_column,
    gives_edit_pairs,
    load_edit_dataset,
)
from ..data.streaming import (
    StreamedExamples,
    StreamedRows,
    load_streamed_dataset,
    prepare_streamed_image_column,
    streamed_loader,
)
from ..errors import DataError
from ..families import detect_family
from ..families.objectives import (
    ObjectiveSettings,
    latent_loss_weights,
    sample_generators,
    timestep_bias_weights,
)
from ..placement.frozen_inputs import place_frozen_models, resolve_component_sources
from ..placement.plan import resolve_auto_placements
from ..runtime.context_parallel import (
    SPLIT_FAILURE,
    ContextParallel,
    check_context_parallel,
    check_token_counts,
    context_parallel,
    enable_context_parallel,
    group_loader,
    pad_text_to_multiple,
    set_attention_backend,
)
from ..runtime.distributed import log_rank_zero, max_over_ranks
from ..runtime.ds_config import fill_auto_bucket_sizes, weight_dtype
from ..runtime.memory import MIB, MemoryLog, heap_bytes, model_state_bytes, return_large_frees_to_os
from ..runtime.notices import quiet_library_notices
from ..runtime.phases import reached
from ..state.ema import ShardedEMA
from ..state.pipeline_io import (
    check_output_dir,
    generate_validation_images,
    image_grid,
    model_card,
    pipeline_components,
    save_final_pipeline,
)
from ..state.pretrained import CheckpointError, resolve_model_folder
from ..state.resume import resume_training, save_training_checkpoint
from ..training.job import (
    accelerator_from_args,
    clear_interrupted_writes,
    finish_trackers,
    load_trainable_denoiser,
)
from ..training.lora import LORA_WEIGHT_NAME, add_lora_adapters, save_lora_zero3
from ..training.parts import adamw, backward_parts, prepare_extra_part, prepare_first_part, step_part
from ..training.report import StepOutput, log_outputs, step_log_path
from ..training.schedule import (
    batches_to_skip,
    epoch_batches,
    epochs_for,
    epochs_to_run,
    first_last_means,
    resume_position,
    scaled_learning_rate,
    updates_per_epoch,
)

logger = logging.getLogger("diffusers_zero3.recipes.text_to_image")


def live_text_for_caption_dropout(
    placements: dict[str, str],
    requested: dict[str, str],
    family,
    empty_prompt_probability: float,
    live: str = "shard",
) -> dict[str, str]:
    """The placements with every text encoder live when captions are emptied at random
    (``--proportion_empty_prompts`` / ``--caption_dropout``): a cache holds each row's own
    caption's embedding, so the emptied captions would be ignored without a word. A cache that
    ``auto`` chose becomes ``live`` (``shard`` under DeepSpeed, else ``replicate``; logged); one
    the user asked for is one error line."""
    if not empty_prompt_probability:
        return placements
    placements = dict(placements)
    for spec in family.text_encoders:
        if placements.get(spec.name) != "cache":
            continue
        if requested.get(spec.name, "auto") != "auto":
            raise ArgumentError(
                f"--{spec.name}_placement cache holds each row's caption embedding, so --proportion_empty_prompts "
                "/ --caption_dropout would be ignored: give replicate, shard or offload, or no caption dropout"
            )
        placements[spec.name] = live
        log_rank_zero(f"{spec.name}: {live}, not the cache 'auto' chose (caption dropout needs it live)")
    return placements


class TextToImageTrainer:
    """setup() -> train() -> save(); each step is a short method. All ranks call each.

    ``args`` is a ``TextToImageSettings`` (or a subclass's). A subclass may replace ``_load_data`` (it
    sets ``hf_dataset``, ``train_dataset``, ``collate_fn``, ``image_column``,
    ``caption_column``), ``_loss`` (which may leave per-micro-batch ``batch_metrics``, logged
    per step beside the loss, averaged over ranks) and extend ``_load_models``.
    """

    # Frozen outputs depend on the data alone (crops and flips are cached too): the planner
    # may cache them (--*_placement auto). A trainer whose inputs change sets this False.
    cacheable_data = True
    # Whether this trainer reads ImageCaptionDataset rows (_load_data), to which aspect-ratio
    # buckets and loss masks apply; a subclass with data of its own sets this False.
    image_caption_rows = True

    def __init__(self, args: TextToImageSettings):
        self.args = args
        self.global_step = 0
        self.first_epoch = 0
        self.epoch = 0
        self.resume_batches = 0
        self.trained_steps = 0
        self.collate_fn = collate
        self.buckets: list[tuple[int, int]] | None = None  # --use_aspect_ratio_buckets: (height, width)
        self.bucket_sampler = None  # buckets.BucketBatchSampler, with buckets
        self.bucket_start = None  # buckets.BucketPosition a resumed epoch continues from
        self.batch_metrics: dict[str, torch.Tensor] = {}
        self.metric_history: list[dict[str, float]] = []
        self.memory = MemoryLog()
        self.model_states: dict[str, int] | None = None  # bytes by kind, measured at the first step
        # Trained models beside the denoiser (parts.TrainedModel: DreamBooth's text encoders),
        # each its own engine, optimizer and schedule; a subclass adds them in _prepare_extra_parts.
        self.extra_parts: list = []
        self.trained_folder: str | None = None  # the first trained model's folder (set as it loads)
        self._second_expert = None  # Wan 2.2's low-noise expert, when both train
        self.cp: ContextParallel | None = None  # --context_parallel_size > 1
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
        self.component_sources = resolve_component_sources(
            self.family, self.source, component_overrides(args), args.revision, args.cache_dir
        )
        check_resolution(
            args.resolution, self.family, self.component_sources.get("vae", Path(self.source) / "vae")
        )
        if self.family.video:
            self._check_video_flags()
        self._check_data_flags()
        self.accelerator = acc = accelerator_from_args(args)
        try:
            self.placements, self.plan = resolve_auto_placements(
                component_placements(args),
                self.source,
                acc,
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
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        cached = sorted(name for name, placement in self.placements.items() if placement == "cache")
        if args.streaming and cached:
            raise ArgumentError(
                f"--streaming reads each row once per epoch as it trains; nothing to cache {', '.join(cached)} from: "
                "give those placements replicate, shard or offload"
            )
        self.placements = live_text_for_caption_dropout(
            self.placements, component_placements(args), self.family, args.proportion_empty_prompts,
            live="shard" if acc.state.deepspeed_plugin is not None else "replicate",
        )  # fmt: skip
        try:
            self.placements = self.family.settle_placements(self.placements)
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        if args.mask_column is not None and self.placements.get("vae") == "cache":
            raise ArgumentError(
                "--mask_column needs each step's crop and flip of the mask: give --vae_placement replicate or shard, "
                "not cache"
            )
        if self._reads_pairs and self.placements.get("vae") == "cache":
            raise ArgumentError(
                "editing pairs encode each step's source images with the live VAE: give --vae_placement replicate, "
                "shard or offload (not cache / --cache_latents)"
            )
        if self._reads_pairs and self.family.encodes_source_images:
            for spec in self.family.text_encoders:
                if self.placements.get(spec.name) == "cache":
                    raise ArgumentError(
                        f"{self.family.title}'s {spec.name} reads each step's source images: give "
                        f"--{spec.name}_placement replicate, shard or offload (not cache)"
                    )
        validate_launch(
            args,
            deepspeed_active=acc.state.deepspeed_plugin is not None,
            on_cpu=acc.device.type == "cpu",
            placements=self.placements,
            use_8bit_adam=args.use_8bit_adam,
        )
        self.cp = self._context_parallel()
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
        self._load_data()
        self._check_context_parallel_shapes()
        self._place_frozen()
        self.memory.mark("frozen models placed")
        self._prepare_training()
        self.memory.mark("prepared")

    def _context_parallel(self) -> ContextParallel | None:
        """``--context_parallel_size``: the groups of ranks that split each sample's sequence
        (None for 1); one error line for what cannot be split. Collective (it creates the
        groups' process groups)."""
        args = self.args
        if args.context_parallel_size == 1:
            return None
        try:
            check_context_parallel(
                args.context_parallel_size, args.context_parallel_mode, self.accelerator.num_processes
            )
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        if self.accelerator.state.deepspeed_plugin is None:
            raise ArgumentError(
                "--context_parallel_size needs DeepSpeed: launch with a ZeRO-3 accelerate config"
            )
        return context_parallel(
            args.context_parallel_size, args.context_parallel_mode, self.accelerator.device.type
        )

    def _check_context_parallel_shapes(self) -> None:
        """One error line at start for a training image shape (the resolution, or each bucket)
        whose tokens the context-parallel groups cannot split (a video's and an editing pair's
        are checked at their first batch). Not a collective."""
        if self.cp is None or self.family.video:
            return
        vae_config, denoiser_config = self._vae_config(), dict(self.denoiser.config)
        shapes = self.buckets or [(self.args.resolution, self.args.resolution)]
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

    def _data_state(self, state: dict) -> dict:
        """A checkpoint's state with ``world_size`` the processes that took different samples
        (``data_parallel_size`` where it was written under context parallelism)."""
        return {**state, "world_size": state.get("data_parallel_size", state["world_size"])}

    def _check_data_flags(self) -> None:
        """``--use_aspect_ratio_buckets`` and ``--mask_column`` where this trainer and family
        take them; one error line otherwise (before anything loads)."""
        args = self.args
        given = [flag for flag, on in (("--use_aspect_ratio_buckets", args.use_aspect_ratio_buckets),
                                       ("--mask_column", args.mask_column is not None),
                                       ("--streaming", args.streaming)) if on]  # fmt: skip
        if args.streaming:
            if args.max_train_steps is None:
                raise ArgumentError(
                    "--streaming needs --max_train_steps (a stream has no length to count epochs by)"
                )
            if given[0] != "--streaming":
                raise ArgumentError(f"{given[0]} with --streaming is not supported yet")
        if self._reads_pairs and (args.streaming or args.context_parallel_size > 1):
            flag = "--streaming" if args.streaming else "--context_parallel_size"
            raise ArgumentError(f"{flag} is not supported for editing pairs ({self.family.title}) yet")
        sources = args.validation_image if self.image_caption_rows else None  # ControlNet's are its own
        if sources:
            if not self.family.edits:
                raise ArgumentError(
                    f"--validation_image is the source image of an editing family's validation; a "
                    f"{self.family.pipeline_class} generates from --validation_prompts alone"
                )
            prompts = args.validation_prompts or []  # --validation_prompt joined them (args.resolve)
            if prompts and len(sources) not in (1, len(prompts)):
                raise ArgumentError(
                    "give one --validation_image for every --validation_prompts, or one per prompt"
                )
            for path in sources:
                if not os.path.isfile(path):
                    raise ArgumentError(f"--validation_image {path!r} is not a file")
            least = getattr(self.family, "least_source_side", 0)  # Flux.2's pipelines refuse smaller images
            if min(args.width or args.resolution, args.height or args.resolution) < least:
                raise ArgumentError(
                    f"--validation_image: {self.family.pipeline_class} takes source images of {least} px a side "
                    f"or more, and validation resizes them to the training size: train at {least} px or more, "
                    "or validate without --validation_image"
                )
        if given and not self.image_caption_rows:
            raise ArgumentError(f"{given[0]} is not supported by {type(self).__name__} yet")

    @property
    def _reads_pairs(self) -> bool:
        """Whether this trainer reads editing pairs (an editing family's image-caption rows)."""
        return self.family.edits and self.image_caption_rows

    def _validation_sources(self) -> list | None:
        """An editing family's source image of each validation prompt (``--validation_image``:
        one for all, or one per prompt), at the training resolution; None without them."""
        from PIL import Image

        paths, n = self.args.validation_image, len(self.args.validation_prompts or [])
        if not (self._reads_pairs and paths):
            return None
        size = (self.args.width or self.args.resolution, self.args.height or self.args.resolution)
        images = [Image.open(p).convert("RGB").resize(size, Image.BICUBIC) for p in paths]
        return images * n if len(images) == 1 else images

    def _validation_call(self) -> dict:
        """Validation's pipeline call besides the prompt, the source image and the generator, as
        the family's pipeline class takes it (``family.size_kwargs``): the model card's usage."""
        args = self.args
        size = self.family.size_kwargs(args.height or args.resolution, args.width or args.resolution)
        return {"num_inference_steps": args.num_validation_inference_steps, **size,
                **self.family.validation_kwargs(args.max_sequence_length, args.guidance_scale)}  # fmt: skip

    def _load_models(self) -> None:
        args, src = self.args, self.source
        self.noise_scheduler = self.family.load_noise_scheduler(src)
        self.weighting_scheme = args.weighting_scheme or self.family.default_weighting_scheme
        if args.prediction_type is not None:
            self.noise_scheduler.register_to_config(prediction_type=args.prediction_type)
        if args.dream_training and self.noise_scheduler.config.prediction_type != "epsilon":
            raise ArgumentError(
                "--dream_training supports epsilon prediction only (diffusers has no v-prediction DREAM)"
            )
        self.timestep_weights = (
            None
            if self.family.flow_matching
            else timestep_bias_weights(
                self.noise_scheduler.config.num_train_timesteps,
                args.timestep_bias_strategy,
                args.timestep_bias_multiplier,
                args.timestep_bias_begin,
                args.timestep_bias_end,
                args.timestep_bias_portion,
            )
        )
        self.objective_settings = ObjectiveSettings(
            snr_gamma=args.snr_gamma,
            noise_offset=args.noise_offset,
            input_perturbation=args.input_perturbation,
            dream_detail_preservation=args.dream_detail_preservation if args.dream_training else None,
            timestep_weights=self.timestep_weights,
            weighting_scheme=self.weighting_scheme,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
            guidance_scale=args.guidance_scale,
        )
        self.tokenizers = self.family.load_tokenizers(src, self.component_sources)
        self._load_trained_model()

    def _load_trained_model(self) -> None:
        """The first trained model, ``self.denoiser`` (the family's denoiser; a ControlNet for
        the ControlNet trainer), partitioned under ZeRO-3, with LoRA adapters under ``--rank``."""
        args, src = self.args, self.source
        folders = self._trained_folders()
        self.trained_folder = folders[0]
        self.denoiser = load_trainable_denoiser(
            self.accelerator, src, self.family, args.variant,
            self.component_sources.get(folders[0], Path(src) / folders[0]),
        )  # fmt: skip
        self._second_expert = None
        if len(folders) > 1:  # Wan 2.2 --train_experts both: the low-noise expert, its own engine
            self._second_expert = load_trainable_denoiser(
                self.accelerator, src, self.family, args.variant,
                self.component_sources.get(folders[1], Path(src) / folders[1]),
            )  # fmt: skip
        if len(getattr(self.family, "experts", ())) > 1:
            self.boundary = self.family.boundary(src)
            log_rank_zero(f"experts trained: {', '.join(folders)} (boundary at timestep {self.boundary:g})")
        elif hasattr(self.family, "trained_denoisers"):
            log_rank_zero(f"denoisers trained: {', '.join(folders)}")
        if args.rank is not None:
            targets = args.lora_layers.split(",") if args.lora_layers else self.family.lora_target_modules
            adapters = add_lora_adapters(
                self.denoiser,
                rank=args.rank,
                target_modules=targets,
                alpha=args.lora_alpha,
                dropout=args.lora_dropout,
                use_dora=args.use_dora,
                seed=args.seed or 0,  # the same initial adapters on any number of processes
            )
            plugin = self.accelerator.state.deepspeed_plugin
            if plugin is not None:  # the reduce bucket and sub-groups: the adapters' sizes now
                fill_auto_bucket_sizes(plugin.deepspeed_config, self.denoiser)
            log_rank_zero(
                f"LoRA rank {args.rank} on {', '.join(targets)}: {sum(p.numel() for p in adapters):,} trainable "
                f"parameters; the {self.family.denoiser} is frozen"
            )
        if args.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
            log_rank_zero(f"gradient checkpointing of the {self.family.denoiser}: on")
        if args.enable_xformers_memory_efficient_attention:
            self.denoiser.enable_xformers_memory_efficient_attention()

    def _load_data(self) -> None:
        args = self.args
        if self.family.video:
            self._load_video_data()
            return
        if args.streaming:
            self._load_streamed_data()
            return
        if self.family.edits:  # (source image(s), instruction) -> target pairs: data/pairs.py
            ds = load_edit_dataset(
                args.dataset_name, args.dataset_config_name, args.train_data_dir, args.cache_dir,
                args.image_column, args.source_image_column or SOURCE_COLUMN, args.edit_prompt_column or args.caption_column,
            )  # fmt: skip
        else:
            ds = load_image_caption_dataset(
                args.dataset_name, args.dataset_config_name, args.train_data_dir, args.cache_dir
            )
        self.image_column, self.caption_column = resolve_columns(
            ds.column_names, args.image_column, args.edit_prompt_column or args.caption_column
        )
        ds = prepare_image_column(ds, self.image_column, args.dataset_name or args.train_data_dir)
        dataset_class, pairs = ImageCaptionDataset, {}
        if self.family.edits:
            folder = args.dataset_name or args.train_data_dir
            pairs = {"source_column": args.source_image_column or SOURCE_COLUMN,
                     "source_root": folder if folder and os.path.isdir(folder) else None}  # fmt: skip
            count = check_source_column(ds, pairs["source_column"], pairs["source_root"])
            dataset_class = PairedImageDataset
            log_rank_zero(
                f"editing pairs: {count} source image(s) per target, column {pairs['source_column']!r}"
            )
        if args.mask_column is not None:
            if args.mask_column not in ds.column_names:
                raise DataError(
                    f"--mask_column {args.mask_column!r} is not a dataset column; columns are: {', '.join(ds.column_names)}"
                )
            ds = prepare_image_column(ds, args.mask_column, args.dataset_name or args.train_data_dir)
            log_rank_zero(f"loss masks: column {args.mask_column!r}, averaged down to the latents")
        ds = self._select_rows(ds)
        self.hf_dataset = ds
        row_buckets = self._bucket_rows(ds) if args.use_aspect_ratio_buckets else None
        self.train_dataset = dataset_class(
            ds,
            None,
            self.image_column,
            self.caption_column,
            args.resolution,
            args.center_crop,
            args.random_flip,
            seed=args.seed or 0,
            with_images=self.placements.get("vae") != "cache",
            tokenize=lambda captions: self.family.tokenize(
                self.tokenizers, captions, args.max_sequence_length
            ),
            empty_prompt_probability=args.proportion_empty_prompts,
            buckets=self.buckets,
            row_buckets=row_buckets,
            interpolation=args.image_interpolation_mode,
            mask_column=args.mask_column,
            **pairs,
        )
        if row_buckets is not None:
            self.train_dataset.skipped_rows.update(i for i, b in enumerate(row_buckets) if b == NO_BUCKET)

    def _load_streamed_data(self) -> None:
        """``--streaming``: the rows in each epoch's shuffled order (``streaming.StreamedRows``),
        decoded per rank by the loader's ``collate_fn`` (``streaming.StreamedExamples``)."""
        args = self.args
        source = load_streamed_dataset(
            args.dataset_name, args.dataset_config_name, args.train_data_dir, args.cache_dir
        )
        columns = source.column_names or list(next(iter(source)))
        self.image_column, self.caption_column = resolve_columns(
            columns, args.image_column, args.caption_column
        )
        # datasets Images, or struct<bytes, path> / image bytes / image paths as other tools write them
        source = prepare_streamed_image_column(
            source, self.image_column, args.dataset_name or args.train_data_dir
        )
        if args.max_train_samples is not None:
            source = source.take(args.max_train_samples)
        self.hf_dataset = None  # nothing to cache from: --streaming refuses the cache placement
        self.train_dataset = StreamedRows(
            source, self.image_column, global_batch=args.train_batch_size * self.data_processes,
            seed=args.seed or 0, shuffle_buffer_size=args.shuffle_buffer_size,
        )  # fmt: skip
        examples = ImageCaptionDataset(
            [], None, self.image_column, self.caption_column, args.resolution, args.center_crop, args.random_flip,
            seed=args.seed or 0, empty_prompt_probability=args.proportion_empty_prompts,
            interpolation=args.image_interpolation_mode,
            tokenize=lambda captions: self.family.tokenize(self.tokenizers, captions, args.max_sequence_length),
        )  # fmt: skip
        self.collate_fn = StreamedExamples(
            examples,
            self.image_column,
            threads=self.loading.num_workers,
            skipped_rows=self.train_dataset.skipped_rows,
        )
        log_rank_zero(
            f"streaming {args.dataset_name or args.train_data_dir} ({source.n_shards} shard(s)), shuffle buffer "
            f"{args.shuffle_buffer_size} rows"
        )

    def _bucket_rows(self, ds) -> list[int]:
        """``--use_aspect_ratio_buckets``: the buckets (``self.buckets``, from
        ``--aspect_ratio_buckets`` or ``--resolution``), each row's bucket, and the sampler that
        draws one bucket per global batch (``self.bucket_sampler``). Collective (every rank
        reads the image headers of its share)."""
        args = self.args
        multiple = self.family.latent_multiple(self._vae_config())
        try:
            if args.aspect_ratio_buckets:
                self.buckets = parse_buckets(args.aspect_ratio_buckets, multiple)
            else:
                self.buckets = default_buckets(args.resolution, multiple)
        except DataError as e:
            raise ArgumentError(str(e)) from e
        row_buckets = bucket_rows(ds, self.image_column, self.buckets)
        self._make_bucket_sampler(row_buckets)
        return row_buckets

    def _make_bucket_sampler(self, row_buckets: list[int]) -> None:
        """``self.bucket_sampler`` over ``self.buckets``, logged; one error line when no bucket
        fills a global batch."""
        args = self.args
        self.bucket_sampler = BucketBatchSampler(
            row_buckets, args.train_batch_size, self.data_processes, seed=args.seed or 0
        )
        log_rank_zero(describe_buckets(self.buckets, row_buckets, self.bucket_sampler.global_batch))
        if self.bucket_sampler.min_batches_per_epoch() == 0:
            raise DataError(
                f"no aspect-ratio bucket holds processes x --train_batch_size = {self.bucket_sampler.global_batch} "
                f"{'clips' if self.family.video else 'images'}: lower the batch size, use fewer buckets, or add data"
            )

    def _vae_config(self) -> dict:
        """The VAE's config (its folder, or the one ``--component vae=PATH`` gives)."""
        return self.family.component_class("vae").load_config(
            self.component_sources.get("vae", Path(self.source) / "vae")
        )

    def _select_rows(self, ds):
        """``--max_train_samples`` rows of ``ds`` (shuffled by the seed), checked to give every
        process a batch."""
        args = self.args
        if args.max_train_samples is not None:
            ds = ds.shuffle(seed=args.seed or 0).select(range(min(args.max_train_samples, len(ds))))
        check_enough_rows(len(ds), self.data_processes, args.train_batch_size)
        return ds

    def _place_frozen(self) -> None:
        """Frozen models by placement; 'cache' ones are run once over the data, then freed."""
        args = self.args
        self.frozen = place_frozen_models(
            self.accelerator,
            self.family,
            self.source,
            {name: self.placements.get(name) for name in self.family.frozen_components},
            dataset=self.hf_dataset,
            tokenizers=self.tokenizers,
            cache_dir=args.frozen_cache_dir or os.path.join(args.output_dir, "frozen_cache"),
            image_column=self.image_column,
            caption_column=self.caption_column,
            resolution=args.resolution,
            center_crop=args.center_crop,
            random_flip=args.random_flip,
            seed=args.seed or 0,
            batch_size=args.train_batch_size,
            variant=args.variant,
            component_sources=self.component_sources,
            max_sequence_length=args.max_sequence_length,
            clips=self.train_dataset if self.family.video else None,
            buckets=self.buckets,
            row_buckets=self.train_dataset.row_buckets if self.buckets is not None else None,
            interpolation=args.image_interpolation_mode,
        )
        if self.frozen.cache is not None:
            self.train_dataset.unreadable_rows = set(self.frozen.cache.skipped_rows)

    def _prepare_training(self) -> None:
        from diffusers.optimization import get_scheduler

        args, acc = self.args, self.accelerator
        if args.attention_backend is not None:
            for model in (self.denoiser, self._second_expert):
                if model is not None:
                    try:
                        set_attention_backend(model, args.attention_backend)
                    except ValueError as e:
                        raise ArgumentError(str(e)) from e
        if self.cp is not None:  # after LoRA's layers, so that the plan's modules are the wrapped ones
            for model in (self.denoiser, self._second_expert):
                if model is not None:
                    try:
                        enable_context_parallel(model, self.cp, acc.device, dtype=weight_dtype(acc))
                    except ValueError as e:
                        raise ArgumentError(str(e)) from e
        lr = args.learning_rate
        if args.scale_lr:
            lr = scaled_learning_rate(
                lr,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                train_batch_size=args.train_batch_size,
                num_processes=self.data_processes,
            )
        self._learning_rate = lr
        optimizer = adamw(self.denoiser, args, lr)  # the adapters alone under LoRA
        if args.streaming:  # accelerate deals each global batch out to the ranks
            loader = streamed_loader(
                self.train_dataset, self.collate_fn, args.train_batch_size, pin_memory=self.loading.pin_memory
            )
        elif self.bucket_sampler is not None:  # one bucket per global batch, dealt out to the ranks
            loader = torch.utils.data.DataLoader(
                self.train_dataset,
                batch_sampler=self.bucket_sampler,
                collate_fn=self.collate_fn,
                num_workers=self.loading.num_workers,
                pin_memory=self.loading.pin_memory,
            )
            # a loader with a batch sampler has no batch_size, from which accelerate fills "auto"
            plugin = acc.state.deepspeed_plugin
            if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
                plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.train_batch_size
        else:
            loader = torch.utils.data.DataLoader(
                self.train_dataset,
                shuffle=True,
                collate_fn=self.collate_fn,
                batch_size=args.train_batch_size,
                num_workers=self.loading.num_workers,
                pin_memory=self.loading.pin_memory,
                generator=torch.Generator().manual_seed(args.seed or 0),  # CPU: the sampler shuffles there
            )
        if args.max_train_steps is None:
            steps = updates_per_epoch(
                math.ceil(len(loader) / self.data_processes), args.gradient_accumulation_steps
            )
            args.max_train_steps = args.num_train_epochs * steps
        scheduler = get_scheduler(
            args.lr_scheduler,
            optimizer=optimizer,
            num_warmup_steps=args.lr_warmup_steps * acc.num_processes,
            num_training_steps=args.max_train_steps * acc.num_processes,
            num_cycles=args.lr_num_cycles,
            power=args.lr_power,
        )
        # The denoiser first: accelerate's backward drives the first engine it prepared.
        # Context parallelism: the loader dealt out to the groups, not to every rank.
        # A stream: dealt out per rank too, so that each rank decodes its own rows (accelerate's
        # prepare would dispatch it from rank 0, which then decodes every row).
        deal_here = self.cp is not None or args.streaming
        self.denoiser_part, self.loader = prepare_first_part(
            acc, self._first_part_name(), self.denoiser, optimizer, scheduler,
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
        engine and before a resume (every rank): Wan 2.2's low-noise expert when both train."""
        if self._second_expert is None:
            return
        from diffusers.optimization import get_scheduler

        args = self.args
        model = self._second_expert
        optimizer = adamw(model, args, self._learning_rate)
        first = self.denoiser if hasattr(self.denoiser, "save_checkpoint") else None
        per_update = 1 if first is not None else self.accelerator.num_processes
        scheduler = get_scheduler(
            args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps * per_update,
            num_training_steps=args.max_train_steps * per_update, num_cycles=args.lr_num_cycles,
            power=args.lr_power,
        )  # fmt: skip
        part = prepare_extra_part(self.accelerator, self._trained_folders()[1], model, optimizer, scheduler,
                                  first_engine=first, max_grad_norm=args.max_grad_norm)  # fmt: skip
        part.extra["expert"] = True
        if args.use_ema:
            part.ema = ShardedEMA(part.engine, device="cpu" if args.offload_ema else None)
        self.extra_parts.append(part)

    def _first_part_name(self) -> str:
        """The name of the loop's first trained model (in logs): the denoiser's folder."""
        return self.trained_folder

    def _trained_folders(self) -> list[str]:
        """The folders of the trained denoiser(s): the family's; for Wan 2.2 those of
        ``--train_experts`` (default both), the high-noise expert first; for Ideogram 4 those of
        ``--train_denoisers`` (default transformer)."""
        if hasattr(self.family, "trained_denoisers"):
            return list(self.family.trained_denoisers(self.args.train_denoisers))
        experts = getattr(self.family, "experts", ())
        if len(experts) < 2:
            return [self.family.denoiser]
        from ..families.wan import TRAIN_EXPERTS

        return list(TRAIN_EXPERTS[self.args.train_experts or "both"])

    def _expert_part(self):
        return next((p for p in self.extra_parts if p.extra.get("expert")), None)

    def _expert_of_step(self) -> str:
        """The Wan 2.2 expert this optimizer step trains (all micro-batches of a step alike);
        Ideogram 4's two denoisers (both trained) take the steps in turn."""
        folders = self._trained_folders()
        if len(folders) == 1:
            return folders[0]
        if len(getattr(self.family, "experts", ())) < 2:
            return folders[self.global_step % len(folders)]
        from ..families.wan import expert_of_step

        if not hasattr(self, "_p_high"):
            self._p_high = self.family.expert_probability(
                self.noise_scheduler, self.objective_settings, self.boundary
            )
        return expert_of_step(self.args.seed or 0, self.global_step, self._p_high)

    def _check_video_flags(self) -> None:
        """``--num_frames`` (default 81), ``--height`` and ``--width`` (default ``--resolution``)
        that the family's VAE can encode; one error line otherwise."""
        from ..data.video import check_video_shape

        args = self.args
        args.num_frames = args.num_frames or 81
        args.height, args.width = args.height or args.resolution, args.width or args.resolution
        try:
            check_video_shape(args.num_frames, args.height, args.width, self.family, self._vae_config())
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        if args.rank is not None and len(self._trained_folders()) > 1:
            raise ArgumentError(
                "--rank with --train_experts both: train LoRA adapters on one expert at a time"
            )
        if self.family.sound and args.context_parallel_size > 1:
            raise ArgumentError(
                f"--context_parallel_size with {self.family.title}: its audio stream is not split yet; train with 1"
            )

    def _load_video_data(self) -> None:
        from ..data.video import VideoCaptionDataset, load_video_caption_dataset

        args = self.args
        ds = load_video_caption_dataset(args.train_data_dir, args.caption_column)
        self.image_column, self.caption_column = "video", args.caption_column
        if args.max_train_samples is not None:
            raise ArgumentError(
                "--max_train_samples applies to image datasets; use a folder of the clips to train on"
            )
        check_enough_rows(len(ds), self.data_processes, args.train_batch_size)
        self.hf_dataset = ds
        try:
            clips = VideoCaptionDataset(
                ds, lambda captions: self.family.tokenize(self.tokenizers, captions, args.max_sequence_length),
                args.num_frames, args.resolution, height=args.height, width=args.width,
                frame_stride=args.frame_stride, fps=args.fps, center_crop=args.center_crop,
                random_flip=args.random_flip, seed=args.seed or 0, caption_column=args.caption_column,
                empty_prompt_probability=args.proportion_empty_prompts,
                with_videos=self.placements.get("vae") != "cache", mask_column=args.mask_column,
                **self._audio_of_clips(),
            )  # fmt: skip
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        if args.mask_column is not None:
            if args.mask_column not in ds.column_names:
                raise DataError(
                    f"--mask_column {args.mask_column!r} is not a column of the metadata; columns are: "
                    f"{', '.join(ds.column_names)}"
                )
            log_rank_zero(
                f"loss masks: the clips named in column {args.mask_column!r}, averaged down to the latents"
            )
        self.train_dataset = clips
        if args.use_aspect_ratio_buckets:
            self._bucket_clips(clips)

    def _audio_of_clips(self) -> dict:
        """``{"audio": AudioSpec}`` for a family that trains on the clips' sound (LTX-2: the
        audio VAE's rate, channels and mel bins), else nothing."""
        if not self.family.sound:
            return {}
        folder = self.component_sources.get("audio_vae", Path(self.source) / "audio_vae")
        config = self.family.component_class("audio_vae").load_config(folder)
        log_rank_zero(
            f"audio: each clip's sound at {config['sample_rate']} Hz, {config['mel_bins']} mel bins"
        )
        return {"audio": self.family.audio_spec(config)}

    def _bucket_clips(self, clips) -> None:
        """``--use_aspect_ratio_buckets`` for a video family: ``(frames, height, width)`` buckets
        (``--aspect_ratio_buckets "f,h,w;..."``, or ``"h,w"`` at ``--num_frames``; by default
        ``--height`` x ``--width``'s area at common ratios), each checked against the VAE; each
        clip in the longest bucket it holds, at the nearest ratio (collective: every rank probes
        its share of the clips' headers)."""
        from ..data.video import bucket_clips, check_video_shape, parse_video_buckets

        args = self.args
        vae_config = self._vae_config()
        try:
            if args.aspect_ratio_buckets:
                self.buckets = parse_video_buckets(args.aspect_ratio_buckets, args.num_frames)
            else:
                side = round(math.sqrt(args.height * args.width))
                spatial = default_buckets(side, self.family.latent_multiple(vae_config))
                self.buckets = [(args.num_frames, h, w) for h, w in spatial]
            for frames, height, width in self.buckets:
                check_video_shape(frames, height, width, self.family, vae_config)
        except ValueError as e:  # DataError too
            raise ArgumentError(f"--aspect_ratio_buckets: {e}") from e
        row_buckets = bucket_clips(clips, self.buckets)
        clips.set_buckets(self.buckets, row_buckets)
        clips.skipped_rows.update(i for i, b in enumerate(row_buckets) if b == NO_BUCKET)
        self._make_bucket_sampler(row_buckets)

    def _maybe_resume(self) -> None:
        processes, batch = self.data_processes, self.args.train_batch_size

        def check(state: dict) -> None:  # before anything is loaded: where would the data resume?
            if ("stream_rows" in state) != self.args.streaming:
                with_streaming = "with" if "stream_rows" in state else "without"
                raise CheckpointError(
                    f"the checkpoint at step {state['global_step']} was trained {with_streaming} --streaming: "
                    "resume it the same way"
                )
            if self.args.streaming:
                return  # rows consumed: resumable on any number of processes
            bucketed = "bucket_position" in state or "bucket_consumed" in state  # the latter: older
            if bucketed != (self.bucket_sampler is not None):
                with_buckets = "with" if bucketed else "without"
                raise CheckpointError(
                    f"the checkpoint at step {state['global_step']} was trained {with_buckets} "
                    "--use_aspect_ratio_buckets: resume it the same way"
                )
            if self.bucket_sampler is not None:
                if [list(b) for b in self.buckets] != state.get("buckets"):
                    raise CheckpointError(
                        f"the checkpoint at step {state['global_step']} was trained with the buckets "
                        f"{state.get('buckets')}, not {[list(b) for b in self.buckets]}: give the same "
                        "--aspect_ratio_buckets and --resolution"
                    )
                try:
                    BucketPosition.from_state(state)
                except ValueError as e:
                    raise CheckpointError(f"cannot resume from step {state['global_step']}: {e}") from e
                return  # a bucket position resumes on any number of processes
            try:
                batches_to_skip(self._data_state(state), processes, batch)
            except ValueError as e:
                raise CheckpointError(f"cannot resume from step {state['global_step']}: {e}") from e

        resumed = resume_training(
            self.accelerator,
            self.args.output_dir,
            self.args.resume_from_checkpoint,
            ema=self.ema,
            check=check,
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
        if self.args.streaming:  # the epoch's order goes on at its first unseen row
            self.train_dataset.start_at(self.first_epoch, int(state["stream_rows"]))
            self.resume_batches = 0
        elif self.bucket_sampler is not None:  # the epoch continues at each bucket's first unseen sample
            self.bucket_start = BucketPosition.from_state(state)
            self.bucket_sampler.start_at(self.bucket_start)
            self.resume_batches = 0
        else:
            self.resume_batches = batches_to_skip(self._data_state(state), processes, batch)
        if int(self._data_state(state)["world_size"]) != processes:
            log_rank_zero(
                f"{path} was written by {state['world_size']} processes; resharded for {processes} "
                f"(batch {self.resume_batches} of epoch {self.first_epoch} next)"
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
                counts = {
                    f"this batch's {k} ({tuple(v.shape)})": v.shape[1]
                    for k, v in cond.items()
                    if v.dim() == 3
                }
                try:
                    check_token_counts(counts, self.cp.size)
                except ValueError as err:
                    raise ArgumentError(str(err)) from None
                raise ArgumentError(
                    f"context parallelism cannot split this batch's image tokens (latents {tuple(latents.shape)}) "
                    f"{self.cp.size} ways: choose a shape (--resolution, --height/--width, buckets) that gives a multiple"
                ) from None
        return self._family_loss(batch, latents, cond, generators)

    def _family_loss(self, batch: dict, latents: torch.Tensor, cond: dict, generators) -> torch.Tensor:
        """The family's loss of one micro-batch, with the denoiser (or expert) of this step."""
        masked = {}
        if "loss_mask" in batch:  # --mask_column: each latent pixel weighs what it encodes of the mask
            masked["loss_weights"] = latent_loss_weights(batch["loss_mask"], latents)
        if hasattr(self.family, "trained_denoisers"):
            # Ideogram 4: the denoiser of this step (both trained: in turn), as the pipeline calls it
            trained = self._expert_of_step()
            denoiser = self.denoiser if trained == self.trained_folder else self._expert_part().engine
            return self.family.loss(
                denoiser, self.noise_scheduler, latents, cond, self.objective_settings, generators,
                trained=trained, **masked,
            )  # fmt: skip
        if len(getattr(self.family, "experts", ())) < 2:
            return self.family.loss(
                self.denoiser,
                self.noise_scheduler,
                latents,
                cond,
                self.objective_settings,
                generators,
                **masked,
            )
        # Wan 2.2: the expert of this step, on its side of the boundary (with both, one expert a
        # step, the same on every rank: each expert's engine is called in lockstep)
        expert = self._expert_of_step()
        denoiser = self.denoiser if expert == self.trained_folder else self._expert_part().engine
        return self.family.loss(
            denoiser, self.noise_scheduler, latents, cond, self.objective_settings, generators,
            expert=expert, boundary=self.boundary, **masked,
        )  # fmt: skip

    def _backward(self, loss: torch.Tensor) -> None:
        """The micro-batch's backward: the first trained model's through accelerate, then the
        other parts' from the gradients at their cut outputs (``parts.backward_parts``; under
        DDP the one backward reaches them), then their optimizer steps; on a Wan 2.2 step of
        the other expert (both trained), that expert alone (its backward, and its step at the
        boundary: its own engine under ZeRO-3, accelerate's backward and its own optimizer
        under DDP). Every rank, every micro-batch."""
        if self.cp is not None:  # ZeRO-3 averages over every rank: a group's shares make one sample
            loss = loss * self.cp.loss_scale
        part = self._expert_part()
        if part is not None and self._expert_of_step() == part.name:
            sync = self.accelerator.sync_gradients
            if part.own_engine:
                part.engine.set_gradient_accumulation_boundary(sync)
                part.engine.backward(loss)
            else:  # DDP: only this expert's module ran forward, so the one backward reaches it alone
                self.accelerator.backward(loss)
            step_part(part, self.accelerator, sync)
            return
        backward_parts(self.accelerator, loss, self.denoiser_part, self._cuts)
        self._cuts = []
        self._step_extra_parts()

    def _trains_this_step(self, part) -> bool:
        """Whether ``part`` trains on this optimizer step: False only for the Wan 2.2 expert that
        the step did not draw (``--train_experts both``). Its optimizer step, schedule step and
        EMA step are skipped then: AdamW moves weights even without a gradient (weight decay;
        its moments, where a gradient is zero rather than absent), a schedule stepped there
        runs ahead of the steps the expert trained, and an EMA step pulls the average toward
        weights that did not change. Every rank draws the same expert, so every rank skips
        alike (each ZeRO-3 engine stays in lockstep)."""
        if len(self._trained_folders()) < 2:
            return True
        return part.name == self._expert_of_step()

    def _step_extra_parts(self) -> None:
        """After the micro-batch's backward: each other trained model's optimizer step (its
        clipping, its schedule). Every rank, every micro-batch."""
        sync = self.accelerator.sync_gradients
        for part in self.extra_parts:
            if not part.extra.get("expert"):  # an expert steps on its own steps only (_backward)
                step_part(part, self.accelerator, sync)

    def train(self) -> list[float]:
        """The training loop; returns the logged per-step losses (all ranks call it).

        Per step, a ``step N loss X`` line (with the objective's metrics): on a terminal only
        into ``OUTPUT_DIR/<logging_dir>/train.log`` beside a progress bar, elsewhere printed as
        well (``training.report.StepOutput``)."""
        args, acc = self.args, self.accelerator
        with StepOutput(
            args.max_train_steps,
            initial=self.global_step,
            log_file=step_log_path(args.output_dir, args.logging_dir),
            bar=acc.is_local_main_process,
        ) as steps:
            return self._train_epochs(steps)

    def _train_epochs(self, steps: StepOutput) -> list[float]:
        args, acc = self.args, self.accelerator
        losses = []
        if self.global_step >= args.max_train_steps:
            log_rank_zero(f"the run is complete at step {self.global_step}: no step to train")
            return losses
        resumed_at = self.global_step
        for epoch in self._epochs_to_run():
            self.epoch = epoch
            self.train_dataset.set_epoch(epoch)
            if self.bucket_sampler is not None:
                self.bucket_sampler.set_epoch(epoch)
            if isinstance(self.collate_fn, StreamedExamples):  # the crops and captions of this epoch
                self.collate_fn.examples.set_epoch(epoch)
            done_in_epoch = self.resume_batches if epoch == self.first_epoch else 0
            accumulated, metrics = 0.0, {}
            for batch in epoch_batches(acc, self.loader, epoch, done_in_epoch):
                first = not self.memory.has("first forward")
                ddp_parts = [p.engine for p in self.extra_parts if not p.own_engine]
                with acc.accumulate(self.denoiser, *ddp_parts):
                    loss = self._loss(batch)
                    if first:
                        self.memory.mark("first forward")
                    accumulated += acc.gather(loss.detach().repeat(len(batch["index"]))).mean().item()
                    if self.batch_metrics:  # one gather for all of them
                        values = torch.stack([v.detach().float() for v in self.batch_metrics.values()])
                        means = acc.gather(values.unsqueeze(0)).mean(dim=0).tolist()
                        for name, mean in zip(self.batch_metrics, means):
                            metrics[name] = metrics.get(name, 0.0) + mean
                    reached("train_step")
                    self._backward(loss)
                    if first:
                        self.memory.mark("first backward")
                    # clipped at --max_grad_norm as diffusers' script (DeepSpeed: its gradient_clipping)
                    if self._trains_this_step(self.denoiser_part):
                        step_part(
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
                for part in [self.denoiser_part, *self.extra_parts]:
                    if part.ema is not None and self._trains_this_step(part):
                        part.ema.step()
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
                if self.global_step >= args.max_train_steps:
                    break
            if done_in_epoch == 0 and not (resumed_at and epoch == self.first_epoch):  # a stream too short
                raise DataError(
                    f"epoch {epoch} of the data gave no batch: it holds fewer rows than processes x "
                    f"--train_batch_size = {self.data_processes * args.train_batch_size}"
                )
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
        self._log_memory()
        if len(losses) >= 2:
            k, first, last = first_last_means(losses)
            log_rank_zero(
                f"loss: mean of the first {k} steps {first:.4f} -> mean of the last {k} steps {last:.4f}"
            )
        if isinstance(self.collate_fn, StreamedExamples):  # a collective: every rank
            decoded = acc.gather(torch.tensor([self.collate_fn.decoded_rows], device=acc.device)).tolist()
            log_rank_zero(f"streamed rows decoded per rank: {', '.join(str(n) for n in decoded)}")
        skipped = len(self.train_dataset.skipped_rows)
        if skipped:
            logger.warning("skipped %d unreadable image row(s) on rank %d", skipped, acc.process_index)
        return losses

    def _epochs_to_run(self) -> range:
        """The epochs from the first (a resume's) to ``--max_train_steps``, counted from the
        steps left and this run's epoch length (``schedule.epochs_to_run``): a run resumed on a
        smaller global batch has longer epochs, and ``args.num_train_epochs`` (the fresh run's
        count) can end before the epoch it resumes in."""
        args = self.args
        if args.streaming:  # epochs end when the stream does, each one step at least (else DataError)
            return range(self.first_epoch, self.first_epoch + 1 + args.max_train_steps - self.global_step)
        if self.bucket_sampler is not None:  # global batches = each rank's batches
            first = self.bucket_sampler.batches_in_epoch(self.first_epoch)  # from the resumed position
            per_epoch = self.bucket_sampler.min_batches_per_epoch()
        else:
            per_epoch = len(self.loader)
            first = max(0, per_epoch - self.resume_batches)
        return epochs_to_run(
            self.first_epoch, self.global_step, args.max_train_steps, first, per_epoch,
            args.gradient_accumulation_steps,
        )  # fmt: skip

    def _first_step_measures(self) -> None:
        """After the first optimizer step, before zero_grad (a plain optimizer's gradients still
        exist): the memory mark and the trained model's state bytes."""
        self.memory.mark("first optimizer step")
        self.model_states = model_state_bytes(self.denoiser, self.optimizer, self.ema)

    def _log_memory(self) -> None:
        """Log the RSS per phase and the trained model's state bytes (measured after the first
        optimizer step, before its gradients are zeroed), each the maximum over ranks
        (collectives: every rank calls it once, at the end of training)."""
        records = self.memory.gathered()
        states = self.model_states or model_state_bytes(self.denoiser, self.optimizer, self.ema)
        states = dict(zip(states, (int(v) for v in max_over_ranks(list(states.values())))))
        log_rank_zero("memory per rank (maximum over ranks):\n" + MemoryLog.format(records))
        log_rank_zero(
            "model states per rank: "
            + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in states.items())
            + f" (total {sum(states.values()) / MIB:.1f} MiB)"
        )
        heap = heap_bytes()
        heap = max_over_ranks(list(heap) if heap is not None else [-1, -1, -1])  # every rank the same call
        if heap[0] >= 0:
            log_rank_zero(
                f"glibc heap per rank at the end: in use {heap[0] / MIB:.1f} MiB, freed but held "
                f"{heap[1] / MIB:.1f} MiB, mmapped {heap[2] / MIB:.1f} MiB (the RSS counts all three)"
            )
        # On a GPU the states live in device memory: what torch's allocator held right after
        # the first optimizer step (marked just before the states above were counted) is the
        # device-side number to compare the planner's with (it also holds frozen models on the GPU).
        step = next((r for r in records if r.phase == "first optimizer step"), None)
        if step is not None and step.device_allocated:
            log_rank_zero(
                f"device memory per rank after the first optimizer step: {step.device_allocated / MIB:.1f} MiB"
                " allocated (model states above, plus frozen models and buffers on the device)"
            )
        self.model_states = states

    def _checkpoint(self, epoch: int, done_in_epoch: int) -> None:
        reached("checkpoint")
        if self.args.streaming:  # rows of the epoch's order consumed: resumable on any N
            rows = self.train_dataset.position_after(epoch, done_in_epoch)
            state = {"epoch": epoch, "batches_in_epoch": 0, "stream_rows": rows}
        elif self.bucket_sampler is not None:  # samples consumed per bucket: resumable on any N
            # the resumed position applies to its own epoch alone (position_after checks)
            position = self.bucket_sampler.position_after(epoch, done_in_epoch, self.bucket_start)
            state = {**position.to_state(), "batches_in_epoch": 0, "buckets": [list(b) for b in self.buckets]}
        else:
            state = resume_position(epoch, done_in_epoch, len(self.loader))
        state["train_batch_size"] = self.args.train_batch_size
        state["data_parallel_size"] = self.data_processes
        path = save_training_checkpoint(
            self.accelerator,
            self.args.output_dir,
            self.global_step,
            state,
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
        with contextlib.ExitStack() as stack:
            modules = stack.enter_context(self.frozen.validation_modules(acc))
            for ema in [self.ema, *(p.ema for p in self.extra_parts)]:
                if ema is not None:
                    stack.enter_context(ema.averaged_weights())
            modules.update({part.name: part.module for part in self.extra_parts})  # trained encoders, experts
            denoiser = stack.enter_context(self._validation_denoiser(modules))
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
                resolution=args.resolution,
                num_inference_steps=args.num_validation_inference_steps,
                seed=args.seed or 0,
                dtype=self.frozen.dtype,
                height=args.height,
                width=args.width,
                sources=self._validation_sources(),
                **self.family.validation_kwargs(args.max_sequence_length, args.guidance_scale),
            )
        if acc.is_main_process:
            folder = Path(args.output_dir) / "validation"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"step-{self.global_step:06d}.png"
            if images and isinstance(images[0], list):  # videos: an mp4 each, and their frames as a grid
                from ..data.video import write_validation_videos

                videos = write_validation_videos(images, folder, self.global_step)
                frames = [frame for video in images for frame in video]
                image_grid(frames, cols=len(images[0])).save(path)
                self._log_images(frames)
                log_rank_zero(f"validation videos: {', '.join(str(v) for v in videos)}; frames: {path}")
            else:  # an editing family's sources above their edits, so the grid shows what changed
                sources = self._validation_sources()
                image_grid([*sources, *images] if sources else images, cols=len(images)).save(path)
                self._log_images(images)
                log_rank_zero(f"validation images: {path}")

    @contextlib.contextmanager
    def _validation_denoiser(self, modules: dict):
        """The denoiser(s) for a validation pipeline: the trained one; for Wan 2.2 both experts
        (Ideogram 4 both transformers), the one not trained reloaded for the occasion
        (partitioned under ZeRO-3) and freed after. Collective: every rank."""
        trained = getattr(self.denoiser, "module", self.denoiser)
        # Wan 2.2's experts; Ideogram 4's transformer and unconditional_transformer
        experts = getattr(self.family, "experts", ()) or getattr(self.family, "pipeline_denoisers", ())
        if len(experts) < 2:
            yield trained
            return
        from ..placement.frozen import load_frozen_component

        have = {self.trained_folder: trained, **{n: m for n, m in modules.items() if n in experts}}
        reloaded = []
        for name in experts:
            if name not in have:
                folder = self.component_sources.get(name, Path(self.source) / name)
                frozen = load_frozen_component(
                    self.accelerator, Path(folder).parent, Path(folder).name, "cache",
                    self.family.denoiser_cls(), self.args.variant, dtype=self.frozen.dtype, label=name,
                )  # fmt: skip
                have[name] = frozen.module
                reloaded.append(frozen)
        try:
            yield {name: have[name] for name in experts}
        finally:
            for frozen in reloaded:
                frozen.release()

    def _index_entries(self) -> dict[str, list]:
        """``model_index.json`` entries for components given with ``--component`` that the
        source's index leaves empty (``[null, null]``), so the output loads on its own."""
        index = pipeline_components(self.source)
        entries = {}
        tokenizer_of = {spec.tokenizer: spec.name for spec in self.family.text_encoders}
        for name in self.component_sources:
            if index.get(name, [None])[0] is not None:
                continue
            if name in tokenizer_of:
                tokenizer = self.tokenizers[tokenizer_of[name]]
                entries[name] = [type(tokenizer).__module__.split(".")[0], type(tokenizer).__name__]
            else:
                entries[name] = list(self.family.component_library(name))
        return entries

    def _log_images(self, images) -> None:
        import numpy as np

        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                arr = np.stack([np.asarray(img) for img in images])
                tracker.writer.add_images("validation", arr, self.global_step, dataformats="NHWC")

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
            index_entries=self._index_entries(),
            trained={part.name: (part.engine, part.ema) for part in self.extra_parts},
        )
        finish_trackers(self.accelerator)
        loader = f"{self.family.pipeline_class}.from_pretrained"
        log_outputs([("pipeline", args.output_dir, loader), *self._run_outputs()])

    def _run_outputs(self) -> list[tuple[str, str | Path | None]]:
        """The summary's lines beside the trained weights, for ``log_outputs`` (which leaves out
        what does not exist: a run without validation has no validation folder): the validation
        samples (videos for a video family), the step lines (``train.log``) and TensorBoard's logs."""
        args = self.args
        logs = os.path.join(args.output_dir, args.logging_dir)
        samples = "validation videos" if self.family.video else "validation images"
        return [
            (samples, os.path.join(args.output_dir, "validation")),
            ("step log", step_log_path(args.output_dir, args.logging_dir)),
            ("TensorBoard logs", logs if args.report_to in ("tensorboard", "all") else None),
        ]
