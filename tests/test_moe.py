"""A sharded mixture-of-experts block in eval mode, on 2 ZeRO-3 ranks whose data routes to
different experts: HiDream's ``MOEFeedForwardSwiGLU`` calls only the experts that receive
tokens, so without leaf modules the ranks gather different experts, the all-gathers pair up
across experts of equal shape, and the outputs are silently wrong (no error, no hang)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_on_ranks

DIM = 8


def _moe_block() -> torch.nn.Module:
    """A tiny HiDream MoE block whose gate sends +v to experts 0 and 1, and -v to 2 and 3."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    torch.manual_seed(0)
    block = MOEFeedForwardSwiGLU(DIM, 16, num_routed_experts=4, num_activated_experts=2).eval()
    v = torch.ones(DIM)
    with torch.no_grad():
        block.gate.weight.copy_(torch.stack([v, 0.9 * v, -v, -0.9 * v]))
    return block


def _rank_input(rank: int) -> torch.Tensor:
    return (1.0 if rank == 0 else -1.0) * torch.ones(1, 3, DIM)


def worker_sharded_moe_matches_the_plain_block():
    import diffusers_zero3.placement.frozen as frozen
    from diffusers_zero3 import get_rank, prepare_frozen
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3()  # persistence threshold 0: every expert partitioned
    rank = get_rank()
    x = _rank_input(rank)
    with torch.no_grad():
        expected = _moe_block()(x)
        routed = _moe_block().gate(x)[0].unique().tolist()
    assert routed == ([0, 1] if rank == 0 else [2, 3])  # the ranks really route apart
    errors = {}
    # leaf modules first, then the positive control: the block as DeepSpeed handles it by default
    for leaf_modules in (True, False):
        if not leaf_modules:
            frozen.set_moe_leaf_modules = lambda model: []
        sharded = prepare_frozen(_moe_block(), "shard", accelerator=accelerator, name=f"moe-{leaf_modules}")
        with torch.no_grad():
            errors[leaf_modules] = (sharded(x) - expected).abs().max().item()
    print(
        f"rank {rank}: max |sharded - plain| = {errors[True]:.3e}, without leaf modules {errors[False]:.3e}"
    )
    assert errors[True] < 1e-6, errors
    assert errors[False] > 1e-3, (
        f"the unprotected block gave right outputs ({errors}): the test shows nothing"
    )


@pytest.mark.multirank
def test_sharded_moe_in_eval_mode_matches_the_unsharded_block_and_not_without_leaf_modules():
    """One launch: the sharded MoE block with its experts as one leaf module equals the plain
    block on ranks that route to different experts; without (the control) it does not."""
    run_on_ranks(worker_sharded_moe_matches_the_plain_block, timeout=180)


@pytest.mark.unit
def test_moe_blocks_are_found_by_their_experts():
    from diffusers_zero3.runtime.zero3 import mixture_of_experts_blocks

    model = torch.nn.Sequential(_moe_block(), torch.nn.Linear(DIM, DIM))
    assert [c.__name__ for c in mixture_of_experts_blocks(model)] == ["MOEFeedForwardSwiGLU"]
    assert mixture_of_experts_blocks(torch.nn.Linear(2, 2)) == []
