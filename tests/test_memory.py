"""Memory instruments: the per-phase RSS log, model-state bytes, and glibc's mmap threshold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit

_FREED = """
import sys, torch
from diffusers_zero3.memory import current_rss_bytes, return_large_frees_to_os
if sys.argv[1] == "on":
    assert return_large_frees_to_os()
x = torch.ones(8 * 2**20 // 4)  # glibc raises its mmap threshold at the first large free:
del x                           # later blocks of a few MiB then come from the heap
blocks = [torch.ones(2**20) for _ in range(64)]  # 64 x 4 MiB
pin = torch.ones(2**18)  # a live 1 MiB block above them: the heap cannot shrink from the top
before = current_rss_bytes()
del blocks
print(before - current_rss_bytes())
"""


def _freed_mib(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _FREED, mode], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    return int(out.stdout.strip().splitlines()[-1]) / 2**20


def test_return_large_frees_to_os_hands_freed_blocks_back():
    assert _freed_mib("on") > 200  # the 256 MiB freed leave the process
    assert _freed_mib("off") < 64  # control: glibc's default keeps them


def test_memory_log_marks_phases():
    import torch

    from diffusers_zero3.memory import MemoryLog

    log = MemoryLog()
    log.mark("start")
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    log.mark("allocated")
    assert log.has("allocated") and not log.has("missing")
    start, allocated = log.gathered()  # no process group: this rank's own
    assert allocated.rss - start.rss > 48 * 2**20 and allocated.peak >= allocated.rss
    assert "allocated" in MemoryLog.format(log.phases) and x.sum() > 0


def test_model_state_bytes_of_a_plain_module_and_optimizer():
    import torch

    from diffusers_zero3.memory import model_state_bytes

    model = torch.nn.Linear(100, 100)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 100)).sum().backward()
    optimizer.step()
    states = model_state_bytes(model, optimizer)
    n = 100 * 100 + 100
    assert states == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n, "ema": 0, "buffers": 0}
