"""ZeRO-3 detection, a ``zero.Init`` switch that really works, and a safe ``GatheredParameters``.

None of this imports transformers or deepspeed at module import: they are looked up in
``sys.modules`` (state can only exist in a library that was imported) or imported inside the
functions that need them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

# Set by the package when it builds a ZeRO-3 engine itself (frozen models, partitioned load),
# so that ``is_zero3_enabled`` is true even without accelerate.
_package_zero3_engines = 0


def is_deepspeed_available() -> bool:
    """True when the ``deepspeed`` package can be imported (without importing it)."""
    return importlib.util.find_spec("deepspeed") is not None


def _register_zero3_engine() -> None:
    global _package_zero3_engines
    _package_zero3_engines += 1


def _accelerate_zero3_stage() -> int | None:
    """ZeRO stage of accelerate's active DeepSpeed plugin, or None when there is none."""
    state_mod = sys.modules.get("accelerate.state")
    if state_mod is None:
        return None
    shared = getattr(state_mod.AcceleratorState, "_shared_state", {})
    if not shared:
        return None
    plugins = shared.get("deepspeed_plugins")
    if not plugins:
        return None
    state = state_mod.AcceleratorState()
    plugin = state.deepspeed_plugin
    return None if plugin is None else int(plugin.zero_stage)


def _transformers_zero3() -> bool:
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    return bool(hf_ds is not None and hf_ds.is_deepspeed_zero3_enabled())


def is_zero3_enabled() -> bool:
    """Whether DeepSpeed ZeRO stage 3 is in force in this process.

    True when accelerate's active DeepSpeed plugin is at stage 3, when transformers has a
    ZeRO-3 ``HfDeepSpeedConfig`` registered, or when this package built a ZeRO-3 engine.
    Imports neither transformers nor deepspeed nor accelerate; False when they are absent.

    Example:
        >>> from diffusers_zero3 import is_zero3_enabled
        >>> is_zero3_enabled()  # a plain process
        False
    """
    stage = _accelerate_zero3_stage()
    if stage == 3:
        return True
    return _transformers_zero3() or _package_zero3_engines > 0


def unregister_transformers_zero3() -> bool:
    """Forget transformers' registered ZeRO-3 config (accelerate registers it when it builds a
    ZeRO-3 ``Accelerator``); return whether one was registered.

    While it is registered, *every* transformers ``from_pretrained`` partitions the model
    with collectives, so a load on rank 0 alone (a pipeline to look at a sample) waits
    forever for the other ranks. This package builds the models it wants partitioned itself
    (``load_pretrained_zero3``), so ``build_accelerator`` calls this once the accelerator
    exists. Not a collective.
    """
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    if hf_ds is None or getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None) is None:
        return False
    hf_ds._hf_deepspeed_config_weak_ref = None
    return True


def is_zero3_param(param: Any) -> bool:
    """True for a parameter partitioned by DeepSpeed ZeRO-3 (it carries a ``ds_id``)."""
    return hasattr(param, "ds_id")


def full_numel(param: Any) -> int:
    """A parameter's whole number of elements, also when ZeRO-3 has partitioned it (its data
    is then a 1-D placeholder or this rank's slice)."""
    return param.ds_numel if is_zero3_param(param) else param.numel()


