"""What a training loop does when an update comes out non-finite.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import UserError
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
