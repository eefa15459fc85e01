"""One round of ``recipes.grpo.GRPOTrainer`` on 2 real ranks, checked quantity by quantity through
the trainer's own code path (``sample_round``, ``score_round``, ``_loss``, ``_prepare_nft``):

* each real sample's advantage is its reward against the mean and (population) standard
  deviation of its *prompt's* rewards over *every* rank's samples (the 9 samples of 3 prompts x 3
  are cut 5 + 4, so groups straddle the ranks: a rank-local normalisation or a grouping by member
  index gives other numbers);
* before any update, each trained step's loss sees the sampled trajectory's log-probability as the
  old one (the policy ratio is 1, ``approx_kl`` 0) and equals ``-mean(advantage)`` over the
  micro-batch's real samples (a sign flipped in the loss shows);
* DiffusionNFT's training point of trained step ``i`` is ``(1 - sigma_i) * x0 + sigma_i * noise``
  with ``sigma_i`` the schedule the round was sampled on (clamped to 0.999) and the noise of
  ``nft_noise_generator``.

* with several optimizer steps a round (2 micro-batches a rank), each sample's change over the
  round follows its advantage: of its log-probability of its trained steps (grpo; correlation 0.96
  measured) and of its x0 error at its training points (nft with DiffusionNFT's 2-step beta 0.1,
  from the same start and fresh Adam moments; 0.70; -0.70 with the advantages negated in its loss).

The direction of a whole run (a reward and its negation both rise) is checked end to end in
tests/test_train_grpo.py (``test_both_objectives_raise_a_reward_and_its_negation``).
"""

from __future__ import annotations

import pytest

from diffusers_zero3 import testing
from tests.distributed_harness import run_on_ranks

REDNESS = "diffusers_zero3.demo.rewards:redness"
ZERO3_ENV = {**testing.ZERO3_ENV, "ACCELERATE_MIXED_PRECISION": "no"}


def _expected_advantages(rewards: list[float], prompts: list[int], eps: float = 1e-4) -> list[float]:
    """Flow-GRPO's per-prompt advantage of every sample with its configs' ``global_std``:
    ``(r - mean of its prompt's rewards) / (std of every reward + eps)``, population standard
    deviation, in float64 (``PerPromptStatTracker.update``)."""
    import statistics

    by_prompt: dict[int, list[float]] = {}
    for r, p in zip(rewards, prompts):
        by_prompt.setdefault(p, []).append(r)
    means = {p: statistics.fmean(v) for p, v in by_prompt.items()}
    std = statistics.pstdev(rewards)
    return [(r - means[p]) / (std + eps) for r, p in zip(rewards, prompts)]


