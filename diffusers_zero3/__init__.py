"""diffusers_zero3: DeepSpeed ZeRO-3 for diffusers training with several models at once."""

from .distributed import barrier, get_rank, get_world_size, is_main_process, log_rank_zero
from .launch import build_accelerator
from .zero3 import gathered_parameters, is_zero3_enabled, is_zero3_param, zero3_init_disabled

__version__ = "0.1.0"

__all__ = [
    "barrier",
    "build_accelerator",
    "gathered_parameters",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "is_zero3_enabled",
    "is_zero3_param",
    "log_rank_zero",
    "zero3_init_disabled",
]
