"""Context parallelism (Ulysses, ring) for a denoiser trained under ZeRO-3.

The N ranks form groups of K that process the same samples and split each sample's token
sequence K ways (diffusers' context parallelism: each model's ``_cp_plan`` says which inputs
are split at which module and where the output is gathered; attention exchanges heads with an
all-to-all (Ulysses) or passes key/value chunks around (ring)). ZeRO-3 still partitions the
parameters, gradients and optimizer state over all N ranks.

Gradients: every rank of a group computes the whole loss (the output is gathered) and the
gradient of its own share of the tokens; the group's shares sum to the sample's gradient.
ZeRO-3 averages over all N ranks, which divides that sum by K too often: ``group_loss``
multiplies the loss by K before the backward so that training equals data parallelism over the
N / K groups on the same global batch (tests/test_context_parallel.py: losses and updated
weights of K=2 against K=1, Wan, Flux.1, Qwen-Image).

diffusers' ``ModelMixin.enable_parallelism`` builds its own mesh over the whole world and picks
the device as ``rank % torch.accelerator.device_count()``, which is 0 on a CPU host;
``enable_context_parallel`` does its steps with a mesh whose first dimension is the data-parallel
groups. The diffusers names it uses: ``ContextParallelConfig``, ``ParallelConfig`` and
``hooks.apply_context_parallel`` (documented), and through ``runtime.library_internals`` (its
table, with the versions they were verified on) a model's ``_cp_plan`` / ``_parallel_config``, an
attention processor's ``_parallel_config`` / ``_attention_backend``, ``ParallelConfig.setup`` and
``attention_dispatch._AttentionBackendRegistry`` (the active backend, and the backends that
honour a parallel config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .library_internals import (
    active_attention_backend,
    attach_parallel_config,
    attention_backend_of,
    context_parallel_backends,
    cp_plan_of,
    set_active_attention_backend,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

CONTEXT_PARALLEL_MODES = ("ulysses", "ring")


@dataclass(frozen=True)
class ContextParallel:
    """The context-parallel layout of the ranks.

    Attributes:
        size: K, the ranks that split one sample's sequence.
        mode: ``"ulysses"`` or ``"ring"``.
        mesh: the ``("dp", "ring", "ulysses")`` device mesh over every rank.
    """

    size: int
    mode: str
    mesh: DeviceMesh

    @property
    def data_parallel_size(self) -> int:
        """N / K: the groups that see different samples."""
        return self.mesh.size(0)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's group: ranks with the same one take the same samples."""
        return self.mesh.get_local_rank("dp")

    @property
    def group_rank(self) -> int:
        """This rank's place in its group (0 to K - 1): groups are consecutive ranks."""
        return self.mesh.get_local_rank("ring") * self.mesh.size(2) + self.mesh.get_local_rank("ulysses")

    def group_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backward: ``loss`` times K, since ZeRO-3's average over all N ranks
        divides each group's summed token shares by K too often (see the module docstring).
        Every trainer applies the factor here, and only here."""
        return loss * float(self.size)

    def split_loss(self, cond: dict, latents: torch.Tensor, loss_of: Callable[[dict], torch.Tensor]):
        """``loss_of(cond)`` with ``cond``'s masked texts padded to a multiple of K
        (``pad_text_to_multiple``); a sequence diffusers' sharder cannot split K ways becomes one
        ``ArgumentError`` line naming it (``split_failure``). Collective as ``loss_of`` is."""
        from ..errors import ArgumentError

        cond = pad_text_to_multiple(cond, self.size)
        try:
            return loss_of(cond)
        except AssertionError as e:  # diffusers' sharder, on a length it cannot split
            if SPLIT_FAILURE not in str(e):
                raise
            raise ArgumentError(split_failure(cond, latents, self.size)) from None


def check_context_parallel(
    size: int,
    mode: str,
    world_size: int,
    model: Any | None = None,
    *,
    trained: bool = True,
    dtype: torch.dtype | None = None,
) -> None:
    """Raise ``ValueError`` (one line) when ``size``/``mode`` cannot split ``model`` over
    ``world_size`` ranks: K not dividing the ranks, a model without a ``_cp_plan``, attention
    heads that Ulysses cannot split K ways, an attention backend that diffusers does not list
    as context-parallel (it would accept the split and ignore it: each rank attending within its
    own tokens, silently), ``sage`` on a ``trained`` model (diffusers has no backward for it),
    and for ring: a backend without the log-sum-exp it needs, weights of ``dtype`` fp32 (flash
    and cuDNN attention take bf16/fp16), or a model that reads an attention mask (ring hands
    each key/value chunk the whole mask). Not a collective."""
    if mode not in CONTEXT_PARALLEL_MODES:
        raise ValueError(
            f"context parallel mode must be one of {', '.join(CONTEXT_PARALLEL_MODES)}, got {mode!r}"
        )
    if size < 1 or world_size % size:
        raise ValueError(f"context parallel size {size} must divide the number of processes ({world_size})")
    if model is None or size == 1:
        return
    name = type(model).__name__
    plan = cp_plan_of(model)
    if plan is None:
        raise ValueError(
            f"{name} has no context-parallel plan (_cp_plan): train it with context parallel size 1"
        )
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if mode == "ulysses" and heads is not None and heads % size:
        raise ValueError(
            f"Ulysses context parallelism splits the attention heads: {name} has {heads}, not divisible by {size}"
        )
    backend = attention_backend_of(model) or "native"
    supported = context_parallel_backends()
    if backend not in supported:
        raise ValueError(
            f"{name} uses the attention backend {backend!r}, which diffusers does not split for context "
            f"parallelism (each rank would attend within its own tokens): choose one of {', '.join(supported)} "
            "(--attention_backend)"
        )
    if trained and backend.startswith("sage"):
        raise ValueError(
            f"the attention backend {backend!r} has no backward in diffusers: train {name} with another "
            "(--attention_backend)"
        )
    if mode == "ring":
        if backend == "native":
            raise ValueError(
                f"ring attention needs an attention backend that returns the log-sum-exp (flash, _native_cudnn,"
                f" sage); {name} uses native: choose one (--attention_backend, set_attention_backend())"
                " or use ulysses"
            )
        if dtype == torch.float32:
            raise ValueError(
                f"ring attention on {backend!r} takes bf16 or fp16: launch with bf16 "
                "(configs/accelerate_zero3_bf16.yaml, --mixed_precision bf16) or use ulysses"
            )
        masks = sorted(
            {k for inputs in plan.values() if isinstance(inputs, dict) for k in inputs if "mask" in str(k)}
        )
        if masks:
            raise ValueError(
                f"ring attention hands each key/value chunk the whole attention mask, and {name} reads "
                f"{', '.join(masks)}: use ulysses"
            )


def set_attention_backend(model: torch.nn.Module, backend: str) -> None:
    """``model.set_attention_backend(backend)`` (diffusers' registry names: ``flash``,
    ``_native_cudnn``, ``sage``, ...) for ``model``'s attention processors alone, a backend that
    cannot run here raised as one-line ``ValueError``. diffusers' method also makes it the
    process's active backend, which every other model without a backend of its own then runs
    (a VAE in fp32 on ``flash``, which takes bf16/fp16 only): the active one is restored. Not a
    collective."""
    active = active_attention_backend()
    try:
        model.set_attention_backend(backend)
    except (RuntimeError, ValueError, ImportError) as e:
        message = " ".join(str(e).split())
        raise ValueError(f"--attention_backend {backend}: {message}") from e
    finally:
        set_active_attention_backend(active)


def split_failure(cond: dict, latents: torch.Tensor, size: int) -> str:
    """What a batch's sequence that diffusers' sharder could not split ``size`` ways (its
    ``SPLIT_FAILURE`` assertion) was: a text stream (``cond``'s 3-D tensors) or the image
    tokens of ``latents``, as one line that names the shape flags."""
    counts = {f"this batch's {k} ({tuple(v.shape)})": v.shape[1] for k, v in cond.items() if v.dim() == 3}
    try:
        check_token_counts(counts, size)
    except ValueError as e:
        return str(e)
    return (
        f"context parallelism cannot split this batch's image tokens (latents {tuple(latents.shape)}) {size} ways: "
        "choose a shape (--resolution, --height/--width, buckets) that gives a multiple"
    )


def context_parallel_of_flags(size: int, mode: str, accelerator) -> ContextParallel | None:
    """``--context_parallel_size`` / ``--context_parallel_mode`` for a trainer: the groups
    (``context_parallel``; None for 1), one ``ArgumentError`` line for what cannot be split or
    a launch without DeepSpeed. Collective (it creates the groups' process groups)."""
    from ..errors import ArgumentError

    if size == 1:
        return None
    try:
        check_context_parallel(size, mode, accelerator.num_processes)
    except ValueError as e:
        raise ArgumentError(str(e)) from e
    if accelerator.state.deepspeed_plugin is None:
        raise ArgumentError("--context_parallel_size needs DeepSpeed: launch with a ZeRO-3 accelerate config")
    return context_parallel(size, mode, accelerator.device.type)


def context_parallel(
    size: int, mode: str = "ulysses", device_type: str | None = None
) -> ContextParallel | None:
    """The ranks grouped K = ``size`` at a time (consecutive ranks: one machine's, where the
    all-to-alls are cheap); None for ``size`` 1.

    Collective: call on every rank (it creates the groups' process groups).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size() if dist.is_initialized() else 1
    check_context_parallel(size, mode, world)
    if size == 1:
        return None
    ring, ulysses = (size, 1) if mode == "ring" else (1, size)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(
        device_type, (world // size, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses")
    )
    return ContextParallel(size=size, mode=mode, mesh=mesh)


def enable_context_parallel(
    model: torch.nn.Module,
    cp: ContextParallel,
    device: torch.device,
    *,
    trained: bool = True,
    dtype: torch.dtype | None = None,
) -> None:
    """Split ``model``'s sequence over ``cp``'s groups, as its ``_cp_plan`` says: what
    ``enable_parallelism`` does, on this package's mesh and ``device`` (the rank's). Call it
    before ``deepspeed.initialize`` (or on the engine's module); the model must then be called
    with ``return_dict=False`` (the plan's hooks take tensors). ``check_context_parallel`` first,
    with ``trained`` and the ``dtype`` its attention computes in. Not a collective itself, but
    every forward of the model is one within the group.
    """
    import torch.distributed as dist
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.hooks import apply_context_parallel

    check_context_parallel(cp.size, cp.mode, dist.get_world_size(), model, trained=trained, dtype=dtype)
    ring, ulysses = (cp.size, 1) if cp.mode == "ring" else (1, cp.size)
    cp_config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=cp.mesh)
    config = ParallelConfig(context_parallel_config=cp_config)
    attach_parallel_config(model, config, dist.get_rank(), dist.get_world_size(), device, cp.mesh)
    apply_context_parallel(model, cp_config, cp_plan_of(model))


# the text masks a denoiser reads beside its text: positions masked there attend to nothing and
# are attended by nothing, so padding the text with masked positions leaves the output as it was
TEXT_MASK_KEYS = {"encoder_hidden_states": "encoder_hidden_states_mask"}
SPLIT_FAILURE = "must be divisible by mesh size"  # diffusers' sharder, when a length is not


def pad_text_to_multiple(cond: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """``cond`` with each masked text sequence (``TEXT_MASK_KEYS``: Qwen-Image's, trimmed to the
    batch's longest caption) padded along dim 1 to a multiple of ``size`` with zeros, masked out
    (the denoiser's output is unchanged); everything else as given. Not a collective."""
    out = dict(cond)
    for text, mask in TEXT_MASK_KEYS.items():
        if text in cond and mask in cond and cond[text].shape[1] % size:
            extra = size - cond[text].shape[1] % size
            out[text] = torch.nn.functional.pad(cond[text], (0, 0, 0, extra))
            out[mask] = torch.nn.functional.pad(cond[mask], (0, extra))
    return out


def check_token_counts(counts: dict[str, int], size: int) -> None:
    """Raise ``ValueError`` (one line) naming the first of ``counts`` (``{what: tokens}``) that
    context parallelism cannot split ``size`` ways. Not a collective."""
    for what, tokens in counts.items():
        if tokens % size:
            raise ValueError(
                f"context parallelism splits each sequence {size} ways, but {what} has {tokens} tokens, "
                f"not a multiple of {size}: choose a shape (--resolution, --height/--width, buckets, "
                "--max_sequence_length) that gives a multiple"
            )


def group_loader(loader: torch.utils.data.DataLoader, accelerator, groups: int, group: int):
    """``loader`` prepared as ``accelerator.prepare`` prepares it, but dealt out to ``groups``
    groups of ranks instead of to every rank: each rank of group ``group`` (a
    ``ContextParallel``'s ``data_parallel_rank``) gets the same batches, the groups' batches
    together are what ``groups`` processes would get. A map-style dataset's sampler or batch
    sampler is sharded as accelerate shards it; an iterable dataset (a stream) is read whole by
    every rank, which keeps its group's rows (accelerate's ``IterableDatasetShard``; its
    dispatching from rank 0 would deal to every rank). Not a collective."""
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=groups,
        process_index=group,
        split_batches=accelerator.split_batches,
        put_on_device=True,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
    )
