"""Equal call counts across ranks, and a check that turns a mismatch into an error.

Under ZeRO-3 every forward of a partitioned module all-gathers its parameters, so every
rank must call it the same number of times in the same order. A rank that calls it fewer
times leaves the others blocked in an all-gather: a hang (gloo waits for its timeout, NCCL
for up to 30 minutes). Batch *sizes* may differ between ranks; call *counts* may not.

* ``lockstep_map`` runs a callable over a rank's local micro-batches and pads with dummy
  calls so that every rank makes the same number of calls; ``lockstep_iter`` is the same as a
  generator, for results that are written out as they come rather than held.
* ``lockstep_check`` (a context manager over a module) is the debug check: before each
  forward every rank exchanges its call index, so a mismatch raises ``LockstepError``
  naming the model and the counts on every rank, instead of a hang. It costs one small
  all-gather per call.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from .distributed import all_gather_ints, all_gather_object, get_rank, get_world_size, logger

T = TypeVar("T")
R = TypeVar("R")

_CALL, _DONE = 1, 2


class LockstepError(RuntimeError):
    """Ranks called a ZeRO-3 partitioned model a different number of times."""


class _CallCounter:
    """Exchanges (kind, index, name) with every rank before each call and at the end."""

    def __init__(self, name: str):
        self.name = name
        self.calls = 0
        self._name_id = zlib.crc32(name.encode()) & 0x7FFFFFFF

    def _sync(self, kind: int, index: int) -> None:
        if get_world_size() == 1:
            return
        rows = all_gather_ints([kind, index, self._name_id])
        if all(r == rows[0] for r in rows):
            return
        states = []
        for rank, (k, idx, name_id) in enumerate(rows):
            if name_id != self._name_id:
                states.append(f"rank {rank} is at a different model's lockstep point")
            elif k == _CALL:
                states.append(f"rank {rank} is making call {idx + 1}")
            else:
                states.append(f"rank {rank} finished after {idx} call(s)")
        raise LockstepError(
            f"model '{self.name}' called out of lockstep (rank {get_rank()}): "
            + "; ".join(states)
            + ". Every rank must call a ZeRO-3 partitioned model the same number of times; "
            "use lockstep_map() to pad short ranks with dummy calls."
        )

    def before_call(self) -> None:
        self._sync(_CALL, self.calls)
        self.calls += 1

    def finish(self) -> None:
        self._sync(_DONE, self.calls)


@contextlib.contextmanager
def lockstep_check(module: torch.nn.Module, name: str | None = None) -> Iterator[_CallCounter]:
    """Debug check: make out-of-lockstep forwards of ``module`` raise instead of hang.

    Collective: every rank enters and leaves the block. Before each ``module`` forward (a
    hook that runs ahead of DeepSpeed's own parameter fetch) the ranks exchange their call
    index; on leaving the block they exchange their call counts. When a rank calls the
    module fewer times than another, the longer rank's next forward meets the shorter rank's
    final exchange, and both raise ``LockstepError`` naming ``name`` and the counts. If the
    block raises, nothing more is exchanged.

    Example:
        >>> with lockstep_check(reward_engine.module, "reward"):
        ...     for batch in my_local_batches:        # 3 on rank 0, 1 on rank 1
        ...         reward_engine.module(batch)       # LockstepError, not a hang
    """
    counter = _CallCounter(name or type(module).__name__)
    handle = module.register_forward_pre_hook(lambda mod, args: counter.before_call(), prepend=True)
    try:
        yield counter
        counter.finish()
    finally:
        handle.remove()


def _shared_dummy(items: Sequence[Any], counts: list[int]) -> Any:
    """An item from the first rank that has one, for ranks with none (collective).

    A tensor travels through the CPU (a pickled CUDA tensor would land on the sender's GPU
    index) with its device type, and lands on this rank's device of that type: a model held
    on the CPU on a GPU host gets a CPU dummy, a CUDA one a tensor on the current GPU.
    """
    first = next(r for r, c in enumerate(counts) if c > 0)
    item = items[0] if get_rank() == first else None
    device_type = None
    if torch.is_tensor(item):
        device_type = item.device.type
        item = item.detach()  # a tensor in an autograd graph cannot be pickled
        if device_type != "meta":  # a meta tensor has no data to copy, and pickles as it is
            item = item.cpu()
    dummy, device_type = all_gather_object((item, device_type))[first]
    if torch.is_tensor(dummy):
        dummy = dummy.to(torch.device(device_type))  # "cuda": the current GPU
    return dummy


def lockstep_iter(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    dummy: T | None = None,
    name: str = "model",
    dummy_results: list | None = None,
) -> Iterator[R]:
    """``lockstep_map`` as a generator: yields ``fn``'s result for each local item as it comes.

    Collective: call on every rank and exhaust the generator on every rank (a plain ``for``
    loop, ``list()``): the padding calls of a short rank run after its last real result, and
    a generator left unfinished leaves the other ranks waiting in their next call (a hang). The
    first collective (the exchange of item counts) runs at the first ``next()``, not at the
    call. Arguments as ``lockstep_map``'s.

    Example:
        >>> for out in lockstep_iter(encode, chunks, name="vae"):   # 3 chunks here, 1 there
        ...     writer.add(out)             # written as it comes: one chunk in memory at a time
    """
    counts = [c[0] for c in all_gather_ints([len(items)])]
    total = max(counts)
    if total == 0:
        return
    if dummy is None and min(counts) == 0:
        # Every rank knows the counts, so every rank joins this collective (or none does).
        dummy = _shared_dummy(items, counts)
    elif dummy is None and len(items) < total:
        dummy = items[0]
    for i in range(total):
        if i < len(items):
            yield fn(items[i])
        else:
            out = fn(dummy)
            if dummy_results is not None:
                dummy_results.append(out)
    if len(items) < total:
        logger.debug("%s: %d dummy call(s) on rank %d to keep lockstep", name, total - len(items), get_rank())


def lockstep_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    dummy: T | None = None,
    name: str = "model",
    dummy_results: list | None = None,
) -> list[R]:
    """Apply ``fn`` to each local item so that every rank calls ``fn`` equally often.

    Collective: call on every rank, each with its own ``items`` (any number, zero
    included). Every rank calls ``fn`` ``max(len(items) over ranks)`` times; a rank with
    fewer items calls it on ``dummy`` for the rest and discards those results. When
    ``dummy`` is None a short rank borrows the first item of the first rank that has one (an
    extra small ``all_gather_object``, only when some rank has no items at all) or repeats
    its own first item.

    Args:
        fn: the call that runs the partitioned model on one micro-batch.
        items: this rank's micro-batches.
        dummy: a micro-batch to pad with (same shapes as a real one).
        name: the model's name, for logs.
        dummy_results: if given, the results of the dummy calls are appended to it (e.g. to
            keep them in an autograd graph, so that backward passes stay equal too).

    Returns:
        ``fn``'s results for this rank's real items, in order.

    Example:
        >>> batches = list(torch.split(my_images, 4))          # 3 on rank 0, 1 on rank 1
        >>> scores = lockstep_map(reward_model, batches, name="reward")
    """
    return list(lockstep_iter(fn, items, dummy=dummy, name=name, dummy_results=dummy_results))
