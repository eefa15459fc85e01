"""Placements of frozen models (text encoder, VAE, reward model) beside a ZeRO-3 UNet.

* ``"replicate"``: a whole copy on every rank, no engine.
* ``"shard"``: a separate DeepSpeed ZeRO-3 *inference* engine (no optimizer, no
  scheduler): each rank holds 1/N of the weights and every forward all-gathers them.
* ``"offload"``: as ``"shard"`` with the partitions in CPU memory (GPU hosts only).
* ``"cache"``: see ``diffusers_zero3.cache``: run the models once, store their outputs, free them.

The frozen engine is built with ``deepspeed.initialize`` directly, not
``accelerator.prepare``: accelerate's ``backward`` drives the *first* engine it prepared
(prepare a frozen one first and ``backward`` fails), and ``save_state`` checkpoints every
prepared engine. Bypassing accelerate avoids both, in any order of preparation.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import TYPE_CHECKING, Any, Literal

import torch

from .distributed import get_world_size
from .lockstep import lockstep_check
from .zero3 import _register_zero3_engine, is_zero3_param

if TYPE_CHECKING:
    from accelerate import Accelerator

Placement = Literal["replicate", "shard", "offload"]
PLACEMENTS: tuple[str, ...] = ("replicate", "shard", "offload")

_DTYPES = {"fp32": torch.float32, "no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FrozenModel:
    """A frozen model placed for every rank to call like the model itself.

    ``frozen(x)`` runs the model's forward; attributes and methods (``vae.encode``,
    ``vae.decode``, ``vae.config``, ``text_encoder.dtype``) come from the wrapped module.
    Parameters have ``requires_grad=False`` and the module is in eval mode; gradients still
    flow to the *inputs* when they require grad.

    For ``"shard"``/``"offload"`` every call is a collective: call it on every rank the same
    number of times (``lockstep_map`` pads short ranks; ``lockstep_check()`` turns a
    mismatch into an error).
    """

    def __init__(self, module: torch.nn.Module, placement: str, engine: Any = None, name: str | None = None):
        self.module = module
        self.placement = placement
        self.engine = engine
        self.name = name or type(module).__name__

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, attr: str):
        # Only reached for attributes FrozenModel itself lacks: delegate to the module.
        if attr in ("module", "placement", "engine", "name"):
            raise AttributeError(attr)
        return getattr(self.module, attr)

    def __repr__(self) -> str:
        return f"FrozenModel({self.name}, placement={self.placement!r})"

    @property
    def is_sharded(self) -> bool:
        """True for placements whose calls are collectives."""
        return self.engine is not None

    def lockstep_check(self) -> contextlib.AbstractContextManager:
        """Debug check over forwards of this model (see ``diffusers_zero3.lockstep_check``)."""
        if not self.is_sharded:
            return contextlib.nullcontext()
        return lockstep_check(self.module, self.name)

    def local_parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds (a ZeRO-3 partition counts as its shard)."""
        return local_parameter_bytes(self.module)

    def release(self) -> None:
        """Drop the weights (engine and module) so that their memory can be freed."""
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = None
        self.module = torch.nn.Module()


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters held on this rank.

    A ZeRO-3 parameter counts its partition (``ds_tensor``), plus its full size when the
    persistence threshold keeps it whole on every rank; any other parameter counts whole.
    """
    total = 0
    for p in module.parameters():
        if is_zero3_param(p):
            total += p.ds_tensor.numel() * p.ds_tensor.element_size()
            if getattr(p, "ds_persist", False):
                total += p.ds_numel * p.ds_tensor.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def _typical_hidden_size(model: torch.nn.Module) -> int:
    """A hidden size for DeepSpeed's bucket heuristics, from the model's own weights.

    accelerate's ``"auto"`` reads ``model.config.hidden_size``, which diffusers models lack.
    The median matrix (or conv kernel) of the model plays the part of ``hidden^2``.
    """
    sizes = sorted(p.ds_numel if is_zero3_param(p) else p.numel() for p in model.parameters() if p.dim() >= 2)
    if not sizes:
        return 1024
    return max(64, int(math.sqrt(sizes[len(sizes) // 2])))


def zero3_bucket_sizes(model: torch.nn.Module) -> dict[str, int]:
    """ZeRO-3 bucket and persistence sizes for ``model`` from its parameter shapes.

    The same rules as accelerate's ``"auto"`` (``hidden^2``, ``0.9 hidden^2``,
    ``10 hidden``), with the hidden size taken from the model's median weight matrix, since
    diffusers models have no ``config.hidden_size``.
    """
    hidden = _typical_hidden_size(model)
    return {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }


def fill_auto_bucket_sizes(ds_config: dict, model: torch.nn.Module) -> dict:
    """Replace ``"auto"`` bucket/persistence sizes in ``ds_config`` (in place) for ``model``.

    Call before ``accelerator.prepare(model)``: accelerate reads ``model.config.hidden_size``
    for them, which diffusers models lack.
    """
    zero = ds_config.setdefault("zero_optimization", {})
    for key, value in zero3_bucket_sizes(model).items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value
    return ds_config


def _resolve_dtype(
    dtype: torch.dtype | str | None, base: dict, accelerator: Accelerator | None
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
        return _DTYPES[dtype]
    for key, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        enabled = base.get(key, {}).get("enabled", False)
        if enabled == "auto":
            enabled = accelerator is not None and accelerator.mixed_precision == key
        if enabled is True:
            return dt
    if accelerator is not None and accelerator.mixed_precision in ("bf16", "fp16"):
        return _DTYPES[accelerator.mixed_precision]
    return torch.float32


def frozen_engine_config(
    model: torch.nn.Module,
    base_config: dict | None = None,
    *,
    micro_batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    offload: bool = False,
    world_size: int | None = None,
) -> dict:
    """A DeepSpeed ZeRO-3 inference config for a frozen ``model``, derived from a training one.

    Keeps the user's explicit stage-3 settings from ``base_config`` and drops everything that
    belongs to training (optimizer, scheduler, optimizer offload, gradient clipping and
    accumulation): a training config copied onto a frozen engine brings its optimizer along
    (huggingface/trl#3228). The micro batch and ``train_batch_size`` are explicit integers
    consistent with the world size (DeepSpeed checks them even without an optimizer), and
    the ``"auto"`` bucket and persistence sizes are computed from the model's own parameter
    shapes.
    """
    world_size = world_size or get_world_size()
    base = copy.deepcopy(base_config or {})
    zero = {
        k: v
        for k, v in base.get("zero_optimization", {}).items()
        if k not in ("offload_optimizer", "offload_param")
    }
    zero["stage"] = 3
    for key, value in zero3_bucket_sizes(model).items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": 1,
        "train_batch_size": int(micro_batch_size) * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": base.get("steps_per_print", 10**9),
        "wall_clock_breakdown": False,
    }


def _freeze(model: torch.nn.Module) -> None:
    model.requires_grad_(False)
    model.eval()


def _default_device(accelerator: Accelerator | None) -> torch.device:
    if accelerator is not None:
        return accelerator.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_frozen(
    model: torch.nn.Module,
    placement: Placement,
    *,
    accelerator: Accelerator | None = None,
    ds_config: dict | None = None,
    micro_batch_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    name: str | None = None,
) -> FrozenModel:
    """Place a frozen model for training beside a ZeRO-3 engine; call on every rank.

    Collective for ``"shard"`` and ``"offload"`` (builds a DeepSpeed engine): call on every
    rank, in the same order relative to other engines.

    Args:
        model: the frozen model, loaded whole (``zero3_init_disabled()``) or already
            partitioned by ``zero.Init`` (then only ``"shard"``/``"offload"`` apply, and no
            full copy is ever built).
        placement: ``"replicate"``, ``"shard"`` or ``"offload"`` (see the module docstring).
        accelerator: where the training config, device and mixed precision come from.
        ds_config: a DeepSpeed config to derive the frozen one from (default: the
            accelerator's active DeepSpeed plugin's config).
        micro_batch_size: DeepSpeed's ``train_micro_batch_size_per_gpu`` for the engine
            (bookkeeping only; any batch size can be passed to a call).
        dtype: weights dtype (``torch.dtype`` or ``"fp32"``/``"bf16"``/``"fp16"``); default
            from the training config / the accelerator's mixed precision.
        name: the model's name in logs and lockstep errors.

    Returns:
        A ``FrozenModel``: call it like the model, use its methods (``.encode``,
        ``.decode``) and attributes (``.config``).

    Example:
        >>> with zero3_init_disabled():
        ...     vae = AutoencoderKL.from_pretrained(path, subfolder="vae")
        ...     text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder")
        >>> vae = prepare_frozen(vae, "replicate", accelerator=accelerator)
        >>> text_encoder = prepare_frozen(text_encoder, "shard", accelerator=accelerator)
        >>> latents = vae.encode(pixels).latent_dist.sample()
        >>> states = text_encoder(input_ids)[0]
    """
    if placement not in PLACEMENTS:
        raise ValueError(
            f"unknown placement {placement!r} for {name or type(model).__name__}: choose one of {', '.join(PLACEMENTS)}"
            " (or 'cache' through diffusers_zero3.precompute_frozen_outputs)"
        )
    name = name or type(model).__name__
    partitioned = any(is_zero3_param(p) for p in model.parameters())
    if placement == "replicate":
        if partitioned:
            raise ValueError(
                f"{name} was loaded while ZeRO-3's zero.Init was active, so its parameters are partitioned"
                " and cannot be replicated. Load it inside `with diffusers_zero3.zero3_init_disabled():`,"
                " or place it with 'shard'."
            )
        _freeze(model)
        base = _base_config(ds_config, accelerator)
        model.to(device=_default_device(accelerator), dtype=_resolve_dtype(dtype, base, accelerator))
        return FrozenModel(model, "replicate", name=name)
    return _shard(model, placement, accelerator, ds_config, micro_batch_size, dtype, name)


def _base_config(ds_config: dict | None, accelerator: Accelerator | None) -> dict:
    if ds_config is not None:
        return ds_config
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin is not None else {}


def _shard(model, placement, accelerator, ds_config, micro_batch_size, dtype, name) -> FrozenModel:
    from .zero3 import is_deepspeed_available

    if not is_deepspeed_available():
        raise RuntimeError(f"placement {placement!r} for {name} needs DeepSpeed: pip install deepspeed")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if placement == "offload" and get_accelerator().device_name() == "cpu":
        raise RuntimeError(
            f"placement 'offload' for {name} moves ZeRO-3 partitions from accelerator memory to CPU memory,"
            " but DeepSpeed runs on its CPU accelerator here: the weights already live in CPU memory."
            " Use 'shard' on this host."
        )
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed()
    base = _base_config(ds_config, accelerator)
    resolved = _resolve_dtype(dtype, base, accelerator)
    if resolved == torch.float16 and get_accelerator().device_name() == "cpu":
        raise RuntimeError(f"fp16 is not supported by DeepSpeed on CPU (placing {name}); use bf16 or fp32")
    _freeze(model)
    cfg = frozen_engine_config(
        model, base, micro_batch_size=micro_batch_size or 1, dtype=resolved, offload=placement == "offload"
    )
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    _register_zero3_engine()
    engine.eval()
    return FrozenModel(engine.module, placement, engine=engine, name=name)
