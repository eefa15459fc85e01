"""The per-module levers on a ZeRO-3 engine, each applied only where ``lever_in_force`` says
so (this package's ``__init__`` lists the DeepSpeed names each needs):

* ``set_block_leaf_modules`` ("leaves"): each block of a model one fetch unit, its gradients
  reduced per parameter (``reduce_block_gradients_per_parameter``);
* ``drop_idle_module_hooks`` ("hooks"): no ZeRO-3 hooks on modules that gather nothing;
* ``gather_kept_whole_in_one_collective`` ("coalesce") and ``all_gather_coalesced``;
* ``set_nvtx_ranges`` ("nvtx");
* ``share_fp32_master_weights`` ("share_fp32");
* ``trim_zero3_overhead``: all of them on a built engine, with ``async_reduce``'s overlap.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..ds_config import live_parameters, zero3_bucket_sizes
from ..zero3 import full_numel, make_leaf_backward_wait_for_its_gradients
from . import lever_in_force


def zero3_optimizer(optimizer: Any) -> Any:
    """DeepSpeed's ZeRO-3 optimizer: ``optimizer`` itself (as ``deepspeed.initialize``
    returns it) or the one inside accelerate's wrapper; None for any other optimizer."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if candidate is not None and hasattr(candidate, "fp32_partitioned_groups_flat"):
            return candidate
    return None


def zero3_optimizer_bytes(zero: Any) -> tuple[int, int, int]:
    """Bytes a ZeRO-3 optimizer holds on this rank beyond its state tensors: its flat buffer of
    gradient partitions, its fp32 master partitions where they are not the parameters' own
    storage (mixed precision), and its gradient reduce buckets. Not a collective."""

    def size(t: torch.Tensor | None) -> int:
        return t.numel() * t.element_size() if t is not None else 0

    grads = size(getattr(zero, "grad_partitions_flat_buffer", None))
    low = {t.untyped_storage().data_ptr() for t in zero.fp16_partitioned_groups_flat if t is not None}
    masters = sum(
        size(master)
        for master in zero.fp32_partitioned_groups_flat
        if master.numel() and master.untyped_storage().data_ptr() not in low
    )
    buckets = sum(size(getattr(b, "buffer", None)) for b in getattr(zero, "ipg_buckets", {}).values())
    return grads, masters, buckets


def share_fp32_master_weights(optimizer: Any) -> int:
    """Let a ZeRO-3 optimizer whose parameters are already fp32 update them in place instead
    of keeping a second fp32 copy of every partition; returns the bytes freed on this rank.

    DeepSpeed means to do this itself ("we don't need another copy of the weights", stage3.py)
    but compares ``tensor.device == "cpu"`` (a ``torch.device`` with a string: always False),
    so an fp32 run keeps ``4 x params / N`` bytes of duplicate master weights per rank. Here
    the master partition becomes a view of the parameter partition it copies (the optimizer
    state, keyed by the master tensor object, is untouched); the optimizer then writes the
    parameters directly, and its copy back to them is a copy onto itself. Mixed precision,
    optimizer offload and NVMe swapping keep their separate master weights (nothing to share).

    Call on every rank after ``accelerator.prepare`` (not a collective). A no-op for other
    optimizers.
    """
    zero = zero3_optimizer(optimizer)
    if zero is None or getattr(zero, "offload_optimizer", False) or not lever_in_force("share_fp32"):
        return 0
    freed = 0
    for low, master in zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat):
        if low is None or master.numel() == 0 or low.numel() != master.numel():
            continue
        if low.dtype != master.dtype or low.device != master.device:
            continue
        if low.untyped_storage().data_ptr() == master.untyped_storage().data_ptr():
            continue  # already shared (a DeepSpeed that compares devices correctly)
        if not torch.equal(low, master):
            continue  # not a fresh copy: leave it alone
        freed += master.numel() * master.element_size()
        master.data = low.data
    return freed


