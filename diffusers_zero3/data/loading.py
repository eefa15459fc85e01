"""How the training loader runs: worker processes and pinned batches, chosen from the device.

diffusers' examples default to ``--dataloader_num_workers 0`` and no ``pin_memory``: every
batch is decoded (images resized and cropped; video clips decoded, 0.5-1.5 s for a 720p x 81
clip) in the training process, between two steps, while the GPU waits; and its tensors are
copied to the GPU from pageable memory, which blocks the host until the GPU's queue has run.
On a CUDA host the loader here defaults to worker processes (they decode the next batches
while the GPU runs the step) and pinned batches (copied without blocking: the trainer's
accelerator is built with ``non_blocking``). On the CPU the defaults stay diffusers': the
training process's cores are the ones that would decode, and there is no copy to overlap.

The choice changes no number: a sample's crop, flip and caption draws come from
``(seed, epoch, index)`` whichever process makes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Workers chosen at most on a CUDA host when --dataloader_num_workers is not given: enough to
# decode ahead of a step (docs/benchmarks.md, "Data path vs training step"), few enough that
# 8 ranks of a host do not start 8 x cores processes.
MAX_AUTO_WORKERS = 4


@dataclass(frozen=True)
class LoaderSettings:
    """A training loader's ``num_workers`` (decoding threads for ``--streaming``, whose rows
    are read in the training process) and ``pin_memory``; ``chosen`` says the workers were
    chosen here, not given by ``--dataloader_num_workers``."""

    num_workers: int
    pin_memory: bool
    chosen: bool

    def describe(self, device_type: str, streaming: bool = False) -> str:
        """One log line: what the loader does and why."""
        what = "decoding threads" if streaming else "worker processes"
        origin = f"chosen for a {device_type} host" if self.chosen else "--dataloader_num_workers"
        pinned = "pinned batches, copied without blocking" if self.pin_memory else "batches not pinned"
        return f"data loader: {self.num_workers} {what} ({origin}), {pinned}"


def loader_settings(device_type: str, requested_workers: int | None, cpus_per_process: int) -> LoaderSettings:
    """The loader settings of a training process on a ``device_type`` device (``"cuda"``,
    ``"cpu"``, ...) that has ``cpus_per_process`` cores to itself.

    ``requested_workers`` (``--dataloader_num_workers``) wins when given. Otherwise a CUDA
    host gets ``min(MAX_AUTO_WORKERS, cpus_per_process - 1)`` workers, at least 1 (one core
    stays with the process that drives the GPU); any other device gets 0, as diffusers'
    examples. Batches are pinned on CUDA only (pinned memory needs the CUDA driver). A pure
    function: ``cpus_per_local_process`` reads the host.

    Example:
        >>> loader_settings("cuda", None, 12)
        LoaderSettings(num_workers=4, pin_memory=True, chosen=True)
        >>> loader_settings("cuda", 0, 12)
        LoaderSettings(num_workers=0, pin_memory=True, chosen=False)
        >>> loader_settings("cpu", None, 12)
        LoaderSettings(num_workers=0, pin_memory=False, chosen=True)
    """
    cuda = device_type == "cuda"
    if requested_workers is not None:
        return LoaderSettings(requested_workers, pin_memory=cuda, chosen=False)
    workers = max(1, min(MAX_AUTO_WORKERS, cpus_per_process - 1)) if cuda else 0
    return LoaderSettings(workers, pin_memory=cuda, chosen=True)


def cpus_per_local_process() -> int:
    """The cores this process may run on (its affinity) over the training processes of this
    host (``LOCAL_WORLD_SIZE``, which ``torchrun`` and ``accelerate launch`` set), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