def _one_round(pipe_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from diffusers_zero3.recipes.grpo import (
        GRPOSettings,
        GRPOTrainer,
        nft_noise_generator,
        timestep_generator,
    )
    from diffusers_zero3.rl import trained_timestep_indices

    settings = GRPOSettings.parse([
        "--pretrained_model_name_or_path", pipe_dir, "--reward", REDNESS, "--output_dir", out,
        "--prompts", "a red circle", "a blue square", "a green circle", "--group_size", "3",
        "--resolution", "32", "--num_inference_steps", "3", "--timestep_fraction", "0.67",
        "--sample_batch_size", "3", "--train_batch_size", "3", "--report_to", "none", "--seed", "3",
    ])  # fmt: skip
    trainer = GRPOTrainer(settings)
    trainer.setup()
    rank = dist.get_rank()

    # the rewards the trainer's own reward call returns, sample by sample (dummies included)
    totals: list[torch.Tensor] = []
    score = trainer.reward_fn

    def recorded(images, prompts, metadata=None):
        total, each = score(images, prompts, metadata=metadata)
        totals.append(total.detach().double().cpu())
        return total, each

    trainer.reward_fn = recorded
    batch = trainer.sample_round(0)
    trainer.score_round(batch)

    # --- advantages: every rank's real samples, grouped by prompt
    real = batch.real.cpu()
    scored = zip(batch.pairs, torch.cat(totals).tolist(), real.tolist())
    mine = [(p, m, r) for (p, m), r, keep in scored if keep]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    samples = [s for share in everyone for s in share]
    assert sorted((p, m) for p, m, _ in samples) == [(p, m) for p in range(3) for m in range(3)], samples
    owners = {p: {r for r, share in enumerate(everyone) for q, _, _ in share if q == p} for p in range(3)}
    assert any(len(ranks) == 2 for ranks in owners.values()), owners  # a group straddles the ranks
    rewards = [r for _, _, r in samples]
    # within a group the rewards differ (else every advantage is 0 and the check is empty)
    assert len({round(r, 9) for r in rewards}) == len(rewards), rewards
    expected_all = _expected_advantages(rewards, [p for p, _, _ in samples])
    start = sum(len(share) for share in everyone[:rank])
    expected = torch.tensor(expected_all[start : start + len(mine)], dtype=torch.float64)
    got = batch.advantages.cpu().double()
    torch.testing.assert_close(got[real], expected, rtol=1e-5, atol=1e-5)
    assert (got[~real] == 0).all(), got

    # --- before any update: the old log-probability is the sampled step's (ratio 1), and the
    # loss of each micro-batch and trained step is -mean(advantage) over its real samples
    full = torch.zeros(len(batch.pairs), dtype=torch.float64)
    full[real] = expected
    batch.steps = trainer._trained_steps(batch)
    assert batch.steps[0].tolist() == [[0, 1]] * len(batch.pairs)  # grpo: the first steps, in order
    for start in range(0, len(batch.pairs), settings.train_batch_size):
        rows = slice(start, min(len(batch.pairs), start + settings.train_batch_size))
        n, keep = rows.stop - rows.start, real[rows]
        for i in range(settings.train_timesteps):
            with torch.no_grad():
                loss, stats = trainer._loss(batch, 0, i, rows)
            if not keep.any():
                continue
            assert stats["approx_kl"].item() < 1e-8 and stats["clipfrac"].item() == 0, (rank, rows, i, stats)
            clip = settings.adv_clip_max
            want = (-full[rows][keep].clamp(-clip, clip).mean() * keep.sum() / n).item()
            assert loss.item() == pytest.approx(want, abs=1e-4), (rank, rows, i, loss.item(), want)

    # --- DiffusionNFT's noised points against the schedule the round was sampled on, each
    # sample at its own random subset of 2 of the 3 steps (DiffusionNFT's per-sample randperm)
    settings.timestep_subset = "random"
    batch.steps = trainer._trained_steps(batch)
    for (p, m), steps in zip(batch.pairs, batch.steps[0].tolist()):  # each sample's own draw
        assert (
            steps
            == trained_timestep_indices(
                3, 2, "random", timestep_generator(settings.seed, 0, p, m, 0)
            ).tolist()
        )
    trainer._prepare_nft(batch)
    sigmas = trainer.scheduler.sigmas.float()
    x0 = batch.latents[:, -1].cpu()
    for k in range(settings.train_timesteps):
        index = batch.steps[0, :, k].cpu()
        sigma = sigmas[index].clamp(max=0.999).view(-1, *[1] * (x0.ndim - 1))
        noise = torch.cat([
            torch.randn(1, *x0.shape[1:], generator=nft_noise_generator(settings.seed, 0, p, m, i))
            for (p, m), i in zip(batch.pairs, index.tolist())
        ])  # fmt: skip
        x_t = batch.nft_points[0][k][0].cpu()
        torch.testing.assert_close(x_t, (1 - sigma) * x0 + sigma * noise, rtol=1e-6, atol=1e-6)
    print(f"rank {rank}: {len(mine)} real samples, advantages {[round(a, 3) for a in expected.tolist()]}")

    # --- several optimizer steps a round move the policy the advantages' way: each rank's 5 rows
    # are 2 micro-batches, 2 steps; afterwards (every rank's real samples) the change of each
    # sample's log-probability of its trained steps (grpo), and of its x0 error at its training
    # points (nft, from the same start), follows its advantage
    import copy

    from diffusers_zero3.rl import sde_step_with_logprob

    def gathered_correlation(values: torch.Tensor) -> float:
        pairs = torch.stack(
            [batch.advantages[batch.real].double().cpu(), values[batch.real.cpu()].double()], 1
        )
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, pairs)
        return torch.corrcoef(torch.cat(everyone).T)[0, 1].item()

    @torch.no_grad()
    def log_probs() -> torch.Tensor:  # [P]: the sum over the trained steps
        total = torch.zeros(len(batch.pairs), dtype=torch.float64)
        for k in range(settings.train_timesteps):
            i = batch.steps[0, :, k]
            at = torch.arange(len(i))
            x, sig = batch.latents[at, i], batch.sigmas[i]
            v = trainer._velocity(trainer.engine, x, sig, batch, slice(0, len(i)), train=True)
            _, lp, _, _ = sde_step_with_logprob(
                v,
                sig,
                batch.sigmas[i + 1],
                x,
                noise_level=settings.noise_level,
                prev_sample=batch.latents[at, i + 1],
            )
            total += lp.double().cpu()
        return total

    @torch.no_grad()
    def x0_errors(points) -> torch.Tensor:  # [P]: the sum over the training points
        total = torch.zeros(len(batch.pairs), dtype=torch.float64)
        for x_t, _, sig in points:
            v = trainer._velocity(trainer.engine, x_t, sig, batch, slice(0, len(sig)), train=True)
            x0_hat = x_t - sig.view(-1, *[1] * (x_t.ndim - 1)) * v
            total += (x0_hat - batch.latents[:, -1]).pow(2).mean(dim=(1, 2, 3)).double().cpu()
        return total

    from deepspeed.utils import safe_set_local_fp32_param

    from diffusers_zero3.state.ema import ShardedEMA

    start_weights = ShardedEMA(trainer.engine)  # a copy of every fp32 master partition
    settings.timestep_subset = "first"
    batch.steps = trainer._trained_steps(batch)
    before = log_probs()
    steps_before = trainer._optimizer_steps()
    trainer.train_round(batch)
    assert trainer._optimizer_steps() - steps_before == 2  # 2 micro-batches, a step each
    grpo_corr = gathered_correlation(log_probs() - before)
    # DiffusionNFT from the same weights (and Adam's moments restarted) on the same round
    start_weights.copy_to()  # the live partitions (and whole parameters), then the masters
    trained = [p for p in trainer.part.module.parameters() if p.requires_grad]
    for p, w in zip(trained, start_weights.shadow):
        safe_set_local_fp32_param(p, w)
    trainer.engine.optimizer.optimizer.state.clear()  # Adam's moments: GRPO's would steer the first steps
    settings.objective, settings.nft_beta = "nft", 0.1  # beta 0.1: DiffusionNFT's 2-step config
    settings.timestep_subset = "random"
    batch.steps = trainer._trained_steps(batch)
    trainer._prepare_nft(batch)
    points = copy.copy(batch.nft_points[0])
    before = x0_errors(points)
    trainer.train_round(batch)
    nft_corr = gathered_correlation(before - x0_errors(points))
    print(
        f"rank {rank}: correlation of the advantage with the change: grpo {grpo_corr:.3f}, nft {nft_corr:.3f}"
    )
    assert grpo_corr > 0.5 and nft_corr > 0.5, (grpo_corr, nft_corr)

    # --- a round with a 1-step SDE window in [0, 2), CPS steps and each group's shared initial
    # noise: the members of a prompt follow one deterministic path up to the window and part in
    # it; the window's step is the trained one, and before any update its CPS log-probability is
    # the sampled one (ratio 1)
    from diffusers_zero3.recipes.grpo import round_window

    settings.objective, settings.timestep_subset, settings.sampler = "grpo", "first", "cps"
    settings.sde_window_size, settings.sde_window_range, settings.same_noise_per_group = 1, [0, 2], True
    windowed = trainer.sample_round(1)
    start, end = windowed.window
    assert (start, end) == round_window(settings.seed, 1, 1, (0, 2)) and end == start + 1
    members: dict[int, list[int]] = {}
    for row, ((p, _), keep) in enumerate(zip(windowed.pairs, windowed.real.tolist())):
        if keep:
            members.setdefault(p, []).append(row)
    shared = [rows for rows in members.values() if len(rows) > 1]
    assert shared, members  # 5 samples of 3 prompts on a rank: one prompt has two
    for a, b in shared:
        assert torch.equal(windowed.latents[a, : start + 1], windowed.latents[b, : start + 1]), start
        assert not torch.allclose(windowed.latents[a, start + 1], windowed.latents[b, start + 1])
    trainer.score_round(windowed)
    windowed.steps = trainer._trained_steps(windowed)
    assert windowed.steps.unique().tolist() == [start]
    for first in range(0, len(windowed.pairs), settings.train_batch_size):
        rows = slice(first, min(len(windowed.pairs), first + settings.train_batch_size))
        with torch.no_grad():
            _, stats = trainer._loss(windowed, 0, 0, rows)
        assert not stats or stats["approx_kl"].item() < 1e-10, stats


@pytest.mark.multirank
def test_one_round_advantages_old_log_probs_and_nft_points(tiny_sd3, tmp_path):
    """The session's tiny SD3 (conftest: ``(pipeline, dataset)``), shared with other tests."""
    run_on_ranks(_one_round, pipe_dir=tiny_sd3[0], out=str(tmp_path / "out"), env=ZERO3_ENV, timeout=240)
