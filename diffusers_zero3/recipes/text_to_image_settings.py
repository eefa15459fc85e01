"""The settings of ``scripts/train_text_to_image.py`` (``TextToImageSettings``: diffusers'
text-to-image flags and this package's own; the DreamBooth, ControlNet and DPO settings extend
it) and their checks: ``validate_args`` (before anything loads), ``validate_family`` (once the
pipeline's family is known), ``check_resolution`` (against the VAE). The shared flag groups and
the parser live in ``diffusers_zero3.args``."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import ClassVar

from ..args import (
    NON_NEGATIVE_FLAGS,
    PLACEMENT_SUFFIX,
    ArgumentError,
    CommonSettings,
    check_positive,
    component_overrides,
    component_pairs_flag,
    component_placements,
    flag,
    frozen_placement_help,
    placement_flag,
    validate_common_args,
)
from ..data.images import INTERPOLATION_MODES
from ..families.objectives import TIMESTEP_BIAS_STRATEGIES, WEIGHTING_SCHEMES

TEXT_TO_IMAGE_POSITIVE_FLAGS = (
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_train_samples",
    "validation_epochs",
    "validation_steps",
    "num_validation_inference_steps",
    "num_validation_images",
    "lr_num_cycles",
)


# ------------------------------------------------------------------ text to image


@dataclasses.dataclass
class TextToImageSettings(CommonSettings):
    """The settings of ``scripts/train_text_to_image.py``: diffusers' text-to-image flags
    (also those of its SDXL, SD3, Flux and LoRA scripts) and this package's own. The
    DreamBooth, ControlNet and DPO settings extend it."""

    DESCRIPTION: ClassVar[str] = "Fine-tune a diffusion pipeline's denoiser under DeepSpeed ZeRO-3."
    TRAINS_TEXT_ENCODERS: ClassVar[bool] = False  # --train_text_encoder works (DreamBooth's script)
    # --- where each frozen model lives (a family without the component refuses its flag)
    text_encoder_placement: str | None = placement_flag("replicate", frozen_placement_help("text_encoder"))
    text_encoder_2_placement: str | None = placement_flag(None, frozen_placement_help("text_encoder_2"))
    text_encoder_3_placement: str | None = placement_flag(None, frozen_placement_help("text_encoder_3"))
    text_encoder_4_placement: str | None = placement_flag(None, frozen_placement_help("text_encoder_4"))
    connectors_placement: str | None = placement_flag(None, frozen_placement_help("connectors"))
    audio_vae_placement: str | None = placement_flag(None, frozen_placement_help("audio_vae"))
    vocoder_placement: str | None = placement_flag(None, frozen_placement_help("vocoder"))
    vae_placement: str | None = placement_flag("replicate", frozen_placement_help("vae"))
    # --- diffusers' flags (same names, defaults and meanings)
    input_perturbation: float = flag(0, "The scale of input perturbation (0.1 recommended).")
    revision: str | None = flag(None, "Revision of the pretrained model.")
    variant: str | None = flag(None, "Variant of the model files, e.g. fp16.")
    dataset_name: str | None = flag(None, "A datasets hub name or local dataset path.")
    dataset_config_name: str | None = flag(None, "The config of the dataset.")
    train_data_dir: str | None = flag(None, "An imagefolder with metadata.jsonl captions.")
    image_column: str = flag("image", "The column holding images.")
    caption_column: str = flag("text", "The column holding captions.")
    max_train_samples: int | None = flag(None, "Truncate the training set (debugging).")
    validation_prompts: list[str] | None = flag(None, "Prompts for validation images.")
    validation_prompt: str | None = flag(
        None,
        "A prompt that is used during validation to verify that the model is learning (diffusers' SDXL, "
        "LoRA and DreamBooth spelling: --num_validation_images images of it, after --validation_prompts).",
    )
    num_validation_images: int = flag(
        4, "Number of images that should be generated during validation with `validation_prompt`."
    )
    cache_dir: str | None = flag(None, "Where downloaded models and datasets are stored.")
    center_crop: bool = flag(False, "Center crop instead of random crop.")
    random_flip: bool = flag(False, "Randomly flip images horizontally.")
    num_train_epochs: int = flag(100)
    gradient_accumulation_steps: int = flag(1)
    gradient_checkpointing: bool = flag(False, "Trade compute for memory in the UNet.")
    scale_lr: bool = flag(False, "Scale lr by GPUs, accumulation and batch size.")
    lr_scheduler: str = flag("constant", "A diffusers.optimization scheduler name.")
    lr_warmup_steps: int = flag(500)
    lr_num_cycles: int = flag(1, "Number of hard resets of the lr in cosine_with_restarts scheduler.")
    lr_power: float = flag(1.0, "Power factor of the polynomial scheduler.")
    snr_gamma: float | None = flag(None, "Min-SNR weighting gamma (5.0 recommended).")
    dream_training: bool = flag(False, "DREAM training (arXiv:2312.00210).")
    dream_detail_preservation: float = flag(1.0)
    use_8bit_adam: bool = flag(False, "bitsandbytes 8-bit Adam.")
    allow_tf32: bool = flag(False, "Allow TF32 on Ampere GPUs.")
    offload_ema: bool = flag(False, "Keep the EMA partitions in CPU memory.")
    foreach_ema: bool = flag(False, "Accepted for compatibility: ShardedEMA gathers nothing.")
    non_ema_revision: str | None = flag(None, "Revision of the UNet to train from (default --revision).")
    dataloader_num_workers: int | None = flag(
        None,
        "Loader worker processes (decoding threads with --streaming). Default: 0 on the CPU (as diffusers); "
        "on a CUDA host min(4, cores per local process - 1), at least 1, with pinned batches.",
    )
    push_to_hub: bool = flag(False, "Not supported here (no hub access is assumed).")
    hub_token: str | None = flag(None)
    hub_model_id: str | None = flag(None)
    prediction_type: str | None = flag(None, "'epsilon' or 'v_prediction'; default: the scheduler's.")
    local_rank: int = flag(-1, "Set by launchers (LOCAL_RANK wins).")
    enable_xformers_memory_efficient_attention: bool = flag(False)
    noise_offset: float = flag(0, "The scale of noise offset.")
    validation_epochs: int | None = flag(5, "Run validation every X epochs.")
    # --- diffusers' SDXL script's own flags (train_text_to_image_sdxl.py)
    pretrained_vae_model_name_or_path: str | None = flag(
        None,
        "A VAE folder (or hub id) to use instead of the pipeline's, e.g. an fp16-safe SDXL VAE "
        "(the same as --component vae=PATH).",
    )
    proportion_empty_prompts: float = flag(0, "Proportion of captions replaced by empty strings (0 to 1).")
    timestep_bias_strategy: str = flag(
        "none", "Bias timestep sampling toward earlier or later timesteps, or a range.",
        choices=TIMESTEP_BIAS_STRATEGIES,
    )  # fmt: skip
    timestep_bias_multiplier: float = flag(1.0, "Weight multiplier of the biased timesteps.")
    timestep_bias_begin: int = flag(0, "First timestep of the 'range' bias.")
    timestep_bias_end: int = flag(1000, "End (exclusive) of the 'range' bias.")
    timestep_bias_portion: float = flag(0.25, "Portion of timesteps 'earlier'/'later' bias.")
    # --- diffusers' SD3 and Flux scripts' flags (train_dreambooth_sd3.py, train_dreambooth_flux.py)
    weighting_scheme: str | None = flag(
        None,
        "Flow matching's timestep density and loss weighting (default: logit_normal for SD3, none for Flux).",
        choices=WEIGHTING_SCHEMES,
    )
    logit_mean: float = flag(0.0, "Mean of the logit_normal weighting scheme.")
    logit_std: float = flag(1.0, "Std of the logit_normal weighting scheme.")
    mode_scale: float = flag(1.29, "Scale of the mode weighting scheme.")
    guidance_scale: float = flag(
        3.5,
        "Guidance value of guidance-distilled Flux (transformer.config.guidance_embeds), in training and validation.",
    )
    max_sequence_length: int | None = flag(
        None, "T5 tokens per caption (default: 77 for SD3, 512 for Flux, as diffusers' scripts)."
    )
    # --- diffusers' LoRA scripts' flags (train_text_to_image_lora.py, train_dreambooth_lora_*.py)
    rank: int | None = flag(
        None,
        "Train LoRA adapters of this rank on the frozen denoiser instead of the whole denoiser "
        "(diffusers' LoRA scripts use 4); the output is pytorch_lora_weights.safetensors.",
    )
    lora_alpha: float | None = flag(None, "LoRA alpha (default: the rank).")
    lora_dropout: float = flag(0.0, "Dropout of the LoRA layers.")
    lora_layers: str | None = flag(
        None, "Comma-separated modules to adapt (default: the family's, as diffusers' LoRA scripts)."
    )
    use_dora: bool = flag(
        False,
        "Whether to train a DoRA as proposed in- DoRA: Weight-Decomposed Low-Rank Adaptation "
        "https://huggingface.co/papers/2402.09353 (peft's LoraConfig(use_dora=True); with --rank).",
    )
    # --- other flags of diffusers' text-to-image, DreamBooth and ControlNet scripts
    tokenizer_name: str | None = flag(
        None,
        "Pretrained tokenizer name or path if not the same as model_name (the same as --component tokenizer=PATH).",
    )
    train_text_encoder: bool = flag(
        False,
        "Train the text encoder(s) too, each its own ZeRO-3 engine with its own optimizer "
        "(train_dreambooth.py; the other scripts train the denoiser alone).",
    )
    set_grads_to_none: bool = flag(
        False,
        "Accepted for compatibility: gradients are already freed (set to None) after each step, by "
        "DeepSpeed's ZeRO-3 optimizer and by torch's zero_grad.",
    )
    enable_npu_flash_attention: bool = flag(
        False, "Whether or not to use npu flash attention (Ascend NPUs: not supported here)."
    )
    debug_loss: bool = flag(
        False, "debug loss for each image, if filenames are available in the dataset (not supported here)."
    )
    # --- diffusers' 2026 LoRA scripts' data flags (train_dreambooth_lora_krea2.py, Qwen-Image)
    use_aspect_ratio_buckets: bool = flag(
        False,
        "Train each image at the aspect-ratio bucket nearest its own shape (one bucket per "
        "micro-batch, the same on every rank); the buckets of --aspect_ratio_buckets, or about "
        "--resolution squared pixels at common ratios.",
        group="data",
    )
    aspect_ratio_buckets: str | None = flag(
        None, "Buckets as 'height,width;height,width;...' (with --use_aspect_ratio_buckets).", group="data"
    )
    caption_dropout: float | None = flag(
        None,
        "Probability of training a sample on the empty prompt (= --proportion_empty_prompts).",
        group="data",
    )
    image_interpolation_mode: str = flag(
        "bilinear", "The resize filter of training images.", choices=list(INTERPOLATION_MODES), group="data"
    )
    cache_latents: bool = flag(
        False, "Encode the images with the VAE once, to a disk cache (= --vae_placement cache).", group="data"
    )
    streaming: bool = flag(
        False,
        "Stream --dataset_name (hub id, local parquet or webdataset shards) or --train_data_dir as training "
        "reads it, shuffled with a buffer; needs --max_train_steps. A resume goes on at the first unseen row.",
        group="data",
    )
    shuffle_buffer_size: int = flag(
        1000, "Rows in the shuffle buffer of --streaming (0: no shuffle).", group="data"
    )
    mask_column: str | None = flag(
        None,
        "A column of loss masks (grayscale images the size of their image: white trains, black is "
        "ignored; in between weighs in between), averaged down to the latents.",
        group="data",
    )
    # --- instruction editing (Flux.1 Kontext; data/pairs.py)
    source_image_column: str | None = flag(
        None,
        "The column of source images of an editing family (default source_image): one image or path per row, "
        "or a list of them (several sources per row, as many on every row).",
        group="data",
    )
    edit_prompt_column: str | None = flag(
        None, "The column of edit instructions (default: --caption_column).", group="data"
    )
    validation_image: list[str] | None = flag(
        None,
        "Source images an editing family's validation edits with its --validation_prompts (one for every "
        "prompt, or one per prompt); without it the prompts generate from text alone.",
        group="data",
    )
    # --- video families (Wan)
    num_frames: int | None = flag(None, "Frames per clip (1 + 4k for Wan; default 81).", group="video (Wan)")
    frame_stride: int = flag(1, "Source frames between two frames of a clip.", group="video (Wan)")
    fps: float | None = flag(None, "Take frames at this rate instead of --frame_stride.", group="video (Wan)")
    height: int | None = flag(None, "Clip height (default --resolution).", group="video (Wan)")
    width: int | None = flag(None, "Clip width (default --resolution).", group="video (Wan)")
    train_experts: str | None = flag(
        None,
        "Wan 2.2: train the high-noise expert (transformer), the low-noise one (transformer_2) or "
        "both, each its own ZeRO-3 engine (default both).",
        choices=["high", "low", "both"],
        group="video (Wan)",
    )
    train_denoisers: str | None = flag(
        None,
        "Ideogram 4: train transformer (the default, as diffusers' script), unconditional_transformer "
        "(its CFG negative branch: the image alone) or both, each its own ZeRO-3 engine, one a step in turn.",
        choices=["transformer", "unconditional", "both"],
    )
    # --- this package's flags
    context_parallel_size: int = flag(
        1,
        "Ranks that split each sample's token sequence (context parallelism beside ZeRO-3): groups of K "
        "consecutive ranks train the same samples, each on 1/K of the tokens; for denoisers with a "
        "context-parallel plan (Wan, Flux.1, Flux.2, Qwen-Image). 1: off.",
    )
    context_parallel_mode: str = flag(
        "ulysses",
        "Ulysses (the attention heads exchanged with an all-to-all; K must divide the heads) or ring "
        "(key/value chunks passed around; needs an attention backend with the log-sum-exp, e.g. flash).",
        choices=["ulysses", "ring"],
    )
    attention_backend: str | None = flag(
        None,
        "diffusers' attention backend of the trained denoiser (set_attention_backend: e.g. flash, "
        "_native_cudnn, sage; ring context parallelism needs one that returns the log-sum-exp). "
        "Default: the model's (native).",
    )
    component: list[str] = component_pairs_flag()
    frozen_cache_dir: str | None = flag(None, "Folder of 'cache' outputs (default: OUTPUT_DIR/frozen_cache).")
    validation_steps: int | None = flag(None, "Also validate every N steps.")
    num_validation_inference_steps: int = flag(20, "Denoising steps of validation images.")

    def merge_validation_prompt(self) -> None:
        """``--validation_prompt`` (diffusers' SDXL, LoRA and DreamBooth spelling): validate with
        ``--num_validation_images`` images of it, after those of ``--validation_prompts``. A
        recipe whose validation prompts go with other inputs (ControlNet's images) overrides it."""
        if self.validation_prompt:
            extra = [self.validation_prompt] * self.num_validation_images
            self.validation_prompts = [*(self.validation_prompts or []), *extra]

    def resolve(self) -> None:
        """``LOCAL_RANK`` wins over ``--local_rank`` and ``--non_ema_revision`` defaults to
        ``--revision``, as diffusers' ``parse_args`` does; ``--validation_prompt`` joins
        ``--validation_prompts`` (``merge_validation_prompt``)."""
        env_local_rank = int(os.environ.get("LOCAL_RANK", -1))
        if env_local_rank != -1 and env_local_rank != self.local_rank:
            self.local_rank = env_local_rank
        if self.non_ema_revision is None:
            self.non_ema_revision = self.revision
        if self.train_text_encoder and not self.TRAINS_TEXT_ENCODERS:
            raise ArgumentError(
                "--train_text_encoder: this script trains the denoiser alone; train_dreambooth.py trains the "
                "text encoders too (--train_text_encoder)"
            )
        self.merge_validation_prompt()
        if self.caption_dropout is not None:  # upstream's 2026 name of --proportion_empty_prompts
            if self.proportion_empty_prompts and self.proportion_empty_prompts != self.caption_dropout:
                raise ArgumentError("give --caption_dropout or --proportion_empty_prompts, not both")
            self.proportion_empty_prompts = self.caption_dropout
        if self.cache_latents:  # upstream's name of the VAE's cache placement
            if self.vae_placement not in (None, "replicate", "cache"):
                raise ArgumentError(
                    f"--cache_latents caches the VAE; it contradicts --vae_placement {self.vae_placement}"
                )
            self.vae_placement = "cache"
        if self.aspect_ratio_buckets and not self.use_aspect_ratio_buckets:
            raise ArgumentError("--aspect_ratio_buckets needs --use_aspect_ratio_buckets")


def validate_args(args: TextToImageSettings) -> None:
    """Raise ``ArgumentError`` naming the first flag of ``TextToImageSettings`` (or its subclasses': the
    text-to-image, DreamBooth, ControlNet and DPO scripts) that cannot work as given: the shared
    groups (``validate_common_args``), then the text-to-image flags."""
    validate_common_args(args)
    check_positive(args, TEXT_TO_IMAGE_POSITIVE_FLAGS)
    for name in NON_NEGATIVE_FLAGS:
        value = vars(args)[name]
        if value is not None and value < 0:
            raise ArgumentError(f"--{name} must not be negative, got {value}")
    if not 0 <= args.proportion_empty_prompts <= 1:
        raise ArgumentError(
            f"--proportion_empty_prompts must be between 0 and 1, got {args.proportion_empty_prompts}"
        )
    if args.timestep_bias_strategy != "none":
        if args.timestep_bias_multiplier <= 0:
            raise ArgumentError(
                f"--timestep_bias_multiplier must be positive, got {args.timestep_bias_multiplier}"
            )
        if not 0 <= args.timestep_bias_portion <= 1:
            raise ArgumentError(
                f"--timestep_bias_portion must be between 0 and 1, got {args.timestep_bias_portion}"
            )
        if (
            args.timestep_bias_strategy == "range"
            and not 0 <= args.timestep_bias_begin < args.timestep_bias_end
        ):
            raise ArgumentError(
                f"--timestep_bias_begin {args.timestep_bias_begin} and --timestep_bias_end {args.timestep_bias_end} "
                "do not make a range"
            )
    if args.rank is not None and args.rank <= 0:
        raise ArgumentError(f"--rank must be a positive number, got {args.rank}")
    if args.rank is not None and importlib.util.find_spec("peft") is None:
        raise ArgumentError(
            "--rank (LoRA) needs peft, which is not installed (pip install 'diffusers_zero3[lora]')"
        )
    if args.rank is None:
        for name, unset in (("lora_alpha", None), ("lora_dropout", 0.0), ("lora_layers", None),
                            ("use_dora", False)):  # fmt: skip
            if vars(args)[name] != unset:
                raise ArgumentError(f"--{name} applies to LoRA training: add --rank")
    if not 0 <= args.lora_dropout < 1:
        raise ArgumentError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.max_sequence_length is not None and args.max_sequence_length <= 0:
        raise ArgumentError(
            f"--max_sequence_length must be a positive number, got {args.max_sequence_length}"
        )
    if args.dataset_name is None and args.train_data_dir is None:
        raise ArgumentError("need either --dataset_name or --train_data_dir")
    if args.use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
        raise ArgumentError(
            "--use_8bit_adam needs bitsandbytes, which is not installed (pip install bitsandbytes)"
        )
    if args.enable_xformers_memory_efficient_attention and importlib.util.find_spec("xformers") is None:
        raise ArgumentError(
            "--enable_xformers_memory_efficient_attention needs xformers, which is not installed"
        )
    if args.enable_npu_flash_attention:
        raise ArgumentError(
            "--enable_npu_flash_attention is for Ascend NPUs (torch_npu), which this package does not run on"
        )
    if args.debug_loss:
        raise ArgumentError(
            "--debug_loss (the step's loss logged under each image's file name) is not supported by this script"
        )
    if args.push_to_hub:
        raise ArgumentError("--push_to_hub is not supported by this script; upload OUTPUT_DIR yourself")
    if args.prediction_type not in (None, "epsilon", "v_prediction"):
        raise ArgumentError(
            f"--prediction_type must be epsilon or v_prediction, got {args.prediction_type!r}"
        )


def validate_family(args: TextToImageSettings, family) -> None:
    """Raise ``ArgumentError`` for a flag that does not apply to the pipeline's family."""
    components = set(family.frozen_components)
    known = {family.denoiser, *components, *family.tokenizer_folders}
    for name in component_overrides(args):
        if name not in known:
            raise ArgumentError(
                f"--component {name}=...: a {family.pipeline_class} has no component {name} "
                f"(its components: {', '.join(sorted(known))})"
            )
    for component, placement in component_placements(args).items():
        # a script may place the denoiser too (the ControlNet script's frozen --unet_placement)
        if component not in components and component not in ("reward", "reference", family.denoiser):
            raise ArgumentError(
                f"--{component}{PLACEMENT_SUFFIX} {placement}: a {family.pipeline_class} has no {component} "
                f"(its frozen models: {', '.join(sorted(components))})"
            )
    if not family.video:
        for name, unset in (("num_frames", None), ("frame_stride", 1), ("fps", None), ("height", None),
                            ("width", None)):  # fmt: skip
            if vars(args)[name] != unset:
                raise ArgumentError(
                    f"--{name} applies to video families (Wan), not to a {family.pipeline_class}"
                )
    for name in ("source_image_column", "edit_prompt_column"):
        if vars(args)[name] is not None and not family.edits:
            raise ArgumentError(
                f"--{name} applies to editing families (Flux.1 Kontext, Qwen-Image-Edit-Plus, Flux.2), not to a "
                f"{family.pipeline_class}"
            )
    if args.train_experts is not None and family.denoiser_choice_flag != "--train_experts":
        raise ArgumentError(f"--train_experts applies to Wan 2.2's two experts, not to a {family.title}")
    if args.train_denoisers is not None and family.denoiser_choice_flag != "--train_denoisers":
        raise ArgumentError(
            f"--train_denoisers applies to Ideogram 4's two transformers, not to a {family.title}"
        )
    if args.train_denoisers not in (None, "transformer") and args.rank is not None:
        raise ArgumentError(
            f"--rank with --train_denoisers {args.train_denoisers}: the pipeline's load_lora_weights loads "
            "adapters into transformer only; train LoRA adapters on transformer (the default)"
        )
    if args.dream_training and not family.supports_dream:
        raise ArgumentError(f"--dream_training is not supported for {family.pipeline_class}")
    objective = "flow matching" if family.flow_matching else "DDPM noise prediction"
    unet_only = {  # flag: its value when not given
        "snr_gamma": None,
        "input_perturbation": 0,
        "noise_offset": 0,
        "prediction_type": None,
        "timestep_bias_strategy": "none",
    }
    flow_only = {"weighting_scheme": None, "max_sequence_length": None}
    for name, unset in (unet_only if family.flow_matching else flow_only).items():
        value = vars(args)[name]
        if value != unset:
            hint = (
                " (its CLIP encoders take their tokenizers' own length; DreamBooth's --tokenizer_max_length "
                "sets --max_sequence_length)"
                if name == "max_sequence_length"
                else ""
            )
            raise ArgumentError(
                f"--{name} {value} does not apply to a {family.pipeline_class}, which trains with {objective}{hint}"
            )


def check_resolution(resolution: int, family, vae_folder: str | os.PathLike) -> None:
    """Raise ``ArgumentError`` unless ``--resolution`` is a multiple of what the family's VAE
    (and its latent packing) needs; reads only the VAE's config."""
    try:
        vae_config = family.component_class("vae").load_config(vae_folder)
    except (OSError, ValueError) as e:
        raise ArgumentError(f"cannot read the VAE's config in {vae_folder}: {e}") from e
    multiple = family.latent_multiple(vae_config)
    if resolution % multiple:
        raise ArgumentError(
            f"--resolution must be a multiple of {multiple} for this {family.pipeline_class}, got {resolution}"
        )
