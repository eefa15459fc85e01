"""The console commands: one module per training script, each usable three ways.

    diffusers-zero3-train-text-to-image --pretrained_model_name_or_path PIPE ...   # launches the ranks
    python -m diffusers_zero3.commands.train_text_to_image --pretrained_model_name_or_path PIPE ...
    accelerate launch --config_file CONFIG -m diffusers_zero3.commands.train_text_to_image ...

Run directly (the first two forms), a command launches the ranks of this host itself, through
accelerate's launcher in this process: one per GPU on a CUDA host (DeepSpeed ZeRO-3 in bf16),
else 2 CPU ranks (gloo, fp32), or ``--num_processes N``; ``--config_file PATH`` takes another
accelerate config (the package's own are in ``diffusers_zero3/configs``) and
``--main_process_port P`` another port (launch flags: before the script's own). Its flags are parsed once before any rank starts, so a typo costs no
launch. A user error is then one ``error:`` line from one rank with exit status 2, without the
launcher's traceback after it; a crash keeps the rank's traceback and the launcher's summary.

Under a launcher (``accelerate launch``, ``torchrun``: ``LOCAL_RANK`` is set), the module is one
rank of the job, as ``scripts/train_*.py`` are. Multi-node jobs use that form.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..runtime.user_errors import USER_ERROR_EXIT, error_claim_path, launched_rank

# the command's own, before the script's flags (accelerate launch's names)
LAUNCH_FLAGS = ("--num_processes", "--config_file", "--main_process_port")


def split_launch_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``({"num_processes": ..., "config_file": ..., ...}, the script's flags)``: the command's
    launch flags are read while they lead the command line (``--flag value`` or
    ``--flag=value``); the rest goes to the script unchanged."""
    argv, launch = list(argv), {}
    while argv:
        name, sep, value = argv[0].partition("=")
        if name not in LAUNCH_FLAGS:
            break
        if not sep:
            if len(argv) < 2:
                break
            value = argv[1]
            argv = argv[1:]
        launch[name[2:]] = value
        argv = argv[1:]
    return launch, argv


def launch_ranks(module: str, argv: Sequence[str], parse: Callable[[list[str]], Any]) -> int:
    """Launch ``python -m module argv`` on the ranks of this host through accelerate's launcher
    (in this process) and return the exit status: 0, 2 after a user error (whose line one rank
    printed), else 1 with the launcher's summary of the failed ranks.

    ``parse`` parses the script's flags here first (a bad flag is one ``error:`` line and no
    launch)."""
    from ..errors import UserError
    from ..runtime.launch import launch_settings, stale_build_locks, warn_about_build_locks

    launch, script_argv = split_launch_flags(argv)
    environ = dict(os.environ)
    if "num_processes" in launch:
        environ["NUM_PROCESSES"] = launch["num_processes"]
    try:
        settings = launch_settings(environ)
        config = Path(launch.get("config_file") or settings.config)
        if not config.is_file():
            raise UserError(f"--config_file {config}: no such file")
        parse(list(script_argv))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    warn_about_build_locks(stale_build_locks())
    os.environ.update(settings.env)

    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    port = ["--main_process_port", launch["main_process_port"]] if "main_process_port" in launch else []
    args = launch_command_parser().parse_args(
        ["--config_file", str(config), "--num_processes", str(settings.num_processes), *port, "--module", module,
         *script_argv]
    )  # fmt: skip
    # torchrun's notice that it set OMP_NUM_THREADS=1, and its per-rank "failed (exitcode ...)"
    # lines (a crash is summarised below): not for a user who did not call torchrun
    loggers = [logging.getLogger(name) for name in ("torch.distributed.run", "torch.distributed.elastic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        launch_command(args)
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        if first.exitcode == USER_ERROR_EXIT:  # the rank printed its one line
            return USER_ERROR_EXIT
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        claim = error_claim_path(os.getpid())
        claim.unlink(missing_ok=True)
        claim.with_name(f"{claim.name}.lock").unlink(missing_ok=True)
    return 0


def run_command(module: str, make_trainer: Callable[[list[str]], Any], parse: Callable[[list[str]], Any],
                argv: Sequence[str] | None = None) -> int:  # fmt: skip
    """A console command's body: under a launcher, this rank's part of the job (the trainer
    from ``make_trainer(argv)`` through ``run_trainer``); else ``launch_ranks``. ``--help``
    prints the script's flags without a launch. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if launched_rank():
        from ..runtime.huge_pages import use_huge_pages_for_host_tensors

        use_huge_pages_for_host_tensors()  # first: before torch makes its first tensor
        from ..training.job import run_trainer

        return run_trainer(lambda: make_trainer(argv))
    if "-h" in argv or "--help" in argv:
        print(
            "launch flags (before the script's own): --num_processes N, --config_file PATH, --main_process_port P\n"
        )
        parse(split_launch_flags(argv)[1])
        return 0
    return launch_ranks(module, argv, parse)


# each command module's settings and trainer, "module:Name" under the package (imported at run time)
TRAINERS: dict[str, tuple[str, str]] = {
    "train_text_to_image": (
        "recipes.text_to_image_settings:TextToImageSettings",
        "recipes.text_to_image:TextToImageTrainer",
    ),
    "train_dreambooth": ("recipes.dreambooth:DreamBoothSettings", "recipes.dreambooth:DreamBoothTrainer"),
    "train_controlnet": ("recipes.controlnet:ControlNetSettings", "recipes.controlnet:ControlNetTrainer"),
    "train_dpo": ("recipes.dpo:DPOSettings", "recipes.dpo:DPOTrainer"),
    "train_reward": ("recipes.reward:RewardSettings", "recipes.reward:RewardTrainer"),
    "train_grpo": ("recipes.grpo:GRPOSettings", "recipes.grpo:GRPOTrainer"),
}


def _named(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(f"diffusers_zero3.{module}"), name)


def settings_class(command: str):
    """The settings class of a command (``"train_grpo"``, or its module's full name)."""
    return _named(TRAINERS[command.rpartition(".")[2]][0])


def command_main(module: str, argv: Sequence[str] | None = None) -> int:
    """``main`` of the command module ``module`` (its full name: ``__spec__.name``, which stays
    the module's own under ``python -m``, where ``__name__`` is ``"__main__"``)."""
    command = module.rpartition(".")[2]

    def parse(args: list[str]):
        return settings_class(command).parse(args)

    def make_trainer(args: list[str]):
        return _named(TRAINERS[command][1])(parse(args))

    return run_command(module, make_trainer, parse, argv)


def command(module: str) -> Callable[[Sequence[str] | None], int]:
    """The console entry point ``main(argv=None) -> int`` of the command module ``module`` (its
    full name: ``__spec__.name``): ``command_main(module, argv)``. A command module is its
    docstring, ``main = command(__spec__.name)`` and ``run_if_main(__name__, main)``."""

    def main(argv: Sequence[str] | None = None) -> int:
        return command_main(module, argv)

    console = "diffusers-zero3-" + module.rpartition(".")[2].replace("_", "-")
    main.__doc__ = f"``{console}``: launch this host's ranks, or run as one rank under a launcher."
    return main


def run_if_main(name: str, main: Callable[[], int]) -> None:
    """``sys.exit(main())`` when the calling module runs as ``__main__`` (``python -m``,
    ``accelerate launch -m``): pass it the module's ``__name__``."""
    if name == "__main__":
        sys.exit(main())


__all__ = [
    "TRAINERS",
    "command",
    "command_main",
    "run_if_main",
    "settings_class",
    "launch_ranks",
    "run_command",
    "split_launch_flags",
]
