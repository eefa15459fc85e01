"""The RL numerics (``diffusers_zero3.rl``, issue 37) against independent float64 computations of
what the reference repositories compute: yifan123/flow_grpo (Flow-GRPO) and NVlabs/DiffusionNFT.

Each reference below is written from the formula, in float64, not copied from those repositories;
each test's docstring names the file and function it reproduces. Inputs are fp32 and bf16 (the
functions compute in float32 then), and ``meta`` tensors check that nothing is built on the CPU
(a meta input must give meta outputs). One test runs ``gather_group_advantages`` on 2 gloo ranks.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from diffusers_zero3.rl import (
    NftSettings,
    gather_group_advantages,
    gather_group_reward_stats,
    group_advantages,
    group_assignment,
    group_reward_stats,
    grpo_loss,
    nft_loss,
    nft_optimality,
    samples_per_rank,
    sde_kl,
    sde_step_with_logprob,
)
from tests.distributed_harness import run_on_ranks

META = torch.device("meta")
F64 = torch.float64


def _on_meta(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.device == META, f"a tensor of shape {tuple(t.shape)} is on {t.device}, not on meta"


def _randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _broadcast(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.reshape(-1, *([1] * (ndim - 1)))


# ------------------------------------------------------------------------ references (float64)


def _flow_grpo_sde_reference(v, x, sigma, sigma_next, sigma_max, noise_level, prev):
    """flow_grpo ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``, ``sde_step_with_logprob``,
    in float64, from the paper's SDE (arXiv:2505.05470, eq. 12): ``dx = [v + s_t**2 / (2 t) (x +
    (1 - t) v)] dt + s_t dw`` with ``s_t = a sqrt(t / (1 - t))``, ``1 - t`` taken at the schedule's
    ``sigmas[1]`` where ``t == 1``; the step's log-density from ``torch.distributions.Normal``,
    averaged over every non-batch element."""
    v, x, prev = v.to(F64), x.to(F64), prev.to(F64)
    t = _broadcast(torch.as_tensor(sigma, dtype=F64), x.ndim)
    t_next = _broadcast(torch.as_tensor(sigma_next, dtype=F64), x.ndim)
    dt = t_next - t
    one_minus = 1 - torch.where(t == 1, torch.as_tensor(sigma_max, dtype=F64), t)
    s = noise_level * torch.sqrt(t / one_minus)
    mean = x + (v + s**2 / (2 * t) * (x + (1 - t) * v)) * dt
    density = torch.distributions.Normal(mean, s * torch.sqrt(-dt))
    log_prob = density.log_prob(prev).flatten(1).mean(1)
    return mean, log_prob, s


def _stat_tracker_reference(rewards, ids, global_std=False):
    """flow_grpo ``flow_grpo/stat_tracking.py``, ``PerPromptStatTracker.update`` (type "grpo",
    fresh tracker: the scripts ``clear()`` it every epoch) in numpy float64."""
    rewards = np.asarray(rewards, dtype=np.float64)
    ids = np.asarray(ids)
    out = np.zeros_like(rewards)
    for g in np.unique(ids):
        members = rewards[ids == g]
        std = np.std(rewards if global_std else members) + 1e-4
        out[ids == g] = (members - np.mean(members)) / std
    return torch.from_numpy(out)


def _flow_grpo_step_loss_reference(log_prob, old_log_prob, adv, clip_range, adv_clip_max, kl, beta):
    """flow_grpo ``scripts/train_sd3.py``, the training step's loss, in float64, as PPO's
    ``-mean(min(A r, A clip(r)))``."""
    a = adv.to(F64).clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob.to(F64) - old_log_prob.to(F64))
    surrogate = torch.minimum(a * ratio, a * ratio.clamp(1 - clip_range, 1 + clip_range))
    policy = -surrogate.mean()
    return policy + beta * kl.to(F64).mean() if beta else policy


def _nft_reference(v_theta, v_old, x0, noise, t, adv, beta, adv_clip_max, v_ref, kl_beta, detach=True):
    """NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``, the training loop's loss, in float64,
    written in velocity terms: with ``x_t = (1 - t) x0 + t noise`` and the flow-matching target
    ``u = noise - x0``, the reference's x0-space error of a velocity ``w`` is ``t (w - u)``; each
    side's loss is ``mean(t**2 (w - u)**2) / max(mean|t (w - u)|, 1e-5)`` (weight detached)."""
    v_theta, v_old, x0, noise = v_theta.to(F64), v_old.to(F64), x0.to(F64), noise.to(F64)
    t = _broadcast(torch.as_tensor(t, dtype=F64), x0.ndim)
    u = noise - x0
    r = ((adv.to(F64).clamp(-adv_clip_max, adv_clip_max) / adv_clip_max) / 2 + 0.5).clamp(0, 1)

    def side(w):
        error = t * (w - u)
        weight = (error.detach() if detach else error).abs().flatten(1).mean(1).clamp(min=1e-5)
        return (error**2).flatten(1).mean(1) / weight

    positive = side(beta * v_theta + (1 - beta) * v_old)
    negative = side((1 + beta) * v_old - beta * v_theta)
    loss = adv_clip_max * ((r * positive + (1 - r) * negative) / beta).mean()
    if v_ref is not None:
        loss = loss + kl_beta * ((v_theta - v_ref.to(F64)) ** 2).flatten(1).mean(1).mean()
    return loss


