"""What a rank holds: process RSS by phase of a run, and model-state bytes by kind.

``MemoryLog`` records the resident set size (now, and the peak so far) at named phases of a
run (after loading, after ``prepare``, after the first forward, backward and optimizer
step, ...), and on a CUDA host the GPU memory of torch's allocator too;
``model_state_bytes`` counts the bytes of parameters, gradients, optimizer state and EMA a
rank holds in tensors (on whichever device), for a ZeRO-3 engine or a plain module alike. The
text-to-image trainer logs both; the benchmarks read them; the planner
(``diffusers_zero3.placement.plan``) predicts the second.
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from dataclasses import dataclass, field

import torch

from .deepspeed_internals.levers import zero3_optimizer, zero3_optimizer_bytes
from .zero3 import full_numel, is_zero3_param

MIB = 2**20


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux; 0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024


# glibc's mallopt parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD = -3).
_M_MMAP_THRESHOLD = -3


def return_large_frees_to_os(threshold_bytes: int = MIB) -> bool:
    """Make glibc serve allocations of ``threshold_bytes`` or more with ``mmap`` (returned to
    the OS on free) instead of its heap, for this process from now on. Returns False where
    glibc is absent.

    ZeRO-3 on a CPU host allocates and frees a whole parameter (or bucket) at every gather.
    glibc's default raises its mmap threshold dynamically up to 32 MiB after the first such
    frees, after which freed blocks stay in the heap and the RSS of a rank keeps them: the
    same effect as ``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment, set in-process.
    Setting the threshold explicitly also turns glibc's dynamic adjustment off.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33)
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )
    ]  # fmt: skip


