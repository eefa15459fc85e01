"""Group-relative advantages: each sample's reward against the other samples of its prompt.

Flow-GRPO and DiffusionNFT both score ``k`` images per prompt and normalise each reward by its
prompt group's mean and standard deviation (``flow_grpo/stat_tracking.py``,
``PerPromptStatTracker.update``, type ``"grpo"``; the training scripts call ``clear()`` after
each epoch's update, so its per-prompt history holds that epoch's rewards only)::

    advantage = (reward - mean(group)) / (std(group) + 1e-4)

with numpy's population standard deviation (``ddof=0``), in float64. With ``global_std`` the
denominator is the standard deviation of every reward of the update (every rank's, since the
scripts gather them first), each group keeping its own mean. A group of one sample gets 0.

Groups are named by an integer per sample (a prompt's index), not by the prompt's text. The
reference gathers every rank's rewards and prompts and keeps its own rank's slice, assuming the
same number of samples on each rank; ``gather_group_advantages`` takes any number per rank,
zero included.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..runtime.distributed import all_gather_ints, comm_device, get_rank, get_world_size, is_distributed


def _as_ids(group_ids: torch.Tensor | Sequence[int], like: torch.Tensor) -> torch.Tensor:
    if not isinstance(group_ids, torch.Tensor):  # a list: integers (an empty one too)
        group_ids = torch.tensor([operator.index(i) for i in group_ids], dtype=torch.long, device=like.device)
    ids = group_ids.to(like.device)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"group ids must be integers, not {ids.dtype}")
    if ids.shape != like.shape:
        raise ValueError(f"{tuple(ids.shape)} group ids for rewards of shape {tuple(like.shape)}")
    return ids.to(torch.long)


def _group_index(ids: torch.Tensor) -> torch.Tensor:
    """For each sample, the rank of its group among the distinct ids (0, 1, ...). Built by a sort,
    without ``torch.unique``, so that every shape is known in advance (meta tensors work)."""
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    starts = torch.ones_like(sorted_ids, dtype=torch.long)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    return torch.empty_like(order).scatter_(0, order, torch.cumsum(starts, 0) - 1)


def _per_group(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The sum of ``values`` over each group, handed back to every member."""
    totals = torch.zeros_like(values).scatter_add_(0, index, values)
    return totals[index]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int],
    *,
    std_eps: float = 1e-4,
    global_std: bool = False,
    clip: float | None = None,
) -> torch.Tensor:
    """Each reward normalised by its group's mean and standard deviation, as Flow-GRPO's
    ``PerPromptStatTracker`` (one update, then ``clear()``).

    ``(reward - group mean) / (group std + std_eps)``, with the population standard deviation.
    Computed in float64 (the reference works in numpy float64); the result is float32 for
    bf16 / fp16 / fp32 rewards, on ``rewards``' device, and carries no gradient. Giving every
    sample the same id is the reference's ``per_prompt_stat_tracking=False`` branch (one group).

    Args:
        rewards: ``[N]`` rewards.
        group_ids: ``[N]`` integers (a tensor or a list): the samples of one prompt share an id.
        std_eps: Added to the standard deviation (the reference's 1e-4).
        global_std: Divide by the standard deviation of all ``rewards`` instead of the group's
            (the reference's ``config.sample.global_std``, on in its configs).
        clip: If given, clamp the advantages to ``[-clip, clip]`` (the reference clamps with
            ``adv_clip_max`` in its loss; ``grpo_loss`` does that too).

    Returns:
        ``[N]`` advantages.

    Example:
        >>> group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), [0, 0, 1, 1])
        tensor([-0.9999,  0.9999,  0.0000,  0.0000])
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], not {tuple(rewards.shape)}")
    ids = _as_ids(group_ids, rewards)
    values = rewards.detach().to(torch.float64)
    index = _group_index(ids)
    count = _per_group(torch.ones_like(values), index)
    deviation = values - _per_group(values, index) / count
    if global_std:
        std = (values - values.mean()).pow(2).mean().sqrt()
    else:
        std = (_per_group(deviation**2, index) / count).sqrt()
    advantages = deviation / (std + std_eps)
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages.to(torch.promote_types(rewards.dtype, torch.float32))


def gather_group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int],
    *,
    std_eps: float = 1e-4,
    global_std: bool = False,
    clip: float | None = None,
) -> torch.Tensor:
    """``group_advantages`` over every rank's samples; returns this rank's. Collective: call on
    every rank, also one with no samples (``rewards`` of shape ``[0]``).

    The members of a group may sit on different ranks: each rank gathers every rank's rewards and
    group ids (two collectives: the counts, then the padded values), computes the advantages of
    all of them in rank order, and keeps its own. Without a process group this is
    ``group_advantages``. ``global_std`` is then the standard deviation over every rank's rewards,
    as in the reference, which gathers before its tracker's update.

    Args:
        rewards: This rank's ``[N_rank]`` rewards (any ``N_rank``, 0 included).
        group_ids: This rank's ``[N_rank]`` group ids (integers below 2**53 in magnitude).
        std_eps: As ``group_advantages``.
        global_std: As ``group_advantages``.
        clip: As ``group_advantages``.

    Returns:
        This rank's ``[N_rank]`` advantages, on ``rewards``' device.

    Example:
        >>> # rank 0: prompt 7's first two images; rank 1: its third and prompt 9's
        >>> gather_group_advantages(rewards, torch.tensor([7, 7]))  # on rank 0
        >>> gather_group_advantages(rewards, torch.tensor([7, 9]))  # on rank 1
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], not {tuple(rewards.shape)}")
    ids = _as_ids(group_ids, rewards)
    if not is_distributed():
        return group_advantages(rewards, ids, std_eps=std_eps, global_std=global_std, clip=clip)
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    gathered = _gather_rewards_and_ids(rewards, ids)
    if gathered is None:
        return torch.empty(0, dtype=out_dtype, device=rewards.device)
    all_rewards, all_ids, counts = gathered
    advantages = group_advantages(all_rewards, all_ids, std_eps=std_eps, global_std=global_std, clip=clip)
    start = sum(counts[: get_rank()])
    return advantages[start : start + counts[get_rank()]].to(device=rewards.device, dtype=out_dtype)


