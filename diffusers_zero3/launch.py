"""An ``Accelerator`` that runs DeepSpeed on CPU-only hosts as well as on GPU hosts."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .distributed import process_group_timeout

if TYPE_CHECKING:
    from accelerate import Accelerator


def _world_size_from_env() -> int:
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def needs_gloo_backend() -> bool:
    """True on a multi-process launch with no GPU, where accelerate would pick no backend.

    accelerate 1.x only chooses a backend for a device it knows; on a CPU-only host it
    leaves ``num_processes == 1`` while DeepSpeed's world is N, and DeepSpeed's batch-size
    check fails (``train_batch_size ... 2 != 2 * 1 * 2``).
    """
    return _world_size_from_env() > 1 and not torch.cuda.is_available()


def build_accelerator(*, timeout_s: float | None = None, **accelerator_kwargs: Any) -> Accelerator:
    """Create an ``accelerate.Accelerator`` that works on CPU-only hosts and GPU hosts alike.

    On a multi-process CPU-only launch (``accelerate launch`` or ``torchrun`` without CUDA)
    it asks accelerate for the ``gloo`` backend, so that accelerate's process count matches
    DeepSpeed's world; GPU hosts keep their normal backend. The collective timeout is
    ``timeout_s`` (default: ``DIFFUSERS_ZERO3_PG_TIMEOUT`` seconds, else 1800), so that a
    rank that dies makes the others fail instead of waiting forever.

    All other keyword arguments go to ``Accelerator`` unchanged. An
    ``InitProcessGroupKwargs`` passed in ``kwargs_handlers`` is respected as given.

    Example:
        >>> from diffusers_zero3 import build_accelerator
        >>> accelerator = build_accelerator(gradient_accumulation_steps=2, mixed_precision="no")
        >>> accelerator.num_processes  # 2 under `accelerate launch --num_processes 2`, even on CPU
    """
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = list(accelerator_kwargs.pop("kwargs_handlers", None) or [])
    if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
        timeout = process_group_timeout() if timeout_s is None else timedelta(seconds=timeout_s)
        backend = "gloo" if needs_gloo_backend() else None
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timeout))
    if needs_gloo_backend():
        # DeepSpeed falls back to its CPU accelerator when it finds no GPU; saying so
        # explicitly silences its warning and keeps a half-visible GPU from being picked.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return Accelerator(kwargs_handlers=handlers, **accelerator_kwargs)
