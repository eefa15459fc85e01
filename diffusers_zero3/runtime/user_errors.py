"""One ``error:`` line for a user's mistake, printed once per launch rather than once per rank.

Every rank of a launch parses the same flags and reads the same folders, so a bad input
usually raises on all of them at once. The first rank of a machine to report it claims a
file named for the launcher process (the parent every local rank shares: torchrun's agent,
``accelerate launch``'s or the package's console command) and prints the line; the others
stay silent and exit with the same code. A rank that alone hits a problem claims the file
alone, so its line is never lost. Outside a launch (one plain process) the line is always
printed.

Nothing here imports torch, so the command line's own errors can use it before any import.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from pathlib import Path

USER_ERROR_EXIT = 2  # the exit status of a user error, on every rank (argparse's too)


def launched_rank() -> bool:
    """Whether this process is a rank of a launch (``torchrun`` and ``accelerate launch`` set
    ``LOCAL_RANK`` and ``WORLD_SIZE`` on every rank)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def error_claim_path(launcher_pid: int) -> Path:
    """The file whose creation decides which local rank of the launcher ``launcher_pid`` prints
    a user error."""
    return Path(tempfile.gettempdir()) / f"diffusers_zero3-error-{launcher_pid}"


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (a time stamp), or None where that cannot be read."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # no psutil, or the launcher is gone: trust the file as it is
        return None


def claim_error_report() -> bool:
    """Whether this process should print the launch's user error: True outside a launch, and
    for the first local rank to ask; a claim left by an earlier launcher of the same pid (one
    older than the launcher itself) is taken over."""
    if not launched_rank():
        return True
    parent = os.getppid()
    path = error_claim_path(parent)
    try:
        # one rank at a time from here: two that found the same stale claim would both take it
        # over (each unlinking the other's new one)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                return True
            except FileExistsError:
                started = process_start_time(parent)
                try:
                    stale = started is not None and path.stat().st_mtime < started
                except FileNotFoundError:
                    stale = True
                if not stale:
                    return False
                path.unlink(missing_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                return True
    except OSError:  # an unwritable temporary folder: better a line per rank than none
        return True


def print_user_error(message: str) -> None:
    """Print ``error: <message>`` to stderr, unless another rank of this launch already did."""
    if claim_error_report():
        print(f"error: {message}", file=sys.stderr, flush=True)


__all__ = [
    "USER_ERROR_EXIT",
    "claim_error_report",
    "error_claim_path",
    "launched_rank",
    "print_user_error",
    "process_start_time",
]
