"""Command line of the training scripts: each recipe's settings as one typed object.

A recipe's settings are a dataclass (``TextToImageSettings``, DreamBooth's, ControlNet's,
DPO's, GRPO's and the reward recipe's, each beside its trainer in ``recipes/``) whose fields are its flags: name, type, default,
help, choices. ``settings_parser(cls)`` turns the class into an ``argparse`` parser (as trl's
``HfArgumentParser`` turns its configs), ``cls.parse(argv)`` returns the typed object, and
library code reads attributes of it. Shared groups (optimizer, tracking, checkpoints,
placements) are base classes, so a flag is defined once for every recipe; a recipe changes a
shared flag's default with ``redefault``.

Every flag of diffusers' ``examples/text_to_image/train_text_to_image.py`` is accepted with
the same name, default and meaning, so an existing launch command works unchanged; a flag
that cannot apply here fails in ``recipes.text_to_image_settings.validate_args`` with one clear
message. The same holds for
its SDXL and LoRA text-to-image scripts, its DreamBooth and its ControlNet scripts
(``tests/data/upstream_flags.json``: their flags, read from a diffusers commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from .errors import ArgumentError
from .runtime.user_errors import USER_ERROR_EXIT, print_user_error

PLACEMENT_CHOICES = ("replicate", "shard", "offload", "cache")
FROZEN_PLACEMENT_CHOICES = (*PLACEMENT_CHOICES, "auto")
ENGINE_PLACEMENT_CHOICES = ("replicate", "shard", "offload")  # a model called live (no cache)

S = TypeVar("S", bound="Settings")


def flag(
    default: Any = None,
    help: str | Callable[[], str] = "",
    *,
    choices: Sequence[str] | None = None,
    required: bool = False,
    metavar: str | None = None,
    append: bool = False,
    group: str | None = None,
    as_value: bool = False,
) -> Any:
    """A settings field that is a command-line flag ``--<field name>``.

    Args:
        default: its value when not given (a list default is copied per object).
        help: the help text, or a function returning it (computed when the parser is built).
        choices: the values it accepts.
        required: the command line must give it.
        metavar: the value's name in the help.
        append: a list field that takes one value per repetition (``--component A --component B``);
            otherwise a list field takes one value or more after its flag (``nargs="+"``).
        group: the help section (default: the ``GROUP`` of the class that defines the field).
        as_value: a boolean field that takes a value (``--x true``/``--x false``), for upstream's
            ``type=bool`` flags that default to True; a plain boolean is ``store_true``.

    Example:
        >>> @dataclasses.dataclass
        ... class Mine(Settings):
        ...     steps: int = flag(10, "Optimisation steps.")
        >>> Mine.parse(["--steps", "3"]).steps
        3
    """
    metadata = {"help": help, "choices": choices, "required": required,
                "metavar": metavar, "append": append, "group": group, "as_value": as_value}  # fmt: skip
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def redefault(settings: type, name: str, default: Any) -> Any:
    """The field ``name`` of ``settings`` (help, choices, group) with another default: a
    recipe's own default of a shared flag, e.g. DreamBooth's ``learning_rate = redefault(
    TextToImageSettings, "learning_rate", 5e-6)``."""
    return flag(default, **settings.__dataclass_fields__[name].metadata)


def _value_type(hint: Any) -> tuple[Any, bool]:
    """``(type without None, whether None is allowed)`` of a field's annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        return members[0], len(members) < len(typing.get_args(hint))
    return hint, False


