"""diffusers_zero3: DeepSpeed ZeRO-3 for diffusers training with several models at once."""

# ruff: noqa: E402 (huge pages are asked for before the imports below create any tensor)

from .runtime.huge_pages import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor

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

__version__ = "0.1.0"

__all__ = [
    "use_huge_pages_for_host_tensors",
    "ParallelReward",
    "ShardedEMA",
    "CheckpointError",
    "load_pretrained_zero3",
    "publish_folder",
    "save_pretrained_zero3",
    "load_training_checkpoint",
    "resume_training",
    "save_training_checkpoint",
    "CachedOutputs",
    "precompute_frozen_outputs",
    "PLACEMENTS",
    "FrozenModel",
    "LockstepError",
    "frozen_engine_config",
    "local_parameter_bytes",
    "placement_bytes_per_rank",
    "lockstep_check",
    "lockstep_map",
    "prepare_frozen",
    "barrier",
    "enable_nccl_error_handling",
    "init_distributed_if_needed",
    "build_accelerator",
    "gathered_parameters",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "is_zero3_enabled",
    "is_zero3_param",
    "log_rank_zero",
    "zero3_init_disabled",
    "share_fp32_master_weights",
    "trim_zero3_overhead",
    "set_moe_leaf_modules",
    "MemoryLog",
    "model_state_bytes",
    "return_large_frees_to_os",
]
