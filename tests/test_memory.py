"""Memory instruments: the per-phase RSS log, model-state bytes, glibc's mmap threshold and its heap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit

_FREED = """
import sys, torch
from diffusers_zero3.runtime.memory import current_rss_bytes, return_large_frees_to_os
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


_HEAP = """
import sys, torch
from diffusers_zero3.runtime.memory import heap_bytes, return_large_frees_to_os
if sys.argv[1] == "on":
    assert return_large_frees_to_os()
x = torch.ones(8 * 2**20 // 4)
del x
blocks = [torch.ones(2**20) for _ in range(64)]  # 64 x 4 MiB, from the heap (see _FREED)
pin = torch.ones(2**18)
used, held, mapped = heap_bytes()
del blocks
used2, held2, mapped2 = heap_bytes()
print(used - used2, held2 - held, mapped - mapped2)
"""


def test_heap_bytes_count_the_blocks_glibc_keeps_after_a_free():
    def deltas(mode):
        out = subprocess.run(
            [sys.executable, "-c", _HEAP, mode], capture_output=True, text=True, cwd=REPO_ROOT, check=True
        )
        return [int(v) / 2**20 for v in out.stdout.split()]

    freed_in_heap, held, unmapped = deltas("off")
    assert freed_in_heap > 250 and held > 250 and abs(unmapped) < 8  # 256 MiB freed, kept by the heap
    freed_in_heap, held, unmapped = deltas("on")  # control: served by mmap, handed back
    assert abs(freed_in_heap) < 8 and held < 8 and unmapped > 250


def test_memory_log_marks_phases():
    import torch

    from diffusers_zero3.runtime.memory import MemoryLog

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

    from diffusers_zero3.runtime.memory import model_state_bytes

    model = torch.nn.Linear(100, 100)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 100)).sum().backward()
    optimizer.step()
    states = model_state_bytes(model, optimizer)
    n = 100 * 100 + 100
    assert states == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n, "ema": 0, "buffers": 0}