def parse_bool(text: str) -> bool:
    """The value of a boolean flag that takes one (``flag(..., as_value=True)``): true/false,
    yes/no, 1/0, any case. diffusers' ``type=bool`` flags read any non-empty text as True
    (``--prodigy_decouple False`` is True there); here False is False."""
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _argparse_kwargs(field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """``add_argument`` keywords of one settings field."""
    m = field.metadata
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    kind, _ = _value_type(hint)
    kwargs: dict[str, Any] = {"default": default, "help": m["help"]() if callable(m["help"]) else m["help"]}
    if kind is bool and m.get("as_value"):
        return {**kwargs, "type": parse_bool, "metavar": "{true,false}"}
    if kind is bool:
        if default is not False:
            raise TypeError(f"the boolean flag --{field.name} must default to False (it is store_true)")
        return {**kwargs, "action": "store_true"}
    if typing.get_origin(kind) is list:
        kwargs["type"] = typing.get_args(kind)[0]
        if m["append"]:
            kwargs["action"] = "append"
        else:
            kwargs["nargs"] = "+"
    else:
        kwargs["type"] = kind
    for key in ("choices", "metavar"):
        if m[key] is not None:
            kwargs[key] = m[key]
    if m["required"]:
        kwargs["required"] = True
    return kwargs


@dataclasses.dataclass
class Settings:
    """Base of every recipe's settings: a dataclass whose fields (made with ``flag``) are its
    command-line flags. ``DESCRIPTION`` is the parser's description, ``GROUP`` the help
    section of the fields a class defines."""

    DESCRIPTION: ClassVar[str] = ""
    GROUP: ClassVar[str | None] = None

    @classmethod
    def parse(cls: type[S], argv: Sequence[str] | None = None) -> S:
        """The settings from ``argv`` (default ``sys.argv``), resolved by ``resolve`` (which
        may raise ``ArgumentError``); a malformed command line exits as argparse does."""
        settings = cls(**vars(settings_parser(cls).parse_args(argv)))
        settings.resolve()
        return settings

    def resolve(self) -> None:
        """Fill the values that derive from others and check the recipe's own combinations
        (raise ``ArgumentError``). A subclass extends it; the base does nothing."""

    def scalars(self) -> dict[str, Any]:
        """``{flag: value}`` of the settings that are not lists: the hyper-parameters a tracker
        and a model card take (the flags alone: not what ``resolve`` derives from them)."""
        flags = (getattr(self, f.name) for f in dataclasses.fields(self))
        return {f.name: v for f, v in zip(dataclasses.fields(self), flags) if not isinstance(v, list)}


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose malformed command line is one ``error:`` line (printed once
    per launch: ``runtime.user_errors``) and exit status 2, instead of argparse's usage block
    (scores of lines for a trainer's flags) repeated by every rank."""

    def error(self, message: str):
        print_user_error(f"{message} (--help lists the flags)")
        sys.exit(USER_ERROR_EXIT)


def settings_parser(settings: type[Settings]) -> argparse.ArgumentParser:
    """An ``argparse`` parser with one ``--<name>`` flag per field of ``settings``, in field
    order, in help sections by the ``GROUP`` of the class that first defines each field; a
    malformed command line is one ``error:`` line (``OneLineErrorParser``)."""
    parser = OneLineErrorParser(description=settings.DESCRIPTION)
    hints = typing.get_type_hints(settings)
    sections: dict[str, argparse._ArgumentGroup] = {}
    for field in dataclasses.fields(settings):
        title = field.metadata.get("group")
        if title is None:
            owner = next(
                c for c in reversed(settings.__mro__) if field.name in vars(c).get("__annotations__", {})
            )
            title = vars(owner).get("GROUP")
        target = parser if title is None else sections.setdefault(title, parser.add_argument_group(title))
        target.add_argument(f"--{field.name}", **_argparse_kwargs(field, hints[field.name]))
    return parser


# ------------------------------------------------------------------ the groups every recipe shares


@dataclasses.dataclass
class OptimizerSettings(Settings):
    """Optimizer (AdamW, or Prodigy as diffusers' DreamBooth LoRA scripts offer) and clipping
    flags, with diffusers' names and defaults; ``training.parts.build_optimizer`` reads them."""

    GROUP: ClassVar[str | None] = "optimizer"
    learning_rate: float = flag(1e-4, "Learning rate (after warmup).")
    optimizer: str = flag(
        "AdamW",
        'The optimizer type to use. Choose between ["AdamW", "prodigy"] (any case). prodigy needs '
        "prodigyopt (pip install prodigyopt); it is usually run with --learning_rate 1.0.",
    )
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.999)
    adam_weight_decay: float = flag(1e-2)
    adam_epsilon: float = flag(1e-08)
    max_grad_norm: float = flag(1.0)
    prodigy_beta3: float | None = flag(
        None,
        "coefficients for computing the Prodigy stepsize using running averages. If set to None, "
        "uses the value of square root of beta2. Ignored if optimizer is adamW",
    )
    prodigy_decouple: bool = flag(True, "Use AdamW style decoupled weight decay", as_value=True)
    prodigy_use_bias_correction: bool = flag(
        True, "Turn on Adam's bias correction. True by default. Ignored if optimizer is adamW", as_value=True
    )
    prodigy_safeguard_warmup: bool = flag(
        True,
        "Remove lr from the denominator of D estimate to avoid issues during warm-up stage. True by "
        "default. Ignored if optimizer is adamW",
        as_value=True,
    )


@dataclasses.dataclass
class TrackingSettings(Settings):
    """Precision, trackers and logs, with diffusers' names and defaults."""

    GROUP: ClassVar[str | None] = "precision and logging"
    mixed_precision: str | None = flag(None, choices=["no", "fp16", "bf16"])
    report_to: str = flag("tensorboard", "tensorboard, wandb, all or none.")
    logging_dir: str = flag("logs", "TensorBoard folder, inside --output_dir.")
    tracker_project_name: str = flag("text2image-fine-tune")


@dataclasses.dataclass
class CheckpointSettings(Settings):
    """Checkpoints, rotation, resume and EMA (see ``diffusers_zero3.state.resume`` for the rules)."""

    GROUP: ClassVar[str | None] = "checkpoints and EMA"
    checkpointing_steps: int = flag(500, "Save a resumable checkpoint every N steps.")
    checkpoints_total_limit: int | None = flag(None, "Keep the newest N checkpoints (N >= 1).")
    resume_from_checkpoint: str | None = flag(None, "'latest' or a checkpoint folder.")
    resume_fallback: bool = flag(
        False,
        "With --resume_from_checkpoint latest: a damaged latest checkpoint (its files differ from its "
        "manifest) falls back to the newest intact one instead of stopping.",
    )
    use_ema: bool = flag(False, "Keep an EMA of the trained model (ShardedEMA under ZeRO-3).")


PLACEMENTS_GROUP = "placements of frozen models"


@dataclasses.dataclass
class ProcessSettings(Settings):
    """The process group's timeout and the host-memory lever every recipe has."""

    GROUP: ClassVar[str | None] = PLACEMENTS_GROUP
    process_group_timeout: float = flag(1800, "Seconds before a collective gives up.")
    dead_rank_timeout: float = flag(
        60,
        "Seconds without a heartbeat from a rank (dead, frozen, its host lost) before every rank stops with "
        "one error line naming it and exit status 69, instead of waiting out --process_group_timeout; 0: off.",
    )
    return_freed_memory: bool = flag(
        False,
        "Have glibc hand freed blocks of 1 MiB or more back to the OS (memory.return_large_frees_to_os): "
        "a lower peak RSS per rank for ZeRO-3 on CPU hosts, at the cost of page faults (slower steps).",
    )


def frozen_placement_help(name: str) -> Callable[[], str]:
    """The help of ``--<name>_placement``: which families have ``name`` (read when the parser
    is built, so that importing this module imports no family)."""

    def text() -> str:
        from .families import ALL_FAMILIES

        owners = [
            f"{f.title}: {f.component_library(name)[1]}" for f in ALL_FAMILIES if name in f.frozen_components
        ]
        return f"Where {name} lives ({'; '.join(owners)})."

    return text


def placement_flag(
    default: str | None, help: str | Callable[[], str], choices=FROZEN_PLACEMENT_CHOICES
) -> Any:
    """A ``--<component>_placement`` field (in the placements' help section)."""
    return flag(default, help, choices=choices, group=PLACEMENTS_GROUP)


def component_pairs_flag() -> Any:
    """``--component NAME=PATH`` (repeatable): a pipeline component from another folder."""
    return flag(
        [],
        "Load the pipeline component NAME (e.g. text_encoder_4, tokenizer_4, vae, transformer) from "
        "PATH, a folder or hub id that holds it, instead of the pipeline's own folder; repeatable. A text "
        "encoder's folder also gives its tokenizer when the pipeline has none. The output pipeline holds it.",
        append=True,
        metavar="NAME=PATH",
    )


def component_overrides(args: Settings) -> dict[str, str]:
    """``{component: path}`` from ``--component NAME=PATH`` (and
    ``--pretrained_vae_model_name_or_path``, the same as ``--component vae=PATH``, and
    ``--tokenizer_name``, the same as ``--component tokenizer=PATH``); raises
    ``ArgumentError`` for a value without ``=``, a name that is not a plain folder name, or a
    component given twice."""
    overrides: dict[str, str] = {}
    pairs = list(args.component or [])
    if args.pretrained_vae_model_name_or_path:
        pairs.append(f"vae={args.pretrained_vae_model_name_or_path}")
    if args.tokenizer_name:  # diffusers' DreamBooth and ControlNet scripts: the first tokenizer
        pairs.append(f"tokenizer={args.tokenizer_name}")
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


@dataclasses.dataclass
class FaultSettings(Settings):
    """Preemption and non-finite updates (``training.faults``): every training loop has them
    (``CommonSettings`` and the reward recipe's settings); ``validate_common_args`` checks them."""

    GROUP: ClassVar[str | None] = "preemption and non-finite updates"
    save_on_signal: str = flag(
        "SIGTERM,SIGUSR1",
        "Signals that preempt the job (SLURM, Kubernetes): every rank finishes its step, that step's checkpoint is "
        "published and the job exits with status 75; 'none' leaves the signals' default action.",
    )
    max_nonfinite_steps: int = flag(
        3,
        "Updates in a row that may be skipped for a non-finite loss or gradient (every rank skips it: weights, "
        "optimizer, schedule and EMA unchanged); one more stops the job with an error naming the step and rank.",
    )


@dataclasses.dataclass
class CommonSettings(FaultSettings, ProcessSettings, CheckpointSettings, TrackingSettings, OptimizerSettings):
    """What every training recipe has: the model, the output folder, the seed, the resolution,
    the batch and the number of steps, with the shared groups (optimizer, tracking,
    checkpoints, process, faults). ``validate_common_args`` checks them."""

    pretrained_model_name_or_path: str | None = flag(None, "Pipeline folder or hub id.", required=True)
    output_dir: str = flag("sd-model-finetuned", "Where checkpoints and the pipeline go.")
    seed: int | None = flag(None, "A seed for reproducible training.")
    resolution: int = flag(512, "Training image resolution.")
    train_batch_size: int = flag(16, "Batch size per device.")
    max_train_steps: int | None = flag(None, "Total optimisation steps; overrides epochs.")


# flags of the shared settings groups, by rule
COMMON_POSITIVE_FLAGS = (
    "train_batch_size",
    "max_train_steps",
    "checkpointing_steps",
    "checkpoints_total_limit",
    "resolution",
)
NON_NEGATIVE_FLAGS = ("lr_warmup_steps", "dataloader_num_workers", "noise_offset", "input_perturbation")
REPORT_TO = ("tensorboard", "wandb", "all", "none")


def check_positive(args: Settings, flags: tuple[str, ...]) -> None:
    """Raise ``ArgumentError`` for the first of ``flags`` that is set and not positive."""
    for name in flags:
        value = vars(args)[name]
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name} must be a positive number, got {value}")


