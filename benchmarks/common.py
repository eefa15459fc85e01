"""Shared pieces of the benchmarks: launch N ranks, read per-rank memory, print tables.

A benchmark case is a module-level function run on every rank through
``diffusers_zero3.testing``; it calls ``report(**numbers)`` once, and ``run_case`` returns
one dict per rank. Memory is read two ways: the process's peak RSS (what the OS saw) and
the bytes held in tensors by category (parameters, optimizer state, other).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from diffusers_zero3.runtime.deepspeed_internals import LEVERS
from diffusers_zero3.runtime.huge_pages import HUGE_PAGES_ENV
from diffusers_zero3.runtime.memory import current_rss_bytes, peak_rss_bytes  # noqa: F401 (the benchmarks' readers)
from diffusers_zero3.testing import run_function_on_ranks

REPO_ROOT = Path(__file__).resolve().parent.parent
_MARK = "BENCH_RESULT "

LEVERS_ENV = "DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS"
# The environment of a run at DeepSpeed's own behaviour, the benchmarks' "DeepSpeed's defaults"
# rows: every lever of this package set back, and no huge pages for host tensors.
DEEPSPEED_DEFAULTS_ENV = {LEVERS_ENV: ",".join(LEVERS), HUGE_PAGES_ENV: "0"}


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0), so a later phase is measured alone."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset_bytes() -> int:
    """VmHWM: peak RSS since the last ``reset_peak_rss`` (or since start)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return peak_rss_bytes()


def optimizer_state_bytes(optimizer) -> int:
    """Bytes held in an optimizer's state tensors, DeepSpeed's fp32 master partitions
    included where they are a copy (``diffusers_zero3.runtime.memory.model_state_bytes``)."""
    from diffusers_zero3.runtime.memory import model_state_bytes

    return model_state_bytes(torch.nn.Module(), optimizer)["optimizer"]


def report(**numbers) -> None:
    """Called once by a case on each rank: hands its numbers back to ``run_case``."""
    print(_MARK + json.dumps(numbers), flush=True)


def run_case(
    target: str, world_size: int = 2, timeout_s: float = 1200, env: dict[str, str] | None = None, **kwargs
) -> list[dict]:
    """Run ``module:function`` on ``world_size`` ranks (with extra environment variables
    ``env``); one dict of reported numbers per rank."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    outputs = run_function_on_ranks(target, kwargs, world_size=world_size, timeout_s=timeout_s, env=env)
    results = []
    for rank, out in enumerate(outputs):
        lines = [line for line in out.splitlines() if line.startswith(_MARK)]
        if not lines:
            raise RuntimeError(f"rank {rank} of {target} reported nothing:\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len(_MARK) :]))
    return results


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of ``rows`` (dicts) with the given column order."""
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def print_section(title: str, table: str) -> None:
    print(f"\n### {title}\n\n{table}\n", flush=True)
    sys.stdout.flush()
