"""Which (prompt, member) samples each rank draws in a round of group sampling.

Flow-GRPO's ``DistributedKRepeatSampler`` (``scripts/train_sd3.py``; DiffusionNFT's
``scripts/train_nft_sd3.py`` has the same one) seeds a generator with ``seed + epoch`` on every
rank, picks ``m`` prompts of the dataset at random, repeats each ``k`` times, shuffles the
``m * k`` samples and hands rank ``r`` the ``r``-th slice of ``batch_size``; it asserts that
``k`` divides ``world_size * batch_size``. The members of a prompt's group thus land on
several ranks, which is why the advantages are computed after a gather
(``gather_group_advantages``).

``group_assignment`` does the same from the number of prompts and the group size, and takes any
``num_prompts * group_size``: the ranks' shares then differ by one sample at most. A caller that
needs the same number of sampler and reward calls on every rank (a sharded reward model, a
ZeRO-3 denoiser: a forward is a collective) pads the shorter ranks to ``samples_per_rank`` with
dummy samples and drops their results.
"""

from __future__ import annotations

import hashlib
import random


def _round_rng(seed: int, round_index: int) -> random.Random:
    """The same generator on every rank for ``(seed, round_index)``. Hashing the pair (not
    ``seed + round``, as the reference does) keeps ``(seed, round + 1)`` apart from
    ``(seed + 1, round)``."""
    digest = hashlib.sha256(f"diffusers_zero3.rl.groups:{seed}:{round_index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _check(num_prompts: int, group_size: int, world_size: int) -> None:
    if num_prompts < 0 or group_size < 1 or world_size < 1:
        raise ValueError(
            f"need num_prompts >= 0, group_size >= 1, world_size >= 1; got {num_prompts}, {group_size}, {world_size}"
        )


def samples_per_rank(num_prompts: int, group_size: int, world_size: int) -> int:
    """The most samples any rank gets in a round: ``ceil(num_prompts * group_size / world_size)``.

    Every rank gets this many or one fewer (``group_assignment``). Pad each rank's batch to this
    length so that every rank makes the same number of sampler and reward calls.

    Example:
        >>> samples_per_rank(3, 5, 2)  # 15 samples: 8 on rank 0, 7 on rank 1
        8
    """
    _check(num_prompts, group_size, world_size)
    return -(-num_prompts * group_size // world_size)


def group_assignment(
    num_prompts: int,
    group_size: int,
    world_size: int,
    rank: int,
    round_index: int,
    seed: int,
    *,
    dataset_size: int | None = None,
) -> list[tuple[int, int]]:
    """This rank's ``(prompt_index, member)`` samples for one round.

    Every rank computes the same global order from ``(seed, round_index)``: the
    ``num_prompts * group_size`` pairs ``(p, m)``, ``m`` in ``range(group_size)``, shuffled. Rank
    ``r`` gets the ``r``-th of ``world_size`` consecutive slices of it; with ``total =
    num_prompts * group_size``, the first ``total % world_size`` ranks get
    ``total // world_size + 1`` samples and the others ``total // world_size``. Over the ranks,
    each pair appears exactly once, and a prompt's members usually span several ranks.

    Without ``dataset_size``, the prompts are ``0 .. num_prompts - 1`` (the caller's list for the
    round). With it, the round's ``num_prompts`` distinct prompts are drawn at random from
    ``range(dataset_size)``, as the reference's sampler does from its dataset.

    The member index tells the samples of a group apart (for instance to seed each one's noise);
    pure Python, no process group needed.

    Args:
        num_prompts: Prompts per round (groups).
        group_size: Samples per prompt (the reference's ``num_image_per_prompt``).
        world_size: Number of ranks.
        rank: This rank.
        round_index: The round (epoch), so that each round has its own order.
        seed: The run's seed, the same on every rank.
        dataset_size: Draw the prompts from this many instead of using ``range(num_prompts)``.

    Returns:
        This rank's ``[(prompt_index, member), ...]`` in the global order.

    Example:
        >>> group_assignment(3, 5, world_size=2, rank=0, round_index=0, seed=42)[:3]
        [(1, 2), (1, 3), (1, 1)]
    """
    _check(num_prompts, group_size, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0 .. {world_size - 1}")
    if dataset_size is not None and dataset_size < num_prompts:
        raise ValueError(f"cannot draw {num_prompts} distinct prompts from {dataset_size}")
    rng = _round_rng(seed, round_index)
    prompts = range(num_prompts) if dataset_size is None else rng.sample(range(dataset_size), num_prompts)
    pairs = [(p, m) for p in prompts for m in range(group_size)]
    rng.shuffle(pairs)
    base, extra = divmod(len(pairs), world_size)
    start = rank * base + min(rank, extra)
    return pairs[start : start + base + (rank < extra)]
