"""Instruments for tests, benchmarks and a user's own smoke tests.

* ``run_function_on_ranks`` / ``launch_local_ranks`` start N local ranks as real processes
  (the environment ``torchrun`` would give them, a free port, ``DS_ACCELERATOR=cpu`` on a
  host without CUDA) and turn a failure or a hang into ``RanksFailed`` with every rank's
  output.
* ``count_collectives`` counts calls into ``torch.distributed`` / ``deepspeed.comm``.
* ``fault_point(name)`` does nothing unless ``DIFFUSERS_ZERO3_FAULT`` names this point and
  this rank (``"<name>:<rank>"``); then the process stops itself with SIGSTOP, as a rank that
  is frozen (not dead: its sockets stay open) would. The tests make it the trainers' phase
  hook (``DIFFUSERS_ZERO3_PHASE_HOOK=diffusers_zero3.testing:fault_point``,
  ``runtime.phases``) to show that the other ranks fail within the collective timeout in
  every phase that waits on a collective.
* ``ZERO3_ENV`` / ``DDP_ENV``: accelerate's environment for ranks that build their
  ``Accelerator`` from it (a trainer, ``build_accelerator()``): ZeRO-3 with ``zero.Init`` and
  nothing offloaded, or no DeepSpeed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .runtime.distributed import get_rank


class RanksFailed(RuntimeError):
    """A rank exited non-zero, or the ranks did not finish in time (a hang).

    The message holds every rank's exit code and the tail of its output (tracebacks).
    """

    def __init__(self, message: str, outputs: list[str], codes: list[int | None], timed_out: bool):
        super().__init__(message)
        self.outputs = outputs
        self.codes = codes
        self.timed_out = timed_out


ZERO3_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
}
DDP_ENV = {"ACCELERATE_USE_DEEPSPEED": "false"}

_PORTS_GIVEN: set[int] = set()


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago, below the kernel's ephemeral range and
    never one this process gave before. A port of the ephemeral range (what binding port 0
    gives) can be taken between its choice and the launcher's bind by any outgoing connection,
    a running rank's gloo pairs among them (EADDRINUSE at the rendezvous, seen in side-by-side
    launches); two calls could also give the same one. The scan starts at an offset of the pid,
    so that parallel test workers look in different places."""
    high = _ephemeral_ports_start()
    low = 10000 if high > 12000 else 1024
    span = high - low
    start = (os.getpid() * 7919) % span
    for i in range(span):
        port = low + (start + i) % span
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port between {low} and {high}")


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


def kill_process_tree(pid: int) -> None:
    """SIGKILL process ``pid``, its process group and every process descended from it (each in
    its own group too). torch elastic (``accelerate launch``, ``torchrun``) starts each worker
    in a session of its own, which a kill of the launcher's process group does not reach: a hung
    launch killed that way left its ranks running, orphaned."""
    import psutil

    try:
        descendants = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        descendants = []
    for target in (pid, *descendants):
        try:
            os.killpg(target, signal.SIGKILL)  # a session leader's whole group
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            kill_process_tree(p.pid)
    for p in procs:
        p.wait()


class _ForkedRank:
    """A rank forked from the preloading fork server, with ``Popen``'s ``poll``/``pid``."""

    def __init__(self, process: Any):
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.exitcode is None:
            try:  # its session (it calls setsid first): whatever it started goes too
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet its own session leader
                self.process.kill()
        self.process.join()


def _wait_for_ranks(
    procs: Sequence[Any], logs: list[Path], timeout_s: float, grace_s: float, kill: Callable[[], None]
) -> list[str]:
    """Wait for every rank (``poll()``), then read and remove their logs; ``RanksFailed`` as
    ``launch_local_ranks`` describes."""
    world_size = len(procs)
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
    kill()
    codes = [p.poll() for p in procs]
    outputs = [log.read_text(errors="replace") for log in logs]
    for log in logs:
        log.unlink()
    logs[0].parent.rmdir()
    if timed_out or any(c != 0 for c in codes):
        what = f"ranks timed out after {timeout_s:.0f}s (a hang)" if timed_out else "a rank failed"
        report = "\n".join(
            f"===== rank {r} (exit {codes[r]}) =====\n{_tail(outputs[r])}" for r in range(world_size)
        )
        raise RanksFailed(f"{what}; exit codes {codes}\n{report}", outputs, codes, timed_out)
    return outputs


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
    return _wait_for_ranks(procs, logs, timeout_s, grace_s, lambda: _kill(procs))