# ------------------------------------------------------------------------ sde_step_with_logprob


def _schedule(num_steps: int = 10) -> torch.Tensor:
    """The sigmas Flow-GRPO samples with: SD3's scheduler (shift 3), 1.0 first, 0.0 last."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(4, 3, 8, 8), (4, 3, 2, 4, 4)], ids=["image", "video"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sde_step_matches_flow_grpo(shape, dtype):
    """flow_grpo ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``, ``sde_step_with_logprob``:
    the mean, the [B] log-probability and ``std_dev_t``, with one sigma per sample taken from the
    first step (sigma == 1: ``sigmas[1]`` in the denominator), the last (sigma_next == 0) and two
    between; images and 5-D videos; bf16 inputs computed in float32 (their float64 reference
    takes the same bf16-rounded values)."""
    sigmas = _schedule()
    assert sigmas[0] == 1 and sigmas[-1] == 0
    steps = torch.tensor([0, 3, 7, len(sigmas) - 2])
    sigma, sigma_next = sigmas[steps], sigmas[steps + 1]
    v, x = _randn(*shape, seed=1, dtype=dtype), _randn(*shape, seed=2, dtype=dtype)
    prev = _randn(*shape, seed=3) * 0.3 + x.float()

    prev_out, log_prob, mean, std = sde_step_with_logprob(
        v, sigma, sigma_next, x, noise_level=0.7, prev_sample=prev
    )
    ref_mean, ref_log_prob, ref_std = _flow_grpo_sde_reference(v, x, sigma, sigma_next, sigmas[1], 0.7, prev)
    for out in (prev_out, log_prob, mean, std):
        assert out.dtype == torch.float32
    assert log_prob.shape == (shape[0],) and std.shape == (shape[0],) + (1,) * (len(shape) - 1)
    assert torch.equal(prev_out, prev)
    assert_close(mean, ref_mean.float(), rtol=1e-5, atol=1e-5)
    assert_close(std, ref_std.float(), rtol=1e-6, atol=0)
    assert_close(log_prob, ref_log_prob.float(), rtol=1e-5, atol=1e-4)
    assert torch.isfinite(log_prob).all()


@pytest.mark.unit
def test_sde_step_samples_and_differentiates_like_flow_grpo():
    """flow_grpo ``sd3_sde_with_logprob.py``, ``sde_step_with_logprob`` without ``prev_sample``:
    ``prev = mean + std_dev_t * sqrt(-dt) * randn`` with the generator's draw (one generator, or
    one per sample as diffusers' ``randn_tensor``), and the gradient of the log-probability with
    respect to the velocity (``prev_sample`` detached) against float64 autograd."""
    sigmas = _schedule()
    sigma, sigma_next = sigmas[2], sigmas[3]
    v, x = _randn(3, 4, 6, 6, seed=4), _randn(3, 4, 6, 6, seed=5)

    prev, log_prob, mean, std = sde_step_with_logprob(
        v, sigma, sigma_next, x, noise_level=0.7, noise=torch.Generator().manual_seed(7)
    )
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    assert_close(prev, mean + std * torch.sqrt(sigma - sigma_next) * noise)
    scored = sde_step_with_logprob(v, sigma, sigma_next, x, noise_level=0.7, prev_sample=prev)[1]
    assert torch.equal(scored, log_prob)

    per_sample = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    prev = sde_step_with_logprob(v, sigma, sigma_next, x, noise_level=0.7, noise=per_sample)[0]
    noise = torch.cat(
        [torch.randn((1, 4, 6, 6), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    )
    assert_close(prev, mean + std * torch.sqrt(sigma - sigma_next) * noise)

    v_leaf, v64 = v.clone().requires_grad_(), v.to(F64).requires_grad_()
    sde_step_with_logprob(v_leaf, sigma, sigma_next, x, noise_level=0.7, prev_sample=prev)[1].sum().backward()
    _flow_grpo_sde_reference(v64, x, sigma, sigma_next, sigmas[1], 0.7, prev)[1].sum().backward()
    assert_close(v_leaf.grad, v64.grad.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.unit
def test_sde_step_first_step_uses_the_second_sigma():
    """flow_grpo ``sd3_sde_with_logprob.py``: ``torch.where(sigma == 1, sigma_max, sigma)`` with
    ``sigma_max = self.sigmas[1]``. Ours puts ``sigma_next`` there, that value at the first step;
    the control: the reference without a substitute (``sigma_max=1``) has an infinite
    ``std_dev_t`` there, so a step that did not substitute could not match it."""
    sigmas = _schedule()
    assert sigmas[0] == 1  # the step under test is the one that divides by 1 - sigma
    v, x = _randn(1, 4, 4, 4, seed=8), _randn(1, 4, 4, 4, seed=9)
    ours = sde_step_with_logprob(v, sigmas[0], sigmas[1], x, noise_level=0.7, prev_sample=x)
    reference = _flow_grpo_sde_reference(v, x, sigmas[:1], sigmas[1:2], sigmas[1], 0.7, x)
    assert torch.isfinite(ours[3]).all()
    assert_close(ours[3], reference[2].float())
    assert_close(ours[1], reference[1].float(), rtol=1e-5, atol=1e-5)
    unguarded = _flow_grpo_sde_reference(v, x, sigmas[:1], sigmas[1:2], 1.0, 0.7, x)
    assert torch.isinf(unguarded[2]).all()


@pytest.mark.unit
def test_sde_step_stays_on_meta():
    """Meta inputs (bf16, 5-D), sigmas as numbers, CPU tensors and meta tensors, and a CPU
    generator: every output is a float32 meta tensor (nothing built on the CPU)."""
    v = torch.empty(2, 4, 3, 8, 8, dtype=torch.bfloat16, device=META)
    x = torch.empty_like(v)
    for sigma, sigma_next in [(0.8, 0.0), (torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.4]))]:
        for s, s_next in [
            (sigma, sigma_next),
            (torch.as_tensor(sigma).to(META), torch.as_tensor(sigma_next).to(META)),
        ]:
            for generator in (None, torch.Generator().manual_seed(0)):
                outs = sde_step_with_logprob(v, s, s_next, x, noise_level=0.7, noise=generator)
                _on_meta(*outs)
                assert all(o.dtype == torch.float32 for o in outs)
                assert outs[1].shape == (2,)
    outs = sde_step_with_logprob(v, 0.5, 0.25, x, noise_level=0.7, prev_sample=torch.empty_like(x))
    _on_meta(*outs)


# ------------------------------------------------------------------------ advantages


@pytest.mark.unit
@pytest.mark.parametrize("global_std", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_advantages_match_the_stat_tracker(global_std, dtype):
    """flow_grpo ``flow_grpo/stat_tracking.py``, ``PerPromptStatTracker.update`` (also DiffusionNFT's
    copy): per group ``(r - mean) / (std + 1e-4)``, population std, and ``global_std``'s std over
    every reward; a group of one gets 0; one id for all is the scripts' non-per-prompt branch."""
    g = torch.Generator().manual_seed(11)
    ids = torch.tensor([3, 0, 3, 7, 0, 3, 12, 0, 7])  # group 12 has one member
    rewards = (torch.rand(len(ids), generator=g) * 4 - 1).to(dtype)
    out = group_advantages(rewards, ids, global_std=global_std)
    assert out.dtype == torch.float32
    assert_close(out, _stat_tracker_reference(rewards.double(), ids, global_std).float())
    assert out[6] == 0
    assert_close(group_advantages(rewards, ids.tolist(), global_std=global_std), out)  # ids as a list
    one_group = group_advantages(rewards, [5] * len(ids))
    r64 = rewards.double()
    assert_close(one_group, ((r64 - r64.mean()) / (r64.std(correction=0) + 1e-4)).float())
    clipped = group_advantages(rewards * 100, ids, clip=0.5, std_eps=1e-2)
    assert clipped.abs().max() <= 0.5 and (clipped.abs() == 0.5).any()
    assert group_advantages(torch.empty(0), torch.empty(0, dtype=torch.long)).shape == (0,)


