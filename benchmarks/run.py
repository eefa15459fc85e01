"""``make bench``: run every benchmark suite side by side and print markdown tables.

Usage: ``python -m benchmarks.run [--only NAME ...]``. Each suite module has a ``main()``
that runs its cases on 2 local ranks and prints one table of ratios.
"""

from __future__ import annotations

import argparse
import importlib
import time

SUITES = [
    "plan",
    "plan_rl",
    "end_to_end",
    "collectives",
    "rss_baseline",
    "frozen",
    "frozen_sdxl",
    "t5",
    "lora",
    "ema",
    "checkpoint",
    "universal",
    "reward",
    "grpo",
    "sampler",
    "video_rl",
    "cache",
    "data",
    "context_parallel",
    "host_stalls",
    "rl_learning",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", choices=SUITES, help="run only these suites")
    args = parser.parse_args()
    for name in args.only or SUITES:
        start = time.time()
        importlib.import_module(f"benchmarks.bench_{name}").main()
        print(f"({name}: {time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
