"""Host tensors of 2 MiB and more on transparent huge pages: torch's ``THP_MEM_ALLOC_ENABLE``.

torch's CPU allocator aligns such tensors to 2 MiB and asks the kernel for huge pages
(``madvise(MADV_HUGEPAGE)``) when ``THP_MEM_ALLOC_ENABLE=1``. It reads the variable once, at
the process's first CPU tensor; importing diffusers, transformers, accelerate or DeepSpeed
creates tensors (importing torch alone does not), so ``use_huge_pages_for_host_tensors()`` is
the first call of a training script, and it says when it comes too late. Importing
``diffusers_zero3`` sets nothing.

Why: ZeRO-3 gathers every parameter and reduces every gradient through buffers allocated and
freed around each module, of many sizes. On a host (CPU ranks, or anything kept on the CPU)
glibc serves them from its heap and keeps many freed blocks; on huge pages fewer are kept and
peak RSS per rank falls (docs/benchmarks.md, "ZeRO-3 per module").
"""

from __future__ import annotations

import logging
import os

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
HUGE_PAGE_BYTES = 2 << 20

logger = logging.getLogger("diffusers_zero3")


def huge_pages_in_effect() -> bool:
    """Whether a host tensor of 2 MiB and more gets huge pages in this process: a 4 MiB probe,
    written, is looked up in ``/proc/self/smaps`` (False where there is none). Under the
    kernel's ``madvise`` mode that is whether torch asks for them; under ``always`` they come
    anyway, under ``never`` never. Reading it fixes torch's setting if no tensor existed yet."""
    import torch

    probe = torch.ones(2 * HUGE_PAGE_BYTES, dtype=torch.uint8, device="cpu")  # a host tensor
    address = probe.data_ptr()
    try:
        with open("/proc/self/smaps") as fh:
            inside = False
            for line in fh:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping's header: start-end perms ...
                    start, end = (int(x, 16) for x in first.split("-"))
                    inside = start <= address < end
                elif inside and first == "AnonHugePages:":
                    return int(line.split()[1]) > 0
    except OSError:
        return False
    return False


def use_huge_pages_for_host_tensors() -> bool:
    """Ask torch to put host tensors of 2 MiB and more on huge pages; whether it does.

    Call it first thing in a script, before importing diffusers, transformers, accelerate or
    DeepSpeed. It sets ``THP_MEM_ALLOC_ENABLE=1`` unless the environment sets the variable
    (``THP_MEM_ALLOC_ENABLE=0`` keeps torch's default, and this returns False), and launched
    child processes inherit it. When torch had already read the variable (a tensor existed),
    it logs one warning line saying so, and returns False.

    Example:
        >>> from diffusers_zero3 import use_huge_pages_for_host_tensors
        >>> use_huge_pages_for_host_tensors()  # before `import diffusers`
        True
    """
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    if os.environ[HUGE_PAGES_ENV] != "1":
        return False
    if huge_pages_in_effect():
        return True
    if "[never]" in _kernel_mode():
        logger.warning("warning: no huge pages for host tensors: the kernel's transparent huge pages are off")
    else:
        logger.warning(
            "warning: huge pages for host tensors asked for too late (torch read %s at this process's first "
            "tensor): call use_huge_pages_for_host_tensors() before importing diffusers, transformers, "
            "accelerate or deepspeed",
            HUGE_PAGES_ENV,
        )
    return False


def _kernel_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return fh.read()
    except OSError:
        return ""
