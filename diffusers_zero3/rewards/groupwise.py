"""Group-wise rewards: a reward that scores a prompt's whole group of samples together.

Pref-GRPO (arXiv 2508.20751, CodeGoat24/Pref-GRPO) rewards each image by its *win rate* within
its prompt's group: a judge compares the images two by two and an image's reward is the fraction
of its comparisons it won. Its trainer keeps a prompt's whole group on one rank, so it scores
there. Here a group's members are spread over several ranks (``rl.groups``: the round's samples
are shuffled, then cut into one slice per rank), so a group-wise reward needs the group gathered
first, and a sharded judge needs every rank to make the same number of forwards. A round goes:

1. ``gather_round``: every rank's real samples (images, prompts, ``(group, member)`` keys) to
   every rank, in the same order everywhere (by group, then member); a sample held by several
   ranks (context parallelism: a group of ranks draws the same samples) is kept once.
2. The work is listed the same way on every rank (``ordered_pairs``: each ordered pair of a
   group's members, both orders; or ``group_members``: each group) and dealt
   (``deal``): rank ``r`` takes the ``r``-th contiguous slice, padded with copies of the first
   item to ``ceil(len / world_size)``, so every rank makes the same number of judge calls
   (a sharded judge's forward is a collective), zero when there is nothing to score.
3. Each rank scores its share; ``gather_dealt`` hands every rank the whole list's results.
4. Every rank assembles every sample's reward (``win_rates`` of the pairs' preferences; a
   group's scores) and keeps its own samples', in their order (``GroupwiseReward``); its dummy
   samples get 0 (the trainer drops them).

Every step is a collective of fixed shape, also on a rank with no real sample, so nothing waits
for a rank that has fewer. Every rank holds the round's real images once during the scoring
(gathered), which is the price of step 1.

Declaring one: a reward function or model class carries ``reward_scope``:

* ``"group"`` (``scores_groups``): called ``fn(images, prompts)`` once per group with that
  group's members (``[n, 3, H, W]``, by member index; the prompt repeated), returns ``[n]``.
* ``"pairwise"`` (``judges_pairs``): called ``fn(pairs, prompts)`` with ``pairs`` ``[B, 2, 3,
  H, W]`` (first and second image of each comparison), returns ``[B]``: P(first is better),
  in ``[0, 1]``. An image's reward is its win rate over the other members of its group, each
  pair judged in both orders and averaged (a judge's preference for a position cancels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..placement.rewards import ParallelReward
from ..runtime.distributed import (
    all_gather_ints,
    all_gather_object,
    comm_device,
    get_rank,
    get_world_size,
    is_distributed,
)

SCOPES = ("sample", "group", "pairwise")
F = TypeVar("F", bound=Callable[..., Any])


def scores_groups(fn: F) -> F:
    """Declare a reward function (or model class) group-wise: called once per prompt's group
    with all of its members, ``fn(images, prompts) -> [n]``.

    Example:
        >>> @scores_groups
        ... def above_group_mean(images, prompts):
        ...     m = images.mean((1, 2, 3))
        ...     return m - m.mean()
    """
    fn.reward_scope = "group"
    return fn


def judges_pairs(fn: F) -> F:
    """Declare a reward function (or model class) a pairwise judge: ``fn(pairs, prompts) ->
    P(first better) [B]`` for ``pairs`` ``[B, 2, 3, H, W]``; each image's reward is its win rate
    in its group.

    Example:
        >>> @judges_pairs
        ... def brighter(pairs, prompts):
        ...     return torch.sigmoid(10 * (pairs[:, 0].mean((1, 2, 3)) - pairs[:, 1].mean((1, 2, 3))))
    """
    fn.reward_scope = "pairwise"
    return fn


def reward_scope(obj: Any) -> str:
    """The scope a reward function or model class declares: ``"sample"`` (the default: one score
    per image, from that image alone), ``"group"`` or ``"pairwise"``.

    Raises:
        ValueError: a declared scope that is none of these.
    """
    scope = getattr(obj, "reward_scope", "sample")
    if scope not in SCOPES:
        raise ValueError(f"reward_scope {scope!r} of {obj!r}: choose one of {', '.join(SCOPES)}")
    return scope


@dataclass(frozen=True)
class SampleGroups:
    """Which prompt group and member each of a rank's samples is, and which are real.

    Attributes:
        group_ids: one integer per sample: the samples of a prompt share it.
        members: one integer per sample: its index within the group (two real samples with the
            same ``(group, member)`` are the same sample, held by several ranks).
        real: False for a dummy sample (padding): it joins no group and gets 0.
    """

    group_ids: Sequence[int]
    members: Sequence[int]
    real: Sequence[bool]

    def __post_init__(self):
        if not len(self.group_ids) == len(self.members) == len(self.real):
            raise ValueError(
                f"{len(self.group_ids)} group ids, {len(self.members)} members and {len(self.real)} real flags"
            )

    def __len__(self) -> int:
        return len(self.group_ids)


@dataclass
class GatheredRound:
    """Every rank's real samples, once each, by ``(group, member)``; the same on every rank.

    Attributes:
        images: ``[M, ...]`` on this rank's images' device and dtype.
        prompts: ``M`` prompts (None when the ranks gave none).
        keys: ``M`` ``(group, member)`` keys, sorted.
        mine: for each of this rank's samples, its row in ``images`` (-1 for a dummy).
    """

    images: torch.Tensor
    prompts: list[str] | None
    keys: list[tuple[int, int]]
    mine: list[int]


def gather_round(images: torch.Tensor, prompts: Sequence[str] | None, groups: SampleGroups) -> GatheredRound:
    """Every rank's real samples on every rank (see ``GatheredRound``). Collective: call on every
    rank, also one with no real sample; three collectives (the counts, the padded images and
    keys, the prompts) of shapes every rank knows.

    Example:
        >>> # rank 0 holds prompt 7's members 0 and 2, rank 1 its member 1 and a dummy
        >>> round_ = gather_round(images, prompts, SampleGroups([7, 7], [0, 2], [True, True]))
        >>> round_.keys, round_.mine  # on rank 0
        ([(7, 0), (7, 1), (7, 2)], [0, 2])
    """
    if len(images) != len(groups):
        raise ValueError(f"{len(images)} images for {len(groups)} samples")
    real = [i for i, keep in enumerate(groups.real) if keep]
    keys = [(int(groups.group_ids[i]), int(groups.members[i])) for i in real]
    texts = [prompts[i] for i in real] if prompts is not None else None
    mine_images = images[real]
    if is_distributed():
        counts = [c for (c,) in all_gather_ints([len(real)])]
        width = max(counts)
        shape = tuple(images.shape[1:])
        padded = torch.zeros(width, *shape, dtype=images.dtype, device=comm_device())
        padded[: len(real)] = mine_images.detach().to(padded.device)
        key_rows = torch.zeros(width, 2, dtype=torch.long, device=comm_device())
        key_rows[: len(real)] = torch.tensor(keys, dtype=torch.long, device=key_rows.device).reshape(-1, 2)
        everyone = [torch.empty_like(padded) for _ in counts]
        everyone_keys = [torch.empty_like(key_rows) for _ in counts]
        if width:
            dist.all_gather(everyone, padded)
            dist.all_gather(everyone_keys, key_rows)
        all_texts = all_gather_object(texts)
        all_images = torch.cat([t[:n] for t, n in zip(everyone, counts)]).to(images.device)
        all_keys = [tuple(k) for t, n in zip(everyone_keys, counts) for k in t[:n].tolist()]
        all_prompts = None if any(t is None for t in all_texts) else [p for t in all_texts for p in t]
    else:
        all_images, all_keys, all_prompts = mine_images.detach(), keys, texts
    first: dict[tuple[int, int], int] = {}
    for i, key in enumerate(all_keys):  # a sample held by several ranks: the first copy
        first.setdefault(key, i)
    order = sorted(first)
    rows = [first[k] for k in order]
    row_of = {k: i for i, k in enumerate(order)}
    mine = [-1] * len(groups)
    for i, key in zip(real, keys):
        mine[i] = row_of[key]
    return GatheredRound(
        images=all_images[rows],
        prompts=[all_prompts[r] for r in rows] if all_prompts is not None else None,
        keys=order,
        mine=mine,
    )


def group_members(keys: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The rows of each group in ``keys`` (sorted by group, then member), group by group.

    Example:
        >>> group_members([(3, 0), (3, 1), (5, 0)])
        [[0, 1], [2]]
    """
    groups: dict[int, list[int]] = {}
    for i, (group, _) in enumerate(keys):
        groups.setdefault(group, []).append(i)
    return list(groups.values())


