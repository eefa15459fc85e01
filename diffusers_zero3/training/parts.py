"""Trained models as parts of a job, each with its own engine, optimizer, schedule, clipping and
EMA, and one training step over them when one loss flows through several (DreamBooth: the text
encoder's output conditions the denoiser).

Under ZeRO-3 each part is a DeepSpeed engine of its own. The first (the denoiser; the ControlNet)
is prepared by accelerate (``prepare_first_part``: ``accelerator.backward`` drives it, and
accelerate checkpoints it); every other one (``prepare_extra_part``) is built with ``deepspeed.initialize`` from the same DeepSpeed settings, its
own optimizer, learning-rate schedule and gradient clipping, and is checkpointed by the package
(``resume.save_training_checkpoint(..., parts=...)``, beside accelerate's state in the same
checkpoint folder, and resumed on any number of processes).
accelerate drives only its first engine's backward (FIELD_NOTES 2): a second engine given to
``accelerator.prepare`` would never be updated, with no error. So the graph is cut where a
part's output enters the next one (``cut_outputs``); the first part's backward runs from the
loss, and each other part then runs its own full ``engine.backward`` of the vector-Jacobian
product ``sum(output * grad_of_cut)`` (``backward_through``): every engine's hooks, gradient
reduction and accumulation boundary are then its own. Matched plain training to 1e-7 (fp32,
2 ranks, accumulation 2) where ``loss.backward()`` alone halved the first part's gradients and
``accelerator.backward`` left the second part unchanged. The cut's gradients carry the first
engine's fp16 loss scale; ``backward_parts`` reads it before that engine's backward and
divides it out (each engine divides out only its own).

Without DeepSpeed (plain DDP, or one process) every part is prepared by accelerate and one
``accelerator.backward`` reaches all of them; each part is still clipped and stepped alone.

Gradient clipping is per part (``--max_grad_norm`` for each model's own gradients), as each
engine clips its own; diffusers' DreamBooth scripts clip the norm of all trained models'
gradients together.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.deepspeed_internals.levers import (
    set_block_leaf_modules,
    share_fp32_master_weights,
    trim_zero3_overhead,
)
from ..runtime.deepspeed_internals.reads import engine_loss_scale
from ..runtime.distributed import log_rank_zero
from ..runtime.ds_config import zero3_bucket_sizes

MIB = 2**20


@dataclass
class TrainedModel:
    """One trained model of a job (see the module doc).

    ``engine`` is what its forward calls (a DeepSpeed engine, or the model accelerate
    prepared); ``module`` the model itself. ``own_engine``: built by ``deepspeed.initialize``
    here (checkpointed by ``save_parts``), not by accelerate.
    """

    name: str
    module: torch.nn.Module
    engine: Any
    optimizer: Any
    lr_scheduler: Any
    max_grad_norm: float | None = None
    own_engine: bool = False
    ema: Any = None
    extra: dict = field(default_factory=dict)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device


def build_optimizer(
    model: torch.nn.Module, args, lr: float | None = None, weight_decay: float | None = None
) -> torch.optim.Optimizer:
    """The script's ``--optimizer`` over ``model``'s trainable parameters (the adapters alone
    under LoRA): AdamW, or prodigyopt's Prodigy (``--optimizer prodigy``, with the
    ``--prodigy_*`` flags, as diffusers' DreamBooth LoRA scripts build it). Both read
    ``--learning_rate`` unless ``lr``, ``--adam_beta1/2``, ``--adam_weight_decay`` unless
    ``weight_decay``, and ``--adam_epsilon``.

    Under ZeRO-3 on several ranks Prodigy is built with ``fsdp_in_use=True``: each rank steps
    its own partition, and its step-size estimate is a sum over all parameters, which Prodigy
    then all-reduces over the ranks (without it every rank would adapt its own step size).
    ``prepare_first_part`` / ``prepare_extra_part`` make DeepSpeed step it once per update
    (``fit_zero3_config_to_optimizer``).

    Example:
        >>> from types import SimpleNamespace
        >>> flags = SimpleNamespace(optimizer="AdamW", learning_rate=1e-4, adam_beta1=0.9,
        ...                         adam_beta2=0.999, adam_weight_decay=1e-2, adam_epsilon=1e-8)
        >>> type(build_optimizer(torch.nn.Linear(2, 2), flags)).__name__
        'AdamW'
    """
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.learning_rate if lr is None else lr
    weight_decay = args.adam_weight_decay if weight_decay is None else weight_decay
    if args.optimizer.lower() != "prodigy":
        return torch.optim.AdamW(
            params,
            lr=lr,
            betas=(args.adam_beta1, args.adam_beta2),
            weight_decay=weight_decay,
            eps=args.adam_epsilon,
        )
    from prodigyopt import Prodigy

    from ..runtime.distributed import get_world_size
    from ..runtime.zero3 import is_zero3_enabled

    if lr <= 0.1:  # diffusers' scripts warn alike
        log_rank_zero(f"--optimizer prodigy with a learning rate of {lr}: Prodigy is usually run with 1.0")
    return Prodigy(
        params,
        lr=lr,
        betas=(args.adam_beta1, args.adam_beta2),
        beta3=args.prodigy_beta3,
        weight_decay=weight_decay,
        eps=args.adam_epsilon,
        decouple=args.prodigy_decouple,
        use_bias_correction=args.prodigy_use_bias_correction,
        safeguard_warmup=args.prodigy_safeguard_warmup,
        fsdp_in_use=is_zero3_enabled() and get_world_size() > 1,
    )


# The recipes' name for it from when AdamW was the only choice; it builds --optimizer's choice.
adamw = build_optimizer


def steps_whole_partition(optimizer: torch.optim.Optimizer) -> bool:
    """Whether DeepSpeed must step ``optimizer`` once over a rank's whole partition: Prodigy,
    whose step size comes from sums over every parameter and whose counters advance per call.
    (DeepSpeed calls ``optimizer.step()`` once per sub-group of ``sub_group_size`` elements,
    which is right for AdamW's element-wise update only.)"""
    return type(optimizer).__name__ == "Prodigy"


def fit_zero3_config_to_optimizer(config: dict, model: torch.nn.Module, optimizer) -> None:
    """Adjust a ZeRO-3 training ``config`` (in place) for ``optimizer`` when it is not an
    Adam DeepSpeed knows (``steps_whole_partition``): one sub-group as large as the trained
    parameters (one ``step()`` per update: an fp32 copy of the partition's gradients at the
    step, where smaller sub-groups would hold one sub-group's), and ``zero_force_ds_cpu_optimizer``
    off, so that with an offloaded optimizer accelerate keeps it (it would swap in
    DeepSpeedCPUAdam, an Adam at Prodigy's learning rate) and it steps the partitions in host
    memory. Nothing for AdamW."""
    if not steps_whole_partition(optimizer):
        return
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    zero = config.setdefault("zero_optimization", {})
    zero["sub_group_size"] = max(int(zero.get("sub_group_size") or 0), trained)
    config["zero_force_ds_cpu_optimizer"] = False
    config["zero_allow_untested_optimizer"] = True
    log_rank_zero(
        f"{type(optimizer).__name__}: one optimizer sub-group of {trained:,} elements (stepped once per update)"
    )


def set_micro_batch_size(accelerator, size: int) -> None:
    """Under DeepSpeed, the micro-batch size of the engine ``prepare_first_part`` builds, for a
    job whose loader is not prepared with it (accelerate reads the size from a prepared loader:
    a loader dealt out by the job itself, or none). Nothing without DeepSpeed. Not a
    collective; call on every rank before ``prepare_first_part``."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = size


def prepare_first_part(
    accelerator,
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler=None,
    *,
    dataloader=None,
    max_grad_norm: float | None = None,
    ema: bool | str = False,
):
    """The job's first trained model, prepared by accelerate (under ZeRO-3 its DeepSpeed engine
    is the one ``accelerator.backward`` drives): ``(part, dataloader)``, the loader prepared in
    the same call when given (accelerate reads the micro-batch size from it; else call
    ``set_micro_batch_size`` first). Its fp32 master weights are shared with its partitions
    under fp32 ZeRO-3 (the bytes freed are logged); ``ema`` gives it a ``ShardedEMA`` (True: on
    the model's device; ``"cpu"``: in host memory). Collective: call on every rank, before any
    other part is prepared."""
    from ..state.ema import ShardedEMA

    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("zero_optimization", {}).get("stage") == 3:
        _log_blocks(name, set_block_leaf_modules(model))
    if plugin is not None:
        fit_zero3_config_to_optimizer(plugin.deepspeed_config, model, optimizer)
    objects = [model, optimizer] + ([dataloader] if dataloader is not None else [])
    objects += [lr_scheduler] if lr_scheduler is not None else []
    prepared = list(accelerator.prepare(*objects))
    engine, optimizer = prepared[0], prepared[1]
    _log_trimmed(name, engine)
    loader = prepared[2] if dataloader is not None else None
    lr_scheduler = prepared[-1] if lr_scheduler is not None else None
    freed = share_fp32_master_weights(optimizer)
    if freed:
        log_rank_zero(
            f"{name}: fp32 master weights shared with the parameters: {freed / MIB:.1f} MiB freed per rank"
        )
    average = ShardedEMA(engine, device="cpu" if ema == "cpu" else None) if ema else None
    module = getattr(engine, "module", engine)
    return TrainedModel(name, module, engine, optimizer, lr_scheduler, max_grad_norm, ema=average), loader


def trained_engine_config(base: dict, model: torch.nn.Module, max_grad_norm: float | None) -> dict:
    """A DeepSpeed ZeRO-3 training config for another trained ``model`` of the job, from the
    first engine's resolved config ``base``: the same batch sizes, accumulation, precision and
    ZeRO settings, its own gradient clipping, bucket and persistence sizes from its own shapes,
    and no optimizer or scheduler section (the part brings its own)."""
    config = copy.deepcopy(base)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config["gradient_clipping"] = float(max_grad_norm or 0.0)
    zero = config.setdefault("zero_optimization", {})
    zero.update(zero3_bucket_sizes(model))
    return config


def prepare_extra_part(
    accelerator,
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler,
    *,
    first_engine=None,
    max_grad_norm: float | None = None,
) -> TrainedModel:
    """A second (third, ...) trained model of the job. Collective: call on every rank, after
    the first part is prepared.

    Under ZeRO-3 (``first_engine`` is the first part's DeepSpeed engine) it becomes a DeepSpeed
    engine of its own (``trained_engine_config`` of the first engine's config), its fp32
    master weights shared with its partitions under fp32 training; ``lr_scheduler`` is stepped
    by the engine once per update. Otherwise accelerate prepares it (DDP).
    """
    if first_engine is None or not hasattr(first_engine, "save_checkpoint"):
        engine, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
        return TrainedModel(name, model, engine, optimizer, lr_scheduler, max_grad_norm)
    import deepspeed

    config = trained_engine_config(first_engine.config, model, max_grad_norm)
    fit_zero3_config_to_optimizer(config, model, optimizer)
    _log_blocks(name, set_block_leaf_modules(model))
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, lr_scheduler=lr_scheduler
    )
    share_fp32_master_weights(ds_optimizer)
    _log_trimmed(name, engine)
    return TrainedModel(
        name, engine.module, engine, ds_optimizer, lr_scheduler, max_grad_norm, own_engine=True
    )


def _log_blocks(name: str, blocks: int) -> None:
    if blocks:
        log_rank_zero(
            f"{name}: {blocks} blocks gathered whole, one ZeRO-3 fetch each (set_block_leaf_modules)"
        )


def _log_trimmed(name: str, engine: Any) -> None:
    """``trim_zero3_overhead`` on a part's engine (all ranks), logged once."""
    dropped = trim_zero3_overhead(engine)
    if dropped:
        total = sum(1 for _ in engine.module.modules())
        log_rank_zero(
            f"{name}: ZeRO-3 hooks dropped on {dropped} of {total} modules "
            "(parameters kept whole, or none of their own)"
        )


def cut_outputs(outputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(cut, kept)``: ``outputs`` detached where they carry a graph (new leaves that collect
    their gradient, for the next part's input), and the originals to backward through."""
    cut, kept = {}, {}
    for key, value in outputs.items():
        if torch.is_tensor(value) and value.requires_grad:
            kept[key] = value
            cut[key] = value.detach().requires_grad_()
        else:
            cut[key] = value
    return cut, kept


def loss_scale(engine) -> float:
    """The factor by which ``engine.backward`` multiplies a loss: DeepSpeed's fp16 loss scale
    (static, dynamic, or a torch ``GradScaler`` under its ``torch_autocast``), asked of the
    engine's own optimizer; 1.0 under bf16 and fp32, and for a model that is not a DeepSpeed
    engine (under DDP one backward reaches every part: nothing is cut). Read it before that
    engine's backward: at an accumulation boundary accelerate's backward also runs the engine's
    step, which updates a dynamic scale. Not a collective. The engine's names it reads are not
    DeepSpeed's documented API: ``runtime.deepspeed_internals.reads.engine_loss_scale``.

    Example:
        >>> scale = loss_scale(first.engine)  # 65536.0 at the start of an fp16 run
    """
    return engine_loss_scale(engine)


def backward_parts(
    accelerator,
    loss: torch.Tensor,
    first: TrainedModel,
    cuts: list[tuple[TrainedModel, dict[str, torch.Tensor], dict[str, torch.Tensor]]],
) -> None:
    """The micro-batch's backward through every trained part: accelerate's backward of ``loss``
    (the ``first`` part's engine), then ``backward_through`` of each own-engine part in
    ``cuts`` (``(part, kept, cut)`` from ``cut_outputs``), with the first engine's loss scale
    read before its backward (which may step it and change the scale) and divided out of the
    cut's gradients. Under DDP the one backward reaches every part. Collective: call on every
    rank, every micro-batch.
    """
    upstream_scale = loss_scale(first.engine)
    accelerator.backward(loss)
    for part, kept, cut in cuts:
        if part.own_engine:
            backward_through(part, kept, cut, accelerator.sync_gradients, upstream_scale=upstream_scale)


def backward_through(
    part: TrainedModel,
    kept: dict[str, torch.Tensor],
    cut: dict[str, torch.Tensor],
    sync: bool,
    upstream_scale: float | None = None,
) -> None:
    """The backward of one part from the gradients that reached its cut outputs (after the
    downstream part's backward). Collective for a ZeRO-3 part: every rank, every micro-batch.

    ``engine.backward`` takes a scalar: ``sum(output * grad)`` has exactly the cut's gradient
    as its gradient, which already carries the 1 / accumulation factor of the first part's
    backward (so it is not scaled again). In fp32 under bf16, as the engines reduce in it.

    ``upstream_scale`` is the factor by which the backward that filled the cut's gradients
    multiplied its loss (``loss_scale`` of that engine, read before its backward;
    ``backward_parts`` does so). It is divided out here: this engine multiplies by its own
    scale and divides only that one back out, so an fp16 run's gradients would otherwise be
    the first engine's scale (2^16 at the start) too large. Where this engine scales its losses
    and no ``upstream_scale`` is given: ``ValueError``, on every rank alike (the scale follows
    from the engines' precision, not from the data).

    Every output that carries a graph is backpropagated, with a zero gradient where its cut
    got none (it reached no loss on this rank): every rank then runs the same modules'
    backwards, whose ZeRO-3 gathers and reduce-scatters pair up across ranks, and every
    gradient has its parameter's full shape (a loss built from partitioned parameters would
    give 0-element gradients, which DeepSpeed refuses while the other ranks wait).
    """
    if not kept:
        raise ValueError(
            f"{part.name}: none of its outputs carries a graph (did its forward run without "
            "gradients?): there is nothing to backpropagate into it"
        )
    if upstream_scale is None:
        if loss_scale(part.engine) != 1.0:
            raise ValueError(
                f"{part.name}: its engine scales losses (fp16): pass upstream_scale, the loss scale "
                "of the backward that filled the cut's gradients (backward_parts does)"
            )
        upstream_scale = 1.0
    terms = []
    for key, out in kept.items():
        grad = cut[key].grad
        if grad is None:  # this output reached no loss on this rank
            terms.append((out.float() * 0.0).sum())
            continue
        grad = grad.float() if upstream_scale == 1.0 else grad.float() / upstream_scale
        terms.append((out.float() * grad).sum())
    engine = part.engine
    engine.set_gradient_accumulation_boundary(sync)
    engine.backward(sum(terms), scale_wrt_gas=False)


def step_part(
    part: TrainedModel, accelerator, sync: bool, before_zero_grad: Callable[[], None] | None = None
) -> bool:
    """The optimizer step of one part at a micro-batch's end (its own clipping; the update and
    the schedule only at an accumulation boundary). ``before_zero_grad`` runs after the step,
    while a plain optimizer's gradients still exist (the trainer measures model states there).
    Every rank.

    A part of its own engine is stepped by DeepSpeed (which clips, updates and steps its
    schedule at the boundary only). The first part goes through accelerate's wrappers: under
    DeepSpeed its ``accelerator.backward`` already stepped the engine (clipping by the config's
    ``gradient_clipping``) and these calls do nothing; under DDP they clip at ``max_grad_norm``
    on synchronising steps, update, and step the schedule.

    Under DDP fp16 one GradScaler scaled the loss of every part, and each part's optimizer step
    ends with the scaler's update, which forgets which optimizers were unscaled. So clipping
    unscales this part's gradients alone (``accelerator.clip_grad_norm_`` unscales every
    optimizer's: a part stepped after another's update would be unscaled a second time, its
    update 2^16 too small at the start of a run).

    Returns whether the update was applied (True between boundaries): False where the reduced
    gradients were not finite, the same on every rank (``training.faults``). DeepSpeed's ZeRO-3
    optimizer skips such a step itself in every precision (``engine.was_step_applied``);
    without DeepSpeed the norm of the reduced gradients decides here, and the optimizer and
    schedule steps are skipped (under fp16 accelerate's scaler skips it and says so).
    """
    deepspeed = hasattr(part.engine, "was_step_applied")
    if part.own_engine:
        part.engine.step()
        if before_zero_grad is not None:
            before_zero_grad()
        return part.engine.was_step_applied() if sync else True
    applied = True
    if sync and accelerator.state.deepspeed_plugin is None:
        applied = _finite_gradients(part, accelerator)
    if applied:
        part.optimizer.step()
        if part.lr_scheduler is not None:
            part.lr_scheduler.step()
    if before_zero_grad is not None:
        before_zero_grad()
    part.optimizer.zero_grad()
    if sync and deepspeed:  # accelerate's backward stepped the engine at the boundary
        return part.engine.was_step_applied()
    if sync and accelerator.scaler is not None:
        return applied and not accelerator.optimizer_step_was_skipped
    return applied


def _finite_gradients(part: TrainedModel, accelerator) -> bool:
    """Whether the part's reduced gradients have a finite norm (the same on every rank), after
    clipping them at ``max_grad_norm``. Under fp16 the scaler's own check decides: True here."""
    params = [p for p in part.module.parameters() if p.grad is not None]
    if part.max_grad_norm:
        accelerator.unscale_gradients(optimizer=part.optimizer)  # a no-op without fp16's scaler
        norm = torch.nn.utils.clip_grad_norm_(params, part.max_grad_norm)
    elif accelerator.scaler is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        return True
    return accelerator.scaler is not None or bool(torch.isfinite(norm))
