"""The schedules of online RL that are not losses: which sampled timesteps a sample trains on, how
DiffusionNFT's old policy follows the trained one, the references' EMA decay, and which samples
a zero advantage takes out of the loss.

Each is a transcription of its reference (flow_grpo @ac4c86e, ``scripts/train_sd3.py``;
DiffusionNFT @24af555, ``scripts/train_nft_sd3.py``), named there.
"""

from __future__ import annotations

import random
from typing import Literal

import torch

TimestepSubset = Literal["first", "random"]
NFT_DECAY_TYPES = (0, 1, 2)


def nft_old_decay(step: int, decay_type: int) -> float:
    """DiffusionNFT's ``return_decay(step, decay_type)``: the weight the old policy keeps of itself
    when it follows the trained one after a round (``old = decay * old + (1 - decay) * new``),
    ``step`` being the optimizer steps taken so far.

    * type 0: 0 (the old policy is the trained one at each round's start);
    * type 1: ``min(0.001 * step, 0.5)`` (the reference's default, ``config/nft.py``);
    * type 2: 0 for the first 75 steps, then ``min(0.0075 * (step - 75), 0.999)`` (its OCR config).

    Example:
        >>> nft_old_decay(100, 1), nft_old_decay(1000, 1), nft_old_decay(75, 2)
        (0.1, 0.5, 0.0)
    """
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def reference_ema_decay(step: int, decay: float) -> float:
    """The decay of the references' ``EMAModuleWrapper.get_current_decay(step)`` (flow_grpo's
    ``flow_grpo/ema.py``, the same in DiffusionNFT): ``min((1 + step) / (10 + step), decay)``,
    ``step`` the optimizer steps taken so far.

    Example:
        >>> reference_ema_decay(0, 0.9), reference_ema_decay(100, 0.9)
        (0.1, 0.9)
    """
    return min((1 + step) / (10 + step), decay)


def reference_ema_updates(step: int, every: int) -> bool:
    """Whether the references' EMA updates at optimizer step ``step``:
    ``(step + 1) % update_step_interval == 0`` (``EMAModuleWrapper.step``; flow_grpo updates
    every 8 steps, DiffusionNFT every step)."""
    return (step + 1) % every == 0


def trained_timestep_indices(
    num_steps: int, count: int, subset: TimestepSubset, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The indices (``[count]``, long, CPU) of the sampled steps one sample trains on, in the order
    it trains them.

    * ``"first"``: ``0 .. count - 1`` (flow_grpo's ``train_sd3.py``: the first
      ``int(num_steps * timestep_fraction)`` steps, the noisiest);
    * ``"random"``: the first ``count`` of a random permutation of the ``num_steps`` steps
      (DiffusionNFT's ``train_nft_sd3.py`` draws ``torch.randperm(num_timesteps)`` per sample and
      per inner epoch and trains on the first ``num_train_timesteps`` of it), drawn with
      ``generator``.

    Example:
        >>> trained_timestep_indices(6, 3, "first").tolist()
        [0, 1, 2]
    """
    if not 1 <= count <= num_steps:
        raise ValueError(f"cannot train {count} of {num_steps} steps")
    if subset == "first":
        # CPU: indices into a round's stored steps, moved by the caller
        return torch.arange(count)
    if subset == "random":
        # CPU: drawn with a CPU generator (the same subset on any device and rank)
        return torch.randperm(num_steps, generator=generator)[:count]
    raise ValueError(f"unknown timestep subset {subset!r}")


def sde_window(size: int, window_range: tuple[int, int], rng: random.Random) -> tuple[int, int]:
    """The ``[start, end)`` steps of a round's SDE window (flow_grpo's ``pipeline_with_logprob``
    with ``sde_window_size``: ``start = random.randint(range[0], range[1] - size)``, ``end = start +
    size``); the steps outside it are deterministic (noise level 0) and untrained. ``rng`` is the
    round's: every rank draws the same window.

    Example:
        >>> sde_window(2, (0, 6), random.Random(0))
        (3, 5)
    """
    low, high = window_range
    if not 1 <= size <= high - low:
        raise ValueError(f"a window of {size} steps does not fit in [{low}, {high})")
    start = rng.randint(low, high - size)
    return start, start + size


def kept_sample_weight(advantages: torch.Tensor, real: torch.Tensor, filter_zero: bool) -> torch.Tensor:
    """Each sample's weight in the loss of a rank's round (``[P]`` float, on ``advantages``'
    device): 0 for a dummy (``real`` false); with ``filter_zero``, flow_grpo's zero-advantage
    filter (``train_sd3.py``: ``mask = advantages.abs().sum(dim=1) != 0``, the samples of a group
    whose rewards are all equal), 0 for such a sample and ``real / kept`` for the others, so that
    the loss is a mean over the kept samples as the reference's re-batched micro-batches are
    (their size shrinks by ``kept / real``); a rank that keeps none weighs all of them 0.
    Without it, 1 for every real sample.

    The reference also puts back a few zero-advantage samples so that the kept count divides its
    number of micro-batches; here a micro-batch keeps its size and the weight carries the mean.

    Example:
        >>> kept_sample_weight(torch.tensor([1.0, 0.0, -1.0, 0.0]), torch.tensor([True, True, True, False]), True)
        tensor([1.5000, 0.0000, 1.5000, 0.0000])
    """
    real = real.to(advantages.device)
    weight = real.to(torch.float32)
    if not filter_zero:
        return weight
    kept = real & (advantages != 0)
    n_kept = int(kept.sum())
    if n_kept == 0:
        return torch.zeros_like(weight)
    return kept.to(torch.float32) * (int(real.sum()) / n_kept)


__all__ = [
    "NFT_DECAY_TYPES",
    "TimestepSubset",
    "kept_sample_weight",
    "nft_old_decay",
    "reference_ema_decay",
    "reference_ema_updates",
    "sde_window",
    "trained_timestep_indices",
]
