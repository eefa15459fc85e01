"""Command line of ``scripts/train_text_to_image.py``: diffusers' flags, plus placements.

Every flag of diffusers' ``examples/text_to_image/train_text_to_image.py`` is accepted with
the same name, default and meaning, so an existing launch command works unchanged; a flag
that cannot apply here fails in ``validate_args`` with one clear message.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from .errors import ArgumentError
from .families.objectives import TIMESTEP_BIAS_STRATEGIES, WEIGHTING_SCHEMES

PLACEMENT_CHOICES = ("replicate", "shard", "offload", "cache")


def add_optimizer_args(parser: argparse.ArgumentParser, learning_rate: float = 1e-4) -> None:
    """AdamW and clipping flags, with diffusers' names and defaults."""
    a = parser.add_argument_group("optimizer").add_argument
    a("--learning_rate", type=float, default=learning_rate)
    a("--adam_beta1", type=float, default=0.9)
    a("--adam_beta2", type=float, default=0.999)
    a("--adam_weight_decay", type=float, default=1e-2)
    a("--adam_epsilon", type=float, default=1e-08)
    a("--max_grad_norm", default=1.0, type=float)


def add_tracking_args(parser: argparse.ArgumentParser, tracker_project_name: str) -> None:
    """Precision, trackers and logs, with diffusers' names and defaults."""
    a = parser.add_argument_group("precision and logging").add_argument
    a("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"])
    a("--report_to", type=str, default="tensorboard", help="tensorboard, wandb, all or none.")
    a("--logging_dir", type=str, default="logs", help="TensorBoard folder, inside --output_dir.")
    a("--tracker_project_name", type=str, default=tracker_project_name)


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """Checkpoints, rotation, resume and EMA (see ``diffusers_zero3.state.resume`` for the rules)."""
    a = parser.add_argument_group("checkpoints and EMA").add_argument
    a("--checkpointing_steps", type=int, default=500, help="Save a resumable checkpoint every N steps.")
    a("--checkpoints_total_limit", type=int, default=None, help="Keep the newest N checkpoints (N >= 1).")
    a("--resume_from_checkpoint", type=str, default=None, help="'latest' or a checkpoint folder.")
    a("--use_ema", action="store_true", help="Keep an EMA of the trained model (ShardedEMA under ZeRO-3).")


def add_placement_args(
    parser: argparse.ArgumentParser, components: dict[str, str], choices=PLACEMENT_CHOICES
) -> None:
    """One ``--<component>_placement`` flag per frozen model (``{component: help}``),
    ``--process_group_timeout`` and ``--return_freed_memory``."""
    group = parser.add_argument_group("placements of frozen models")
    for name, help_text in components.items():
        default = "replicate" if name in ("text_encoder", "vae") else None  # others: families that have them
        group.add_argument(f"--{name}_placement", default=default, choices=choices, help=help_text)
    group.add_argument(
        "--process_group_timeout", type=float, default=1800, help="Seconds before a collective gives up."
    )
    group.add_argument(
        "--return_freed_memory",
        action="store_true",
        help="Have glibc hand freed blocks of 1 MiB or more back to the OS (memory.return_large_frees_to_os): "
        "a lower peak RSS per rank for ZeRO-3 on CPU hosts, at the cost of page faults (slower steps).",
    )


def frozen_placement_help() -> dict[str, str]:
    """``{frozen component: help}`` for every frozen model folder of any family (each gets a
    ``--<name>_placement`` flag; a family without that component refuses the flag)."""
    from .families import ALL_FAMILIES, FROZEN_COMPONENTS

    helps = {}
    for name in FROZEN_COMPONENTS:
        owners = [
            f"{f.title}: {f.component_library(name)[1]}" for f in ALL_FAMILIES if name in f.frozen_components
        ]
        helps[name] = f"Where {name} lives ({'; '.join(owners)})."
    return helps


