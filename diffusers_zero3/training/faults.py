"""What a training loop does when an update comes out non-finite, and when the scheduler is
about to take the job away.

A non-finite loss (on any rank) gives non-finite gradients on every rank once they are
reduced, and so does an overflow in the backward. The update is then skipped on every rank
together (``training.parts.step_part`` says whether it was applied): DeepSpeed's ZeRO-3
optimizer skips a step whose gradient norm is not finite in every precision (and clears the
gradients; its engine leaves the learning-rate schedule where it was); without DeepSpeed
``step_part`` checks the norm of the reduced gradients (the same on every rank) and skips the
optimizer and schedule steps itself. The loop then skips the EMA step too, so that nothing of
the model moves: weights, optimizer moments, schedule and averages stay as the last applied
update left them.

``NonFiniteUpdates`` counts the skips, logs each with the ranks whose loss was not finite,
and stops the job (one ``error:`` line naming the step and the ranks) after more than
``--max_nonfinite_steps`` skips in a row: the weights are then those of the last applied
update, and the latest checkpoint holds no non-finite value.

``StopSignals`` notes a preemption signal (``--save_on_signal``); the loop then finishes the
step it is in on every rank, publishes that step's checkpoint by the scheduled path and stops
(``Preempted``; each rank exits with ``PREEMPTED_EXIT``).
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from ..errors import ArgumentError, UserError
from ..runtime.distributed import log_rank_zero


class NonFiniteError(UserError):
    """Training stopped: too many updates in a row were non-finite."""


def nonfinite_ranks(rank_losses: Sequence[float]) -> list[int]:
    """The ranks whose loss (``rank_losses[r]``, as gathered from every rank) is not finite."""
    return [rank for rank, value in enumerate(rank_losses) if not math.isfinite(value)]


class NonFiniteUpdates:
    """Counts the updates skipped as non-finite (see the module doc); ``limit`` skips in a row
    are tolerated (``--max_nonfinite_steps``), one more raises ``NonFiniteError``.

    Example:
        >>> guard = NonFiniteUpdates(limit=1)
        >>> guard.record(applied=False, step=7, ranks=[1])   # logs "step 7: update skipped ..."
        False
        >>> guard.record(applied=True, step=8, ranks=[])
        True
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.skipped = 0

    def record(self, applied: bool, step: int, ranks: Sequence[int]) -> bool:
        """Record optimizer step ``step`` (applied or skipped; ``ranks`` those whose loss was
        not finite in it) and return ``applied``. Every rank calls it with the same values (the
        decision and the losses are the same on every rank): every rank raises together."""
        if applied:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        cause = (
            f"a non-finite loss on rank {', '.join(str(r) for r in ranks)}"
            if ranks
            else "non-finite gradients (every rank's loss was finite)"
        )
        if self.in_a_row > self.limit:
            raise NonFiniteError(
                f"step {step}: {self.in_a_row} updates in a row skipped for non-finite values, the last for {cause} "
                f"(--max_nonfinite_steps {self.limit}); the weights are those of the last applied update and the "
                "latest checkpoint holds no non-finite value: lower the learning rate, or look at the data of these steps"
            )
        log_rank_zero(
            f"step {step}: update skipped for {cause} ({self.in_a_row} in a row, {self.skipped} in all; "
            "weights, optimizer, schedule and EMA unchanged)"
        )
        return False


# -------------------------------------------------------------------------------- preemption

# The exit status of a rank that stopped on a signal after publishing its checkpoint: sysexits'
# EX_TEMPFAIL ("try again later"), so that a requeue script tells "preempted" from "failed" (1)
# and from a usage error (2). A launcher that reports its workers' failures as its own status
# (torchrun, ``accelerate launch``: 1) hides it; the package's console commands pass it on.
PREEMPTED_EXIT = 75
DEFAULT_STOP_SIGNALS = "SIGTERM,SIGUSR1"


class Preempted(Exception):
    """Training stopped on a signal (``--save_on_signal``) after the checkpoint of the step it
    was in was published; ``--resume_from_checkpoint latest`` continues it exactly."""


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
    """``--save_on_signal``'s signals: a comma-separated list of names (``SIGTERM,SIGUSR1``; the
    ``SIG`` prefix may be left out), or ``none``; ``ArgumentError`` (a ``ValueError``) naming an
    unknown one: a trainer parses it when it is built, before ``validate_common_args`` runs."""
    if spec.strip().lower() == "none":
        return ()
    found = []
    for name in (part.strip().upper() for part in spec.split(",") if part.strip()):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if not hasattr(signal.Signals, name) or name in ("SIGKILL", "SIGSTOP"):
            raise ArgumentError(f"--save_on_signal: {name} is not a signal a process can catch")
        found.append(signal.Signals[name])
    return tuple(found)


class StopSignals:
    """While entered, the signals a scheduler sends before it kills a job (SLURM's and
    Kubernetes' SIGTERM, SLURM's ``--signal=USR1@...``) are only noted: ``received`` names the
    first. The loop asks every rank at each micro-batch (inside a gather it does anyway), and at
    the step's end every rank checkpoints and stops together (``Preempted``): a signal that
    arrives during a checkpoint lets that save finish. Not a collective."""

    def __init__(self, signals: tuple[signal.Signals, ...]):
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _note(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers live in the main thread
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def flag(self) -> float:
        """1.0 once a signal was noted on this rank, else 0.0: the value a loop puts into a
        gather it makes anyway, so that every rank learns of a signal that reached one."""
        return float(self.received is not None)

    def checkpoint_and_stop(
        self, where: str, step: int, checkpointing_steps: int, checkpoint: Callable[[], object]
    ) -> NoReturn:
        """Publish the checkpoint of ``step`` with ``checkpoint()`` (the loop's scheduled save)
        unless the schedule (every ``checkpointing_steps``) just did, then ``stop``. Collective:
        call on every rank, once every rank knows of the signal.

        Example (at the end of a step, ``stop`` being whether any rank's flag was set):
            >>> if stop:
            ...     signals.checkpoint_and_stop("at step", step, args.checkpointing_steps, save)
        """
        if step % checkpointing_steps:
            checkpoint()
        self.stop(where, step)

    def stop(self, where: str, step: int) -> NoReturn:
        """Log that the job stops on the signal ``where`` (``"at step"``, ``"after round"``)
        ``step``, whose checkpoint the caller published, and raise ``Preempted`` (every rank)."""
        cause = self.received or "a signal on another rank"
        message = (
            f"preempted {where} {step} ({cause}): checkpoint-{step} is published; "
            "--resume_from_checkpoint latest continues the run"
        )
        log_rank_zero(message)
        raise Preempted(message)
