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
        dist.barrier()  # every rank's work is done
    os._exit(code)


def process_group_timeout(default_s: float = 1800.0) -> timedelta:
    """The collective timeout: ``DIFFUSERS_ZERO3_PG_TIMEOUT`` seconds if set, else ``default_s``."""
    return timedelta(seconds=float(os.environ.get("DIFFUSERS_ZERO3_PG_TIMEOUT", default_s)))
