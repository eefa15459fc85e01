"""Start N local ranks as real processes and turn failures and hangs into exceptions.

Used by the test suite and the benchmarks; also handy for a user's own 2-rank smoke tests
on a laptop. Each rank gets the environment ``torchrun`` would give it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, a free ``MASTER_PORT``) and, on a host
without CUDA, ``DS_ACCELERATOR=cpu``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


class RanksFailed(RuntimeError):
    """A rank exited non-zero, or the ranks did not finish in time (a hang).

    The message holds every rank's exit code and the tail of its output (tracebacks).
    """

    def __init__(self, message: str, outputs: list[str], codes: list[int | None], timed_out: bool):
        super().__init__(message)
        self.outputs = outputs
        self.codes = codes
        self.timed_out = timed_out


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of local rank ``rank`` out of ``world_size``."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    env.update(extra or {})
    return env


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def launch_local_ranks(
    argv_for_rank: Callable[[int], Sequence[str]],
    world_size: int = 2,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    grace_s: float = 30.0,
) -> list[str]:
    """Run ``argv_for_rank(rank)`` on ``world_size`` local ranks; return each rank's output.

    Raises ``RanksFailed`` when a rank exits non-zero (the others get ``grace_s`` seconds to
    fail on their own before they are killed) or when the ranks run past ``timeout_s``
    (every rank is killed: a hang becomes an error that shows what each rank printed).
    """
    port = free_port()
    logdir = Path(tempfile.mkdtemp(prefix="dz3-ranks-"))
    procs, logs = [], []
    for rank in range(world_size):
        log = logdir / f"rank{rank}.log"
        logs.append(log)
        with open(log, "w") as fh:
            procs.append(
                subprocess.Popen(
                    list(argv_for_rank(rank)),
                    env=rank_env(rank, world_size, port, env),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                    start_new_session=True,
                )
            )
    start = time.monotonic()
    first_failure = None
    timed_out = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
            first_failure = now
        if now - start > timeout_s:
            timed_out = True
            break
        if first_failure is not None and now - first_failure > grace_s:
            break
        time.sleep(0.2)
    _kill(procs)
    codes = [p.returncode for p in procs]
    outputs = [log.read_text(errors="replace") for log in logs]
    for log in logs:
        log.unlink()
    logdir.rmdir()
    if timed_out or any(c != 0 for c in codes):
        what = f"ranks timed out after {timeout_s:.0f}s (a hang)" if timed_out else "a rank failed"
        report = "\n".join(
            f"===== rank {r} (exit {codes[r]}) =====\n{_tail(outputs[r])}" for r in range(world_size)
        )
        raise RanksFailed(f"{what}; exit codes {codes}\n{report}", outputs, codes, timed_out)
    return outputs


def run_function_on_ranks(
    target: str, kwargs: dict | None = None, world_size: int = 2, timeout_s: float = 600.0, **launch_kwargs
) -> list[str]:
    """Run ``module:function`` with JSON-serialisable ``kwargs`` on every local rank.

    Each rank calls the function, then tears its process group down cleanly. See
    ``launch_local_ranks`` for failures and timeouts.
    """
    payload = json.dumps(kwargs or {})
    return launch_local_ranks(
        lambda rank: [sys.executable, "-m", "diffusers_zero3.local_ranks", target, payload],
        world_size=world_size,
        timeout_s=timeout_s,
        **launch_kwargs,
    )


def _rank_main() -> int:
    import importlib
    import traceback

    target, payload = sys.argv[1], sys.argv[2]
    module_name, func_name = target.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), func_name)
        fn(**json.loads(payload))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: with a live gloo group it can hang or abort.
        os._exit(1)
    from .distributed import destroy_process_group

    destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
