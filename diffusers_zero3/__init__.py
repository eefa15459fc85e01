"""diffusers_zero3: DeepSpeed ZeRO-3 for diffusers training with several models at once.

Importing the package imports nothing else and changes nothing in the process: each public
name below loads its module on first use. A training script calls
``use_huge_pages_for_host_tensors()`` first thing, before it imports diffusers, transformers,
accelerate or DeepSpeed (any of them creates tensors at import, and torch's allocator reads its
huge-pages switch at the process's first tensor).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    "use_huge_pages_for_host_tensors": ".runtime.huge_pages",
    "ParallelReward": ".placement.rewards",
    "ShardedEMA": ".state.ema",
    "CheckpointError": ".state.pretrained",
    "load_pretrained_zero3": ".state.pretrained",
    "publish_folder": ".state.pretrained",
    "save_pretrained_zero3": ".state.pretrained",
    "load_training_checkpoint": ".state.resume",
    "resume_training": ".state.resume",
    "save_training_checkpoint": ".state.resume",
    "CachedOutputs": ".placement.cache",
    "precompute_frozen_outputs": ".placement.cache",
    "PLACEMENTS": ".placement.frozen",
    "FrozenModel": ".placement.frozen",
    "frozen_engine_config": ".placement.frozen",
    "local_parameter_bytes": ".placement.frozen",
    "placement_bytes_per_rank": ".placement.frozen",
    "prepare_frozen": ".placement.frozen",
    "LockstepError": ".runtime.lockstep",
    "lockstep_check": ".runtime.lockstep",
    "lockstep_map": ".runtime.lockstep",
    "barrier": ".runtime.distributed",
    "enable_nccl_error_handling": ".runtime.distributed",
    "get_rank": ".runtime.distributed",
    "get_world_size": ".runtime.distributed",
    "init_distributed_if_needed": ".runtime.distributed",
    "is_main_process": ".runtime.distributed",
    "log_rank_zero": ".runtime.distributed",
    "build_accelerator": ".runtime.accelerator",
    "gathered_parameters": ".runtime.zero3",
    "is_zero3_enabled": ".runtime.zero3",
    "is_zero3_param": ".runtime.zero3",
    "zero3_init_disabled": ".runtime.zero3",
    "share_fp32_master_weights": ".runtime.zero3",
    "trim_zero3_overhead": ".runtime.zero3",
    "set_moe_leaf_modules": ".runtime.zero3",
    "MemoryLog": ".runtime.memory",
    "model_state_bytes": ".runtime.memory",
    "return_large_frees_to_os": ".runtime.memory",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .placement.cache import CachedOutputs, precompute_frozen_outputs
    from .placement.frozen import (
        PLACEMENTS,
        FrozenModel,
        frozen_engine_config,
        local_parameter_bytes,
        placement_bytes_per_rank,
        prepare_frozen,
    )
    from .placement.rewards import ParallelReward
    from .runtime.accelerator import build_accelerator
    from .runtime.distributed import (
        barrier,
        enable_nccl_error_handling,
        get_rank,
        get_world_size,
        init_distributed_if_needed,
        is_main_process,
        log_rank_zero,
    )
    from .runtime.huge_pages import use_huge_pages_for_host_tensors
    from .runtime.lockstep import LockstepError, lockstep_check, lockstep_map
    from .runtime.memory import MemoryLog, model_state_bytes, return_large_frees_to_os
    from .runtime.zero3 import (
        gathered_parameters,
        is_zero3_enabled,
        is_zero3_param,
        set_moe_leaf_modules,
        share_fp32_master_weights,
        trim_zero3_overhead,
        zero3_init_disabled,
    )
    from .state.ema import ShardedEMA
    from .state.pretrained import CheckpointError, load_pretrained_zero3, publish_folder, save_pretrained_zero3
    from .state.resume import load_training_checkpoint, resume_training, save_training_checkpoint
