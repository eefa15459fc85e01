"""A sharded mixture-of-experts block in eval mode, on 2 ZeRO-3 ranks whose data routes to
different experts: HiDream's ``MOEFeedForwardSwiGLU`` calls only the experts that receive
tokens, so without leaf modules the ranks gather different experts, the all-gathers pair up
across experts of equal shape, and the outputs are silently wrong (no error, no hang).
NucleusMoE-Image's expert-choice MoE needs no leaf: every expert runs on every call."""

from __future__ import annotations

import math

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


def _nucleusmoe_transformer() -> torch.nn.Module:
    """A tiny NucleusMoE-Image transformer, both blocks a mixture of 4 experts, each taking the 4
    tokens (of 16) it scores highest (expert-choice routing), in eval mode."""
    from diffusers import NucleusMoEImageTransformer2DModel

    torch.manual_seed(0)
    model = NucleusMoEImageTransformer2DModel(
        in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=8, axes_dims_rope=(4, 2, 2), dense_moe_strategy="all_moe", num_experts=4,
        moe_intermediate_dim=16, capacity_factors=[1.0, 1.0],
    )  # fmt: skip
    with torch.no_grad():
        for block in model.transformer_blocks:  # the packed experts are torch.empty at __init__
            for weight in block.img_mlp.experts.parameters():
                weight.normal_(std=0.25)
    return model.eval()


def _nucleusmoe_chosen_tokens(model, inputs) -> list[list[list[int]]]:
    """The tokens each expert of each MoE block takes for ``inputs`` (the layer's own top-C of
    its softmax scores, read from its gate's output)."""
    chosen, handles = [], []
    for block in model.transformer_blocks:
        moe = block.img_mlp

        def record(module, args, logits, moe=moe):
            scores = torch.softmax(logits.float(), dim=-1).transpose(1, 2)  # (B, E, S)
            capacity = max(1, math.ceil(moe.capacity_factor * scores.shape[-1] / moe.num_experts))
            chosen.append(sorted(map(sorted, scores.topk(capacity, dim=-1).indices[0].tolist())))

        handles.append(moe.gate.register_forward_hook(record))
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    return chosen


def check_sharded_nucleusmoe_matches_the_plain_model(accelerator, rank: int) -> None:
    """NucleusMoE-Image's MoE on 2 ranks whose tokens route apart: the partitioned transformer
    equals the plain one, as placed by default and with every module its own fetch unit
    (no leaf modules at all). Expert-choice routing runs every expert on every call and the
    experts are two packed parameters of one module, so the gathers pair up whatever the data."""
    import os

    import torch.distributed as dist

    from diffusers_zero3 import prepare_frozen
    from diffusers_zero3.runtime.zero3 import mixture_of_experts_blocks

    g = torch.Generator().manual_seed(100 + rank)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(1, 4, 8, generator=g),
        timestep=torch.tensor([0.3 + 0.4 * rank]),
        img_shapes=[(1, 4, 4)],
        return_dict=False,
    )
    plain = _nucleusmoe_transformer()
    assert mixture_of_experts_blocks(plain) == []  # packed experts, no ModuleList: not made a leaf
    with torch.no_grad():
        expected = plain(**inputs)[0]
    chosen = _nucleusmoe_chosen_tokens(plain, inputs)
    both = [None, None]
    dist.all_gather_object(both, chosen)
    assert both[0] != both[1], both  # the positive control: the ranks' experts take different tokens
    errors = {}
    for variant, levers in (("default", ""), ("no leaves", "leaves")):
        os.environ["DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS"] = levers
        try:
            sharded = prepare_frozen(
                _nucleusmoe_transformer(), "shard", accelerator=accelerator, name=f"nmoe-{variant}"
            )
        finally:
            os.environ.pop("DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS")
        with torch.no_grad():
            errors[variant] = (sharded(**inputs)[0] - expected).abs().max().item()
    print(f"rank {rank}: NucleusMoE max |sharded - plain| = {errors}")
    assert all(e < 1e-6 for e in errors.values()), errors


def worker_sharded_moe_matches_the_plain_block():
    import diffusers_zero3.placement.frozen as frozen
    from diffusers_zero3 import get_rank, prepare_frozen
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3()  # persistence threshold 0: every expert partitioned
    rank = get_rank()
    check_sharded_nucleusmoe_matches_the_plain_model(accelerator, rank)
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
    block on ranks that route to different experts; without (the control) it does not. In the
    same launch, NucleusMoE-Image's expert-choice MoE, sharded without any leaf module, equals
    the plain transformer on ranks whose experts take different tokens."""
    run_on_ranks(worker_sharded_moe_matches_the_plain_block, timeout=180)


@pytest.mark.unit
def test_moe_blocks_are_found_by_their_experts():
    from diffusers_zero3.runtime.zero3 import mixture_of_experts_blocks

    model = torch.nn.Sequential(_moe_block(), torch.nn.Linear(DIM, DIM))
    assert [c.__name__ for c in mixture_of_experts_blocks(model)] == ["MOEFeedForwardSwiGLU"]
    assert mixture_of_experts_blocks(torch.nn.Linear(2, 2)) == []
