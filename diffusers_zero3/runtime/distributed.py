"""Small rank-aware utilities shared by the rest of the package.

Everything here works in a plain single process (no ``torch.distributed`` group): ranks are
then 0 of 1 and collectives are identities.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("diffusers_zero3")


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank, 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """The number of ranks, 1 without a process group."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on global rank 0 (and in a single process)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank. Collective: call on every rank. No-op without a process group."""
    if is_distributed():
        dist.barrier()


def comm_device() -> torch.device:
    """The device collectives of the default group expect tensors on (CPU for gloo)."""
    if not is_distributed() or dist.get_backend() == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj):
    """Every rank's ``obj``, in rank order. Collective: call on every rank."""
    if not is_distributed():
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_over_ranks(values: list[float]) -> list[float]:
    """The element-wise maximum of a fixed-length list of numbers over every rank (float64).
    Collective: call on every rank; without a process group, ``values`` themselves."""
    if not is_distributed() or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Gather a fixed-length list of ints from every rank. Collective: call on every rank.

    Cheaper than ``all_gather_object`` (no pickling) and safe to call inside forward hooks.
    """
    t = torch.tensor(values, dtype=torch.long, device=comm_device())
    if not is_distributed():
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def log_rank_zero(msg: str, *args, level: int = logging.INFO) -> None:
    """Log ``msg`` on rank 0 only (the single place that decides who speaks).

    Goes to the ``diffusers_zero3`` logger. When logging is not configured at all (no
    handler on that logger or the root), the message is printed to stderr instead, so that a
    script that never calls ``logging.basicConfig`` still sees it.
    """
    if not is_main_process():
        return
    if logger.handlers or logging.getLogger().handlers:
        logger.log(level, msg, *args)
    elif level >= logging.INFO:
        import sys

        print(msg % args if args else msg, file=sys.stderr, flush=True)


def launched_as_rank() -> bool:
    """True in a process started by a distributed launcher (``WORLD_SIZE`` > 1), whether or
    not its process group is (still) initialised."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def exit_after_teardown(code: int = 0) -> None:
    """End a launched rank: wait for every rank (a barrier, while the process group exists),
    flush the output, and leave with ``os._exit(code)``, skipping the interpreter's teardown.
    Collective when a process group is initialised: call on every rank, last.

    On CPU/gloo, the interpreter's teardown of a finished run aborts now and then ("terminate
    called without an active exception": a C++ thread destroyed while joinable; about one run
    in ten here), more so once the process group was destroyed (``accelerator.end_training()``
    does; the scripts use ``recipe.finish_trackers`` instead). Leaving without any teardown
    makes the exit code the run's own. Outside a launched rank this returns and the
    interpreter exits normally.
    """
    if not (is_distributed() or launched_as_rank()):
        return
    import sys

    logging.shutdown()  # everything that takes time happens before the barrier: once a rank
    sys.stdout.flush()  # is past it and leaves, the others' collective threads see its
    sys.stderr.flush()  # sockets close, and a rank still tearing down can abort on that
    if is_distributed():
        from .rank_watch import finish_rank_watch

        finish_rank_watch()  # every rank finished, each still watched until then
        dist.barrier()  # every rank's work is done
    os._exit(code)


def process_group_timeout(default_s: float = 1800.0) -> timedelta:
    """The collective timeout: ``DIFFUSERS_ZERO3_PG_TIMEOUT`` seconds if set, else ``default_s``."""
    return timedelta(seconds=float(os.environ.get("DIFFUSERS_ZERO3_PG_TIMEOUT", default_s)))


def enable_nccl_error_handling() -> dict[str, str]:
    """Make a timed-out NCCL collective end every rank's process instead of leaving it hanging;
    returns the variables this call set. Call before any process group is created: NCCL reads
    them when a group is built. A variable already in the environment is left as it is.

    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (an older ``NCCL_ASYNC_ERROR_HANDLING`` is kept),
      the value torchrun gives its workers: when a collective outlives the process group's
      timeout, NCCL's watchdog thread logs it, aborts the NCCL communicators and takes the
      process down (an uncaught C++ exception in that thread: SIGABRT, no Python traceback,
      no ``finally``). torch's own default (3) takes it down without the communicator abort;
      0 turns the handling off (the watchdog only logs, and the ranks stay blocked).
    * On a CUDA host, ``TORCH_NCCL_ENABLE_MONITORING=1`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
      (torch's current defaults, set for the versions that differ): the first rank to time out
      raises a flag in the rendezvous store; every other rank's monitor thread sees it, dumps
      its collective trace and ends its process too (after ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``,
      8 minutes by default, unless the launcher has stopped it first). A rank that is not
      inside a collective (the one that stopped) is ended this way.

    ``TORCH_NCCL_BLOCKING_WAIT`` is not set: it would turn the timeout into a Python error, but
    only on the ranks waiting, without any watchdog thread, and with every wait blocking the
    CPU (ZeRO-3 overlaps its gathers with compute).

    Example:
        >>> enable_nccl_error_handling()  # before accelerate or DeepSpeed create the process group
        {'TORCH_NCCL_ASYNC_ERROR_HANDLING': '1'}
    """
    # each setting: the names torch reads for it (new name first; any one present wins), value
    settings = [(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"), "1")]
    if torch.cuda.is_available():
        settings += [(("TORCH_NCCL_ENABLE_MONITORING",), "1"), (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1")]
    set_now = {}
    for names, value in settings:
        if not any(n in os.environ for n in names):
            os.environ[names[0]] = set_now[names[0]] = value
    return set_now


def init_distributed_if_needed() -> None:
    """Start DeepSpeed's communication backend (and ``torch.distributed``) unless it runs
    already. Collective: call on every rank.

    Outside ``accelerate`` (a custom script under ``torchrun`` or the ``deepspeed`` launcher),
    ``deepspeed.init_distributed()`` alone leaves every rank on ``cuda:0``, and NCCL would run
    all the ranks' collectives on one GPU. On a CUDA host this first selects the rank's GPU
    (``LOCAL_RANK``; device 0 where each process sees a single GPU) and sets NCCL's error
    handling (``enable_nccl_error_handling``). On a CPU host it only does the latter, which
    NCCL-less backends ignore. With the backend already started it does nothing.

    Example:
        >>> init_distributed_if_needed()  # under `torchrun --nproc_per_node 2 script.py`
        >>> torch.cuda.current_device() == int(os.environ["LOCAL_RANK"])  # on a 2-GPU host
        True
    """
    import deepspeed

    if deepspeed.comm.is_initialized():
        return
    if torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)
    enable_nccl_error_handling()
    deepspeed.init_distributed(timeout=process_group_timeout())
