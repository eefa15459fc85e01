"""A training job's setup and exit, shared by the recipes: its accelerator, the denoiser it
trains, the interrupted writes of its output folder, its trackers, and the exit protocol (one
``error:`` line for a user error, every rank's exit).

Each is a short function a custom script can call as is.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..runtime.accelerator import build_accelerator
from ..runtime.distributed import exit_after_teardown, log_rank_zero
from ..runtime.ds_config import fill_auto_bucket_sizes
from ..runtime.launch import warn_about_locks_older_than_launch
from ..runtime.rank_watch import leave_rank_watch, start_rank_watch
from ..runtime.user_errors import USER_ERROR_EXIT, print_user_error
from ..runtime.zero3 import is_zero3_enabled, set_moe_leaf_modules, zero3_init_disabled
from ..state.pretrained import load_pretrained_zero3
from .faults import PREEMPTED_EXIT, Preempted

GRAD_ACC_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
USER_ERRORS = (UserError,)


def setup_accelerator(
    output_dir: str,
    *,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int = 1,
    report_to: str = "tensorboard",
    logging_dir: str = "logs",
    max_grad_norm: float | None = None,
    process_group_timeout: float = 1800,
    dead_rank_timeout: float = 0,
):
    """An accelerator for a training script, CPU-only hosts included; logging on rank 0 only.

    ``dead_rank_timeout`` > 0 starts the rank watch (``runtime.rank_watch.start_rank_watch``):
    a rank silent for that many seconds (dead, frozen) ends the job on every rank with one
    ``error:`` line naming it, instead of the others waiting out ``process_group_timeout``.
    End the run with ``run_script`` (or ``runtime.distributed.exit_after_teardown``) on every
    rank, which stops it.

    ``gradient_accumulation_steps`` takes effect whatever the accelerate config file says:
    ``accelerate launch`` exports the file's ``gradient_accumulation_steps`` (1 in the
    shipped configs and in what ``accelerate config`` writes) as
    ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, which would silently override the script's
    flag, both in accelerate and in the DeepSpeed config. The flag wins; a different value
    in the launch configuration is logged.

    Sets the DeepSpeed plugin's ``gradient_clipping`` to ``max_grad_norm`` (accelerate
    otherwise applies its own default of 1.0 under DeepSpeed).
    """
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    launch_value = os.environ.get(GRAD_ACC_ENV)
    os.environ[GRAD_ACC_ENV] = str(gradient_accumulation_steps)

    accelerator = build_accelerator(
        timeout_s=process_group_timeout,
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        log_with=None if report_to == "none" else report_to,
        project_config=ProjectConfiguration(output_dir, os.path.join(output_dir, logging_dir)),
        # non_blocking: the prepared loaders' batches are copied to the GPU without blocking the
        # host (their memory is pinned there: data.loading.loader_settings)
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, non_blocking=torch.cuda.is_available()
        ),
    )
    start_rank_watch(dead_rank_timeout, finish_limit_s=process_group_timeout)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and max_grad_norm is not None:
        plugin.deepspeed_config["gradient_clipping"] = max_grad_norm
    logging.basicConfig(
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
        format="%(message)s",
        force=True,
    )
    if launch_value not in (None, str(gradient_accumulation_steps)):
        log_rank_zero(
            f"--gradient_accumulation_steps {gradient_accumulation_steps} overrides the launch configuration's "
            f"gradient_accumulation_steps: {launch_value}"
        )
    return accelerator


def accelerator_from_args(args):
    """``setup_accelerator`` from a script's parsed flags (``output_dir``, ``mixed_precision``,
    ``report_to``, ``logging_dir``, ``max_grad_norm``, ``process_group_timeout``,
    ``dead_rank_timeout``, ``gradient_accumulation_steps``)."""
    return setup_accelerator(
        args.output_dir,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        report_to=args.report_to,
        logging_dir=args.logging_dir,
        max_grad_norm=args.max_grad_norm,
        process_group_timeout=args.process_group_timeout,
        dead_rank_timeout=args.dead_rank_timeout,
    )


def load_trainable_denoiser(
    accelerator,
    source: str | Path,
    family=None,
    variant: str | None = None,
    folder: str | Path | None = None,
):
    """The denoiser to train (the family's ``unet`` or ``transformer``, from ``folder`` when
    given, else ``source/<denoiser>``): straight into ZeRO-3 partitions under ZeRO-3 (with
    bucket sizes filled in from its shapes, mixture-of-experts blocks as leaf modules), else a
    whole ``from_pretrained``. Call on every rank."""
    from ..families import SD

    family = family or SD
    cls = family.denoiser_cls()
    parent, sub = (
        (Path(folder).parent, Path(folder).name) if folder is not None else (source, family.denoiser)
    )
    if is_zero3_enabled():
        model = load_pretrained_zero3(cls, parent, sub, accelerator=accelerator, variant=variant)
        set_moe_leaf_modules(model)  # validation runs it in eval mode, where MoE routes by data
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None:
            fill_auto_bucket_sizes(plugin.deepspeed_config, model)
    else:
        with zero3_init_disabled():
            model = cls.from_pretrained(parent, subfolder=sub, variant=variant)
    model.train()
    return model


def clear_interrupted_writes(output_dir: str | Path) -> None:
    """Remove what an interrupted save left in ``output_dir`` (``state.folders.
    remove_interrupted_writes``), once per job on the global main process, before any rank
    writes; each removal is logged. Collective: every rank (it ends with a barrier)."""
    from ..runtime.distributed import barrier, is_main_process
    from ..state.folders import remove_interrupted_writes

    if is_main_process():
        for path in remove_interrupted_writes(output_dir):
            log_rank_zero(f"removed {path}, left by an interrupted save")
    barrier()


def finish_trackers(accelerator) -> None:
    """End a run's trackers (TensorBoard, wandb, ...), as ``accelerator.end_training()`` does,
    but leave the process group alone. ``end_training`` also destroys it, after which the
    interpreter's own teardown of a gloo run aborts now and then ("terminate called without
    an active exception", SIGABRT: seen in about one run in ten here), turning a finished run
    into a failed one; ``run_script`` ends the process without that teardown."""
    for tracker in accelerator.trackers:
        tracker.finish()


def run_script(body: Callable[[], None]) -> int:
    """Run a training script's ``body`` with the package's exit protocol; return the exit code.

    * A usage problem (``ArgumentError``, ``DataError``, ``CheckpointError``) prints one line
      ``error: <what is wrong>``, from the first local rank that raised it (the others stay
      silent: ``runtime.user_errors``), and exits with code 2 on every rank that raised it.
    * A preemption (``training.faults.Preempted``: a signal, the step's checkpoint published)
      exits with code 75 (``PREEMPTED_EXIT``) on every rank.
    * Any other exception prints its traceback and exits with code 1.
    * A failing rank tells the others through its rank watch (``runtime.rank_watch``, started
      by ``setup_accelerator``), which leave a few seconds later if their own collectives have
      not failed by then.
    * Under ``torch.distributed`` a failing rank leaves with ``os._exit`` at once: tearing
      down a process group whose peers are gone or stuck can hang or abort, and the peers
      then fail at their next collective (within the collective timeout) instead of waiting.
    * On success every rank tears the process group down together and exits with code 0
      (``exit_after_teardown``: interpreter teardown can abort a finished gloo run).
    """
    import traceback

    try:
        body()
    except USER_ERRORS as e:
        leave_rank_watch(failed=True)
        print_user_error(str(e))
        code = USER_ERROR_EXIT
    except Preempted:
        leave_rank_watch(failed=False)  # every rank leaves together
        code = PREEMPTED_EXIT  # every rank, its checkpoint published (the loop logged it)
    except BaseException:
        leave_rank_watch(failed=True)
        if not torch.distributed.is_initialized():
            raise
        traceback.print_exc()
        code = 1
    else:
        exit_after_teardown(0)  # leaves the process when distributed
        return 0
    if torch.distributed.is_initialized():
        sys.stdout.flush()
        os._exit(code)
    return code


def run_trainer(make_trainer: Callable[[], Any]) -> int:
    """``run_script`` over a trainer's ``setup()``, ``train()`` and ``save()`` (every rank);
    returns the exit code. ``make_trainer`` (which parses the flags) runs inside, so its usage
    errors end the same way: one ``error:`` line."""

    def body() -> None:
        warn_about_locks_older_than_launch()  # else a stale op-build lock is a silent wait
        trainer = make_trainer()
        trainer.setup()
        trainer.train()
        trainer.save()

    return run_script(body)