def heap_bytes() -> tuple[int, int, int] | None:
    """glibc's view of this process's allocations, in bytes: ``(in use, freed but held,
    mmapped)``, i.e. the heap's allocated and free blocks (all arenas) and the blocks served
    by ``mmap``; None without glibc's ``mallinfo2`` (glibc < 2.33, or another libc).

    The second number is memory the program has freed and the RSS still counts: on a CPU
    host ZeRO-3 frees a gathered parameter or gradient at every module, and glibc keeps the
    freed blocks (``return_large_frees_to_os``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks), int(info.fordblks), int(info.hblkhd)


def device_memory_bytes() -> tuple[int, int, int]:
    """This rank's GPU memory in torch's CUDA allocator, in bytes: ``(allocated now, peak
    allocated so far, peak reserved so far)`` on the current device; zeros without CUDA (and
    before CUDA is first used: reading the numbers does not initialise it)."""
    if not torch.cuda.is_available():
        return 0, 0, 0
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


@dataclass
class PhaseMemory:
    """RSS at the end of a phase and the peak RSS of the process up to then, in bytes, and
    when the phase ended (``time.monotonic()``). On a CUDA host also the GPU bytes of torch's
    allocator: allocated at the end of the phase, and the peaks so far of allocated and
    reserved (the allocator's cache included) bytes; 0 without CUDA."""

    phase: str
    rss: int
    peak: int
    time: float = field(default_factory=time.monotonic)
    device_allocated: int = 0
    device_peak_allocated: int = 0
    device_peak_reserved: int = 0


class MemoryLog:
    """Per-phase RSS (and GPU memory, on a CUDA host) of this rank: ``mark("after prepare")``
    after each phase.

    Not a collective, except ``gathered`` (every rank calls it the same number of times).
    """

    def __init__(self) -> None:
        self.phases: list[PhaseMemory] = []

    def mark(self, phase: str) -> PhaseMemory:
        """Record the RSS now and the peak so far under ``phase`` (and the GPU bytes, see
        ``device_memory_bytes``); returns the record."""
        rss = current_rss_bytes()
        record = PhaseMemory(phase, rss, max(rss, peak_rss_bytes()))  # the kernel's peak can lag
        record.device_allocated, record.device_peak_allocated, record.device_peak_reserved = (
            device_memory_bytes()
        )
        self.phases.append(record)
        return record

    def has(self, phase: str) -> bool:
        """True once ``phase`` is marked."""
        return any(p.phase == phase for p in self.phases)

    def gathered(self) -> list[PhaseMemory]:
        """The records with each number the maximum over ranks. All ranks must call this,
        with the same phases marked; without a process group it returns the local ones."""
        from .distributed import max_over_ranks

        keys = ("rss", "peak", "time", "device_allocated", "device_peak_allocated", "device_peak_reserved")
        flat = max_over_ranks([getattr(p, k) for p in self.phases for k in keys])  # the one collective
        records = []
        for i, p in enumerate(self.phases):
            values = dict(zip(keys, flat[len(keys) * i : len(keys) * (i + 1)]))
            records.append(
                PhaseMemory(p.phase, **{k: v if k == "time" else int(v) for k, v in values.items()})
            )
        return records

    @staticmethod
    def format(records: list[PhaseMemory]) -> str:
        """One line per phase: RSS, peak so far, the peak's growth in that phase (MiB) and the
        phase's seconds. When GPU memory was recorded, each line ends with
        ``device peak X MiB (reserved Y MiB)``: the peaks so far of allocated and reserved GPU
        bytes; without it the lines are exactly the CPU ones."""
        on_device = any(
            p.device_allocated or p.device_peak_allocated or p.device_peak_reserved for p in records
        )
        lines, last_peak, last_time = [], 0, records[0].time if records else 0.0
        for p in records:
            line = (
                f"  {p.phase:<22} RSS {p.rss / MIB:8.1f} MiB  peak {p.peak / MIB:8.1f} MiB "
                f"(+{max(0, p.peak - last_peak) / MIB:6.1f})  {p.time - last_time:7.2f} s"
            )
            if on_device:
                line += (
                    f"  device peak {p.device_peak_allocated / MIB:8.1f} MiB "
                    f"(reserved {p.device_peak_reserved / MIB:8.1f} MiB)"
                )
            lines.append(line)
            last_peak, last_time = p.peak, p.time
        return "\n".join(lines)


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters held on this rank.

    A ZeRO-3 parameter counts its partition (``ds_tensor``), plus its full size when the
    persistence threshold keeps it whole on every rank; any other parameter counts whole.
    """
    total = 0
    for p in module.parameters():
        if is_zero3_param(p):
            total += p.ds_tensor.numel() * p.ds_tensor.element_size()
            if getattr(p, "ds_persist", False):
                total += p.ds_numel * p.ds_tensor.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def total_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters whole (a ZeRO-3 parameter counts its full size)."""
    total = 0
    for p in module.parameters():
        numel = full_numel(p)
        total += numel * (p.ds_tensor.element_size() if is_zero3_param(p) else p.element_size())
    return total


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer=None, ema=None) -> dict[str, int]:
    """Bytes of the trained model's states this rank holds, by kind.

    * ``parameters``: the model's parameters (a ZeRO-3 parameter counts its partition, plus
      its whole size when the persistence threshold keeps it whole on every rank);
    * ``gradients``: ZeRO-3's flat buffer of gradient partitions, else the ``.grad`` tensors;
    * ``optimizer``: the optimizer's state tensors, plus ZeRO-3's fp32 master partitions
      where they are not the parameters' own storage (mixed precision);
    * ``ema``: ``ShardedEMA.local_bytes()`` (or an EMA model's parameters);
    * ``buffers``: ZeRO-3's gradient reduce buckets (``reduce_bucket_size`` elements per
      gradient dtype), held for the whole run.

    ``model`` may be the prepared engine or its module; ``optimizer`` the prepared one.
    """
    module = getattr(model, "module", model)
    params = local_parameter_bytes(module)
    zero = zero3_optimizer(optimizer)
    # the torch optimizer holding the state: ZeRO's inner one, or the one accelerate wraps
    torch_opt = zero.optimizer if zero is not None else getattr(optimizer, "optimizer", optimizer)
    if zero is not None:
        grads, masters, buffers = zero3_optimizer_bytes(zero)
    else:
        grads = sum(_tensor_bytes(p.grad) for p in module.parameters() if not is_zero3_param(p))
        masters, buffers = 0, 0
    opt, seen = masters, set()
    for state in getattr(torch_opt, "state", {}).values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0 and id(value) not in seen:
                seen.add(id(value))
                opt += _tensor_bytes(value)
    ema_bytes = 0
    if ema is not None:
        ema_bytes = ema.local_bytes() if hasattr(ema, "local_bytes") else local_parameter_bytes(ema)
    return {"parameters": params, "gradients": grads, "optimizer": opt, "ema": ema_bytes, "buffers": buffers}
