"""diffusers_zero3: DeepSpeed ZeRO-3 for diffusers training with several models at once.

Importing the package imports nothing else and changes nothing in the process: each public
name below loads its module on first use. A training script calls
``use_huge_pages_for_host_tensors()`` first thing, before it imports diffusers, transformers,
accelerate or DeepSpeed (any of them creates tensors at import, and torch's allocator reads its
huge-pages switch at the process's first tensor).
"""

from __future__ import annotations

import importlib
from typing import Any

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
    "local_parameter_bytes": ".runtime.memory",
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
    "share_fp32_master_weights": ".runtime.deepspeed_internals.levers",
    "trim_zero3_overhead": ".runtime.deepspeed_internals.levers",
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
