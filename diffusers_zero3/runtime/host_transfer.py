"""Host <-> device copies that do not stall the device's queue.

A copy from ordinary (pageable) host memory to a CUDA device blocks the host until the copy
is done, which waits for every kernel queued before it: one such copy per step drains the
queue that the host had filled ahead of the device. From page-locked (pinned) memory the copy
is asynchronous (``non_blocking=True``): the host goes on queueing work. torch's pinned-memory
allocator keeps a pinned block alive until the copies that read it have run, so a staging
tensor may go out of scope right after its copy is queued.

Elsewhere (the CPU, ``meta``, a device that is not CUDA) these helpers are plain ``.to``
calls: the values, and the numbers a run on the CPU produces, are the same as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pins_host_memory(device: torch.device | str) -> bool:
    """Whether host data bound for ``device`` is staged in pinned memory and copied without
    blocking: on CUDA devices only (pinned memory needs a CUDA driver; on the CPU there is no
    copy to overlap).

    Example:
        >>> pins_host_memory("cuda:1"), pins_host_memory("cpu"), pins_host_memory("meta")
        (True, False, False)
    """
    return torch.device(device).type == "cuda"


def stack_to_device(
    tensors: Sequence[torch.Tensor], device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``torch.stack(tensors).to(device=device, dtype=dtype)`` for host tensors of one shape,
    without a blocking copy on CUDA: they are stacked straight into one pinned buffer (cast
    there to ``dtype``, as ``.to`` would cast them: the same values) and copied with
    ``non_blocking=True``. Not a collective.

    Example (per-sample noise drawn with CPU generators, on the batch's device):
        >>> gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
        >>> noise = stack_to_device([torch.randn(4, 8, 8, generator=g) for g in gens], "cpu")
        >>> noise.shape
        torch.Size([2, 4, 8, 8])
    """
    device = torch.device(device)
    if not pins_host_memory(device):
        return torch.stack(list(tensors)).to(device=device, dtype=dtype)
    first = tensors[0]
    # CPU: the pinned host staging buffer of the copy
    staged = torch.empty((len(tensors), *first.shape), dtype=dtype or first.dtype, pin_memory=True)
    for row, tensor in zip(staged, tensors):
        row.copy_(tensor)  # the cast, on the host, as .to(dtype) of the stack makes it
    return staged.to(device, non_blocking=True)


def host_to_device(
    tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``tensor`` (on the host) on ``device`` as ``dtype``: through pinned memory and a
    non-blocking copy on CUDA, a plain ``.to`` elsewhere. Not a collective.

    Example:
        >>> host_to_device(torch.arange(3), "cpu", torch.float32)
        tensor([0., 1., 2.])
    """
    device = torch.device(device)
    if not pins_host_memory(device) or tensor.device.type != "cpu":
        return tensor.to(device=device, dtype=dtype)
    # CPU: the pinned host staging buffer of the copy
    staged = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, pin_memory=True)
    staged.copy_(tensor)
    return staged.to(device, non_blocking=True)