# The smallest block made a leaf: at least this many of its modules own parameters (a module
# that owns all of its parameters gains nothing from being a leaf).
MIN_BLOCK_MODULES = 2
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def takes_and_returns_tensors(module: torch.nn.Module) -> bool:
    """Whether ``module``'s ``forward`` is annotated to return one tensor and to take no tuple or
    list, its first input not integers: the blocks ZeRO-3 can gather as one unit
    (``set_block_leaf_modules``).

    DeepSpeed's backward hooks on a leaf that returns several tensors (a UNet down block: its
    output and its skip connections) or takes a tuple of them (an up block) fetch and release
    it out of the order they recorded, so that a parameter is released before its gradient is
    accumulated (as with DeepSpeed's own ``stage3_module_granularity_threshold``); the same
    for a leaf whose inputs cannot carry a gradient (a UNet's time embedding), as its release
    after the backward comes from them. A forward without annotations is not a block. (The
    errors each case gave are in docs/benchmarks.md, "ZeRO-3 per module".)
    """
    try:
        signature = inspect.signature(type(module).forward, eval_str=True)
    except (TypeError, ValueError, NameError, AttributeError, SyntaxError):  # annotations it cannot read
        return False
    returned = signature.return_annotation
    if not (isinstance(returned, type) and issubclass(returned, torch.Tensor)):
        return False
    named = [
        p
        for n, p in signature.parameters.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not named or any(word in str(named[0].annotation).lower() for word in ("longtensor", "inttensor")):
        return False  # its main input is integers (token ids): no gradient to release it by
    return all(
        p.annotation is not p.empty
        and "tuple" not in str(p.annotation).lower()
        and "list" not in str(p.annotation).lower()
        for p in named
    )


# set on the leaf modules ``set_block_leaf_modules`` makes (not on mixture-of-experts leaves)
BLOCK_LEAF = "_diffusers_zero3_block_leaf"


def set_block_leaf_modules(model: torch.nn.Module, max_elements: int | None = None) -> int:
    """Make each block of ``model`` a ZeRO-3 leaf module, gathered in one fetch with one set of
    hooks; returns the number of blocks. Call before the model's engine is built (the trained
    parts, ``training.parts.prepare_first_part`` and ``prepare_extra_part``, and
    ``prepare_frozen`` do).

    A block is an outermost module, other than the root and containers (``ModuleList``,
    ``Sequential``, ``ModuleDict``), whose forward takes and returns tensors
    (``takes_and_returns_tensors``) and that holds at most ``max_elements`` parameter elements
    (default: the model's live share, ``ds_config.live_parameters``, so that a block fits the
    window ZeRO-3 may hold gathered) in at least ``MIN_BLOCK_MODULES`` modules that own
    parameters: a text encoder's layers, a UNet's resnet and transformer blocks, the
    feed-forward and attention modules of a dual-stream transformer block. ZeRO-3's cost is
    per module: each fetch unit runs Python hooks and one collective at every call, and a
    UNet has about 8 times fewer blocks than modules.

    Training with blocks as leaves is the same as without, to float rounding (2-rank tests),
    given two changes to how DeepSpeed treats a leaf, without which it fails in training: each
    block's gradients are reduced per parameter (``reduce_block_gradients_per_parameter``,
    run by ``trim_zero3_overhead``), and each block is released after its backward like a
    module (``make_leaf_backward_wait_for_its_gradients``).

    Modules already leaves (mixture-of-experts blocks, ``set_moe_leaf_modules``) stay as they
    are, inside a block or not. ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=leaves`` makes none. Not a
    collective: every rank decides alike from the shapes.
    """
    from deepspeed.utils import set_z3_leaf_module, z3_leaf_module

    if not lever_in_force("leaves"):
        return 0
    if max_elements is None:
        total = sum(full_numel(p) for p in model.parameters())
        max_elements = live_parameters(total, zero3_bucket_sizes(model)["stage3_prefetch_bucket_size"])

    def owners(module: torch.nn.Module) -> int:
        return sum(1 for m in module.modules() if next(m.parameters(recurse=False), None) is not None)

    blocks = 0

    def visit(module: torch.nn.Module) -> None:
        nonlocal blocks
        for child in module.children():
            if z3_leaf_module(child):
                continue
            if (
                not isinstance(child, _CONTAINERS)
                and takes_and_returns_tensors(child)
                and owners(child) >= MIN_BLOCK_MODULES
                and sum(full_numel(p) for p in child.parameters()) <= max_elements
            ):
                set_z3_leaf_module(child, True)
                setattr(child, BLOCK_LEAF, True)
                make_leaf_backward_wait_for_its_gradients(child)
                blocks += 1
            else:
                visit(child)

    visit(model)
    return blocks


def inside_leaf_modules(model: torch.nn.Module) -> set[int]:
    """The ids of the modules of ``model`` inside a ZeRO-3 leaf module (not the leaves
    themselves): ZeRO-3 registers no hooks on them, as the leaf gathers their parameters."""
    from deepspeed.utils import z3_leaf_module

    inside: set[int] = set()
    for module in model.modules():
        if z3_leaf_module(module) and id(module) not in inside:
            inside.update(id(m) for m in module.modules() if m is not module)
    return inside


def _zero3_offload(engine: Any) -> Any:
    """The ``DeepSpeedZeRoOffload`` that holds a ZeRO-3 engine's module hooks (a training
    engine's optimizer owns it; an inference engine's "optimizer" is one)."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if hasattr(offload, "forward_hooks") and hasattr(offload, "backward_hooks") else None


def drop_idle_module_hooks(engine: Any) -> int:
    """Replace ZeRO-3's module hooks on the modules of ``engine`` that gather nothing: those
    whose own parameters are all kept whole (the persistence threshold) or that have none
    (containers, activations, dropout, attention wrappers); returns how many modules lost
    them. In an SD 1.5 UNet that is 544 of 709 modules at the default persistence.

    DeepSpeed gives every module four hooks (gather its own parameters before its forward
    and its backward, release them after) and wraps its outputs and inputs in two autograd
    functions; for a module that gathers nothing they only cost Python time, at every call.
    A module with parameters kept whole gets one light pre-forward hook instead, which
    gathers them if they are not whole (before their first use, or after a gather that
    partitioned them again). Gradients are not affected (per-parameter hooks reduce them).
    The root module, z3 leaf modules and modules with external parameters keep theirs.

    Call on every rank before the engine's first forward (DeepSpeed records the order of
    fetches on the first step). ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=hooks`` keeps them all.
    """
    offload = _zero3_offload(engine)
    if offload is None or not lever_in_force("hooks"):
        return 0
    from deepspeed.utils import z3_leaf_module

    root = offload.module
    in_leaves = inside_leaf_modules(root)  # gathered by their leaf's hooks
    idle = [
        module
        for module in root.modules()
        if module is not root
        and id(module) not in in_leaves
        and all(getattr(p, "ds_persist", False) for p in module.parameters(recurse=False))
        and not getattr(module, "_external_params", None)
        and not z3_leaf_module(module)
    ]
    dicts = {id(d) for m in idle for d in (m._forward_pre_hooks, m._forward_hooks)}
    for hooks in (offload.forward_hooks, offload.backward_hooks):
        kept = []
        for handle in hooks:
            target = handle.hooks_dict_ref()
            if target is not None and id(target) in dicts:
                handle.remove()
            else:
                kept.append(handle)
        hooks[:] = kept
    for module in idle:
        if next(module.parameters(recurse=False), None) is not None:
            offload.forward_hooks.append(module.register_forward_pre_hook(_gather_kept_whole))
    return len(idle)


def _gather_kept_whole(module: torch.nn.Module, *args: Any) -> None:
    # Collective when it gathers: every rank runs the same modules in the same order.
    all_gather_coalesced(list(module.parameters(recurse=False)))


def set_nvtx_ranges(enabled: bool) -> None:
    """Turn DeepSpeed's NVTX ranges (``deepspeed.utils.nvtx``: a push and a pop around each
    of its hooks and collectives) on or off for this process. They name the ranges in an
    Nsight profile, and otherwise cost Python time at every hook."""
    import deepspeed.utils.nvtx

    deepspeed.utils.nvtx.enable_nvtx = enabled


@torch.no_grad()
def all_gather_coalesced(params: list) -> None:
    """Gather the partitioned ZeRO-3 ``params`` whole, in one collective per dtype and
    process group (DeepSpeed's blocking ``param.all_gather(param_list)`` runs one per
    parameter). Each parameter gets a tensor of its own, as DeepSpeed gives it. Collective:
    every rank of the parameters' groups calls it with the same list. Parameters already
    whole or in flight are left alone; where a parameter is quantised or held on NVMe, the
    list goes to DeepSpeed's own gather instead."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    missing = [p for p in params if p.ds_status.name == "NOT_AVAILABLE"]
    if not missing:
        return
    if any(hasattr(p.ds_tensor, "ds_quant_scale") or getattr(p, "nvme_swapper", None) for p in missing):
        missing[0].all_gather(param_list=missing)
        return
    device = torch.device(get_accelerator().current_device_name())
    groups: dict[tuple, list] = {}
    for p in missing:
        groups.setdefault((p.ds_tensor.dtype, id(p.ds_process_group)), []).append(p)
    for (dtype, _), group_params in groups.items():
        group = group_params[0].ds_process_group
        world = dist.get_world_size(group=group)
        sizes = [p.ds_tensor.ds_numel for p in group_params]  # ceil(numel / world), padded
        local = torch.cat([p.ds_tensor.data.to(device).view(-1) for p in group_params])
        out = torch.empty(local.numel() * world, dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, local, group=group)
        by_rank = out.view(world, -1)  # row r: rank r's partitions of every parameter, in order
        offset = 0
        for p, size in zip(group_params, sizes):
            whole = by_rank[:, offset : offset + size].reshape(-1)  # a copy of its own
            p.data = whole.narrow(0, 0, p.ds_numel).view(p.ds_shape)
            p.ds_status = type(p.ds_status).AVAILABLE
            offset += size