def _fake_cuda(monkeypatch, allocated: int, peak: int, reserved: int) -> None:
    """A stand-in for a CUDA host (none exists here): torch's allocator numbers, in bytes."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: reserved)


def test_memory_log_records_device_memory_on_cuda(monkeypatch):
    import re

    from diffusers_zero3.runtime.memory import MIB, MemoryLog

    log = MemoryLog()
    _fake_cuda(monkeypatch, 100 * MIB, 300 * MIB, 512 * MIB)
    first = log.mark("first optimizer step")
    _fake_cuda(monkeypatch, 120 * MIB, 700 * MIB, 1024 * MIB)
    log.mark("training done")
    assert (first.device_allocated, first.device_peak_allocated, first.device_peak_reserved) == (
        100 * MIB,
        300 * MIB,
        512 * MIB,
    )
    import diffusers_zero3.runtime.distributed as distributed

    calls = []
    real = distributed.max_over_ranks
    monkeypatch.setattr(
        distributed, "max_over_ranks", lambda values: calls.append(len(values)) or real(values)
    )
    records = log.gathered()  # no process group: the local numbers
    assert calls == [2 * 6]  # one collective, every number of every phase in it, on every rank
    assert [r.device_peak_allocated for r in records] == [300 * MIB, 700 * MIB]
    assert [r.device_allocated for r in records] == [100 * MIB, 120 * MIB]
    assert all(r.rss == p.rss and r.peak == p.peak for r, p in zip(records, log.phases))
    text = MemoryLog.format(records)
    lines = text.splitlines()
    assert len(lines) == 2 and all("device peak" in line for line in lines), text
    parsed = [re.search(r"device peak\s+([\d.]+) MiB \(reserved\s+([\d.]+) MiB\)$", line) for line in lines]
    assert [(float(m[1]), float(m[2])) for m in parsed] == [(300.0, 512.0), (700.0, 1024.0)], text


def test_memory_log_format_is_unchanged_on_cpu(monkeypatch):
    import re

    import torch

    from diffusers_zero3.runtime.memory import MemoryLog

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    log = MemoryLog()
    log.mark("start")
    log.mark("done")
    assert all(
        p.device_allocated == p.device_peak_allocated == p.device_peak_reserved == 0 for p in log.phases
    )
    text = MemoryLog.format(log.gathered())
    assert "device" not in text
    # the line the benchmarks parse (benchmarks/bench_end_to_end.py, _PHASE)
    phase = re.compile(r"^\s+(.+?)\s+RSS\s+([\d.]+) MiB\s+peak\s+([\d.]+) MiB \(\+\s*[\d.]+\)\s+([\d.]+) s$")
    assert [phase.match(line)[1] for line in text.splitlines()] == ["start", "done"], text


def test_trainer_logs_device_bytes_beside_the_model_states(monkeypatch, caplog):
    import logging
    import re

    import torch

    from diffusers_zero3.runtime.memory import MIB, MemoryLog
    from diffusers_zero3.training.report import log_memory_per_rank

    def log_of_a_run(cuda: bool) -> str:
        if cuda:
            _fake_cuda(monkeypatch, 40 * MIB, 90 * MIB, 128 * MIB)
        else:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        memory = MemoryLog()
        memory.mark("first optimizer step")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="diffusers_zero3"):
            log_memory_per_rank(memory, {"parameters": 10 * MIB, "optimizer": 20 * MIB})
        return caplog.text

    text = log_of_a_run(cuda=True)
    assert "model states per rank: parameters 10.0 MiB, optimizer 20.0 MiB (total 30.0 MiB)" in text
    assert "device memory per rank after the first optimizer step: 40.0 MiB allocated" in text
    assert re.search(r"device peak\s+90\.0 MiB \(reserved\s+128\.0 MiB\)", text), text
    text = log_of_a_run(cuda=False)  # control: a CPU run logs no device line
    assert "model states per rank" in text and "device" not in text


_HUGE = """
import os, sys
import diffusers_zero3
imported = sorted(m for m in ("torch", "diffusers", "transformers", "accelerate", "deepspeed") if m in sys.modules)
print("after import:", os.environ.get("THP_MEM_ALLOC_ENABLE"), imported)
if sys.argv[1] == "late":
    import diffusers.models.unets.unet_2d_condition
print("in effect:", diffusers_zero3.use_huge_pages_for_host_tensors())
import torch
x = torch.ones(2**24)  # 64 MiB, touched
huge = [l.split()[1] for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print("huge kB:", os.environ.get("THP_MEM_ALLOC_ENABLE"), huge[0] if huge else -1)
"""


def test_huge_pages_are_an_explicit_first_call_that_says_when_it_comes_too_late():
    """``import diffusers_zero3`` imports nothing and sets nothing; the call, made first, puts
    large host tensors on huge pages; made after a diffusers model module was imported (which
    creates tensors) it returns False with one warning line; ``THP_MEM_ALLOC_ENABLE=0`` is kept."""

    def run(when: str, **env):
        base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        out = subprocess.run(
            [sys.executable, "-c", _HUGE, when],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            check=True,
            env={**base, **env},
        )
        lines = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in out.stdout.splitlines()}
        return lines, out.stderr

    first, first_err = run("first")
    assert first["after import"] == "None []", first  # no variable set, nothing imported
    late, late_err = run("late")
    off, _ = run("first", THP_MEM_ALLOC_ENABLE="0")  # the user's choice is kept
    assert off["in effect"] == "False" and off["huge kB"].startswith("0 ")
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and "[madvise]" in mode.read_text():  # huge pages only where torch asks for them
        assert first["in effect"] == "True" and "warning" not in first_err, (first, first_err)
        assert int(first["huge kB"].split()[1]) >= 32 * 1024, first
        assert late["in effect"] == "False" and int(late["huge kB"].split()[1]) == 0, late
        warnings = [line for line in late_err.splitlines() if "too late" in line]
        assert len(warnings) == 1 and warnings[0].startswith("warning: huge pages"), late_err