def start_rank_forkserver(preload: Sequence[str], env: dict[str, str] | None = None) -> None:
    """Start the fork server that ``run_function_on_ranks(..., preloaded=True)`` forks its
    ranks from, after it imported the modules ``preload`` names (torch, DeepSpeed, diffusers:
    the seconds every fresh rank would spend importing them).

    ``env`` is set while the server starts, so that what the preloaded modules read at import
    (``DS_ACCELERATOR``, ``CUDA_VISIBLE_DEVICES``) is the ranks'. A no-op once the server runs
    (one per process: the first call's preload and env hold).
    """
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forked_rank_main(target: str, payload: str, env: dict[str, str], cwd: str | None, log: str) -> None:
    """A forked rank: its own session, its output into ``log``, the rank's environment; then
    as ``python -m diffusers_zero3.testing target payload``."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    if env.get("OMP_NUM_THREADS"):  # OpenMP read it when the server imported torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [sys.argv[0], target, payload]
    os._exit(_rank_main())


def _launch_forked_ranks(
    target: str,
    payload: str,
    world_size: int,
    timeout_s: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    grace_s: float = 30.0,
) -> list[str]:
    """``launch_local_ranks`` of ``module:function`` with ranks forked from the fork server."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    port = free_port()
    logdir = Path(tempfile.mkdtemp(prefix="dz3-ranks-"))
    procs, logs = [], []
    for rank in range(world_size):
        log = logdir / f"rank{rank}.log"
        log.touch()
        logs.append(log)
        process = ctx.Process(
            target=_forked_rank_main,
            args=(target, payload, rank_env(rank, world_size, port, env), cwd, str(log)),
            name=f"rank{rank}",
        )
        process.start()
        procs.append(_ForkedRank(process))

    def kill() -> None:
        for p in procs:
            p.kill()

    return _wait_for_ranks(procs, logs, timeout_s, grace_s, kill)


def run_function_on_ranks(
    target: str,
    kwargs: dict | None = None,
    world_size: int = 2,
    timeout_s: float = 600.0,
    *,
    preloaded: bool = False,
    **launch_kwargs,
) -> list[str]:
    """Run ``module:function`` with JSON-serialisable ``kwargs`` on every local rank.

    Each rank calls the function, then tears its process group down cleanly. See
    ``launch_local_ranks`` for failures and timeouts. ``preloaded``: fork the ranks from the
    server of ``start_rank_forkserver`` (one with nothing preloaded if none runs yet), which
    spares each rank its imports; every rank is still a new process.
    """
    payload = json.dumps(kwargs or {})
    if preloaded:
        return _launch_forked_ranks(target, payload, world_size, timeout_s, **launch_kwargs)
    return launch_local_ranks(
        lambda rank: [sys.executable, "-m", "diffusers_zero3.testing", target, payload],
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
    from .runtime.distributed import exit_after_teardown

    exit_after_teardown(0)
    return 0


_COLLECTIVES = (
    "all_reduce all_gather all_gather_into_tensor reduce_scatter_tensor reduce_scatter broadcast gather scatter"
    " barrier all_to_all_single reduce send recv isend irecv all_gather_object broadcast_object_list"
).split()


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count calls into ``torch.distributed`` and ``deepspeed.comm`` collectives in the block.

    Yields a dict whose ``"n"`` is the number of calls so far. A debugging and testing aid:
    it patches the module functions for the duration of the block (not thread-safe).

    Example:
        >>> with count_collectives() as calls:
        ...     ema.step()
        >>> assert calls["n"] == 0
    """
    import sys

    import torch.distributed.distributed_c10d as c10d

    modules = [dist, c10d] + ([sys.modules["deepspeed.comm"]] if "deepspeed.comm" in sys.modules else [])
    counts = {"n": 0}
    saved = []
    for mod in modules:
        for name in _COLLECTIVES:
            fn = getattr(mod, name, None)
            if fn is None:
                continue

            def wrapper(*args, __fn=fn, **kwargs):
                counts["n"] += 1
                return __fn(*args, **kwargs)

            saved.append((mod, name, fn))
            setattr(mod, name, wrapper)
    try:
        yield counts
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


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
    print(f"fault: stopping rank {get_rank()} at {name} (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    sys.exit(_rank_main())
