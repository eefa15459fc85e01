"""Gradient reduce-scatters that overlap the backward on accelerators without streams (the CPU).

DeepSpeed's ZeRO-3 optimizer reduce-scatters each full bucket of gradients while the backward
waits: on a GPU the collective runs on its own stream (``overlap_comm``), but DeepSpeed's CPU
accelerator has none, so the call blocks (a large share of a CPU step's wall time:
docs/benchmarks.md, "ZeRO-3 per module"). DDP's reducer launches its
all-reduces asynchronously and goes on with the backward. ``overlap_gradient_reduction``
does the same for a ZeRO-3 optimizer: each bucket's reduce-scatter is started with
``async_op=True`` on a copy of the bucket, and finished (waited for and copied into the
gradient partitions, DeepSpeed's own ``partition_grads``) when the next bucket is started or
when the backward ends (DeepSpeed's ``independent_gradient_partition_epilogue``), so one
bucket is in flight at a time, as with DeepSpeed's own stream.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import lever_in_force
from .levers import zero3_optimizer

# name-mangled private of DeepSpeedZeroOptimizer_Stage3 (PRIVATE_NAMES, lever "overlap")
_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
_OVERLAPPED = "_diffusers_zero3_overlapped_reduction"


def _interleaved(grads: list[torch.Tensor], world: int) -> tuple[torch.Tensor, list[int]]:
    """One flat copy of ``grads`` laid out for a reduce-scatter: rank r's slice holds the
    r-th chunk of every gradient (each padded to ``ceil(numel / world)``), divided by
    ``world`` (DeepSpeed's pre-divide); with each gradient's chunk size."""
    chunks = [math.ceil(g.numel() / world) for g in grads]
    pieces = []
    for rank in range(world):
        for g, size in zip(grads, chunks):
            piece = g.view(-1)[rank * size : (rank + 1) * size]
            pieces.append(piece)
            if piece.numel() < size:
                pieces.append(torch.zeros(size - piece.numel(), dtype=g.dtype, device=g.device))
    flat = torch.cat(pieces)
    flat.div_(world)
    return flat, chunks


def overlap_gradient_reduction(engine_or_optimizer: Any) -> bool:
    """Make a ZeRO-3 optimizer start each gradient bucket's reduce-scatter asynchronously and
    finish it while the backward goes on (module docstring); returns whether it did. Only on
    an accelerator without streams (``resolves_data_dependency()``: the CPU); on a GPU
    DeepSpeed's ``overlap_comm`` stream does this already. Buckets it cannot take the same
    way (gradient post-scaling, expert-parallel averaging, ZenFlow, all-to-all reduction) go
    to DeepSpeed's own code. The same sums as DeepSpeed's: the collective, its input layout,
    its dtypes and the copy into the partitions are DeepSpeed's. Idempotent. Call on every
    rank right after the engine is built, before the first backward; not a collective.
    ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=overlap`` keeps DeepSpeed's blocking reduction."""
    from deepspeed import comm as ds_dist
    from deepspeed.accelerator import get_accelerator

    optimizer = zero3_optimizer(getattr(engine_or_optimizer, "optimizer", engine_or_optimizer))
    if optimizer is None or not lever_in_force("overlap") or not hasattr(optimizer, "ipg_buckets"):
        return False
    if getattr(optimizer, _OVERLAPPED, False):
        return True
    if not get_accelerator().resolves_data_dependency():
        return False
    own_reduce = getattr(optimizer, _REDUCE)
    own_epilogue = optimizer.independent_gradient_partition_epilogue
    in_flight: list[tuple[list, list[torch.Tensor], Any]] = []

    def finish() -> None:
        while in_flight:
            params, partitions, work = in_flight.pop()
            work.wait()
            accumulated = optimizer.gradient_accumulation_dtype
            partitions = [g.to(accumulated) for g in partitions]  # no copy where it is the same
            optimizer.partition_grads(params, partitions)

    def takes() -> bool:
        o = optimizer
        return (
            o.reduce_scatter
            and not (o.postscale_gradients and o.gradient_predivide_factor != 1.0)
            and not getattr(o, "zenflow", False)
            and getattr(o, "all2all_process_group", None) is None
            and getattr(o, "autoep_folding_tp_group", None) is None
        )

    @torch.no_grad()
    def reduce_and_partition(communication_data_type: torch.dtype) -> None:
        bucket = optimizer.ipg_buckets[communication_data_type]
        params = list(bucket.params)
        if not params:
            return
        finish()  # one bucket in flight, as DeepSpeed's stream: more were no faster
        group = optimizer._get_param_partition_group(params[0])
        world = ds_dist.get_world_size(group=group)
        if not takes() or optimizer._gradient_averaging_world_size(params, world) != world:
            return own_reduce(communication_data_type)
        optimizer._assert_same_partition_group(params)
        for p in params:
            if p.grad.numel() != p.ds_numel:
                raise RuntimeError(
                    f"{p.grad.numel()} != {p.ds_numel} Cannot reduce scatter gradients whose size is "
                    "not same as the params"
                )
        params.sort(key=lambda p: p.ds_id)
        flat, chunks = _interleaved([p.grad.to(communication_data_type) for p in params], world)
        mine = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
        work = torch.distributed.reduce_scatter_tensor(mine, flat, group=group, async_op=True)
        partitions, offset = [], 0
        for p, size in zip(params, chunks):
            partitions.append(mine.narrow(0, offset, p.partition_numel()))
            offset += size
        for p in params:  # the bucket buffer is reused by the next bucket: the copy is in flat
            p.grad = None
        bucket.params.clear()
        bucket.elements = 0
        bucket.process_group = None
        in_flight.append((params, partitions, work))

    def epilogue() -> None:
        own_epilogue()  # starts the last buckets through reduce_and_partition
        finish()

    setattr(optimizer, _REDUCE, reduce_and_partition)
    optimizer.independent_gradient_partition_epilogue = epilogue
    setattr(optimizer, _OVERLAPPED, True)
    return True