def ordered_pairs(groups: Sequence[Sequence[int]], both_orders: bool = True) -> list[tuple[int, int]]:
    """The comparisons of a round: ``(first, second)`` rows of each pair of members of a group,
    in both orders (``both_orders``), else once with the lower row first (the reference's
    ``itertools.combinations``).

    Example:
        >>> ordered_pairs([[0, 1, 2]])
        [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)]
        >>> ordered_pairs([[0, 1, 2]], both_orders=False)
        [(0, 1), (0, 2), (1, 2)]
    """
    pairs = []
    for rows in groups:
        for a, i in enumerate(rows):
            for j in rows[a + 1 :]:
                pairs += [(i, j), (j, i)] if both_orders else [(i, j)]
    return pairs


def deal(count: int, world_size: int, rank: int) -> tuple[list[int], list[bool]]:
    """This rank's share of ``count`` items: the ``rank``-th contiguous slice of
    ``ceil(count / world_size)``, padded with copies of item 0 (which are not real) to that
    length, so that every rank makes the same number of calls (none when ``count`` is 0).

    Example:
        >>> deal(5, 2, 0), deal(5, 2, 1)
        (([0, 1, 2], [True, True, True]), ([3, 4, 0], [True, True, False]))
        >>> deal(1, 2, 1)
        ([0], [False])
    """
    if count < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need count >= 0 and 0 <= rank < world_size; got {count}, {rank}, {world_size}")
    per_rank = -(-count // world_size)
    items = list(range(rank * per_rank, min(count, (rank + 1) * per_rank)))
    real = [True] * len(items) + [False] * (per_rank - len(items))
    return items + [0] * (per_rank - len(items)), real


def gather_dealt(values: torch.Tensor, count: int) -> torch.Tensor:
    """The results of all ``count`` dealt items, in item order, from each rank's ``values``
    (``[ceil(count / world_size)]``, the results of its ``deal`` share, padding included), as
    float64 on ``values``' device. Collective: call on every rank (one ``all_gather``)."""
    values = values.detach().reshape(-1).to(torch.float64)
    if not is_distributed():
        return values[:count]
    mine = values.to(comm_device())
    everyone = [torch.empty_like(mine) for _ in range(get_world_size())]
    if len(mine):
        dist.all_gather(everyone, mine)
    return torch.cat(everyone)[:count].to(values.device)


def win_rates(count: int, pairs: Sequence[tuple[int, int]], preferences: torch.Tensor) -> torch.Tensor:
    """Each of ``count`` samples' win rate: the mean, over the comparisons it took part in, of
    its share of the win (``p`` as the first of a pair, ``1 - p`` as the second, ``p`` =
    ``preferences[k]`` = P(first better) of ``pairs[k]``); 0 for a sample with no comparison
    (as the reference). Pref-GRPO's ``_pairwise_win_rate`` with a hard answer (1, 0, or 0.5 when
    it names neither) and pairs in one order is this, before its rounding to 3 decimals.

    Example:
        >>> win_rates(3, [(0, 1), (0, 2), (1, 2)], torch.tensor([1.0, 1.0, 0.5]))
        tensor([1.0000, 0.2500, 0.2500], dtype=torch.float64)
    """
    prefs = preferences.detach().reshape(-1).to(torch.float64)
    if len(prefs) != len(pairs):
        raise ValueError(f"{len(prefs)} preferences for {len(pairs)} pairs")
    wins = torch.zeros(count, dtype=torch.float64, device=prefs.device)
    seen = torch.zeros(count, dtype=torch.float64, device=prefs.device)
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=prefs.device)
        ones = torch.ones_like(prefs)
        wins.index_add_(0, index[:, 0], prefs).index_add_(0, index[:, 1], 1 - prefs)
        seen.index_add_(0, index[:, 0], ones).index_add_(0, index[:, 1], ones)
    return torch.where(seen > 0, wins / seen.clamp(min=1), torch.zeros_like(wins))


