"""Step arithmetic and resume bookkeeping of a training loop, as diffusers' scripts do it.

Small pure functions a custom script calls instead of copying: how many optimizer steps an
epoch holds, how many epochs ``--max_train_steps`` needs, the learning rate ``--scale_lr``
gives, where a checkpoint taken mid-epoch resumes, and the batches of an epoch with the
ones already done skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def updates_per_epoch(batches_per_epoch: int, gradient_accumulation_steps: int) -> int:
    """Optimizer steps in an epoch of ``batches_per_epoch`` micro-batches (per process)."""
    return math.ceil(batches_per_epoch / gradient_accumulation_steps)


def epochs_for(max_train_steps: int, steps_per_epoch: int) -> int:
    """Epochs needed to reach ``max_train_steps``."""
    return math.ceil(max_train_steps / steps_per_epoch)


def epochs_to_run(
    first_epoch: int,
    global_step: int,
    max_train_steps: int,
    first_epoch_batches: int,
    batches_per_epoch: int,
    gradient_accumulation_steps: int,
) -> range:
    """The epochs a run (new or resumed) loops over to go from ``global_step`` to
    ``max_train_steps``: from ``first_epoch``, which has ``first_epoch_batches`` micro-batches
    (per process) left, then epochs of at least ``batches_per_epoch``. The loop stops at
    ``max_train_steps``; the range only has to reach it.

    Counted from the steps left, not as ``max_train_steps / steps per epoch``: a run resumed on
    a smaller global batch has longer epochs, and that quotient can be below the epoch it resumes
    in (an empty range: no step trained, the run "complete" at the checkpoint's step).

    Example: 2 processes x 2 on 8 samples, checkpointed at step 6 (epoch 3 next), resumed on
    1 x 2 with ``--max_train_steps 8``: ``epochs_to_run(3, 6, 8, 4, 4, 1) == range(3, 4)``.
    """
    steps_left = max_train_steps - global_step
    if steps_left <= 0:
        return range(first_epoch, first_epoch)
    later = max(0, steps_left - updates_per_epoch(first_epoch_batches, gradient_accumulation_steps))
    per_epoch = updates_per_epoch(max(1, batches_per_epoch), gradient_accumulation_steps)
    return range(first_epoch, first_epoch + 1 + epochs_for(later, per_epoch))


def scaled_learning_rate(
    learning_rate: float, *, gradient_accumulation_steps: int, train_batch_size: int, num_processes: int
) -> float:
    """``--scale_lr``: the rate times the effective batch size (accumulation x batch x processes)."""
    return learning_rate * gradient_accumulation_steps * train_batch_size * num_processes


def job_learning_rate(args, data_processes: int) -> float:
    """``--learning_rate``, times the effective batch size under ``--scale_lr``
    (``scaled_learning_rate`` over ``data_processes``: the ranks that take different samples)."""
    if not args.scale_lr:
        return args.learning_rate
    return scaled_learning_rate(
        args.learning_rate,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        train_batch_size=args.train_batch_size,
        num_processes=data_processes,
    )


def resume_position(epoch: int, batches_done: int, batches_per_epoch: int) -> dict[str, int]:
    """Where a checkpoint taken after ``batches_done`` micro-batches of ``epoch`` resumes:
    ``{"epoch", "batches_in_epoch"}``, the next epoch when this one is complete."""
    if batches_done >= batches_per_epoch:
        return {"epoch": epoch + 1, "batches_in_epoch": 0}
    return {"epoch": epoch, "batches_in_epoch": batches_done}


def batches_to_skip(state: dict, world_size: int, train_batch_size: int) -> int:
    """Micro-batches per rank of the checkpoint's epoch that this run skips, with
    ``world_size`` processes of ``train_batch_size`` samples each.

    ``state`` is a checkpoint's training state (``resume_position``'s ``batches_in_epoch``,
    with the ``world_size`` and ``train_batch_size`` that wrote it). The sampler's order of an
    epoch does not depend on the number of processes (one seeded permutation, dealt out batch
    by batch to the ranks in turn), so the samples consumed are ``batches x processes x
    batch``, and the run resumes at the first sample no rank has seen. Raises ``ValueError``
    when those samples do not fill whole steps of this run (keep processes x batch the same,
    or a multiple that divides them), or when the checkpoint does not record its batch size.
    """
    done, saved_world = int(state["batches_in_epoch"]), int(state["world_size"])
    saved_batch = state.get("train_batch_size")
    if saved_world == world_size and saved_batch in (None, train_batch_size):
        return done
    if saved_batch is None:
        raise ValueError(
            "the checkpoint does not record its per-process batch size (an older layout): "
            f"resume it with {saved_world} processes and the same --train_batch_size"
        )
    samples = done * saved_world * int(saved_batch)
    per_round = world_size * train_batch_size
    if samples % per_round:
        raise ValueError(
            f"the checkpoint's epoch is {samples} samples in ({done} batches x {saved_world} processes x "
            f"{saved_batch}), which is not a whole number of batches of {world_size} processes x "
            f"{train_batch_size}; keep processes x --train_batch_size at {saved_world * int(saved_batch)}"
        )
    return samples // per_round


def epoch_batches(accelerator, loader, epoch: int, skip: int = 0) -> Iterable:
    """The batches of ``epoch``: the sampler's order for that epoch, with the first ``skip``
    (already trained before a resume) skipped. Each rank calls it with the same arguments."""
    loader.set_epoch(epoch)
    return accelerator.skip_first_batches(loader, skip) if skip else loader


def first_last_means(values: list[float]) -> tuple[int, float, float]:
    """``(k, mean of the first k values, mean of the last k)``, k a quarter of them, 1 to 10:
    the end-of-run summary of a per-step curve (loss, reward, implicit accuracy)."""
    k = max(1, min(10, len(values) // 4))
    return k, sum(values[:k]) / k, sum(values[-k:]) / k


def lr_schedule(args, optimizer, per_update: int):
    """``--lr_scheduler`` over ``optimizer`` for ``--max_train_steps`` updates with
    ``--lr_warmup_steps`` of warm-up (``--lr_num_cycles``, ``--lr_power``), stepped
    ``per_update`` times per update: 1 by a part's own DeepSpeed engine, the number of
    processes by accelerate's prepared scheduler."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * per_update,
        num_training_steps=args.max_train_steps * per_update,
        num_cycles=args.lr_num_cycles,
        power=args.lr_power,
    )