@contextlib.contextmanager
def zero3_init_disabled() -> Iterator[None]:
    """Build and load models whole, even while ZeRO-3 is active.

    Under this context manager:

    * transformers' ``HfDeepSpeedConfig`` registration is hidden, so ``from_pretrained`` /
      ``from_config`` of a transformers model does not open ``deepspeed.zero.Init``. Since
      accelerate 1.0 ``set_deepspeed_weakref()`` registers it whatever
      ``zero3_init_context_manager(enable=False)`` says, which is why the upstream
      workaround leaves the CLIP text encoder partitioned (huggingface/accelerate#3170);
    * an enclosing ``deepspeed.zero.Init`` is paused (its module and tensor patches are
      removed), so modules constructed here keep ordinary parameters.

    Everything is restored on exit, also when the body raises. Nestable. A no-op where
    DeepSpeed and transformers were never imported. Does not import transformers.

    Example:
        >>> from diffusers_zero3 import zero3_init_disabled
        >>> with zero3_init_disabled():
        ...     text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder")
        ...     vae = AutoencoderKL.from_pretrained(path, subfolder="vae")
        >>> # both hold full weights on every rank; place them with prepare_frozen()
    """
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    saved_ref = hf_ds._hf_deepspeed_config_weak_ref if hf_ds is not None else None

    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    paused_init = None
    if (
        pp is not None
        and pp.top_level_context is not None
        and getattr(pp.top_level_context, "patched", False)
    ):
        paused_init = pp.top_level_context
    try:
        if hf_ds is not None:
            hf_ds._hf_deepspeed_config_weak_ref = None
        if paused_init is not None:
            paused_init.unpatch_init_and_builtins()
        yield
    finally:
        if paused_init is not None:
            paused_init.patch_init_and_builtins()
        if hf_ds is not None:
            hf_ds._hf_deepspeed_config_weak_ref = saved_ref


def _as_param_list(
    params: torch.nn.Module | torch.nn.Parameter | Iterable[torch.Tensor],
) -> list[torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


def gathered_parameters(
    params: torch.nn.Module | torch.nn.Parameter | Iterable[torch.Tensor],
    modifier_rank: int | None = None,
    enabled: bool = True,
    fwd_module: torch.nn.Module | None = None,
) -> contextlib.AbstractContextManager:
    """Gather ZeRO-3 partitioned parameters so they can be read (or written) whole.

    A thin wrapper around ``deepspeed.zero.GatheredParameters`` that accepts a module, a
    single parameter or any iterable of parameters; drops parameters that are not ZeRO-3
    parameters (and, for a read-only gather, those already whole, which DeepSpeed would
    otherwise release on exit); and is a plain ``nullcontext`` when nothing is partitioned (DeepSpeed
    missing, ZeRO-3 off, or ``enabled=False``). Collective when anything is gathered: call
    on every rank with the same parameters.

    Writes:
        With ``modifier_rank=None`` the gather is **read-only**: anything written to the
        parameters inside the block is discarded when it exits (the partitions are simply
        released). Pass ``modifier_rank=r`` to keep writes: on exit rank ``r``'s values are
        broadcast to every rank and re-partitioned. (DeepSpeed-Chat's and OpenRLHF's EMA
        lost their updates by writing under ``modifier_rank=None``.)

    Examples:
        Read a full weight on every rank::

            with gathered_parameters(unet.conv_in.weight):
                w = unet.conv_in.weight.detach().clone()

        Write on rank 0 and keep the change::

            with gathered_parameters(unet.conv_in, modifier_rank=0):
                if get_rank() == 0:
                    unet.conv_in.weight.zero_()

        Run a partitioned module's custom method outside of forward::

            with gathered_parameters(vae, fwd_module=vae):
                latents = vae.encode(pixels).latent_dist.sample()
    """
    zero_params = [p for p in _as_param_list(params) if is_zero3_param(p)]
    if modifier_rank is None:
        # Already whole (kept by the persistence threshold): reading needs no gather, and
        # DeepSpeed's exit would release them, undoing their persistence.
        zero_params = [p for p in zero_params if p.ds_status.name != "AVAILABLE"]
    if not enabled or not zero_params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero_params, modifier_rank=modifier_rank, fwd_module=fwd_module)


