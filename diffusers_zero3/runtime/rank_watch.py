"""Notice a rank that died within a bounded time, name it, and leave.

Under NCCL a rank that dies (the OOM killer, a lost node) leaves the others blocked in their
next collective until the process-group timeout (30 minutes by default), and nothing says
which rank is gone. A frozen rank does the same under any backend (gloo sees a killed peer's
sockets close at once, but not a frozen one's). ``RankWatch`` is a heartbeat beside the
training, through the job's rendezvous store (a ``TCPStore`` client of its own), in two
daemon threads per rank:

* the beat thread adds 1 to the rank's counter every ``interval`` seconds and reads its
  neighbour's (rank ``r`` watches rank ``r + 1``, the last watches rank 0: a ring, so that
  each poll is a handful of store requests whatever the world size). A neighbour whose counter
  has not moved for ``timeout`` seconds is announced in the store (``gone``); every rank reads
  that announcement at its next poll, prints one ``error:`` line naming the rank and leaves
  with ``DEAD_RANK_EXIT`` (69). A rank that failed with its own error announces it as it leaves
  (``leave``); the others leave ``FAILED_PEER_GRACE_S`` seconds later unless they failed on
  their own first (under gloo they usually have: the failed rank's sockets closed).
* the deadline thread ends the process when the beat thread has not completed a poll for
  ``timeout`` seconds: the store itself does not answer (its host, the launcher's agent or
  rank 0, is gone or frozen; a store request has no timeout of its own).

The threads only take the GIL for a store request every ``interval`` seconds, so a rank that
is busy (a long step, rank 0 alone writing validation images or the final pipeline) keeps
beating; only a process that no longer runs stops. At the end of a run every rank calls
``finish`` (``runtime.distributed.exit_after_teardown`` does): it waits, still beating and
watching, until every rank has finished, so a rank that finishes first is not taken for dead
and a rank that dies during another's last work is still noticed.

Nothing is half-published by the exit: checkpoints and outputs are published by a rename
(``state.folders``), and the next run removes what an interrupted write left.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

DEAD_RANK_EXIT = 69  # sysexits' EX_UNAVAILABLE: another rank (or the store) is gone
FAILED_PEER_GRACE_S = 5.0  # after a peer announced its own failure, before leaving too
MIN_INTERVAL_S = 0.2

_started = itertools.count()  # watches started in this process (the same sequence on every rank)
_active: RankWatch | None = None


@dataclass
class RankWatch:
    """The heartbeat of one rank; see the module's docstring. Build with ``start_rank_watch``."""

    store: object  # a torch.distributed Store (a PrefixStore over a TCPStore client)
    rank: int
    world_size: int
    timeout_s: float
    interval_s: float
    where: str  # the store's address, for messages
    finish_limit_s: float = 1800.0  # how long ``finish`` waits for the others (the collective timeout)
    _stop: threading.Event = field(default_factory=threading.Event)
    _last_poll: float = field(default_factory=time.monotonic)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        """Start the beat and deadline threads (daemons). Not a collective."""
        for target, name in ((self._beat, "rank-watch-beat"), (self._deadline, "rank-watch-deadline")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    # -- the threads

    def _beat(self) -> None:
        neighbour = (self.rank + 1) % self.world_size
        seen, seen_at = -1, time.monotonic()
        failed_seen_at: float | None = None
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if self.store.add("gone", 0):
                    self._leave(self.store.get("gone_reason").decode())
                if self.store.add("failed", 0):
                    failed_seen_at = failed_seen_at or time.monotonic()
                    if time.monotonic() - failed_seen_at > FAILED_PEER_GRACE_S:
                        self._leave(f"rank {self.store.get('failed_rank').decode()} stopped with an error")
                count = self.store.add(f"beat/{neighbour}", 0)
            except Exception as e:  # the store is gone: its host (the launcher or rank 0) is
                if self._stop.is_set():  # a finishing job's store may go first
                    return
                self._leave(f"the rendezvous store at {self.where} is gone ({type(e).__name__}: {e})")
            now = time.monotonic()
            if count != seen:
                seen, seen_at = count, now
            elif now - seen_at > self.timeout_s and not self._stop.is_set():
                reason = f"rank {neighbour} is gone: no heartbeat for {now - seen_at:.0f} s (seen by rank {self.rank})"
                try:
                    self.store.set("gone_reason", reason)
                    self.store.add("gone", 1)
                finally:
                    self._leave(reason)
            self._last_poll = now

    def _deadline(self) -> None:
        while not self._stop.wait(self.interval_s):
            silent = time.monotonic() - self._last_poll
            if silent > self.timeout_s + self.interval_s and not self._stop.is_set():
                self._leave(f"the rendezvous store at {self.where} has not answered for {silent:.0f} s")

    def _leave(self, reason: str) -> None:
        if self._stop.is_set():
            return
        _leave_now(self.rank, reason)

    # -- the rank's own exit

    def stop(self) -> None:
        """Stop watching (this rank only; not a collective)."""
        self._stop.set()

    def announce_failure(self) -> None:
        """Stop watching and tell the other ranks that this one failed with its own error, so
        that they leave after ``FAILED_PEER_GRACE_S`` instead of waiting for the timeout. Not a
        collective; gives up after a second when the store does not answer."""
        self.stop()

        def tell() -> None:
            try:
                self.store.set("failed_rank", str(self.rank))
                self.store.add("failed", 1)
            except Exception:
                pass  # the store is gone too: the others' own watch notices

        thread = threading.Thread(target=tell, daemon=True)
        thread.start()
        thread.join(1.0)

    def finish(self) -> None:
        """Wait, still beating and watching, until every rank called ``finish`` (at most
        ``finish_limit_s`` seconds: then return, and the caller's collectives time out as
        before), then stop. Collective: every rank, at the end of its run."""
        deadline = time.monotonic() + self.finish_limit_s
        try:
            self.store.add("finished", 1)
            while self.store.add("finished", 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            pass  # the store is gone: the beat thread says so, or the caller's barrier fails
        finally:
            self.stop()


def _leave_now(rank: int, reason: str) -> NoReturn:
    """Print the one ``error:`` line and end this process with ``DEAD_RANK_EXIT``."""
    print(
        f"error: {reason}; rank {rank} leaves (exit status {DEAD_RANK_EXIT}). Nothing half-written is "
        "published: resume from the latest checkpoint (--resume_from_checkpoint latest).",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(DEAD_RANK_EXIT)


class StoreUnreachable(RuntimeError):
    """The job's rendezvous store did not answer a new client within the timeout."""


def _store_client(timeout_s: float):
    """A ``TCPStore`` client of the job's rendezvous store (``MASTER_ADDR``:``MASTER_PORT``, as
    ``torchrun``, ``accelerate launch`` and the ``deepspeed`` launcher set them), or ``None``.
    Raises ``StoreUnreachable`` when the store has not answered within ``timeout_s`` (+1 s): a
    frozen host's kernel still accepts the connection, and ``TCPStore``'s constructor then waits
    for the handshake forever (torch 2.13), so it runs in a daemon thread that is abandoned."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None, ""
    where = f"{host}:{port}"
    made: list = []

    def connect() -> None:
        try:
            made.append(
                dist.TCPStore(
                    host, int(port), is_master=False, timeout=timedelta(seconds=max(timeout_s, 1.0))
                )
            )
        except Exception as e:  # refused, or the constructor's own timeout
            made.append(e)

    thread = threading.Thread(target=connect, name="rank-watch-connect", daemon=True)
    thread.start()
    thread.join(max(timeout_s, 1.0) + 1.0)
    if not made or isinstance(made[0], Exception):
        why = f" ({type(made[0]).__name__}: {made[0]})" if made else ""
        raise StoreUnreachable(
            f"the rendezvous store at {where} has not answered for {max(timeout_s, 1.0) + 1.0:.0f} s{why}"
        )
    # every rank starts its watches in the same order; a restarted elastic job reuses the store
    prefix = "/".join(
        (
            "diffusers_zero3/rank_watch",
            os.environ.get("TORCHELASTIC_RUN_ID", "-"),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            str(next(_started)),
        )
    )
    return dist.PrefixStore(prefix, made[0]), where


def start_rank_watch(timeout_s: float | None, finish_limit_s: float = 1800.0) -> RankWatch | None:
    """Watch the other ranks of this job: a rank that stops beating for ``timeout_s`` seconds
    (dead, frozen, its host lost) makes every rank print one ``error:`` line naming it and
    leave with ``DEAD_RANK_EXIT``. Returns the watch, or ``None`` where there is nothing to
    watch (``timeout_s`` 0 or ``None``, a single rank, no ``MASTER_ADDR``/``MASTER_PORT``).
    A watch already running in this process is stopped first. ``finish_limit_s``: how long the
    end of the run waits for the slowest rank (give the process group's timeout).

    Call on every rank, after the process group exists, in the same order on every rank (not a
    collective: it makes no collective call, but the ranks' watches pair up by their order).
    End it with ``finish_rank_watch`` on every rank (``exit_after_teardown`` does), or
    ``leave_rank_watch`` on a rank that fails.

    Example:
        >>> accelerator = build_accelerator(...)
        >>> start_rank_watch(60)  # a rank silent for a minute ends the job, named
    """
    global _active
    import torch.distributed as dist

    stop_rank_watch()
    if not timeout_s or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        store, where = _store_client(timeout_s)
    except StoreUnreachable as e:  # its host is frozen or gone: the job cannot go on
        _leave_now(dist.get_rank(), str(e))
    if store is None:
        return None
    watch = RankWatch(
        store=store,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        timeout_s=float(timeout_s),
        interval_s=max(MIN_INTERVAL_S, timeout_s / 6),
        where=where,
        finish_limit_s=finish_limit_s,
    )
    watch.start()
    _active = watch
    return watch


def stop_rank_watch() -> None:
    """Stop this process's watch, if any (this rank only)."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def finish_rank_watch() -> None:
    """``RankWatch.finish`` on this process's watch, if any. Collective: every rank, last."""
    global _active
    if _active is not None:
        _active.finish()
        _active = None


def leave_rank_watch(failed: bool) -> None:
    """This rank is leaving early: stop its watch; ``failed`` also announces the failure to the
    other ranks (``RankWatch.announce_failure``). Not a collective."""
    global _active
    if _active is not None:
        if failed:
            _active.announce_failure()
        else:
            _active.stop()
        _active = None


__all__ = [
    "DEAD_RANK_EXIT",
    "RankWatch",
    "StoreUnreachable",
    "finish_rank_watch",
    "leave_rank_watch",
    "start_rank_watch",
    "stop_rank_watch",
]