class GroupwiseReward:
    """A group-wise reward (``reward_scope`` ``"group"`` or ``"pairwise"``) over the ranks'
    samples: gathered, dealt, scored, handed back (the module docstring's four steps).

    Args:
        reward: the reward model or function, as ``ParallelReward`` calls it (a sharded judge:
            every rank makes the same number of its forwards); not differentiable and not
            normalised (its outputs are preferences or a group's scores).
        scope: ``"group"`` or ``"pairwise"``.

    Collective: call on every rank.

    Example:
        >>> judge = GroupwiseReward(ParallelReward(brighter), "pairwise")
        >>> scores = judge(images, prompts, SampleGroups(prompt_ids, members, real))  # [B] each rank
    """

    def __init__(self, reward: ParallelReward, scope: str):
        if scope not in ("group", "pairwise"):
            raise ValueError(f"a group-wise reward's scope is 'group' or 'pairwise', not {scope!r}")
        if reward.differentiable or reward.normalize is not None:
            raise ValueError("a group-wise reward is neither differentiable nor normalised by ParallelReward")
        self.reward, self.scope = reward, scope
        self.fn, self.model = reward.fn, reward.model  # what WeightedRewards reads of a reward

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str] | None, groups: SampleGroups
    ) -> torch.Tensor:
        """``[B]`` float32 scores of this rank's samples (0 for dummies), on the images' device."""
        gathered = gather_round(images, prompts, groups)
        if self.scope == "pairwise":
            scores = self._pairwise(gathered)
        else:
            scores = self._groups(gathered)
        mine = torch.tensor(gathered.mine, dtype=torch.long, device=scores.device)
        out = torch.zeros(len(mine), dtype=torch.float64, device=scores.device)
        out[mine >= 0] = scores[mine[mine >= 0]]
        return out.float().to(images.device)

    def _prompts(self, gathered: GatheredRound, rows: Sequence[int]) -> list[str] | None:
        return [gathered.prompts[r] for r in rows] if gathered.prompts is not None else None

    def _pairwise(self, gathered: GatheredRound) -> torch.Tensor:
        pairs = ordered_pairs(group_members(gathered.keys))
        items, _ = deal(len(pairs), get_world_size(), get_rank())
        share = [pairs[k] for k in items]
        if not share:  # no pair anywhere (every rank agrees): no judge call on any rank
            return torch.zeros(len(gathered.keys), dtype=torch.float64, device=gathered.images.device)
        # one micro-batch of pairs at a time (every rank has as many: the same calls everywhere),
        # so that a rank never holds its whole share's pairs of images and their judge inputs
        size = self.reward.micro_batch_size
        prefs = torch.full((len(share),), torch.nan, dtype=torch.float64, device=gathered.images.device)
        failed: Exception | None = None
        for start in range(0, len(share), size):
            chunk = share[start : start + size]
            firsts, seconds = [i for i, _ in chunk], [j for _, j in chunk]
            stacked = torch.stack([gathered.images[firsts], gathered.images[seconds]], dim=1)
            try:
                out = torch.as_tensor(self.reward(stacked, self._prompts(gathered, firsts))).reshape(-1)
                if len(out) != len(chunk):
                    raise ValueError(f"returned {len(out)} preferences for {len(chunk)} pairs")
            except Exception as e:  # raised after the gather below, which the other ranks are in
                failed = e
                break
            prefs[start : start + len(chunk)] = out.to(prefs)
        every = gather_dealt(prefs, len(pairs))
        if failed is not None:
            raise failed
        return win_rates(len(gathered.keys), pairs, every)

    def _groups(self, gathered: GatheredRound) -> torch.Tensor:
        members = group_members(gathered.keys)
        items, _ = deal(len(members), get_world_size(), get_rank())
        width = max((len(m) for m in members), default=0)
        # each dealt group's scores, padded to the widest group: one gather of a fixed shape
        scored = torch.zeros(len(items), width, dtype=torch.float64, device=gathered.images.device)
        failed: Exception | None = None
        for k, g in enumerate(items):
            rows = members[g]
            try:
                out = torch.as_tensor(
                    self.reward(gathered.images[rows], self._prompts(gathered, rows))
                ).reshape(-1)
                if len(out) != len(rows):
                    raise ValueError(f"returned {len(out)} scores for a group of {len(rows)}")
            except Exception as e:  # raised after the gather below, which the other ranks are in
                failed = e
                break
            scored[k, : len(rows)] = out.to(scored)
        every = gather_dealt(scored.reshape(-1), len(members) * width).reshape(len(members), width)
        if failed is not None:
            raise failed
        scores = torch.zeros(len(gathered.keys), dtype=torch.float64, device=every.device)
        for g, rows in enumerate(members):
            scores[rows] = every[g, : len(rows)]
        return scores

    def lockstep_check(self):
        """The inner reward's lockstep check (``ParallelReward.lockstep_check``)."""
        return self.reward.lockstep_check() if self.model is not None else contextlib.nullcontext()