def gather_kept_whole_in_one_collective(engine: Any) -> bool:
    """Make a trained ZeRO-3 ``engine`` gather its kept-whole (persistent) parameters after
    each optimizer step in one collective (``all_gather_coalesced``) instead of one per
    parameter; returns whether it did. DeepSpeed partitions every parameter for the step
    and then gathers the persistent ones back one by one: with the persistence share of
    ``ds_config.persistence_threshold`` that is hundreds of collectives per step in a UNet.
    Call on every rank
    before the first step. ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=coalesce`` keeps DeepSpeed's."""
    optimizer = zero3_optimizer(getattr(engine, "optimizer", None))
    persistent = getattr(optimizer, "persistent_parameters", None)
    if not persistent or not lever_in_force("coalesce"):
        return False
    first = persistent[0]
    own_gather = first.all_gather

    def all_gather(param_list=None, async_op=False, hierarchy=0):
        # the optimizer's post-step call; any other goes to DeepSpeed's own
        if param_list is persistent and not async_op and not hierarchy:
            return all_gather_coalesced(param_list)
        return own_gather(param_list=param_list, async_op=async_op, hierarchy=hierarchy)

    first.all_gather = all_gather
    return True


def reduce_block_gradients_per_parameter(engine: Any) -> int:
    """Give the parameters of ``engine``'s blocks (``set_block_leaf_modules``) DeepSpeed's
    per-parameter gradient hooks, the ones of every other module; returns the number of blocks.
    Call on every rank right after the engine is built (``trim_zero3_overhead`` does); not a
    collective. A no-op on an engine without blocks or without a ZeRO-3 optimizer.

    DeepSpeed reduces a leaf module's gradients together, in a full backward hook on the leaf,
    so that the experts of a mixture-of-experts block that got no tokens on one rank still
    take part, with zeros, in every rank's reduce-scatter. PyTorch skips that hook when the
    gradient reaches the leaf's output through a tensor captured before its backward hooks
    wrap it: transformers records ``output_hidden_states`` that way, and a trained text
    encoder whose penultimate layer feeds the loss (SDXL) kept that layer's gradients
    unreduced (DeepSpeed then fails at the optimizer step). A block runs all
    its parameters on every rank, so it needs no such grouping; it stays one fetch unit.
    Mixture-of-experts leaves keep DeepSpeed's hook.
    """
    optimizer = getattr(engine, "optimizer", None)
    grouped = getattr(optimizer, "leaf_parameters", None)
    blocks = [module for module in grouped or {} if getattr(module, BLOCK_LEAF, False)]
    if not blocks or not lever_in_force("leaves"):
        return 0
    for handle in optimizer._grad_acc_hooks + optimizer._leaf_module_hooks:
        handle.remove()
    optimizer._grad_acc_hooks, optimizer._leaf_module_hooks = [], []
    for module in blocks:
        for param in grouped[module]:
            del param.ds_z3_leaf_module
    # DeepSpeed's own, on the new grouping, without the gather and re-partition of each
    # parameter it starts with: the parameters are partitioned already, and on torch >= 2.1
    # its hooks are post-accumulate-grad hooks, which need no data; they would cost a
    # collective per tensor
    params = [p for group in optimizer.fp16_groups for p in group]
    kept = [(p.all_gather, p.partition) for p in params]
    for p in params:
        p.all_gather = p.partition = _nothing
    try:
        optimizer.create_reduce_and_remove_grad_hooks()
    finally:
        for p, (gather, partition) in zip(params, kept):
            p.all_gather, p.partition = gather, partition
    return len(blocks)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def trim_zero3_overhead(engine: Any) -> int:
    """The per-module levers on a ZeRO-3 ``engine`` (trained or frozen): its idle module
    hooks dropped (``drop_idle_module_hooks``), its kept-whole parameters gathered in one
    collective after each step (``gather_kept_whole_in_one_collective``), its gradient
    reduce-scatters overlapping the backward on the CPU
    (``async_reduce.overlap_gradient_reduction``) and DeepSpeed's NVTX ranges off, each unless
    ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS`` names it, and its blocks' gradients reduced per
    parameter (``reduce_block_gradients_per_parameter``); returns the number of modules whose
    hooks were dropped. Call on every rank right after
    ``deepspeed.initialize`` / ``accelerator.prepare``, before the first forward. A no-op on
    other engines."""
    if _zero3_offload(engine) is None:
        return 0
    from .async_reduce import overlap_gradient_reduction

    if lever_in_force("nvtx"):
        set_nvtx_ranges(False)
    reduce_block_gradients_per_parameter(engine)
    gather_kept_whole_in_one_collective(engine)
    overlap_gradient_reduction(engine)
    return drop_idle_module_hooks(engine)
