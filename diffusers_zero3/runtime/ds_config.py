"""Every DeepSpeed config and dtype rule of the package, derived in one place.

* ``frozen_engine_config``: a ZeRO-3 *inference* config for a frozen model, from a training one.
* ``zero_init_config``: what ``deepspeed.zero.Init`` needs to build a model partitioned.
* ``zero3_bucket_sizes`` / ``fill_auto_bucket_sizes``: ZeRO-3 bucket and persistence sizes
  from a model's own shapes (accelerate's ``"auto"`` reads ``config.hidden_size``, which
  diffusers models lack).
* ``resolve_dtype`` / ``weight_dtype``: which dtype a model runs in.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import TYPE_CHECKING

import torch

from .deepspeed_internals import levers_turned_off
from .distributed import get_world_size
from .zero3 import full_numel, is_zero3_param

if TYPE_CHECKING:
    from accelerate import Accelerator

_DTYPES = {"fp32": torch.float32, "no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weight_dtype(accelerator) -> torch.dtype:
    """The dtype frozen models run in: the accelerator's mixed precision, else fp32."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


def typical_hidden_size(model: torch.nn.Module) -> int:
    """A hidden size for DeepSpeed's bucket heuristics, from the model's own weights.

    accelerate's ``"auto"`` reads ``model.config.hidden_size``, which diffusers models lack.
    The median matrix (or conv kernel) of the model plays the part of ``hidden^2``.
    """
    sizes = sorted(
        full_numel(p)
        for p in model.parameters()
        if len(p.ds_shape if is_zero3_param(p) else p.shape) >= 2  # a partitioned parameter's data is 1-D
    )
    if not sizes:
        return 1024
    return max(64, int(math.sqrt(sizes[len(sizes) // 2])))


# The share of a model's parameter elements that the persistence threshold may keep whole on
# every rank, smallest tensors first (``persistence_threshold``).
PERSISTENT_SHARE = 0.05

# The share of a model's parameter elements that ZeRO-3 may hold gathered at once, beyond the
# module it is running (``live_parameters``).
LIVE_SHARE = 0.1

# DeepSpeed's default ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance``.
DEEPSPEED_LIVE_DEFAULT = 10**9


def persistence_threshold(numels: list[int], hidden: int, share: float = PERSISTENT_SHARE) -> int:
    """The ``stage3_param_persistence_threshold`` for parameters of ``numels`` elements: the
    largest size such that all parameters at or below it hold at most ``share`` of all
    elements, and at least accelerate's ``10 hidden`` (norms and biases).

    A parameter at or below the threshold is kept whole on every rank: it is never gathered,
    and a module whose own parameters are all kept whole needs no ZeRO-3 hooks
    (``deepspeed_internals.levers.drop_idle_module_hooks``). In a UNet the small tensors are many and hold
    little: in SD 1.5's, 522 of 686 tensors hold 4.0 % of the elements (threshold 614,400),
    which leaves 165 of its 709 modules with something to gather. Keeping them whole costs
    at most ``share x (1 - 1/N)`` of the parameter bytes per rank. Tensors of one size are
    kept all or none.
    """
    threshold, total, kept = 0, sum(numels), 0
    for size, count in sorted(Counter(numels).items()):  # all tensors of a size or none of them
        if kept + size * count > share * total:
            break
        kept += size * count
        threshold = size
    return max(threshold, 10 * hidden)


def live_parameters(total: int, prefetch_bucket: int, share: float = LIVE_SHARE) -> int:
    """``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` for a model of
    ``total`` parameter elements: ``share`` of them, at least two prefetch buckets (one in
    use, one in flight), at most DeepSpeed's default of 10^9.

    DeepSpeed's 10^9 keeps any smaller model gathered whole from the second step on: each
    module's fetch prefetches another bucket from the recorded trace, and nothing but the
    live-parameter limit stops the prefetch from overtaking the forward (modules without
    parameters consume none of it); the reuse distance then keeps every gathered parameter
    until its use in the backward, which is within 10^9 elements. Measured on a 34 M UNet
    shaped like SD 1.5's: 33.6 M gathered at the end of each forward; with both limits at
    this size, 2.0 M. Either limit alone changes nothing (a gathered parameter is kept by the
    other one). On a GPU the same default holds the whole of an SD 1.5 UNet (860 M) gathered
    from forward to backward, and 10^9 elements of any larger model.
    """
    return min(DEEPSPEED_LIVE_DEFAULT, max(2 * prefetch_bucket, int(share * total)))


# Buckets never grow past this many elements for one large parameter (an embedding table of
# a text encoder): 2**25 elements is 64 MiB in bf16.
MAX_BUCKET = 2**25


def zero3_bucket_sizes(model: torch.nn.Module) -> dict[str, int]:
    """ZeRO-3 bucket, sub-group and persistence sizes for ``model`` from its parameter shapes.

    ``hidden`` is the model's typical hidden size (its median weight matrix: diffusers models
    have no ``config.hidden_size`` for accelerate's ``"auto"``); sizes are ``max(hidden^2,
    largest)`` with ``largest`` the largest parameter (at most ``MAX_BUCKET`` elements): the
    largest of all for what is gathered, the largest trainable one for what is reduced and
    stepped (under LoRA, the adapters'; call again once they are added):

    * ``stage3_param_persistence_threshold`` (``persistence_threshold``): parameters up to
      it stay whole on every rank, with no gather per forward: the smallest ones, up to
      ``PERSISTENT_SHARE`` of the elements, and at least accelerate's ``10 hidden``
      (norms, biases). ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=persistence`` keeps ``10 hidden``.
    * ``reduce_bucket_size``: gradients are reduce-scattered in buckets of this many
      elements; a gradient larger than the bucket goes alone, so accelerate's ``hidden^2``
      gave a UNet (whose largest convolutions hold many times ``hidden^2``) one collective
      per gradient. One buffer of this size is held for the run.
    * ``stage3_prefetch_bucket_size``: the parameters gathered ahead of the module
      that needs them, in one collective; ``0.9 hidden^2`` fetched about one matrix ahead.
    * ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance``
      (``live_parameters``): at most ``LIVE_SHARE`` of the elements gathered at once beyond
      the running module (DeepSpeed's 10^9 holds a smaller model gathered whole from
      forward to backward). ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=live`` keeps 10^9.
    * ``sub_group_size``: the optimizer steps over its partition in groups of this
      many elements. DeepSpeed's default (10^9) makes one group of the whole partition, with
      an fp32 copy of all of its gradients at every step (``4 params / N`` bytes at once)
      and an Adam update that streams the whole partition through memory once per operation.
    """
    hidden = typical_hidden_size(model)

    def largest(params) -> int:
        return min(MAX_BUCKET, max((full_numel(p) for p in params), default=0))

    numels = [full_numel(p) for p in model.parameters()]
    gathered = max(hidden * hidden, largest(model.parameters()))
    reduced = max(hidden * hidden, largest(p for p in model.parameters() if p.requires_grad))
    if "persistence" in levers_turned_off():
        persist = 10 * hidden
    else:
        persist = persistence_threshold(numels, hidden)
    sizes = {
        "reduce_bucket_size": reduced,
        "stage3_prefetch_bucket_size": gathered,
        "stage3_param_persistence_threshold": persist,
        "sub_group_size": reduced,
    }
    if "live" not in levers_turned_off():
        live = live_parameters(sum(numels), gathered)
        sizes["stage3_max_live_parameters"] = sizes["stage3_max_reuse_distance"] = live
    return sizes


# id(zero_optimization dict) -> the keys fill_auto_bucket_sizes set in it: sizes derived from
# one model (the trained one), which a frozen engine built from the same config recomputes
# from its own shapes instead of inheriting.
_FILLED_FOR_ANOTHER_MODEL: dict[int, frozenset[str]] = {}


def fill_auto_bucket_sizes(ds_config: dict, model: torch.nn.Module) -> dict:
    """Replace ``"auto"`` bucket/persistence sizes in ``ds_config`` (in place) for ``model``.

    Call before ``accelerator.prepare(model)``: accelerate reads ``model.config.hidden_size``
    for them, which diffusers models lack. Frozen engines later derived from the same config
    (``frozen_engine_config``) still get sizes from their own shapes.
    """
    zero = ds_config.setdefault("zero_optimization", {})
    filled = set(_FILLED_FOR_ANOTHER_MODEL.get(id(zero), ()))
    for key, value in zero3_bucket_sizes(model).items():
        if zero.get(key, "auto") == "auto" or key in filled:
            zero[key] = value
            filled.add(key)
    _FILLED_FOR_ANOTHER_MODEL[id(zero)] = frozenset(filled)
    return ds_config


def resolve_dtype(
    dtype: torch.dtype | str | None, base: dict, accelerator: Accelerator | None
) -> torch.dtype:
    """The dtype a model runs in: ``dtype`` if given (a dtype or ``"fp32"``/``"bf16"``/...),
    else the DeepSpeed config's bf16/fp16 section (``"auto"`` follows the accelerator), else
    the accelerator's mixed precision, else fp32."""
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
    the ``"auto"`` bucket and persistence sizes (also those ``fill_auto_bucket_sizes`` filled
    in for the trained model) are computed from the model's own parameter shapes.
    """
    world_size = world_size or get_world_size()
    filled = _FILLED_FOR_ANOTHER_MODEL.get(id((base_config or {}).get("zero_optimization")), frozenset())
    base = copy.deepcopy(base_config or {})
    zero = {
        k: v
        for k, v in base.get("zero_optimization", {}).items()
        if k not in ("offload_optimizer", "offload_param")
    }
    zero["stage"] = 3
    for key, value in zero3_bucket_sizes(model).items():
        if zero.get(key, "auto") == "auto" or key in filled:
            zero[key] = value
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]
    if offload:
        zero["offload_param"] = offload_param_section()
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


def base_config(ds_config: dict | None, accelerator: Accelerator | None) -> dict:
    """``ds_config``, else the accelerator's active DeepSpeed plugin's config, else ``{}``."""
    if ds_config is not None:
        return ds_config
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin is not None else {}


def offload_param_section() -> dict:
    """ZeRO-3's ``offload_param`` that keeps partitions in host memory (pinned on CUDA hosts)."""
    return {"device": "cpu", "pin_memory": torch.cuda.is_available()}


def zero_init_config(
    ds_config: dict | None, accelerator, offload: bool | None = None, dtype: torch.dtype | None = None
) -> dict:
    """The part of a (training) DeepSpeed config that ``zero.Init`` needs, ``"auto"`` resolved.

    ``offload`` says where the partitions go, whatever the config's ``offload_param``: True
    into host memory, False into accelerator memory; None follows the config (the trained
    model). A frozen model asks for its own placement's: partitions are not moved by the
    config of the engine built on them later. ``dtype`` is the partitions' dtype (default:
    the config's); it goes into the config's bf16/fp16 sections, which is how ``zero.Init``
    must be told: DeepSpeed 0.19 reads ``zero.Init(dtype=...)`` as ``dtype or torch.float16
    if <fp16 supported> else ...``, so on an accelerator without fp16 (its CPU one) an
    explicit dtype is ignored and every partition comes out bf16.
    """
    if ds_config is None and accelerator is not None:
        plugin = accelerator.state.deepspeed_plugin
        ds_config = plugin.deepspeed_config if plugin is not None else None
    if ds_config is None:
        return {}
    zero = ds_config.get("zero_optimization", {})
    init_zero = {"stage": zero.get("stage")}
    configured = zero.get("offload_param")
    if (
        offload is None
        and isinstance(configured, dict)
        and configured.get("device") not in (None, "none", "auto")
    ):
        init_zero["offload_param"] = configured
    elif offload:
        init_zero["offload_param"] = offload_param_section()
    dtype = resolve_dtype(dtype, ds_config, accelerator)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": get_world_size(),
        "zero_optimization": init_zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
