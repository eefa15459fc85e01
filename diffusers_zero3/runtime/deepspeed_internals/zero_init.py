"""``zero.Init`` internals: pausing an enclosing one, transformers' registration of a ZeRO-3
config, and how a new model's parameters are partitioned (``fastload``). The table of names
is in this package's ``__init__``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from . import lever_in_force, require_names

_HF_REF = "_hf_deepspeed_config_weak_ref"


def transformers_zero3_config() -> Any:
    """transformers' registered ``HfDeepSpeedConfig`` reference (None when transformers' DeepSpeed
    integration was never imported or nothing is registered)."""
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    return getattr(hf_ds, _HF_REF, None) if hf_ds is not None else None


def set_transformers_zero3_config(ref: Any) -> None:
    """Register ``ref`` (None: nothing) as transformers' ZeRO-3 config, where its DeepSpeed
    integration is imported. While one is registered, every transformers ``from_pretrained``
    partitions the model with collectives."""
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    if hf_ds is not None:
        setattr(hf_ds, _HF_REF, ref)


def active_zero_init() -> Any:
    """The outermost ``deepspeed.zero.Init`` in force in this process (its module and tensor
    patches applied), or None."""
    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    context = getattr(pp, "top_level_context", None) if pp is not None else None
    return context if context is not None and getattr(context, "patched", False) else None


@contextlib.contextmanager
def paused_zero_init() -> Iterator[None]:
    """Within it, an enclosing ``deepspeed.zero.Init`` is paused (its patches removed), and put
    back on exit, also when the body raises. Raises ``RuntimeError`` where one is in force and
    this DeepSpeed cannot be paused (``require_names("pause_init")``)."""
    paused = active_zero_init()
    if paused is not None:
        require_names("pause_init")
        paused.unpatch_init_and_builtins()
    try:
        yield
    finally:
        if paused is not None:
            paused.patch_init_and_builtins()


def partition_new_parameters(init: Any, dtype: torch.dtype, broadcast: bool) -> bool:
    """Make ``init`` (a ``deepspeed.zero.Init`` not yet entered) cast each new floating
    parameter to ``dtype`` as it partitions it, and with ``broadcast=False`` partition it
    without broadcasting it from rank 0 (for a model whose every parameter is read from a
    checkpoint next: there is no random initialisation to agree on). Returns whether it did
    (the ``fastload`` lever in force); otherwise ``init`` partitions as DeepSpeed does."""
    if not lever_in_force("fastload"):
        return False
    zero_init_param = init._zero_init_param

    def cast_and_partition(param: torch.nn.Parameter) -> None:
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
        if broadcast:
            zero_init_param(param)
        else:
            init._convert_to_deepspeed_param(param)
            param.partition()

    init._zero_init_param = cast_and_partition
    return True
