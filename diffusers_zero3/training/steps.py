"""One optimizer step of a trainer, its two halves as parts the trainer owns:

* ``TrainedParts``: every model the job trains (the first, whose engine accelerate's backward
  drives; the others, each its own engine under ZeRO-3: DreamBooth's text encoders, a second
  denoiser) and the family's ``DenoiserSchedule``, which picks the denoiser each step trains
  (Wan 2.2's experts, Ideogram 4's twin). It runs a micro-batch's backward, the optimizer
  steps, the EMA steps, and gives the averaged weights for validation and the final save.
* ``StepTally``: what a step's micro-batches measured, gathered over the ranks: the loss
  averaged over every rank's samples, the objective's metrics, the ranks whose loss was not
  finite, whether a rank got a stop signal.

Methods that touch an engine or gather are collectives: every rank, every micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..families.base import DenoiserSchedule
from ..runtime.context_parallel import ContextParallel
from .faults import nonfinite_ranks
from .parts import TrainedModel, backward_parts, step_part


@dataclass
class TrainedParts:
    """The models a job trains and how one optimizer step trains them (see the module doc).

    ``cuts``: the current micro-batch's ``(part, kept, cut)`` outputs of own-engine parts
    (``parts.cut_outputs``), which the backward goes through after the first part's; a loss
    that runs such a part appends to it. ``cp``: under context parallelism the loss is one
    group's share, multiplied by K once here (``ContextParallel.group_loss``)."""

    first: TrainedModel
    others: list[TrainedModel]
    schedule: DenoiserSchedule
    cp: ContextParallel | None = None
    cuts: list = field(default_factory=list)

    @property
    def all(self) -> list[TrainedModel]:
        return [self.first, *self.others]

    @property
    def second_denoiser(self) -> TrainedModel | None:
        """The second trained denoiser's part (``part.extra["denoiser"]``), None when one trains."""
        return next((p for p in self.others if p.extra.get("denoiser")), None)

    def denoiser_of_step(self, step: int):
        """The engine of the denoiser that optimizer step ``step`` trains (every micro-batch)."""
        name = self.schedule.of_step(step)
        return self.first.engine if name == self.first.name else self.second_denoiser.engine

    def trains(self, part: TrainedModel, step: int) -> bool:
        """Whether ``part`` trains on optimizer step ``step``: False only for the trained
        denoiser the step did not pick (``DenoiserSchedule.trains``). Its optimizer, schedule
        and EMA steps are skipped then: AdamW moves weights even without a gradient (weight
        decay; its moments, where a gradient is zero rather than absent), a schedule stepped
        there runs ahead of the steps the denoiser trained, and an EMA step pulls the average
        toward weights that did not change. Every rank picks the same denoiser, so every rank
        skips alike (each ZeRO-3 engine stays in lockstep)."""
        return self.schedule.trains(part.name, step)

    def backward(self, accelerator, loss: torch.Tensor, step: int) -> bool:
        """The micro-batch's backward and the other parts' optimizer steps: the first part's
        through accelerate, then the other parts' from the gradients at their cut outputs
        (``parts.backward_parts``; under DDP the one backward reaches them); on a step of the
        second trained denoiser, that one alone (its backward, and its step at the boundary:
        its own engine under ZeRO-3, accelerate's backward and its own optimizer under DDP).
        Returns whether those parts' updates were applied (``step_part``). Collective: every
        rank, every micro-batch."""
        if self.cp is not None:  # ZeRO-3 averages over every rank: a group's shares make one sample
            loss = self.cp.group_loss(loss)
        sync, second = accelerator.sync_gradients, self.second_denoiser
        if second is not None and self.schedule.of_step(step) == second.name:
            if second.own_engine:
                second.engine.set_gradient_accumulation_boundary(sync)
                second.engine.backward(loss)
            else:  # DDP: only this denoiser's module ran forward, so the one backward reaches it alone
                accelerator.backward(loss)
            return step_part(second, accelerator, sync)
        backward_parts(accelerator, loss, self.first, self.cuts)
        self.cuts = []
        applied = True
        for part in self.others:
            if not part.extra.get("denoiser"):  # a second denoiser steps on its own steps only (above)
                applied &= step_part(part, accelerator, sync)
        return applied

    def step_first(self, accelerator, step: int, before_zero_grad: Callable[[], None] | None = None) -> bool:
        """The first part's optimizer step after the micro-batch's backward (clipped at
        ``--max_grad_norm`` as diffusers' scripts; DeepSpeed: its ``gradient_clipping``), skipped
        on a step that trains the other denoiser; ``before_zero_grad`` runs either way. Whether
        the update was applied. Every rank, every micro-batch."""
        if self.trains(self.first, step):
            return step_part(self.first, accelerator, accelerator.sync_gradients, before_zero_grad)
        if before_zero_grad is not None:
            before_zero_grad()
        return True

    def step_emas(self, step: int) -> None:
        """After an applied update: the EMA step of each part that trained on ``step``. Local."""
        for part in self.all:
            if part.ema is not None and self.trains(part, step):
                part.ema.step()

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Every part's EMA average in its weights for the block (validation, the final save).
        Collective: every rank."""
        with contextlib.ExitStack() as stack:
            for part in self.all:
                if part.ema is not None:
                    stack.enter_context(part.ema.averaged_weights())
            yield


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step's gathered records: its loss (averaged over the micro-batches and
    every rank's samples), the objective's metrics, whether every update was applied, and the
    ranks whose loss was not finite."""

    loss: float
    metrics: dict[str, float]
    applied: bool
    bad_ranks: list[int]


class StepTally:
    """The records of the step being trained, added per micro-batch (``add``, a collective),
    read and reset at the step's end (``close``). ``stop`` stays set once a rank got a stop
    signal (``--save_on_signal``)."""

    def __init__(self, accumulation: int):
        self.accumulation = accumulation
        self.stop = False
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.metrics, self.applied, self.bad_ranks = 0.0, {}, True, set()

    def add(
        self, accelerator, loss: torch.Tensor, samples: int, signalled: bool, metrics: dict[str, torch.Tensor]
    ) -> None:
        """A micro-batch's loss of ``samples`` samples, whether this rank got a stop signal, and
        the objective's per-micro-batch ``metrics`` (averaged over the ranks): one gather, two
        with metrics. Collective: every rank, every micro-batch."""
        n = float(samples)
        local = loss.new_tensor([n, float(signalled)], dtype=torch.float32)
        sums = accelerator.gather(
            torch.cat([(loss.detach().float() * n).reshape(1), local]).reshape(1, 3)
        ).tolist()
        self.loss_sum += sum(s for s, _, _ in sums) / sum(c for _, c, _ in sums)
        self.bad_ranks.update(nonfinite_ranks([s for s, _, _ in sums]))
        self.stop = self.stop or any(f for _, _, f in sums)
        if metrics:  # one gather for all of them
            values = torch.stack([v.detach().float() for v in metrics.values()])
            means = accelerator.gather(values.unsqueeze(0)).mean(dim=0).tolist()
            for name, mean in zip(metrics, means):
                self.metrics[name] = self.metrics.get(name, 0.0) + mean

    def note_applied(self, applied: bool) -> None:
        """Whether a micro-batch's updates were applied (``step_part``'s answers)."""
        self.applied &= applied

    def close(self) -> StepRecord:
        """The step's record; the tally starts the next step. Local."""
        k = self.accumulation
        record = StepRecord(
            self.loss_sum / k,
            {name: v / k for name, v in self.metrics.items()},
            self.applied,
            sorted(self.bad_ranks),
        )
        self._reset()
        return record