def validate_common_args(args: CommonSettings) -> None:
    """Raise ``ArgumentError`` naming the first flag of the groups every script shares (its
    batch, steps, resolution, optimizer, tracking, checkpoint, placement and fault flags) that cannot
    work as given. Checks the flags alone, before anything is built or written (an unknown
    ``--report_to`` would otherwise fail inside accelerate first)."""
    check_positive(args, COMMON_POSITIVE_FLAGS)
    if isinstance(args, FaultSettings):  # --save_on_signal, --max_nonfinite_steps: every recipe's settings
        from .training.faults import parse_signals

        parse_signals(args.save_on_signal)  # ArgumentError naming a signal it cannot catch
        if args.max_nonfinite_steps < 0:
            raise ArgumentError(f"--max_nonfinite_steps must not be negative, got {args.max_nonfinite_steps}")
    if args.process_group_timeout <= 0:
        raise ArgumentError(f"--process_group_timeout must be positive, got {args.process_group_timeout}")
    if args.dead_rank_timeout < 0:
        raise ArgumentError(
            f"--dead_rank_timeout must not be negative (0: off), got {args.dead_rank_timeout}"
        )
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
    validate_optimizer_args(args)


OPTIMIZERS = ("adamw", "prodigy")


def validate_optimizer_args(args: OptimizerSettings) -> None:
    """Raise ``ArgumentError`` for an ``--optimizer`` that is not AdamW or prodigy (any case),
    prodigy without prodigyopt, or a ``--prodigy_beta3`` outside [0, 1)."""
    if args.optimizer.lower() not in OPTIMIZERS:
        raise ArgumentError(f"--optimizer must be AdamW or prodigy, got {args.optimizer!r}")
    if args.optimizer.lower() == "prodigy" and importlib.util.find_spec("prodigyopt") is None:
        raise ArgumentError(
            "--optimizer prodigy needs prodigyopt, which is not installed (pip install prodigyopt)"
        )
    if args.prodigy_beta3 is not None and not 0 <= args.prodigy_beta3 < 1:
        raise ArgumentError(f"--prodigy_beta3 must be in [0, 1), got {args.prodigy_beta3}")