def zero3_optimizer(optimizer: Any) -> Any:
    """DeepSpeed's ZeRO-3 optimizer: ``optimizer`` itself (as ``deepspeed.initialize``
    returns it) or the one inside accelerate's wrapper; None for any other optimizer."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if candidate is not None and hasattr(candidate, "fp32_partitioned_groups_flat"):
            return candidate
    return None


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
    if zero is None or getattr(zero, "offload_optimizer", False):
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


def mixture_of_experts_blocks(model: torch.nn.Module) -> list[type]:
    """The classes of ``model``'s mixture-of-experts blocks: modules that hold their experts in
    a ``ModuleList`` named ``experts`` (HiDream's ``MOEFeedForwardSwiGLU``, Mixtral's and
    Qwen-MoE's sparse blocks, ...)."""
    found: list[type] = []
    for module in model.modules():
        if isinstance(getattr(module, "experts", None), torch.nn.ModuleList) and type(module) not in found:
            found.append(type(module))
    return found


def set_moe_leaf_modules(model: torch.nn.Module) -> list[str]:
    """Make every mixture-of-experts block of ``model`` a ZeRO-3 leaf module (gathered whole at
    its forward); returns the class names. Call before the model's engine is built.

    ZeRO-3 gathers a module's parameters when the module is called, in lockstep across ranks.
    An MoE block in eval mode calls only the experts that receive tokens (HiDream's
    ``moe_infer``), so two ranks with different data gather different experts; as the experts
    have equal shapes, the all-gathers pair up across experts and the outputs are silently
    wrong (no error, no hang). A leaf block gathers all its experts at once on every rank.
    DeepSpeed's own defaults (``zero_optimization.leaf_module``) list only Mixtral's and
    Qwen-MoE's blocks. Not a collective.

    Example:
        >>> set_moe_leaf_modules(transformer)            # a HiDream transformer
        ['MOEFeedForwardSwiGLU']
    """
    classes = mixture_of_experts_blocks(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        for leaf in set_z3_leaf_modules(model, classes):
            make_leaf_backward_wait_for_its_gradients(leaf)
    return [c.__name__ for c in classes]


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
    it out of the order they recorded, and in training a parameter is released before its
    gradient is accumulated (2 CPU ranks, SD 1.5- and SDXL-shaped UNets: "output with shape
    [0] doesn't match the broadcast shape [64, 64, 1, 0]"; the same with DeepSpeed's own
    ``stage3_module_granularity_threshold``), and so is one whose inputs are not annotated
    (a UNet's time embedding: "The size of tensor a (0) must match the size of tensor b
    (128)" at the next forward): a block's inputs must be able to carry a gradient, so that
    its release after the backward comes from them. A forward without annotations is not a
    block.
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


_LEAF_INPUT_HOOK = "_diffusers_zero3_leaf_input_hook"
# set on the leaf modules ``set_block_leaf_modules`` makes (not on mixture-of-experts leaves)
BLOCK_LEAF = "_diffusers_zero3_block_leaf"


def _leaf_inputs_carry_a_gradient(
    signature: inspect.Signature, module: torch.nn.Module, args: tuple, kwargs: dict
):
    """Forward pre-hook of a leaf module (``make_leaf_backward_wait_for_its_gradients``);
    ``signature`` is its forward's, read once."""
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in module.parameters()):
        return None
    if kwargs:  # hooks see positional inputs only: bind the named ones to their positions
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None  # the forward would raise the same error itself
        args, kwargs = bound.args, bound.kwargs
    floating = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if floating and not any(args[i].requires_grad for i in floating):
        i = floating[0]
        args = (*args[:i], args[i].detach().requires_grad_(True), *args[i + 1 :])
    return args, kwargs


def make_leaf_backward_wait_for_its_gradients(module: torch.nn.Module) -> None:
    """Make DeepSpeed's work after the backward of the ZeRO-3 leaf ``module`` (releasing its
    gathered parameters; for a mixture-of-experts leaf, reducing its gradients) wait for its
    gradients. Idempotent; not a collective.

    DeepSpeed starts both from the leaf's positional inputs: the release once their gradients
    are computed, the reduction in a full backward hook, which PyTorch runs as soon as the
    gradient of the leaf's output arrives when none of them requires a gradient, before the
    leaf's own backward. That is the case of a leaf called with its inputs by name (a
    transformer's attention modules, ``attn(hidden_states=...)``) and of the first block after
    frozen layers (LoRA). Such a leaf was released only at the end of the backward (LoRA on a
    Flux transformer, 2 CPU ranks: 146,784 elements held gathered during the backward against
    51,264 with this hook and 54,976 without leaves), and where DeepSpeed reduces a leaf's
    gradients together (mixture-of-experts leaves; blocks did before
    ``reduce_block_gradients_per_parameter``) they were reduced before they existed (LoRA on
    an SD 1.5-shaped UNet: "The size of tensor a (0) must match the size of tensor b (4)"). This
    forward pre-hook, run before DeepSpeed's, passes named inputs by position and, where no
    floating-point input requires a gradient, a detached copy of the first one that does: its
    gradient (one more product at the leaf's first layer) is what DeepSpeed waits for. It does
    nothing without autograd or without trainable parameters in ``module``.
    """
    if getattr(module, _LEAF_INPUT_HOOK, None) is None:
        hook = functools.partial(_leaf_inputs_carry_a_gradient, inspect.signature(module.forward))
        handle = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
        setattr(module, _LEAF_INPUT_HOOK, handle)


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
    per module: each fetch unit runs Python hooks and one collective at every call (an
    SDXL-shaped UNet: 1,049 hooked modules -> 130, a training step about 20 % shorter on 2 CPU
    ranks).

    Training with blocks as leaves is the same as without, to float rounding (2-rank tests: a
    full fine-tune against DeepSpeed's defaults; LoRA on a UNet, a trained CLIP text encoder
    and LoRA on a Flux transformer against the same without leaves), given two changes to how
    DeepSpeed treats a leaf, which crashed 23 end-to-end tests of this package without them:
    each block's gradients are reduced per parameter (``reduce_block_gradients_per_parameter``,
    run by ``trim_zero3_overhead``), and each block is released after its backward like a
    module (``make_leaf_backward_wait_for_its_gradients``).

    Modules already leaves (mixture-of-experts blocks, ``set_moe_leaf_modules``) stay as they
    are, inside a block or not. ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=leaves`` makes none. Not a
    collective: every rank decides alike from the shapes.
    """
    from deepspeed.utils import set_z3_leaf_module, z3_leaf_module

    from .ds_config import deepspeed_defaults, live_parameters, zero3_bucket_sizes

    if "leaves" in deepspeed_defaults():
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
    from .ds_config import deepspeed_defaults

    offload = _zero3_offload(engine)
    if offload is None or "hooks" in deepspeed_defaults():
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
    Nsight profile, and otherwise cost Python time at every hook (5 % of a ZeRO-3 step of a
    fine-grained UNet on CPU, measured)."""
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
    ``ds_config.persistence_threshold`` that is 522 collectives per step in an SD 1.5
    UNet (6 % of a ZeRO-3 step of a fine-grained UNet on CPU, measured). Call on every rank
    before the first step. ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS=coalesce`` keeps DeepSpeed's."""
    from .ds_config import deepspeed_defaults

    optimizer = zero3_optimizer(getattr(engine, "optimizer", None))
    persistent = getattr(optimizer, "persistent_parameters", None)
    if not persistent or "coalesce" in deepspeed_defaults():
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
    unreduced ("unknown parameter type" at the optimizer step, 2 CPU ranks). A block runs all
    its parameters on every rank, so it needs no such grouping; it stays one fetch unit.
    Mixture-of-experts leaves keep DeepSpeed's hook.
    """
    optimizer = getattr(engine, "optimizer", None)
    grouped = getattr(optimizer, "leaf_parameters", None)
    blocks = [module for module in grouped or {} if getattr(module, BLOCK_LEAF, False)]
    if not blocks:
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
    # collective per tensor (SD 1.5 shape 0.9 s, SDXL shape 2.3 s per engine on 2 CPU ranks)
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
    from .ds_config import deepspeed_defaults

    if _zero3_offload(engine) is None:
        return 0
    from .async_reduce import overlap_gradient_reduction

    set_nvtx_ranges("nvtx" in deepspeed_defaults())
    reduce_block_gradients_per_parameter(engine)
    gather_kept_whole_in_one_collective(engine)
    overlap_gradient_reduction(engine)
    return drop_idle_module_hooks(engine)
