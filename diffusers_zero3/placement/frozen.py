"""Placements of frozen models (text encoder, VAE, reward model) beside a ZeRO-3 UNet.

* ``"replicate"``: a whole copy on every rank, no engine.
* ``"shard"``: a separate DeepSpeed ZeRO-3 *inference* engine (no optimizer, no
  scheduler): each rank holds 1/N of the weights and every forward all-gathers them.
* ``"offload"``: as ``"shard"`` with the partitions in CPU memory (GPU hosts only).
* ``"cache"``: see ``diffusers_zero3.placement.cache``: run the models once, store their outputs, free them.

The frozen engine is built with ``deepspeed.initialize`` directly, not
``accelerator.prepare``: accelerate's ``backward`` drives the *first* engine it prepared
(prepare a frozen one first and ``backward`` fails), and ``save_state`` checkpoints every
prepared engine. Bypassing accelerate avoids both, in any order of preparation.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..runtime.deepspeed_internals.levers import set_block_leaf_modules, trim_zero3_overhead
from ..runtime.ds_config import base_config, frozen_engine_config, resolve_dtype, weight_dtype
from ..runtime.lockstep import lockstep_check
from ..runtime.memory import local_parameter_bytes, total_parameter_bytes
from ..runtime.zero3 import (
    _register_zero3_engine,
    full_numel,
    is_zero3_param,
    set_moe_leaf_modules,
    zero3_init_disabled,
)
from ..state.pretrained import buffers_to, cast_persistent_buffers, load_pretrained_zero3

if TYPE_CHECKING:
    from accelerate import Accelerator

Placement = Literal["replicate", "shard", "offload"]
PLACEMENTS: tuple[str, ...] = ("replicate", "shard", "offload")


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

    def describe(self) -> str:
        """``"<name>: <placement>, X MiB of Y MiB on this rank"``, for the logs."""
        mib = 2**20
        return (
            f"{self.name}: {self.placement}, {self.local_parameter_bytes() / mib:.2f} MiB of "
            f"{total_parameter_bytes(self.module) / mib:.2f} MiB on this rank"
        )

    def release(self) -> None:
        """Drop the weights (engine and module) so that their memory can be freed."""
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = None
        self.module = torch.nn.Module()


def placement_bytes_per_rank(
    model: torch.nn.Module,
    placement: str,
    world_size: int,
    dtype: torch.dtype = torch.float32,
    persistence_threshold: int | None = None,
) -> int:
    """Bytes of a frozen model's weights each rank holds for ``placement``, from its parameter
    shapes alone (a model built on the meta device will do).

    ``replicate``: the whole model. ``shard``: DeepSpeed's partition of every parameter
    (``ceil(numel / world_size)`` elements), plus the whole of each parameter at or below the
    persistence threshold (default: ``zero3_bucket_sizes(model)``'s, as ``frozen_engine_config``
    sets), which stays whole on every rank. ``offload``: the same bytes as ``shard``, held in
    host memory instead of accelerator memory. ``cache``: none (the outputs are on disk).
    """
    from ..runtime.ds_config import zero3_bucket_sizes

    itemsize = dtype.itemsize
    numels = [full_numel(p) for p in model.parameters()]
    if placement == "replicate":
        return sum(numels) * itemsize
    if placement == "cache":
        return 0
    if placement not in ("shard", "offload"):
        raise ValueError(f"unknown placement {placement!r}: choose replicate, shard, offload or cache")
    if persistence_threshold is None:
        persistence_threshold = zero3_bucket_sizes(model)["stage3_param_persistence_threshold"]
    return sharded_elements(numels, world_size, persistence_threshold) * itemsize


def sharded_elements(numels: list[int], world_size: int, persistence_threshold: int) -> int:
    """Elements of parameters a rank holds under ZeRO-3: ``ceil(numel / N)`` of each, plus the
    whole of each parameter at or below the persistence threshold."""
    return sum(-(-n // world_size) + (n if n <= persistence_threshold else 0) for n in numels)


def _freeze(model: torch.nn.Module) -> None:
    model.requires_grad_(False)
    model.eval()


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating parameters to ``dtype`` where they lie, and its persistent
    buffers as ``from_pretrained(torch_dtype=dtype)`` would (``cast_persistent_buffers``).

    Not ``model.to(dtype)``: that also casts the non-persistent buffers a module computed in
    ``__init__`` (rotary tables, kept fp32 by ``from_pretrained``), which no checkpoint
    restores, and diffusers warns on every cast of a model with ``_keep_in_fp32_modules`` (the
    VAE), even a no-op one.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        cast_persistent_buffers(model, dtype)


def _move(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """``model`` to ``device`` in ``dtype``, cast where it lies first: a T5-XXL loaded in fp32
    and moved before its cast to bf16 would hold 19 GB on the GPU for a moment instead of 9.5 GB."""
    _cast(model, dtype)
    model.to(device=device)


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
        base = base_config(ds_config, accelerator)
        _move(model, _default_device(accelerator), resolve_dtype(dtype, base, accelerator))
        return FrozenModel(model, "replicate", name=name)
    return _shard(model, placement, accelerator, ds_config, micro_batch_size, dtype, name)


def check_placement_supported(placement: str, name: str) -> None:
    """Raise ``RuntimeError`` for a placement this host cannot give: ``shard``/``offload``
    without DeepSpeed, ``offload`` on DeepSpeed's CPU accelerator (the weights already live in
    host memory there)."""
    if placement not in ("shard", "offload"):
        return
    from ..runtime.zero3 import is_deepspeed_available

    if not is_deepspeed_available():
        raise RuntimeError(f"placement {placement!r} for {name} needs DeepSpeed: pip install deepspeed")
    from deepspeed.accelerator import get_accelerator

    if placement == "offload" and get_accelerator().device_name() == "cpu":
        raise RuntimeError(
            f"placement 'offload' for {name} moves ZeRO-3 partitions from accelerator memory to CPU memory,"
            " but DeepSpeed runs on its CPU accelerator here: the weights already live in CPU memory."
            " Use 'shard' on this host."
        )


def scalar_parameters_to_buffers(model: torch.nn.Module) -> list[str]:
    """Turn every 0-dim parameter of a frozen ``model`` into a buffer of the same name and
    value; returns their names. Not a collective.

    DeepSpeed 0.19's ``zero.Init(module=...)``, which partitions a model loaded whole,
    broadcasts each parameter as ``param.data.view(torch.uint8)``, which a 0-dim tensor refuses
    ("self.dim() cannot be 0 to view Float as Byte"): CLIP's ``logit_scale`` is one. A frozen
    scalar needs no partition; as a buffer it keeps its shape (a ``[1]`` parameter would change
    the shape of what it multiplies), its name in the state dict, and moves with the model.
    """
    names = []
    for name, param in list(model.named_parameters()):
        if param.dim() == 0:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            delattr(owner, attr)
            owner.register_buffer(attr, param.detach())
            names.append(name)
    return names


def _shard(model, placement, accelerator, ds_config, micro_batch_size, dtype, name) -> FrozenModel:
    check_placement_supported(placement, name)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ..runtime.distributed import init_distributed_if_needed

    init_distributed_if_needed()  # this rank's GPU first, then the process group
    base = base_config(ds_config, accelerator)
    resolved = resolve_dtype(dtype, base, accelerator)
    if resolved == torch.float16 and get_accelerator().device_name() == "cpu":
        raise RuntimeError(f"fp16 is not supported by DeepSpeed on CPU (placing {name}); use bf16 or fp32")
    _freeze(model)
    cfg = frozen_engine_config(
        model, base, micro_batch_size=micro_batch_size or 1, dtype=resolved, offload=placement == "offload"
    )
    set_moe_leaf_modules(model)  # experts gathered together: eval-mode MoE routes by data
    set_block_leaf_modules(model)
    if not any(is_zero3_param(p) for p in model.parameters()):
        # A model loaded whole: cast it where it lies and partition it parameter by parameter
        # (each goes to the device alone, then its partition to where the placement says).
        # DeepSpeed's engine would move the whole module to the device first.
        scalar_parameters_to_buffers(model)
        _cast(model, resolved)
        deepspeed.zero.Init(module=model, config_dict_or_path=cfg, mem_efficient_linear=False)
        # zero.Init builds a new model's buffers on the device; a converted one keeps them
        # where they were, and DeepSpeed's engine does not move a partitioned model.
        buffers_to(model, torch.device(get_accelerator().current_device_name()))
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    trim_zero3_overhead(engine)
    _register_zero3_engine()
    engine.eval()
    return FrozenModel(engine.module, placement, engine=engine, name=name)


def loaded_as(placement: str) -> str:
    """The placement a component placement loads its model in: ``"cache"`` runs the model
    over the data once, sharded under ZeRO-3 (loaded partitioned: no rank ever holds a T5-XXL
    whole) and replicated otherwise; the others are themselves."""
    if placement != "cache":
        return placement
    from ..runtime.zero3 import is_zero3_enabled

    return "shard" if is_zero3_enabled() else "replicate"


def load_frozen_component(
    accelerator,
    source: str | Path,
    name: str,
    placement: str,
    model_cls,
    variant: str | None = None,
    dtype: torch.dtype | None = None,
    label: str | None = None,
):
    """Load ``source/name`` and place it. ``placement`` is a component's placement: one of
    ``PLACEMENTS``, or ``"cache"``, which loads the model as ``loaded_as`` says (to be run over
    the data and freed, or for validation).

    ``"shard"``/``"offload"`` models are read straight into partitions, never whole, in their
    own dtype and into the memory their placement names (``offload``: host memory, ``shard``:
    the accelerator's), whatever the training config's ``offload_param`` says. ``dtype`` is
    the dtype it runs in (default: the accelerator's mixed precision); ``label`` names it in
    logs and errors (default ``name``: a component from another folder keeps its own name).
    Call on every rank.
    """
    dtype = dtype or weight_dtype(accelerator)
    placement = loaded_as(placement)
    if placement in ("shard", "offload"):
        check_placement_supported(placement, label or name)
        model = load_pretrained_zero3(
            model_cls,
            source,
            name,
            accelerator=accelerator,
            variant=variant,
            torch_dtype=dtype,
            offload_param=placement == "offload",
        )
    else:
        with zero3_init_disabled():  # in its dtype, as from_pretrained computes its buffers in it
            model = model_cls.from_pretrained(source, subfolder=name, variant=variant, torch_dtype=dtype)
    return prepare_frozen(
        model,
        placement,
        accelerator=accelerator,
        dtype=dtype,
        name=label or name,
    )
