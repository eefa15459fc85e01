"""Three reads of DeepSpeed state that its documented API does not give.

* ``held_whole``: whether a ZeRO-3 parameter is whole on this rank now (kept whole by the
  persistence threshold, or gathered): its ``ds_status`` (documented) is the value
  ``ZeroParamStatus.AVAILABLE`` (not documented). The partitioned load fills such a parameter
  whole too, ``gathered_parameters`` and the EMA do not gather it.
* ``local_fp32_master``: the fp32 master partition DeepSpeed's ZeRO-3 optimizer keeps for a
  parameter, which the EMA averages: ``safe_get_local_fp32_param`` (documented) for a
  parameter that carries ``_z3_optimizer`` (written on each parameter the optimizer owns).
* ``engine_loss_scale``: the factor an engine's backward multiplies a loss by:
  ``ZeROOptimizer.scale_if_loss`` and ``DeepSpeedEngine.torch_autocast_z0_gradscaler``.

Private names (``PRIVATE_NAMES``, uses ``held_whole``, ``fp32_master``, ``loss_scale``),
checked on DeepSpeed 0.19.8. A missing name of ``held_whole`` or ``loss_scale`` is an error
naming it (``require_names``): without it a parameter kept whole would be loaded partly and
an fp16 gradient would be off by the loss scale, silently. A parameter without
``_z3_optimizer`` is one no ZeRO-3 optimizer owns (a frozen one): averaged from its partition.
"""

from __future__ import annotations

import sys
from typing import Any

from . import require_names

_checked: set[str] = set()


def _require_once(use: str) -> None:
    if use not in _checked:
        require_names(use)
        _checked.add(use)


def held_whole(param: Any) -> bool:
    """Whether the ZeRO-3 parameter ``param`` is whole on this rank now (its ``ds_status`` is
    ``AVAILABLE``: kept whole by the persistence threshold, or inside a gather). Not a
    collective."""
    _require_once("held_whole")
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.AVAILABLE


def local_fp32_master(param: Any) -> Any | None:
    """This rank's fp32 master partition of ``param`` (DeepSpeed's ``safe_get_local_fp32_param``)
    when a ZeRO-3 optimizer owns it; None otherwise (a frozen parameter, or not a ZeRO-3 one).
    Not a collective."""
    if getattr(param, "_z3_optimizer", None) is None:
        return None
    from deepspeed.utils import safe_get_local_fp32_param

    return safe_get_local_fp32_param(param)


def _is_deepspeed_engine(engine: Any) -> bool:
    module = sys.modules.get("deepspeed.runtime.engine")
    return module is not None and isinstance(engine, module.DeepSpeedEngine)


def engine_loss_scale(engine: Any) -> float:
    """The factor by which ``engine.backward`` multiplies a loss: DeepSpeed's fp16 loss scale
    (static, dynamic, or a torch ``GradScaler`` under its ``torch_autocast``), asked of the
    engine's own optimizer; 1.0 under bf16 and fp32, and for a model that is not a DeepSpeed
    engine. A DeepSpeed engine without the names is ``RuntimeError`` naming them. Not a
    collective."""
    if _is_deepspeed_engine(engine):
        require_names("loss_scale", engine)
    scale_if_loss = getattr(getattr(engine, "optimizer", None), "scale_if_loss", None)
    if scale_if_loss is not None:
        import torch

        # what DeepSpeed takes for a loss: one element with a graph
        probe = torch.ones((), device=engine.device, requires_grad=True) * 1.0
        return float(scale_if_loss(probe).detach())
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return float(scaler.get_scale()) if scaler is not None else 1.0
