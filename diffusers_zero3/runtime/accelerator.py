"""An ``Accelerator`` that runs DeepSpeed on CPU-only hosts as well as on GPU hosts."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from .distributed import enable_nccl_error_handling, log_rank_zero, process_group_timeout
from .zero3 import unregister_transformers_zero3

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


def uses_deepspeed(accelerator_kwargs: dict[str, Any]) -> bool:
    """True when an ``Accelerator`` built with these kwargs (and this environment) runs DeepSpeed."""
    if accelerator_kwargs.get("deepspeed_plugin") is not None or accelerator_kwargs.get("deepspeed_plugins"):
        return True
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def set_default_collective_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` the default of every process group created from now on.

    ``init_process_group(timeout=...)`` covers the default group only. DeepSpeed creates its
    own groups with ``new_group(ranks)`` (its ZeRO-3 all-gathers run on a clone of the world
    group), and those take torch's module default of 30 minutes: a rank that stops (not
    dies) would leave the others blocked there for half an hour whatever the flag says.
    """
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


# DeepSpeed's ZeRO-3 collectives call torch's renamed collectives, and torch warns at every
# call site: hundreds of identical lines per run that no user can act on.
_DEPRECATED_COLLECTIVES = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
)


def silence_deepspeed_collective_deprecations() -> None:
    """Hide torch's deprecation warning for the two collectives DeepSpeed calls internally
    (``all_gather_into_tensor``, ``reduce_scatter_tensor``); every other warning stays."""
    import warnings

    warnings.filterwarnings("ignore", message=_DEPRECATED_COLLECTIVES, category=FutureWarning)


def build_accelerator(*, timeout_s: float | None = None, **accelerator_kwargs: Any) -> Accelerator:
    """Create an ``accelerate.Accelerator`` that works on CPU-only hosts and GPU hosts alike.

    * On a multi-process CPU-only launch (``accelerate launch`` or ``torchrun`` without CUDA)
      it asks accelerate for the ``gloo`` backend, so that accelerate's process count matches
      DeepSpeed's world. Without DeepSpeed it also asks for accelerate's ``MULTI_CPU`` mode:
      otherwise accelerate reports ``DistributedType.NO`` with N processes, does not wrap the
      model, and every rank silently trains its own replica.
    * The collective timeout is ``timeout_s`` (default: ``DIFFUSERS_ZERO3_PG_TIMEOUT``
      seconds, else 1800) for the default group *and* for the groups DeepSpeed creates, so a
      rank that dies or stops makes the others fail instead of waiting forever.
    * Under NCCL, a collective that outlives that timeout ends the ranks' processes (they are
      killed, SIGABRT, not a Python exception): ``enable_nccl_error_handling`` sets
      ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (and on CUDA hosts the monitoring that ends the
      ranks not inside the collective) before the process group exists, unless already set.
    * torch's deprecation warnings for the collectives DeepSpeed calls are filtered.
    * transformers' ZeRO-3 registration is dropped (``unregister_transformers_zero3``), so a
      ``from_pretrained`` on a subset of ranks (rank 0 loading a pipeline to look at a
      sample) loads whole instead of waiting for the other ranks; load models that must be
      partitioned with ``load_pretrained_zero3``. The timeout in force is logged.

    All other keyword arguments go to ``Accelerator`` unchanged. An
    ``InitProcessGroupKwargs`` passed in ``kwargs_handlers`` is respected as given.

    Example:
        >>> from diffusers_zero3 import build_accelerator
        >>> accelerator = build_accelerator(gradient_accumulation_steps=2, mixed_precision="no")
        >>> accelerator.num_processes  # 2 under `accelerate launch --num_processes 2`, even on CPU
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    silence_deepspeed_collective_deprecations()
    handlers = list(accelerator_kwargs.pop("kwargs_handlers", None) or [])
    given = [h for h in handlers if isinstance(h, InitProcessGroupKwargs)]
    if given:
        timeout = given[0].timeout
    else:
        timeout = process_group_timeout() if timeout_s is None else timedelta(seconds=timeout_s)
        backend = "gloo" if needs_gloo_backend() else None
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timeout))
    if timeout is not None:
        set_default_collective_timeout(timeout)
    enable_nccl_error_handling()  # NCCL reads it when the process group is built, below
    if needs_gloo_backend():
        # DeepSpeed falls back to its CPU accelerator when it finds no GPU; saying so
        # explicitly silences its warning and keeps a half-visible GPU from being picked.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if not uses_deepspeed(accelerator_kwargs):
            accelerator_kwargs.setdefault("cpu", True)
    accelerator = Accelerator(kwargs_handlers=handlers, **accelerator_kwargs)
    if needs_gloo_backend():
        # DeepSpeed's CPU accelerator answers device_count() by running `numactl --hardware`
        # in a subprocess unless LOCAL_SIZE is set, and ZeRO-3 asks at every gradient
        # reduce-scatter: a fork per bucket (about 0.1 s per step on a 39 M UNet). Set only
        # now, after DeepSpeed's communication backend started: with LOCAL_SIZE set at its
        # start, it maps a 66 MiB shared-memory all-reduce buffer per rank in /dev/shm that
        # nothing ever unlinks (a 2-core machine's /dev/shm filled up after ~150 runs).
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # Loads that must be partitioned go through load_pretrained_zero3; with transformers'
    # ZeRO-3 config registered, a plain from_pretrained on one rank alone would hang.
    unregister_transformers_zero3()
    log_rank_zero(
        f"collective timeout: {timeout.total_seconds():.0f} s (--process_group_timeout or "
        "DIFFUSERS_ZERO3_PG_TIMEOUT); a rank that stops makes the others fail after it"
        if timeout is not None
        else "collective timeout: torch's default"
    )
    return accelerator
