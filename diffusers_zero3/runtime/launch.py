"""How many processes a launch on this host gets, and on which DeepSpeed accelerator.

The default runs (``make train``, ``make train-reward``, ``make train-dpo``) and ``make
smoke-gpu`` ask this module, so that the decision lives in one place::

    SETTINGS=$(python -m diffusers_zero3.runtime.launch)   # fails (exit 2) on a bad NUM_PROCESSES
    eval "$SETTINGS"                   # NUM_PROCESSES=..., CONFIG=..., export DS_ACCELERATOR=cpu
    accelerate launch --config_file "$CONFIG" --num_processes "$NUM_PROCESSES" ...

* A CUDA host: one process per GPU, and ``DS_ACCELERATOR`` is left alone. accelerate picks
  NCCL there, and DeepSpeed must pick its CUDA accelerator to match: exporting
  ``DS_ACCELERATOR=cpu`` beside NCCL is the mismatch that fails (the default runs did this
  unconditionally before).
* A host without CUDA: 2 processes with ``DS_ACCELERATOR=cpu`` (gloo), the runs the README
  describes.
* ``NUM_PROCESSES=N`` in the environment overrides the count; ``DS_ACCELERATOR=cpu`` in the
  environment asks for CPU ranks on a CUDA host too, and then the GPUs are hidden
  (``CUDA_VISIBLE_DEVICES=``) so that accelerate picks gloo as well.

torch is imported inside functions; nothing here imports deepspeed or transformers.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CPU_PROCESSES = 2
CONFIGS = Path(__file__).resolve().parent.parent / "configs"  # the package's accelerate configs


def cuda_device_count() -> int:
    """The number of CUDA devices torch can use here (0 without CUDA or without a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class LaunchSettings:
    """A launch on this host: ``num_processes`` ranks on ``device`` (``"cuda"`` or ``"cpu"``),
    with ``env`` exported for the launcher (``{}`` on a CUDA host)."""

    num_processes: int
    device: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> Path:
        """The accelerate config of a default launch on this host: ZeRO-3 in bf16 on CUDA (fp32
        would hold twice the activations and run ring/flash attention not at all), in fp32 on
        the CPU (DeepSpeed has no fp16 there and bf16 is slow); the package's own files."""
        name = "accelerate_zero3_bf16.yaml" if self.device == "cuda" else "accelerate_zero3.yaml"
        return CONFIGS / name

    def shell(self) -> str:
        """Shell lines for ``eval``: ``NUM_PROCESSES=N`` and ``CONFIG=<accelerate config>`` (not
        exported: launchers need not see them) and one ``export NAME=value`` per variable of
        ``env``."""
        lines = [f"NUM_PROCESSES={self.num_processes}", f"CONFIG={shlex.quote(str(self.config))}"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        return "\n".join(lines)


def _requested_processes(environ: Mapping[str, str]) -> int | None:
    value = environ.get("NUM_PROCESSES", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"NUM_PROCESSES must be a positive integer, got {value!r}")
    return int(value)


def launch_settings(environ: Mapping[str, str] | None = None) -> LaunchSettings:
    """The number of processes and the accelerator for a launch on this host.

    Args:
        environ: the environment to read ``NUM_PROCESSES`` and ``DS_ACCELERATOR`` from
            (default ``os.environ``).

    Raises:
        ValueError: ``NUM_PROCESSES`` is not a positive integer, or asks for more processes
            than there are GPUs on a CUDA host (two NCCL ranks cannot share one device).

    Example::

        >>> launch_settings({})                      # on a host without CUDA
        LaunchSettings(num_processes=2, device='cpu', env={'DS_ACCELERATOR': 'cpu'})
        >>> launch_settings({"NUM_PROCESSES": "1"})  # on a host with 4 GPUs
        LaunchSettings(num_processes=1, device='cuda', env={})
    """
    environ = os.environ if environ is None else environ
    requested = _requested_processes(environ)
    forced_cpu = environ.get("DS_ACCELERATOR", "") == "cpu"
    gpus = 0 if forced_cpu else cuda_device_count()
    if gpus >= 1:
        if requested is not None and requested > gpus:
            raise ValueError(f"NUM_PROCESSES={requested} but this host has {gpus} CUDA device(s)")
        return LaunchSettings(requested or gpus, "cuda")
    env = {"DS_ACCELERATOR": "cpu"}
    if forced_cpu and cuda_device_count() >= 1:
        env["CUDA_VISIBLE_DEVICES"] = ""  # else accelerate picks NCCL beside DeepSpeed's CPU accelerator
    return LaunchSettings(requested or CPU_PROCESSES, "cpu", env)


def stale_build_locks(since: float | None = None) -> list[Path]:
    """Build locks of torch's C++ extensions (where DeepSpeed builds its CPU communication op on
    first use) older than ``since`` (a time stamp; default now). A build killed half-way leaves
    its ``lock``, and every later launch then waits on it in silence."""
    import time

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    )
    since = time.time() if since is None else since
    return sorted(p for p in Path(root).glob("**/lock") if p.is_file() and p.stat().st_mtime < since)


def warn_about_build_locks(locks: Sequence[Path]) -> None:
    """Say what a launch may wait on, and how to clear it (one line per lock, to stderr)."""
    for lock in locks:
        print(
            f"note: {lock} exists: a DeepSpeed/torch op build holds it, or a build killed half-way "
            f"left it and every launch waits on it; if no other job on this host is building, "
            f"remove it: rm {lock}",
            file=sys.stderr,
            flush=True,
        )


def warn_about_locks_older_than_launch() -> None:
    """On local rank 0 of a launch: ``warn_about_build_locks`` for the locks made before the
    launcher started (which no rank of this launch can hold). Anywhere else, nothing."""
    from .user_errors import launched_rank, process_start_time

    if launched_rank() and os.environ.get("LOCAL_RANK") == "0":
        started = process_start_time(os.getppid())
        if started is not None:
            warn_about_build_locks(stale_build_locks(started))


def main(argv: list[str] | None = None) -> int:
    """Print ``launch_settings().shell()``; on a bad ``NUM_PROCESSES`` print an error line
    to stderr and return 2. A one-line summary goes to stderr, so ``eval`` sees only the
    assignments."""
    del argv  # no options: the environment is the input
    try:
        settings = launch_settings()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = "GPU (bf16)" if settings.device == "cuda" else "CPU (fp32)"
    print(f"launch: {settings.num_processes} process(es) on {where}, {settings.config.name}", file=sys.stderr)
    print(settings.shell())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