PLACEMENT_SUFFIX = "_placement"


def component_placements(args: Settings) -> dict[str, str]:
    """``{component: placement}`` of every ``--<component>_placement`` flag of a
    recipe's settings: the one place a flag's name becomes a component's."""
    return {
        k[: -len(PLACEMENT_SUFFIX)]: v
        for k, v in vars(args).items()
        if k.endswith(PLACEMENT_SUFFIX) and isinstance(v, str)
    }


def validate_launch(
    args: CommonSettings,
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
    if args.optimizer.lower() == "prodigy" and deepspeed_active and on_cpu:
        from .runtime.distributed import get_world_size

        if get_world_size() > 1:
            raise ArgumentError(
                "--optimizer prodigy under ZeRO-3 on several ranks needs CUDA: each rank holds a partition, "
                "and prodigyopt sums its step-size estimate over the ranks on a CUDA tensor (fsdp_in_use)"
            )
    for component, placement in (component_placements(args) if placements is None else placements).items():
        name = f"{component}{PLACEMENT_SUFFIX}"
        if placement in ("shard", "offload") and not deepspeed_active:
            raise ArgumentError(
                f"--{name} {placement} needs DeepSpeed: launch with `accelerate launch --config_file "
                "configs/accelerate_zero3.yaml ...`, or choose replicate"
            )
        if placement == "offload" and on_cpu:
            raise ArgumentError(f"--{name} offload needs a GPU (the weights are already in CPU memory here)")
