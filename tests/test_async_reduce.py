"""Gradient reduce-scatters that overlap the backward (``runtime.deepspeed_internals.async_reduce``): the backward
goes on while a bucket is reduced, and training is bit for bit DeepSpeed's own, in fp32 and
bf16."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_on_ranks


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3])
def test_the_interleaved_copy_reduces_to_each_ranks_partition_of_every_gradient(world):
    """The layout of DeepSpeed's reduce_scatter_coalesced, padding included: after the sum over
    ranks (what the reduce-scatter does), rank r's slice holds the r-th ceil(numel / world)
    chunk of each gradient's mean, zero-padded."""
    from diffusers_zero3.runtime.deepspeed_internals.async_reduce import _interleaved

    gen = torch.Generator().manual_seed(0)
    shapes = [(5,), (2, 3), (4,), (1,)]  # 5, 6, 4 and 1 elements: odd sizes are padded
    grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(world)]
    flats = []
    for rank_grads in grads:
        flat, chunks = _interleaved(rank_grads, world)
        flats.append(flat)
    assert chunks == [-(-torch.Size(s).numel() // world) for s in shapes]
    reduced = torch.stack(flats).sum(0).view(world, -1)
    for rank in range(world):
        offset = 0
        for index, size in enumerate(chunks):
            mean = torch.stack([g[index] for g in grads]).mean(0).flatten()
            expected = torch.zeros(size)
            part = mean[rank * size : (rank + 1) * size]
            expected[: part.numel()] = part
            torch.testing.assert_close(reduced[rank, offset : offset + size], expected)
            offset += size


def worker_overlapped_reduction_trains_like_blocking():
    import os

    import deepspeed
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.demo import tiny_component_configs
    from diffusers_zero3.runtime.deepspeed_internals.levers import trim_zero3_overhead
    from diffusers_zero3.runtime.ds_config import zero3_bucket_sizes
    from diffusers_zero3.runtime.zero3 import gathered_parameters, zero3_init_disabled
    from tests.common import zero3_config

    cfg_unet = tiny_component_configs(32, cross_dim=32, unet_shape="sd15")["unet"]
    with zero3_init_disabled():
        torch.manual_seed(0)
        first = UNet2DConditionModel(**cfg_unet)
        initial, sizes = first.state_dict(), zero3_bucket_sizes(first)
    gen = torch.Generator().manual_seed(1 + int(os.environ["RANK"]))
    batches = [
        (torch.randn(1, 4, 16, 16, generator=gen), torch.randn(1, 5, 32, generator=gen)) for _ in range(2)
    ]

    def train(defaults: str, dtype: torch.dtype):
        os.environ["DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS"] = defaults
        with zero3_init_disabled():
            unet = UNet2DConditionModel(**cfg_unet)
        unet.load_state_dict(initial)
        config = {
            **zero3_config(**sizes),
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": dtype == torch.bfloat16},
        }
        optimizer = torch.optim.SGD(unet.parameters(), lr=0.5)
        engine, *_ = deepspeed.initialize(model=unet, optimizer=optimizer, config=config)
        trim_zero3_overhead(engine)
        zero = engine.optimizer
        # gradient hooks that run while a bucket's reduce-scatter is in flight
        state = {"in_flight": 0, "hooks_during": 0, "started": 0}
        own_collective, own_hook = (
            torch.distributed.reduce_scatter_tensor,
            zero.reduce_ready_partitions_and_remove_grads,
        )

        def collective(output, input, *args, async_op=False, **kwargs):
            work = own_collective(output, input, *args, async_op=async_op, **kwargs)
            if not async_op:
                return work
            state["started"] += 1
            state["in_flight"] += 1

            class Waited:
                def wait(self):
                    state["in_flight"] -= 1
                    return work.wait()

            return Waited()

        def hook(param):
            state["hooks_during"] += bool(state["in_flight"])
            return own_hook(param)

        zero.reduce_ready_partitions_and_remove_grads = hook
        torch.distributed.reduce_scatter_tensor = collective
        losses = []
        try:
            for x, text in batches:
                out = engine(x.to(dtype), torch.tensor([10]), encoder_hidden_states=text.to(dtype)).sample
                loss = out.float().pow(2).mean()
                engine.backward(loss)
                assert state["in_flight"] == 0  # every bucket finished before the step
                engine.step()
                losses.append(loss.item())
        finally:
            torch.distributed.reduce_scatter_tensor = own_collective
        with gathered_parameters(list(engine.module.parameters())):
            weights = torch.cat([p.detach().float().flatten().clone() for p in engine.module.parameters()])
        engine.destroy()
        return losses, weights, state

    for dtype in (torch.float32, torch.bfloat16):
        overlapped = train("", dtype)
        blocking = train("overlap", dtype)
        # several buckets each step, the backward's gradient hooks running while they are reduced
        assert overlapped[2]["started"] >= 2 * 3, overlapped[2]
        assert overlapped[2]["hooks_during"] > 100, overlapped[2]
        assert blocking[2] == {"in_flight": 0, "hooks_during": 0, "started": 0}, blocking[2]
        # the same collective on the same layout: the same bits
        assert overlapped[0] == blocking[0], (overlapped[0], blocking[0])
        assert torch.equal(overlapped[1], blocking[1]), (overlapped[1] - blocking[1]).abs().max()
        print("OK overlap", dtype, overlapped[2], overlapped[0])


@pytest.mark.multirank
def test_overlapped_gradient_reduction_trains_bit_for_bit_like_deepspeeds_blocking_one():
    outs = run_on_ranks(worker_overlapped_reduction_trains_like_blocking)
    assert all("OK overlap torch.bfloat16" in o for o in outs)