def add_component_arg(parser: argparse.ArgumentParser) -> None:
    """``--component NAME=PATH`` (repeatable): a pipeline component from another folder."""
    parser.add_argument(
        "--component",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="Load the pipeline component NAME (e.g. text_encoder_4, tokenizer_4, vae, transformer) from "
        "PATH, a folder or hub id that holds it, instead of the pipeline's own folder; repeatable. A text "
        "encoder's folder also gives its tokenizer when the pipeline has none. The output pipeline holds it.",
    )


def component_overrides(args: argparse.Namespace) -> dict[str, str]:
    """``{component: path}`` from ``--component NAME=PATH`` (and
    ``--pretrained_vae_model_name_or_path``, the same as ``--component vae=PATH``); raises
    ``ArgumentError`` for a value without ``=``, a name that is not a plain folder name, or a
    component given twice."""
    overrides: dict[str, str] = {}
    pairs = list(args.component or [])
    if args.pretrained_vae_model_name_or_path:
        pairs.append(f"vae={args.pretrained_vae_model_name_or_path}")
    for pair in pairs:
        name, sep, path = pair.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ArgumentError(f"--component takes NAME=PATH, got {pair!r}")
        if name in (".", "..") or "/" in name or "\\" in name:
            raise ArgumentError(f"--component {pair}: {name!r} is not a component folder name")
        if name in overrides:
            raise ArgumentError(f"--component {name} is given twice ({overrides[name]!r} and {path!r})")
        overrides[name] = path
    return overrides


