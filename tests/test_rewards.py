"""ParallelReward on 2 real ZeRO-3 ranks: uneven counts, lockstep check, modes, normalisation,
gradients."""

from __future__ import annotations

import pytest
import torch

from tests.common import rank_slice
from tests.distributed_harness import run_on_ranks

pytestmark = pytest.mark.multirank

PROMPTS = ["a red circle", "a blue square", "a red circle", "a green circle"]


def _images():
    g = torch.Generator().manual_seed(0)
    return torch.rand(4, 3, 16, 16, generator=g) * 2 - 1


def _redness(images, prompts=None):
    return (images[:, 0] - 0.5 * (images[:, 1] + images[:, 2])).mean(dim=(1, 2))


def worker_rewards(rm_dir: str, ref_path: str):
    from diffusers_zero3 import LockstepError, ParallelReward, zero3_init_disabled
    from diffusers_zero3.demo import RednessRewardModel
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    rank = accelerator.process_index
    ref = torch.load(ref_path)
    images, scores, grads = _images(), ref["scores"], ref["grads"]
    with zero3_init_disabled():
        model = RednessRewardModel.from_pretrained(rm_dir)
    reward = ParallelReward(model, accelerator=accelerator, placement="shard", micro_batch_size=1)
    assert reward.model.is_sharded

    # Uneven local counts, zero included: no hang, and the unsharded model's scores.
    for counts in ((3, 1), (0, 2), (1, 3)):
        sl = rank_slice(counts, rank)
        with reward.lockstep_check():
            out = reward(images[sl], PROMPTS[sl])
        assert out.shape == (counts[rank],)
        torch.testing.assert_close(out, scores[sl])

    # A naive loop with different call counts per rank is caught instead of hanging.
    with pytest.raises(LockstepError, match="'reward' called out of lockstep"):
        with reward.lockstep_check():
            for _ in range(2 if rank == 0 else 1):
                reward.model(images[:1])

    # main_process refuses a sharded model; equals all_ranks for a plain function.
    with pytest.raises(ValueError, match="would wait forever"):
        ParallelReward(reward.model, mode="main_process")
    counts = (3, 1)
    sl = rank_slice(counts, rank)
    fn_all = ParallelReward(_redness)(images[sl], PROMPTS[sl])
    fn_main = ParallelReward(_redness, mode="main_process")(images[sl], PROMPTS[sl])
    torch.testing.assert_close(fn_main, fn_all)
    torch.testing.assert_close(fn_all, _redness(images)[sl])
    # ...and for a replicated model, which rank 0 alone calls (no collective inside).
    with zero3_init_disabled():
        replica = RednessRewardModel.from_pretrained(rm_dir)
    main = ParallelReward(replica, placement="replicate", mode="main_process", micro_batch_size=2)
    torch.testing.assert_close(main(images[sl], PROMPTS[sl]), scores[sl])

    # Normalisation over every rank's samples equals the single-process computation.
    for mode in ("batch", "per_prompt", "reference"):
        normed = ParallelReward(reward.model, normalize=mode, micro_batch_size=2)
        extra = {"reference_images": images[sl].flip(-1)} if mode == "reference" else {}
        torch.testing.assert_close(normed(images[sl], PROMPTS[sl], **extra), ref[mode][sl], msg=mode)

    # Gradients w.r.t. the images equal the unsharded model's, with uneven counts.
    diff = ParallelReward(reward.model, differentiable=True, micro_batch_size=1)
    for counts in ((3, 1), (0, 2)):
        sl = rank_slice(counts, rank)
        x = images[sl].clone().requires_grad_(True)
        diff(x).sum().backward()  # every rank, the one with no samples too
        if counts[rank] == 0:  # connected to this rank's (empty) inputs, with no gradient in it
            assert x.grad is not None and x.grad.shape == x.shape
        else:
            torch.testing.assert_close(x.grad, grads[sl])

    # Zero samples on one rank below a *trainable* ZeRO-3 model, with the natural loss: every
    # rank's backward reaches the generator, whose gradient reduce needs all ranks.
    generator = torch.nn.Linear(8, 3 * 16 * 16)
    generator, optimizer = accelerator.prepare(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
    for counts in ((2, 0), (0, 3), (1, 1)):
        z = torch.randn(counts[rank], 8, generator=torch.Generator().manual_seed(rank))
        r = diff(torch.tanh(generator(z)).view(-1, 3, 16, 16))
        loss = -r.sum() / max(len(r), 1)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print("OK rewards")


def test_parallel_reward(tmp_path):
    from diffusers_zero3.demo import RednessRewardModel, save_reward_model

    rm_dir = save_reward_model(tmp_path / "rm", hidden=32, layers=2)
    model = RednessRewardModel.from_pretrained(rm_dir)
    images = _images().requires_grad_(True)
    scores = model(images)
    (grads,) = torch.autograd.grad(scores.sum(), images)
    scores = scores.detach()
    std = scores.std(correction=0)
    per_prompt = torch.empty_like(scores)
    for p in set(PROMPTS):
        idx = [i for i, q in enumerate(PROMPTS) if q == p]
        s = scores[idx]
        per_prompt[idx] = (s - s.mean()) / (s.std(correction=0) + 1e-8)
    with torch.no_grad():
        reference = scores - model(images.detach().flip(-1))
    ref = {
        "scores": scores,
        "grads": grads,
        "batch": (scores - scores.mean()) / (std + 1e-8),
        "per_prompt": per_prompt,
        "reference": reference,
    }
    torch.save(ref, tmp_path / "ref.pt")
    outs = run_on_ranks(worker_rewards, rm_dir=str(rm_dir), ref_path=str(tmp_path / "ref.pt"))
    assert all("OK rewards" in o for o in outs)
