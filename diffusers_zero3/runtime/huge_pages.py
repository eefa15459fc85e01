"""Host tensors of 2 MiB and more on transparent huge pages: torch's ``THP_MEM_ALLOC_ENABLE``.

torch's CPU allocator aligns such tensors to 2 MiB and asks the kernel for huge pages
(``madvise(MADV_HUGEPAGE)``) when ``THP_MEM_ALLOC_ENABLE=1``. It reads the variable once, at
the process's first CPU tensor, so it must be set before any tensor exists; importing
``diffusers_zero3`` sets it (unless the environment already says otherwise), and
``import diffusers_zero3`` at the top of a script is enough.

Why: ZeRO-3 gathers every parameter and reduces every gradient through buffers allocated
and freed around each module, of many sizes. On a host (CPU ranks, or anything kept on the
CPU) glibc served them from its heap and kept the freed blocks: 450-500 MiB held per rank on
the SD 1.5-shaped UNet of the end-to-end benchmark, peak RSS 1.10 x DDP's. On huge pages the
same run holds 230-275 MiB, peak RSS 0.91-0.94 x DDP's, and steps no slower (fewer page
faults); DDP's runs did not change (docs/benchmarks.md, "ZeRO-3 per module"). Nothing here
imports torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages_for_host_tensors(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless ``environ`` (default ``os.environ``) sets it;
    whether huge pages are asked for now. Takes effect only before the process's first CPU
    tensor (torch reads it then); ``THP_MEM_ALLOC_ENABLE=0`` in the environment turns it off.
    Launched ranks inherit it."""
    environ = os.environ if environ is None else environ
    environ.setdefault(HUGE_PAGES_ENV, "1")
    return environ[HUGE_PAGES_ENV] == "1"
