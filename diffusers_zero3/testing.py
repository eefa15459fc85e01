"""Instruments for tests and benchmarks: fault injection at named points of a training run.

``fault_point(name)`` does nothing unless ``DIFFUSERS_ZERO3_FAULT`` names this point and
this rank (``"<name>:<rank>"``); then the process stops itself with SIGSTOP, as a rank that
is frozen (not dead: its sockets stay open) would. The tests use it to show that the other
ranks fail within the collective timeout in every phase that waits on a collective.
"""

from __future__ import annotations

import os
import signal
import sys

from .distributed import get_rank

FAULT_ENV = "DIFFUSERS_ZERO3_FAULT"
_fired: set[str] = set()


def fault_point(name: str) -> None:
    """Stop this process (SIGSTOP) the first time it reaches point ``name``, if asked to.

    Not a collective. A no-op unless the environment variable ``DIFFUSERS_ZERO3_FAULT`` is
    ``"<name>:<global rank>"``.
    """
    wanted = os.environ.get(FAULT_ENV)
    if not wanted or name in _fired or wanted != f"{name}:{get_rank()}":
        return
    _fired.add(name)
    print(f"fault: stopping rank {get_rank()} at {name}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