def _gather_rewards_and_ids(
    rewards: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """Every rank's rewards (float64) and group ids (long), in rank order, on the collective's
    device, and each rank's count; None when no rank has any. Collective (two: the counts, then
    the padded values)."""
    counts = [c for (c,) in all_gather_ints([rewards.shape[0]])]
    width = max(counts)
    if width == 0:  # every rank agrees on the counts: all of them skip the gather
        return None
    # one gather of [2, width] float64: rewards, and the ids (exact as float64 below 2**53)
    if ids.numel() and ids.abs().max().item() >= 2**53:
        raise ValueError("group ids must be below 2**53 in magnitude")
    mine = torch.zeros(2, width, dtype=torch.float64, device=comm_device())
    mine[0, : len(ids)] = rewards.detach().to(device=mine.device, dtype=torch.float64)
    mine[1, : len(ids)] = ids.to(device=mine.device, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(get_world_size())]
    dist.all_gather(everyone, mine)
    all_rewards = torch.cat([t[0, :n] for t, n in zip(everyone, counts)])
    all_ids = torch.cat([t[1, :n] for t, n in zip(everyone, counts)]).to(torch.long)
    return all_rewards, all_ids, counts


def group_reward_stats(rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int]) -> dict[str, float]:
    """The spread of a round's rewards, as flow_grpo logs it beside the advantages
    (``scripts/train_sd3.py``: the rewards' std, and ``calculate_zero_std_ratio``):

    * ``reward_std``: the population standard deviation of every reward;
    * ``zero_std_fraction``: the fraction of groups whose rewards are all equal: their
      advantages are all 0, so they give no gradient (flow_grpo's ``zero_std_ratio``, which
      tests ``np.std(group) == 0``; here max == min, which rounding cannot miss).

    Computed in float64; NaN for no rewards.

    Example:
        >>> group_reward_stats(torch.tensor([1.0, 3.0, 5.0, 5.0]), [0, 0, 1, 1])
        {'reward_std': 1.6583123951777, 'zero_std_fraction': 0.5}
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], not {tuple(rewards.shape)}")
    ids = _as_ids(group_ids, rewards)
    if not len(rewards):
        return {"reward_std": math.nan, "zero_std_fraction": math.nan}
    values = rewards.detach().to(torch.float64)
    index = _group_index(ids)
    groups = int(index.max()) + 1
    highest = values.new_full((groups,), -math.inf).scatter_reduce(0, index, values, "amax")
    lowest = values.new_full((groups,), math.inf).scatter_reduce(0, index, values, "amin")
    return {
        "reward_std": values.std(correction=0).item(),
        "zero_std_fraction": (highest == lowest).double().mean().item(),
    }


def gather_group_reward_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int]
) -> dict[str, float]:
    """``group_reward_stats`` of every rank's rewards (a group's members may sit on different
    ranks); the same numbers on every rank. Collective: call on every rank, also one with no
    samples.

    Example:
        >>> stats = gather_group_reward_stats(rewards, prompt_ids)  # on every rank
        >>> accelerator.log(stats, step=round_index)
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], not {tuple(rewards.shape)}")
    ids = _as_ids(group_ids, rewards)
    if not is_distributed():
        return group_reward_stats(rewards, ids)
    gathered = _gather_rewards_and_ids(rewards, ids)
    if gathered is None:
        return group_reward_stats(rewards, ids)
    all_rewards, all_ids, _ = gathered
    return group_reward_stats(all_rewards, all_ids)
