"""Trained models as parts of a job, each with its own engine, optimizer, schedule, clipping and
EMA, and one training step over them when one loss flows through several (DreamBooth: the text
encoder's output conditions the denoiser).

Under ZeRO-3 each part is a DeepSpeed engine of its own. The first (the denoiser) is prepared
by accelerate as before (``accelerator.backward`` drives it, and accelerate checkpoints it);
every other one is built with ``deepspeed.initialize`` from the same DeepSpeed settings, its
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
``accelerator.backward`` left the second part unchanged.

Without DeepSpeed (plain DDP, or one process) every part is prepared by accelerate and one
``accelerator.backward`` reaches all of them; each part is still clipped and stepped alone.

Gradient clipping is per part (``--max_grad_norm`` for each model's own gradients), as each
engine clips its own; diffusers' DreamBooth scripts clip the norm of all trained models'
gradients together.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.ds_config import zero3_bucket_sizes
from ..runtime.zero3 import share_fp32_master_weights


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
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, lr_scheduler=lr_scheduler
    )
    share_fp32_master_weights(ds_optimizer)
    return TrainedModel(
        name, engine.module, engine, ds_optimizer, lr_scheduler, max_grad_norm, own_engine=True
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


def backward_through(
    part: TrainedModel, kept: dict[str, torch.Tensor], cut: dict[str, torch.Tensor], sync: bool
) -> None:
    """The backward of one part from the gradients that reached its cut outputs (after the
    downstream part's backward). Collective for a ZeRO-3 part: every rank, every micro-batch.

    ``engine.backward`` takes a scalar: ``sum(output * grad)`` has exactly the cut's gradient
    as its gradient, which already carries the 1 / accumulation factor of the first part's
    backward (so it is not scaled again). In fp32 under bf16, as the engines reduce in it.
    """
    pairs = [(kept[k], cut[k].grad) for k in kept if cut[k].grad is not None]
    engine = part.engine
    if not pairs:  # nothing of this part reached the loss: the engine still steps in lockstep
        total = sum(p.sum() * 0.0 for p in part.module.parameters() if p.requires_grad)
    else:
        total = sum((out.float() * grad.float()).sum() for out, grad in pairs)
    engine.set_gradient_accumulation_boundary(sync)
    engine.backward(total, scale_wrt_gas=False)


def step_part(part: TrainedModel, accelerator, sync: bool) -> None:
    """The optimizer step of one part at a micro-batch's end (its own clipping; the update and
    the schedule only at an accumulation boundary). Every rank."""
    if part.own_engine:
        part.engine.step()  # DeepSpeed updates, clips and steps its schedule at the boundary only
        return
    if sync and part.max_grad_norm:
        accelerator.clip_grad_norm_(part.module.parameters(), part.max_grad_norm)
    part.optimizer.step()
    part.lr_scheduler.step()
    part.optimizer.zero_grad()