def text_to_image_parser() -> argparse.ArgumentParser:
    """The argument parser: diffusers' text-to-image flags and this package's own."""
    p = argparse.ArgumentParser(description="Fine-tune a Stable Diffusion UNet under DeepSpeed ZeRO-3.")
    add_optimizer_args(p)
    add_tracking_args(p, "text2image-fine-tune")
    add_checkpoint_args(p)
    add_placement_args(p, frozen_placement_help(), choices=(*PLACEMENT_CHOICES, "auto"))
    a = p.add_argument
    # --- diffusers' flags (same names, defaults and meanings)
    a(
        "--input_perturbation",
        type=float,
        default=0,
        help="The scale of input perturbation (0.1 recommended).",
    )
    a(
        "--pretrained_model_name_or_path",
        type=str,
        default=None,
        required=True,
        help="Pipeline folder or hub id.",
    )
    a("--revision", type=str, default=None, help="Revision of the pretrained model.")
    a("--variant", type=str, default=None, help="Variant of the model files, e.g. fp16.")
    a("--dataset_name", type=str, default=None, help="A datasets hub name or local dataset path.")
    a("--dataset_config_name", type=str, default=None, help="The config of the dataset.")
    a("--train_data_dir", type=str, default=None, help="An imagefolder with metadata.jsonl captions.")
    a("--image_column", type=str, default="image", help="The column holding images.")
    a("--caption_column", type=str, default="text", help="The column holding captions.")
    a("--max_train_samples", type=int, default=None, help="Truncate the training set (debugging).")
    a("--validation_prompts", type=str, default=None, nargs="+", help="Prompts for validation images.")
    a("--output_dir", type=str, default="sd-model-finetuned", help="Where checkpoints and the pipeline go.")
    a("--cache_dir", type=str, default=None, help="Where downloaded models and datasets are stored.")
    a("--seed", type=int, default=None, help="A seed for reproducible training.")
    a("--resolution", type=int, default=512, help="Training image resolution.")
    a("--center_crop", default=False, action="store_true", help="Center crop instead of random crop.")
    a("--random_flip", action="store_true", help="Randomly flip images horizontally.")
    a("--train_batch_size", type=int, default=16, help="Batch size per device.")
    a("--num_train_epochs", type=int, default=100)
    a("--max_train_steps", type=int, default=None, help="Total optimisation steps; overrides epochs.")
    a("--gradient_accumulation_steps", type=int, default=1)
    a("--gradient_checkpointing", action="store_true", help="Trade compute for memory in the UNet.")
    a("--scale_lr", action="store_true", default=False, help="Scale lr by GPUs, accumulation and batch size.")
    a("--lr_scheduler", type=str, default="constant", help="A diffusers.optimization scheduler name.")
    a("--lr_warmup_steps", type=int, default=500)
    a("--snr_gamma", type=float, default=None, help="Min-SNR weighting gamma (5.0 recommended).")
    a("--dream_training", action="store_true", help="DREAM training (arXiv:2312.00210).")
    a("--dream_detail_preservation", type=float, default=1.0)
    a("--use_8bit_adam", action="store_true", help="bitsandbytes 8-bit Adam.")
    a("--allow_tf32", action="store_true", help="Allow TF32 on Ampere GPUs.")
    a("--offload_ema", action="store_true", help="Keep the EMA partitions in CPU memory.")
    a("--foreach_ema", action="store_true", help="Accepted for compatibility: ShardedEMA gathers nothing.")
    a("--non_ema_revision", type=str, default=None, help="Revision of the UNet to train from.")
    a("--dataloader_num_workers", type=int, default=0)
    a("--push_to_hub", action="store_true", help="Not supported here (no hub access is assumed).")
    a("--hub_token", type=str, default=None)
    a("--hub_model_id", type=str, default=None)
    a(
        "--prediction_type",
        type=str,
        default=None,
        help="'epsilon' or 'v_prediction'; default: the scheduler's.",
    )
    a("--local_rank", type=int, default=-1, help="Set by launchers.")
    a("--enable_xformers_memory_efficient_attention", action="store_true")
    a("--noise_offset", type=float, default=0, help="The scale of noise offset.")
    a("--validation_epochs", type=int, default=5, help="Run validation every X epochs.")
    # --- diffusers' SDXL script's own flags (train_text_to_image_sdxl.py)
    a(
        "--pretrained_vae_model_name_or_path",
        type=str,
        default=None,
        help="A VAE folder (or hub id) to use instead of the pipeline's, e.g. an fp16-safe SDXL VAE "
        "(the same as --component vae=PATH).",
    )
    a(
        "--proportion_empty_prompts",
        type=float,
        default=0,
        help="Proportion of captions replaced by empty strings (0 to 1).",
    )
    a(
        "--timestep_bias_strategy",
        type=str,
        default="none",
        choices=TIMESTEP_BIAS_STRATEGIES,
        help="Bias timestep sampling toward earlier or later timesteps, or a range.",
    )
    a(
        "--timestep_bias_multiplier",
        type=float,
        default=1.0,
        help="Weight multiplier of the biased timesteps.",
    )
    a("--timestep_bias_begin", type=int, default=0, help="First timestep of the 'range' bias.")
    a("--timestep_bias_end", type=int, default=1000, help="End (exclusive) of the 'range' bias.")
    a(
        "--timestep_bias_portion",
        type=float,
        default=0.25,
        help="Portion of timesteps 'earlier'/'later' bias.",
    )
    # --- diffusers' SD3 and Flux scripts' flags (train_dreambooth_sd3.py, train_dreambooth_flux.py)
    a(
        "--weighting_scheme",
        type=str,
        default=None,
        choices=WEIGHTING_SCHEMES,
        help="Flow matching's timestep density and loss weighting (default: logit_normal for SD3, none for Flux).",
    )
    a("--logit_mean", type=float, default=0.0, help="Mean of the logit_normal weighting scheme.")
    a("--logit_std", type=float, default=1.0, help="Std of the logit_normal weighting scheme.")
    a("--mode_scale", type=float, default=1.29, help="Scale of the mode weighting scheme.")
    a(
        "--guidance_scale",
        type=float,
        default=3.5,
        help="Guidance value of guidance-distilled Flux (transformer.config.guidance_embeds), in training and validation.",
    )
    a(
        "--max_sequence_length",
        type=int,
        default=None,
        help="T5 tokens per caption (default: 77 for SD3, 512 for Flux, as diffusers' scripts).",
    )
    # --- diffusers' LoRA scripts' flags (train_text_to_image_lora.py, train_dreambooth_lora_*.py)
    a(
        "--rank",
        type=int,
        default=None,
        help="Train LoRA adapters of this rank on the frozen denoiser instead of the whole denoiser "
        "(diffusers' LoRA scripts use 4); the output is pytorch_lora_weights.safetensors.",
    )
    a("--lora_alpha", type=float, default=None, help="LoRA alpha (default: the rank).")
    a("--lora_dropout", type=float, default=0.0, help="Dropout of the LoRA layers.")
    a(
        "--lora_layers",
        type=str,
        default=None,
        help="Comma-separated modules to adapt (default: the family's, as diffusers' LoRA scripts).",
    )
    # --- video families (Wan)
    v = p.add_argument_group("video (Wan)").add_argument
    v("--num_frames", type=int, default=None, help="Frames per clip (1 + 4k for Wan; default 81).")
    v("--frame_stride", type=int, default=1, help="Source frames between two frames of a clip.")
    v("--fps", type=float, default=None, help="Take frames at this rate instead of --frame_stride.")
    v("--height", type=int, default=None, help="Clip height (default --resolution).")
    v("--width", type=int, default=None, help="Clip width (default --resolution).")
    v("--train_experts", default=None, choices=["high", "low", "both"],
      help="Wan 2.2: train the high-noise expert (transformer), the low-noise one (transformer_2) or "
      "both, each its own ZeRO-3 engine (default both).")  # fmt: skip
    # --- this package's flags
    add_component_arg(p)
    a(
        "--frozen_cache_dir",
        type=str,
        default=None,
        help="Folder of 'cache' outputs (default: OUTPUT_DIR/frozen_cache).",
    )
    a("--validation_steps", type=int, default=None, help="Also validate every N steps.")
    a("--num_validation_inference_steps", type=int, default=20, help="Denoising steps of validation images.")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv``) and apply ``LOCAL_RANK`` like upstream."""
    args = text_to_image_parser().parse_args(argv)
    env_local_rank = int(os.environ.get("LOCAL_RANK", -1))
    if env_local_rank != -1 and env_local_rank != args.local_rank:
        args.local_rank = env_local_rank
    if args.non_ema_revision is None:
        args.non_ema_revision = args.revision
    return args


# flags of the groups every script shares (add_*_args) and of text_to_image_parser, by rule
COMMON_POSITIVE_FLAGS = (
    "train_batch_size",
    "max_train_steps",
    "checkpointing_steps",
    "checkpoints_total_limit",
    "resolution",
)
TEXT_TO_IMAGE_POSITIVE_FLAGS = (
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_train_samples",
    "validation_epochs",
    "validation_steps",
    "num_validation_inference_steps",
)
NON_NEGATIVE_FLAGS = ("lr_warmup_steps", "dataloader_num_workers", "noise_offset", "input_perturbation")
REPORT_TO = ("tensorboard", "wandb", "all", "none")


def check_positive(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """Raise ``ArgumentError`` for the first of ``flags`` that is set and not positive."""
    for flag in flags:
        value = vars(args)[flag]
        if value is not None and value <= 0:
            raise ArgumentError(f"--{flag} must be a positive number, got {value}")


def validate_common_args(args: argparse.Namespace) -> None:
    """Raise ``ArgumentError`` naming the first flag of the groups every script shares (its
    batch, steps, resolution, optimizer, tracking, checkpoint and placement flags) that cannot
    work as given. Checks the flags alone, before anything is built or written (an unknown
    ``--report_to`` would otherwise fail inside accelerate first)."""
    check_positive(args, COMMON_POSITIVE_FLAGS)
    if args.process_group_timeout <= 0:
        raise ArgumentError(f"--process_group_timeout must be positive, got {args.process_group_timeout}")
    if args.resolution % 8:
        raise ArgumentError(
            f"--resolution must be divisible by 8 (the VAE's downsampling and the pipelines need it), "
            f"got {args.resolution}"
        )
    if args.report_to not in REPORT_TO:
        raise ArgumentError(f"--report_to must be one of {', '.join(REPORT_TO)}, got {args.report_to!r}")
    if args.report_to in ("wandb", "all") and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--report_to wandb needs wandb, which is not installed")
    if args.report_to in ("tensorboard", "all") and importlib.util.find_spec("tensorboard") is None:
        raise ArgumentError(
            "--report_to tensorboard needs tensorboard (pip install tensorboard) or --report_to none"
        )


def validate_args(args: argparse.Namespace) -> None:
    """Raise ``ArgumentError`` naming the first flag of a ``text_to_image_parser`` namespace (the
    text-to-image, DreamBooth, ControlNet and DPO scripts) that cannot work as given: the shared
    groups (``validate_common_args``), then the text-to-image flags."""
    validate_common_args(args)
    check_positive(args, TEXT_TO_IMAGE_POSITIVE_FLAGS)
    for flag in NON_NEGATIVE_FLAGS:
        value = vars(args)[flag]
        if value is not None and value < 0:
            raise ArgumentError(f"--{flag} must not be negative, got {value}")
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
        for flag, unset in (("lora_alpha", None), ("lora_dropout", 0.0), ("lora_layers", None)):
            if vars(args)[flag] != unset:
                raise ArgumentError(f"--{flag} applies to LoRA training: add --rank")
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
    if args.push_to_hub:
        raise ArgumentError("--push_to_hub is not supported by this script; upload OUTPUT_DIR yourself")
    if args.prediction_type not in (None, "epsilon", "v_prediction"):
        raise ArgumentError(
            f"--prediction_type must be epsilon or v_prediction, got {args.prediction_type!r}"
        )


def validate_family(args: argparse.Namespace, family) -> None:
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
        for flag, unset in (("num_frames", None), ("frame_stride", 1), ("fps", None), ("height", None),
                            ("width", None)):  # fmt: skip
            if vars(args)[flag] != unset:
                raise ArgumentError(
                    f"--{flag} applies to video families (Wan), not to a {family.pipeline_class}"
                )
    if args.train_experts is not None and len(getattr(family, "experts", ())) < 2:
        raise ArgumentError(f"--train_experts applies to Wan 2.2's two experts, not to a {family.title}")
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
    for flag, unset in (unet_only if family.flow_matching else flow_only).items():
        value = vars(args)[flag]
        if value != unset:
            raise ArgumentError(
                f"--{flag} {value} does not apply to a {family.pipeline_class}, which trains with {objective}"
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


PLACEMENT_SUFFIX = "_placement"


def component_placements(args: argparse.Namespace) -> dict[str, str]:
    """``{component: placement}`` of every ``--<component>_placement`` flag of a script's
    namespace: the one place a flag's name becomes a component's."""
    return {
        k[: -len(PLACEMENT_SUFFIX)]: v
        for k, v in vars(args).items()
        if k.endswith(PLACEMENT_SUFFIX) and isinstance(v, str)
    }


def validate_launch(
    args: argparse.Namespace,
    *,
    deepspeed_active: bool,
    on_cpu: bool,
    placements: dict[str, str] | None = None,
    use_8bit_adam: bool = False,
) -> None:
    """Raise ``ArgumentError`` for a flag that cannot work under this launch (DeepSpeed or
    not, CPU or GPU). Call once the accelerator exists. ``placements`` (``{component:
    placement}``, ``auto`` resolved) are checked instead of the flags when given;
    ``use_8bit_adam`` is the script's ``--use_8bit_adam`` where it has one."""
    if use_8bit_adam and deepspeed_active:
        raise ArgumentError(
            "--use_8bit_adam cannot be used with DeepSpeed ZeRO-3 (its optimizer owns the partitions)"
        )
    if args.mixed_precision == "fp16" and on_cpu:
        raise ArgumentError("--mixed_precision fp16 does not run on CPU; use bf16 or no")
    for component, placement in (component_placements(args) if placements is None else placements).items():
        flag = f"{component}{PLACEMENT_SUFFIX}"
        if placement in ("shard", "offload") and not deepspeed_active:
            raise ArgumentError(
                f"--{flag} {placement} needs DeepSpeed: launch with `accelerate launch --config_file "
                "configs/accelerate_zero3.yaml ...`, or choose replicate"
            )
        if placement == "offload" and on_cpu:
            raise ArgumentError(f"--{flag} offload needs a GPU (the weights are already in CPU memory here)")