@pytest.mark.unit
def test_group_advantages_stay_on_meta():
    """Meta rewards and ids: meta advantages (the groups are found without ``torch.unique``)."""
    rewards = torch.empty(6, dtype=torch.bfloat16, device=META)
    ids = torch.empty(6, dtype=torch.long, device=META)
    for global_std in (False, True):
        out = group_advantages(rewards, ids, global_std=global_std, clip=5.0)
        _on_meta(out)
        assert out.shape == (6,) and out.dtype == torch.float32
    _on_meta(gather_group_advantages(rewards, [0, 0, 1, 1, 2, 2]))  # no process group: local


def worker_gather_group_advantages():
    """On each of 2 ranks: the samples ``group_assignment`` gives it (9 samples: 5 and 4, groups
    across both ranks), their advantages over both ranks against the tracker over all 9; then a
    rank with no samples, and no samples anywhere."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # the reward of (prompt, member), the same on both ranks
    table = torch.rand(3, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    everyone = [group_assignment(3, 3, 2, r, round_index=1, seed=5) for r in range(2)]
    ranks_of = {p: {r for r in range(2) for q, _ in everyone[r] if q == p} for p in range(3)}
    assert any(len(rs) == 2 for rs in ranks_of.values()), ranks_of  # a group straddles the ranks

    def rewards_and_ids(pairs):
        return torch.stack([table[p, m] for p, m in pairs]).float(), torch.tensor([p for p, _ in pairs])

    every_pair = everyone[0] + everyone[1]
    all_rewards, all_ids = rewards_and_ids(every_pair)
    mine, my_ids = rewards_and_ids(everyone[rank])
    start = 0 if rank == 0 else len(everyone[0])
    for global_std in (False, True):
        expected = _stat_tracker_reference(all_rewards.double(), all_ids, global_std)[
            start : start + len(mine)
        ]
        out = gather_group_advantages(mine, my_ids, global_std=global_std)
        assert out.dtype == torch.float32 and out.shape == mine.shape
        assert_close(out, expected.float())
        # the control: this rank's samples alone give other advantages
        alone = group_advantages(mine, my_ids, global_std=global_std)
        assert not torch.allclose(alone, out, atol=1e-3), (alone, out)

    # rank 1 holds nothing; rank 0 everything
    held = (all_rewards, all_ids) if rank == 0 else (torch.empty(0), torch.empty(0, dtype=torch.long))
    out = gather_group_advantages(*held)
    assert out.shape == held[0].shape
    if rank == 0:
        assert_close(out, _stat_tracker_reference(all_rewards.double(), all_ids).float())
    out = gather_group_advantages(torch.empty(0, dtype=torch.bfloat16), [])
    assert out.shape == (0,) and out.dtype == torch.float32

    # the round's reward statistics: every rank's samples, the same numbers on each rank
    stats = gather_group_reward_stats(mine, my_ids)
    assert stats == pytest.approx(group_reward_stats(all_rewards, all_ids), abs=1e-12)
    assert stats != pytest.approx(group_reward_stats(mine, my_ids), abs=1e-6)  # the control: alone
    assert gather_group_reward_stats(*held) == pytest.approx(
        group_reward_stats(all_rewards, all_ids), abs=1e-12
    )
    print(f"OK gather rank {rank}", flush=True)


def _zero_std_ratio_reference(prompts, rewards):
    """flow_grpo ``scripts/train_sd3.py``, ``calculate_zero_std_ratio``: the rewards grouped by
    prompt (``np.unique``), ``np.std`` of each group, the fraction that is 0."""
    prompt_array = np.array(prompts)
    _, inverse, counts = np.unique(prompt_array, return_inverse=True, return_counts=True)
    grouped = rewards[np.argsort(inverse, kind="stable")]
    groups = np.split(grouped, np.cumsum(counts)[:-1])
    stds = np.array([np.std(g) for g in groups])
    return np.count_nonzero(stds == 0) / len(stds)


@pytest.mark.unit
def test_group_reward_stats_are_flow_grpos():
    """``group_reward_stats``: the population std of every reward (flow_grpo logs
    ``gathered_rewards['avg'].std()``) and ``calculate_zero_std_ratio``'s fraction of groups whose
    rewards are all equal; groups given in any order, of any size."""
    rewards = np.array([0.5, 0.25, 0.5, 0.75, 0.75, 2.0, 0.75, 1.0, 3.0, 0.5], dtype=np.float64)
    prompts = [
        3,
        1,
        3,
        4,
        4,
        9,
        4,
        1,
        7,
        3,
    ]  # groups 1 (2 different), 3 (all 0.5), 4 (all 0.75), 9 and 7 (one each)
    stats = group_reward_stats(torch.tensor(rewards, dtype=torch.float32), prompts)
    assert stats["reward_std"] == pytest.approx(np.std(rewards), abs=1e-7)
    assert stats["zero_std_fraction"] == _zero_std_ratio_reference(prompts, rewards) == 4 / 5
    # all-equal groups whose float mean is not exactly their value still count (np.std of
    # [0.1] * 3 is 1.4e-17, which flow_grpo's `== 0` misses)
    assert group_reward_stats(torch.tensor([0.1, 0.1, 0.1, 0.2, 0.3], dtype=F64), [0, 0, 0, 1, 1]) == {
        "reward_std": pytest.approx(np.std([0.1, 0.1, 0.1, 0.2, 0.3])), "zero_std_fraction": 0.5,
    }  # fmt: skip
    empty = group_reward_stats(torch.empty(0), [])
    assert all(np.isnan(v) for v in empty.values())
    assert group_reward_stats(torch.tensor([1.0, 2.0]), [0, 1])["zero_std_fraction"] == 1.0


@pytest.mark.multirank
def test_gather_group_advantages_on_two_ranks():
    """flow_grpo ``scripts/train_sd3.py``: gather every rank's rewards and prompts, run
    ``PerPromptStatTracker.update`` over them, keep this rank's slice; here with 5 and 4 samples
    per rank (the reference needs equal counts) and, then, a rank with none."""
    outs = run_on_ranks(worker_gather_group_advantages, timeout=120)
    assert all(f"OK gather rank {r}" in o for r, o in enumerate(outs)), outs


# ------------------------------------------------------------------------ group_assignment


@pytest.mark.unit
@pytest.mark.parametrize(
    "num_prompts,group_size,world_size", [(3, 5, 2), (4, 6, 8), (7, 3, 4), (2, 2, 5), (1, 1, 3), (0, 4, 2)]
)
def test_group_assignment_covers_every_sample_once(num_prompts, group_size, world_size):
    """Like flow_grpo's ``DistributedKRepeatSampler`` (``scripts/train_sd3.py``: every rank the same
    shuffled ``k``-fold repetition, cut in slices), for any total: the ranks' union is every
    ``(prompt, member)`` once, the shares differ by one at most and never exceed
    ``samples_per_rank``, and the order depends on ``(seed, round)`` only."""
    shares = [
        group_assignment(num_prompts, group_size, world_size, r, round_index=2, seed=3)
        for r in range(world_size)
    ]
    union = Counter(pair for share in shares for pair in share)
    assert union == Counter((p, m) for p in range(num_prompts) for m in range(group_size))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) == samples_per_rank(
        num_prompts, group_size, world_size
    )
    assert sizes == sorted(sizes, reverse=True)  # the first ranks take the remainder
    again = [
        group_assignment(num_prompts, group_size, world_size, r, round_index=2, seed=3)
        for r in range(world_size)
    ]
    assert again == shares


@pytest.mark.unit
def test_group_assignment_rounds_seeds_and_dataset_prompts():
    """Groups straddle ranks; another round or seed reorders (and ``(seed, round + 1)`` differs
    from ``(seed + 1, round)``, which the reference's ``seed + epoch`` confuses); with
    ``dataset_size`` the round's prompts are distinct dataset indices, drawn per round."""
    shares = [group_assignment(4, 6, 2, r, round_index=0, seed=0) for r in range(2)]
    assert any({p for p, _ in shares[0]} & {p for p, _ in shares[1]})
    order = [pair for r in range(2) for pair in group_assignment(4, 6, 2, r, round_index=0, seed=0)]
    assert order != [pair for r in range(2) for pair in group_assignment(4, 6, 2, r, round_index=1, seed=0)]
    assert group_assignment(4, 6, 1, 0, round_index=1, seed=0) != group_assignment(
        4, 6, 1, 0, round_index=0, seed=1
    )

    picked = [group_assignment(5, 2, 3, r, round_index=4, seed=9, dataset_size=1000) for r in range(3)]
    prompts = {p for share in picked for p, _ in share}
    assert len(prompts) == 5 and all(0 <= p < 1000 for p in prompts)
    assert Counter(p for share in picked for p, _ in share) == Counter({p: 2 for p in prompts})
    other_round = {
        p for r in range(3) for p, _ in group_assignment(5, 2, 3, r, round_index=5, seed=9, dataset_size=1000)
    }
    assert other_round != prompts
    with pytest.raises(ValueError):
        group_assignment(5, 2, 3, 3, round_index=0, seed=0)
    with pytest.raises(ValueError):
        group_assignment(5, 2, 3, 0, round_index=0, seed=0, dataset_size=4)


# ------------------------------------------------------------------------ grpo_loss, sde_kl


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kl_beta", [0.0, 0.04])
def test_grpo_loss_matches_flow_grpo(dtype, kl_beta):
    """flow_grpo ``scripts/train_sd3.py``, the training step: advantages clamped to
    ``adv_clip_max``, ``ratio = exp(log_prob - old)``, the clipped surrogate, ``beta`` times the mean
    KL, and its logged ``approx_kl`` / ``clipfrac``s; the loss and its gradient against float64
    autograd. Some ratios fall outside ``1 ± clip_range`` and some advantages beyond the clamp."""
    n, clip_range, adv_clip_max = 64, 0.05, 2.0
    old = (_randn(n, seed=20) * 3).to(dtype)
    log_prob = (old.float() + _randn(n, seed=21) * 0.08).to(dtype)
    adv = (_randn(n, seed=22) * 2).to(dtype)
    kl = _randn(n, seed=23).abs().to(dtype)
    leaf = log_prob.clone().requires_grad_()
    loss, stats = grpo_loss(
        leaf, old, adv, clip_range=clip_range, adv_clip_max=adv_clip_max, kl=kl, kl_beta=kl_beta
    )
    leaf64 = log_prob.to(F64).requires_grad_()
    ref = _flow_grpo_step_loss_reference(leaf64, old, adv, clip_range, adv_clip_max, kl, kl_beta)
    assert loss.dtype == torch.float32
    assert_close(loss, ref.float(), rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    assert_close(leaf.grad, leaf64.grad.to(dtype), rtol=1e-3, atol=1e-6)

    ratio = torch.exp(log_prob.to(F64) - old.to(F64))
    assert 0 < stats["clipfrac"] < 1 and (adv.abs() > adv_clip_max).any()
    assert_close(stats["clipfrac"], ((ratio - 1).abs() > clip_range).float().mean())
    assert_close(stats["clipfrac_gt_one"], (ratio - 1 > clip_range).float().mean())
    assert_close(stats["clipfrac_lt_one"], (1 - ratio > clip_range).float().mean())
    assert_close(stats["approx_kl"], (0.5 * ((log_prob.to(F64) - old.to(F64)) ** 2).mean()).float())
    assert_close(stats["kl_loss"], kl.to(F64).mean().float())
    assert_close(
        stats["policy_loss"],
        _flow_grpo_step_loss_reference(log_prob, old, adv, clip_range, adv_clip_max, kl, 0).float(),
    )
    assert all(not s.requires_grad for s in stats.values())
    # the control: without the advantage clamp the loss differs
    unclamped = _flow_grpo_step_loss_reference(log_prob, old, adv, clip_range, 1e9, kl, kl_beta)
    assert not torch.allclose(loss.detach(), unclamped.float())


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (3, 4, 2, 4, 4)], ids=["image", "video"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sde_kl_matches_flow_grpo(shape, dtype):
    """flow_grpo ``scripts/train_sd3.py``, the KL term: ``((mean - ref_mean)**2).mean(dim=(1, 2, 3),
    keepdim=True) / (2 * std_dev_t**2)``, then its mean, with ``std_dev_t`` from
    ``sde_step_with_logprob`` (all non-batch dims for a video). It is the Gaussian KL of one step
    times ``|dt|``: checked against ``torch.distributions.kl_divergence`` of the two steps."""
    sigmas = _schedule()
    sigma, sigma_next = sigmas[torch.tensor([1, 4, 8])], sigmas[torch.tensor([2, 5, 9])]
    v, v_ref, x = (_randn(*shape, seed=s, dtype=dtype) for s in (30, 31, 32))
    _, _, mean, std = sde_step_with_logprob(v, sigma, sigma_next, x, noise_level=0.7, prev_sample=x)
    _, _, ref_mean, _ = sde_step_with_logprob(v_ref, sigma, sigma_next, x, noise_level=0.7, prev_sample=x)
    kl = sde_kl(mean, ref_mean, std)
    assert kl.shape == (3,) and kl.dtype == torch.float32
    d = mean.to(F64) - ref_mean.to(F64)
    expected = (d**2).flatten(1).sum(1) / d[0].numel() / (2 * std.to(F64).flatten() ** 2)
    assert_close(kl, expected.float())
    assert_close(sde_kl(mean, ref_mean, std.flatten()), kl)  # std as [B]

    step_std = _broadcast(std.to(F64).flatten() * torch.sqrt((sigma - sigma_next).to(F64)), len(shape))
    gaussian = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean.to(F64), step_std),
        torch.distributions.Normal(ref_mean.to(F64), step_std),
    )
    assert_close(
        kl, (gaussian.flatten(1).mean(1) * (sigma - sigma_next).to(F64)).float(), rtol=1e-4, atol=1e-6
    )


