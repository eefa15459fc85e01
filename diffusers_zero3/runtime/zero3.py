"""ZeRO-3 detection, a ``zero.Init`` switch that really works, a safe ``GatheredParameters``,
and the leaf modules a mixture-of-experts block needs: read-only helpers (the levers that
change DeepSpeed's behaviour live in ``deepspeed_internals``).

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
    from .library_internals import accelerate_shared_state

    shared = accelerate_shared_state()
    if not shared:
        return None
    plugins = shared.get("deepspeed_plugins")
    if not plugins:
        return None
    state = sys.modules["accelerate.state"].AcceleratorState()
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
    from .deepspeed_internals.zero_init import set_transformers_zero3_config, transformers_zero3_config

    if transformers_zero3_config() is None:
        return False
    set_transformers_zero3_config(None)
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
    from .deepspeed_internals.zero_init import (
        paused_zero_init,
        set_transformers_zero3_config,
        transformers_zero3_config,
    )

    saved_ref = transformers_zero3_config()
    try:
        set_transformers_zero3_config(None)
        with paused_zero_init():
            yield
    finally:
        set_transformers_zero3_config(saved_ref)


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
        from .deepspeed_internals.reads import held_whole

        zero_params = [p for p in zero_params if not held_whole(p)]
    if not enabled or not zero_params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero_params, modifier_rank=modifier_rank, fwd_module=fwd_module)


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


_LEAF_INPUT_HOOK = "_diffusers_zero3_leaf_input_hook"


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
    frozen layers (LoRA). Such a leaf would be released only at the end of the backward (so
    gathered weights pile up through it), and where DeepSpeed reduces a leaf's gradients
    together (mixture-of-experts leaves) they would be reduced before they exist. This
    forward pre-hook, run before DeepSpeed's, passes named inputs by position and, where no
    floating-point input requires a gradient, a detached copy of the first one that does: its
    gradient (one more product at the leaf's first layer) is what DeepSpeed waits for. It does
    nothing without autograd or without trainable parameters in ``module``.
    """
    if getattr(module, _LEAF_INPUT_HOOK, None) is None:
        hook = functools.partial(_leaf_inputs_carry_a_gradient, inspect.signature(module.forward))
        handle = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
        setattr(module, _LEAF_INPUT_HOOK, handle)
