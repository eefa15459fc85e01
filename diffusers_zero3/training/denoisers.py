"""The denoisers a job trains: loading them (partitioned under ZeRO-3, with LoRA adapters),
their kernels (attention backend, context parallelism), the engine of a second one (Wan 2.2's
low-noise expert, Ideogram 4's unconditional transformer), and the pipeline's denoisers for
validation (the ones not trained reloaded for the occasion).

Which one each optimizer step trains is the family's ``DenoiserSchedule``
(``Family.denoiser_schedule``). Every function here is a collective: call it on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..errors import ArgumentError
from ..placement.frozen_inputs import component_folder
from ..runtime.context_parallel import ContextParallel, enable_context_parallel, set_attention_backend
from ..runtime.distributed import log_rank_zero
from ..runtime.ds_config import fill_auto_bucket_sizes, weight_dtype
from ..state.ema import ShardedEMA
from .job import load_trainable_denoiser
from .lora import add_lora_adapters
from .parts import TrainedModel, adamw, prepare_extra_part
from .schedule import lr_schedule


def load_trained_denoisers(accelerator, family, source, folders, component_sources: dict, args) -> list:
    """The denoisers in ``folders`` (``Family.trained_denoisers``), each partitioned under
    ZeRO-3; the first with LoRA adapters under ``--rank`` (one denoiser at a time trains
    adapters), gradient checkpointing and xformers as the flags say."""
    models = [
        load_trainable_denoiser(
            accelerator, source, family, args.variant, component_folder(source, component_sources, name)
        )
        for name in folders
    ]
    first = models[0]
    if args.rank is not None:
        targets = args.lora_layers.split(",") if args.lora_layers else family.lora_target_modules
        adapters = add_lora_adapters(
            first, rank=args.rank, target_modules=targets, alpha=args.lora_alpha, dropout=args.lora_dropout,
            use_dora=args.use_dora, seed=args.seed or 0,  # the same initial adapters on any number of processes
        )  # fmt: skip
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None:  # the reduce bucket and sub-groups: the adapters' sizes now
            fill_auto_bucket_sizes(plugin.deepspeed_config, first)
        log_rank_zero(
            f"LoRA rank {args.rank} on {', '.join(targets)}: {sum(p.numel() for p in adapters):,} trainable "
            f"parameters; the {family.denoiser} is frozen"
        )
    if args.gradient_checkpointing:
        first.enable_gradient_checkpointing()
        log_rank_zero(f"gradient checkpointing of the {family.denoiser}: on")
    if args.enable_xformers_memory_efficient_attention:
        first.enable_xformers_memory_efficient_attention()
    return models


def set_denoiser_kernels(
    models: list, attention_backend: str | None, cp: ContextParallel | None, accelerator
) -> None:
    """``--attention_backend`` and the context-parallel plan on each trained denoiser (after
    LoRA's layers, so that the plan's modules are the wrapped ones); one error line for what
    a model cannot take. Not a collective."""
    for model in models:
        try:
            if attention_backend is not None:
                set_attention_backend(model, attention_backend)
            if cp is not None:
                enable_context_parallel(model, cp, accelerator.device, dtype=weight_dtype(accelerator))
        except ValueError as e:
            raise ArgumentError(str(e)) from e


def prepare_second_denoiser(
    accelerator, name: str, model, args, learning_rate: float, first_engine
) -> TrainedModel:
    """The second trained denoiser's part: its own optimizer and schedule, its own engine under
    ZeRO-3 (``prepare_extra_part``; ``first_engine`` the first denoiser's), its EMA under
    ``--use_ema``; ``part.extra["denoiser"]`` marks it (it steps on its own steps only)."""
    optimizer = adamw(model, args, learning_rate)
    first = first_engine if hasattr(first_engine, "save_checkpoint") else None
    per_update = 1 if first is not None else accelerator.num_processes
    scheduler = lr_schedule(args, optimizer, per_update)
    part = prepare_extra_part(
        accelerator, name, model, optimizer, scheduler, first_engine=first, max_grad_norm=args.max_grad_norm
    )
    part.extra["denoiser"] = True
    if args.use_ema:
        part.ema = ShardedEMA(part.engine, device="cpu" if args.offload_ema else None)
    return part


@contextlib.contextmanager
def pipeline_denoisers(
    accelerator, family, source, component_sources: dict, trained: dict, args, dtype: torch.dtype
) -> Iterator:
    """The denoiser(s) a validation pipeline takes: the trained one; for a pipeline of several
    (``Family.pipeline_denoisers``: Wan 2.2's experts, Ideogram 4's transformers) a dict of
    all, those not in ``trained`` (``{folder: module}``) reloaded whole for the occasion and
    freed after."""
    from ..placement.frozen import load_frozen_component

    names = family.pipeline_denoisers
    if len(names) < 2:
        yield next(iter(trained.values()))
        return
    have = {n: m for n, m in trained.items() if n in names}
    reloaded = []
    for name in names:
        if name not in have:
            folder = component_folder(source, component_sources, name)
            frozen = load_frozen_component(
                accelerator, folder.parent, folder.name, "cache", family.denoiser_cls(),
                args.variant, dtype=dtype, label=name,
            )  # fmt: skip
            have[name] = frozen.module
            reloaded.append(frozen)
    try:
        yield {name: have[name] for name in names}
    finally:
        for frozen in reloaded:
            frozen.release()