@pytest.mark.unit
def test_grpo_loss_and_sde_kl_stay_on_meta():
    """Meta bf16 inputs: meta loss, KL and stats, also without a KL."""
    log_prob = torch.empty(4, dtype=torch.bfloat16, device=META)
    mean = torch.empty(4, 3, 2, 4, 4, dtype=torch.bfloat16, device=META)
    kl = sde_kl(mean, torch.empty_like(mean), torch.empty(4, 1, 1, 1, 1, device=META))
    _on_meta(kl)
    for kwargs in ({"kl": kl, "kl_beta": 0.04}, {}):
        loss, stats = grpo_loss(
            log_prob, torch.empty_like(log_prob), log_prob, clip_range=1e-4, adv_clip_max=5, **kwargs
        )
        _on_meta(loss, *stats.values())


# ------------------------------------------------------------------------ nft_loss


@pytest.mark.unit
@pytest.mark.parametrize("beta", [1.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nft_loss_matches_diffusion_nft(beta, dtype):
    """NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``, the training loop: ``r`` from the clamped
    advantages, the implicit policies ``v+ = beta v + (1 - beta) v_old``, ``v- = (1 + beta) v_old -
    beta v``, each side's x0-prediction error divided by its own detached mean absolute error,
    ``adv_clip_max * mean(r L+ + (1 - r) L-) / beta`` plus ``train.beta`` times the mean squared
    distance to the reference velocity; the loss and its gradient against the float64 reference
    written in velocity terms. Latents in float32 and velocities in ``dtype``, as under the
    reference's autocast. The control: an undetached weight gives another gradient."""
    shape, adv_clip_max, kl_beta = (4, 4, 8, 8), 5.0, 1e-2
    x0, noise = _randn(*shape, seed=40), _randn(*shape, seed=41)
    t = torch.tensor([0.9, 0.6, 0.3, 0.05])
    x_t = (1 - _broadcast(t, 4)) * x0 + _broadcast(t, 4) * noise
    v_old = (noise - x0 + 0.3 * _randn(*shape, seed=42)).to(dtype)
    v_theta = (v_old.float() + 0.1 * _randn(*shape, seed=43)).to(dtype)
    v_ref = (v_old.float() + 0.1 * _randn(*shape, seed=44)).to(dtype)
    adv = torch.tensor([-7.0, -1.0, 0.5, 3.0])

    leaf = v_theta.clone().requires_grad_()
    old_leaf, ref_leaf = v_old.clone().requires_grad_(), v_ref.clone().requires_grad_()
    kwargs = {"beta": beta, "adv_clip_max": adv_clip_max}
    loss, stats = nft_loss(
        leaf, old_leaf, x_t, x0, t, adv, NftSettings(**kwargs, kl_beta=kl_beta), v_ref=ref_leaf
    )
    leaf64 = v_theta.to(F64).requires_grad_()
    ref = _nft_reference(leaf64, v_old, x0, noise, t, adv, beta, adv_clip_max, v_ref, kl_beta)
    assert loss.dtype == torch.float32
    assert_close(loss, ref.float(), rtol=2e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    assert leaf.grad.dtype == dtype
    assert old_leaf.grad is None and ref_leaf.grad is None  # the old and reference policies: no gradient
    tolerance = {} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-7}  # bf16: its defaults
    assert_close(leaf.grad, leaf64.grad.to(dtype), **tolerance)

    no_kl = _nft_reference(v_theta, v_old, x0, noise, t, adv, beta, adv_clip_max, None, 0.0)
    assert_close(stats["policy_loss"], no_kl.float(), rtol=2e-5, atol=1e-6)
    assert_close(stats["unweighted_policy_loss"], stats["policy_loss"] / adv_clip_max)
    assert_close(stats["kl_loss"], ((v_theta.to(F64) - v_ref.to(F64)) ** 2).mean().float())
    assert_close(stats["old_deviate"], ((v_theta.to(F64) - v_old.to(F64)) ** 2).mean().float())

    # the control: the reference with its weights inside the graph has another gradient
    undetached = v_theta.to(F64).requires_grad_()
    _nft_reference(
        undetached, v_old, x0, noise, t, adv, beta, adv_clip_max, v_ref, kl_beta, detach=False
    ).backward()
    assert not torch.allclose(leaf.grad.to(F64), undetached.grad, rtol=0.05)


@pytest.mark.unit
def test_nft_optimality_modes():
    """NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``: ``r = clamp(A_clip / adv_clip_max / 2 + 0.5,
    0, 1)`` after its ``adv_mode`` (all, positive_only, negative_only, one_only, binary)."""
    a = torch.tensor([-9.0, -2.0, 0.0, 1.0, 7.0], dtype=torch.bfloat16)
    m = 4.0
    clipped = a.to(F64).clamp(-m, m)
    modes = {
        "all": clipped,
        "positive_only": clipped.clamp(0, m),
        "negative_only": clipped.clamp(-m, 0),
        "one_only": (clipped > 0).to(F64),
        "binary": torch.sign(clipped),
    }
    for mode, mapped in modes.items():
        r = nft_optimality(a, adv_clip_max=m, adv_mode=mode)
        assert r.dtype == torch.float32
        assert_close(r, (mapped / m / 2 + 0.5).clamp(0, 1).float(), msg=mode)
    with pytest.raises(ValueError):
        nft_optimality(a, adv_clip_max=m, adv_mode="sometimes")


@pytest.mark.unit
def test_nft_loss_stays_on_meta():
    """Meta bf16 velocities and latents, per-sample and scalar sigma: a meta loss and meta stats."""
    v = torch.empty(2, 4, 3, 8, 8, dtype=torch.bfloat16, device=META)
    adv = torch.empty(2, device=META)
    for sigma in (torch.empty(2, device=META), 0.5):
        settings = NftSettings(beta=1.0, adv_clip_max=5.0, kl_beta=1e-4)
        loss, stats = nft_loss(v, v, v, v, sigma, adv, settings, v_ref=v)
        _on_meta(loss, *stats.values())
        assert loss.dtype == torch.float32
