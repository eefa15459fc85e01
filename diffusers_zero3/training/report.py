"""What a training run shows its user: the per-step output and the end-of-run summary.

Per step, one decision for every trainer (``StepOutput``): is stderr a terminal?

* A terminal: a progress bar is the only per-step output. The step lines (``step 12 loss
  0.123456``) go to ``OUTPUT_DIR/<logging_dir>/train.log`` (``--logging_dir``, ``logs`` by
  default), so the terminal does not scroll by one line per step; other log lines print above
  the bar instead of through it.
* Not a terminal (CI, a test, a log redirected to a file): the step lines print as they always
  did (tests and users parse them, so their format does not change), and there is no bar, whose
  carriage-return redraws would only clutter the file. They go to ``train.log`` too.

At the end, ``log_outputs`` prints the summary: a ``label: path`` line for each output that
exists, so a run without validation names no validation folder.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from ..runtime.distributed import is_main_process, log_rank_zero

STEP_LOG_NAME = "train.log"


def is_terminal(stream: IO | None = None) -> bool:
    """Whether ``stream`` (``sys.stderr`` by default: where the bar and the log lines go) is an
    interactive terminal. A closed stream, or a file-like object without ``isatty``, is not.

    Under ``accelerate launch`` (torch's elastic launcher) every rank inherits the launcher's
    stderr, so a rank's answer is the user's terminal's.

    Example:
        >>> import io
        >>> is_terminal(io.StringIO())
        False
    """
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or "I/O operation on closed file"
        return False


def step_log_path(output_dir: str | os.PathLike, logging_dir: str = "logs") -> Path:
    """Where the step lines of a run go: ``output_dir/logging_dir/train.log``."""
    return Path(output_dir) / logging_dir / STEP_LOG_NAME


def _console_handler(logger: logging.Logger) -> bool:
    return any(
        isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stderr, sys.stdout)
        for h in logger.handlers
    )


class StepOutput:
    """The per-step output of a training loop: a bar on a terminal, step lines elsewhere.

    Args:
        total: the run's steps (``--max_train_steps``).
        initial: steps already done (a resumed run's bar starts there).
        log_file: the file the step lines are appended to, on the global main process
            (``step_log_path``); ``None``: no file.
        bar: whether this process may draw the bar (the local main process: one bar per
            machine, as accelerate's scripts do).
        unit: what a step is called on the bar (``"step"``, ``"round"``).
        stream: where the bar and the step lines go (``sys.stderr`` by default); whether it is
            a terminal decides (``is_terminal``).

    Not a collective: every rank may build one; only the global main process writes lines.
    Close it (or use it as a context manager) to end the bar and give logging its console
    handlers back.

    Example:
        >>> with StepOutput(120, log_file=step_log_path("out")) as steps:
        ...     for step in range(1, 121):
        ...         steps.step(f"step {step} loss {0.1:.6f}", loss="0.1000")
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        log_file: str | os.PathLike | None = None,
        bar: bool = True,
        unit: str = "step",
        stream: IO | None = None,
    ):
        import contextlib

        self.stream = sys.stderr if stream is None else stream
        self.terminal = is_terminal(self.stream)
        self.log_file = Path(log_file) if log_file is not None and is_main_process() else None
        self._bar = None
        self._redirect = contextlib.ExitStack()
        if bar and self.terminal:
            from tqdm.contrib.logging import logging_redirect_tqdm
            from tqdm.std import tqdm

            self._bar = tqdm(total=total, initial=initial, unit=unit, file=self.stream, dynamic_ncols=True)
            # a log line written while the bar is drawn would land on the bar's line; tqdm.write
            # clears the bar, prints the line and redraws the bar below it. Only when logging
            # has a console handler: redirecting otherwise would add one.
            if _console_handler(logging.root):
                self._redirect.enter_context(logging_redirect_tqdm([logging.root], tqdm_class=tqdm))

    @classmethod
    def of_run(cls, args, accelerator, initial: int, unit: str = "step") -> StepOutput:
        """A trainer's output: ``--max_train_steps`` steps from ``initial``, lines into
        ``OUTPUT_DIR/<logging_dir>/train.log`` (``step_log_path``), the bar on each machine's
        main process. Not a collective."""
        return cls(
            args.max_train_steps,
            initial=initial,
            log_file=step_log_path(args.output_dir, args.logging_dir),
            bar=accelerator.is_local_main_process,
            unit=unit,
        )

    def step(self, line: str, **postfix: Any) -> None:
        """One step done: ``line`` to the log file, and printed unless on a terminal; the bar
        (if drawn) moves on and shows ``postfix`` (e.g. ``loss="0.1234"``)."""
        if self._bar is not None:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix(postfix)
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_file, "a") as f:  # opened per line: nothing left open on a crash
                f.write(line + "\n")
        if not self.terminal:
            log_rank_zero(line)

    def close(self) -> None:
        """End the bar and restore logging's console handlers. Safe to call twice."""
        try:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        finally:
            self._redirect.close()

    def __enter__(self) -> StepOutput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


Output = tuple[str, "str | os.PathLike | None"] | tuple[str, "str | os.PathLike | None", str]


def summary_lines(outputs: Iterable[Output]) -> list[str]:
    """The summary's lines: ``label: /absolute/path`` (then `` (note)`` when given) for each
    ``(label, path)`` or ``(label, path, note)`` whose path exists; a ``None`` path or one that
    does not exist is left out. Pure: reads the file system only.

    Example:
        >>> summary_lines([("pipeline", "/tmp", "StableDiffusionPipeline.from_pretrained"),
        ...                ("validation images", "/no/such/folder")])
        ['pipeline: /tmp (StableDiffusionPipeline.from_pretrained)']
    """
    lines = []
    for label, path, *note in outputs:
        if path is None or not Path(path).exists():
            continue
        line = f"{label}: {Path(path).resolve()}"
        lines.append(line + (f" ({note[0]})" if note and note[0] else ""))
    return lines


def log_outputs(outputs: Iterable[Output]) -> list[str]:
    """Log the end-of-run summary (``summary_lines``) on the global main process; returns the
    lines. Not a collective: call it after the outputs are written (every rank may call it)."""
    lines = summary_lines(outputs)
    if lines:
        log_rank_zero("\n".join(lines))
    return lines


__all__ = ["STEP_LOG_NAME", "StepOutput", "is_terminal", "log_outputs", "step_log_path", "summary_lines"]


def log_training_end(memory, states: dict[str, int], losses: list[float]) -> dict[str, int]:
    """After a training loop: the memory mark ``training done``, the memory table with the
    model states (``log_memory_per_rank``, whose maximum over ranks it returns) and the loss's
    trend (the means of its first and last steps). Collective: every rank, once."""
    from .schedule import first_last_means

    memory.mark("training done")
    states = log_memory_per_rank(memory, states)
    if len(losses) >= 2:
        k, first, last = first_last_means(losses)
        log_rank_zero(
            f"loss: mean of the first {k} steps {first:.4f} -> mean of the last {k} steps {last:.4f}"
        )
    return states


def log_memory_per_rank(memory, states: dict[str, int]) -> dict[str, int]:
    """Log the RSS per phase of ``memory`` (a ``runtime.memory.MemoryLog``), the trained
    model's state bytes ``states`` (by kind), the glibc heap and, on a GPU, the device memory
    after the first optimizer step, each the maximum over ranks; returns that maximum of
    ``states``. Collectives: every rank calls it once, at the end of training."""
    from ..runtime.distributed import max_over_ranks
    from ..runtime.memory import MIB, MemoryLog, heap_bytes

    records = memory.gathered()
    states = dict(zip(states, (int(v) for v in max_over_ranks(list(states.values())))))
    log_rank_zero("memory per rank (maximum over ranks):\n" + MemoryLog.format(records))
    log_rank_zero(
        "model states per rank: "
        + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in states.items())
        + f" (total {sum(states.values()) / MIB:.1f} MiB)"
    )
    heap = heap_bytes()
    heap = max_over_ranks(list(heap) if heap is not None else [-1, -1, -1])  # every rank the same call
    if heap[0] >= 0:
        log_rank_zero(
            f"glibc heap per rank at the end: in use {heap[0] / MIB:.1f} MiB, freed but held "
            f"{heap[1] / MIB:.1f} MiB, mmapped {heap[2] / MIB:.1f} MiB (the RSS counts all three)"
        )
    # On a GPU the states live in device memory: what torch's allocator held right after the
    # first optimizer step (marked just before the states were counted) is the device-side
    # number to compare the planner's with (it also holds frozen models on the GPU).
    step = next((r for r in records if r.phase == "first optimizer step"), None)
    if step is not None and step.device_allocated:
        log_rank_zero(
            f"device memory per rank after the first optimizer step: {step.device_allocated / MIB:.1f} MiB"
            " allocated (model states above, plus frozen models and buffers on the device)"
        )
    return states


def log_validation_images(trackers, images: list, step: int) -> None:
    """``images`` (PIL) into TensorBoard's ``validation`` images at ``step`` (other trackers:
    nothing). Rank 0."""
    import numpy as np

    for tracker in trackers:
        if tracker.name == "tensorboard":
            arr = np.stack([np.asarray(img) for img in images])
            tracker.writer.add_images("validation", arr, step, dataformats="NHWC")


def write_validation(
    images: list, sources: list | None, output_dir: str | os.PathLike, step: int, trackers
) -> Path:
    """Validation's output at ``step`` under ``OUTPUT_DIR/validation``: a grid of the images
    (an editing family's ``sources`` above their edits, so the grid shows what changed), or for
    videos (``images`` a list of frame lists) an mp4 each and their frames as a grid; logged to
    the trackers. Returns the grid's path. Rank 0."""
    from ..state.pipeline_io import image_grid

    folder = Path(output_dir) / "validation"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.png"
    if images and isinstance(images[0], list):
        from ..data.video import write_validation_videos

        videos = write_validation_videos(images, folder, step)
        frames = [frame for video in images for frame in video]
        image_grid(frames, cols=len(images[0])).save(path)
        log_validation_images(trackers, frames, step)
        log_rank_zero(f"validation videos: {', '.join(str(v) for v in videos)}; frames: {path}")
    else:
        image_grid([*sources, *images] if sources else images, cols=len(images)).save(path)
        log_validation_images(trackers, images, step)
        log_rank_zero(f"validation images: {path}")
    return path


def run_logs(args: Any) -> list[Output]:
    """The summary's lines for a run's logs under ``args.output_dir`` (a trainer's settings:
    ``output_dir``, ``logging_dir``, ``report_to``): the step lines (``train.log``) and, when
    reported to, TensorBoard's logs."""
    logs = os.path.join(args.output_dir, args.logging_dir)
    return [
        ("step log", step_log_path(args.output_dir, args.logging_dir)),
        ("TensorBoard logs", logs if args.report_to in ("tensorboard", "all") else None),
    ]


def log_run_outputs(weights: Output, args: Any, video: bool) -> list[str]:
    """Log the end-of-run summary: ``weights`` (what was trained, where, how to load it), then
    the validation samples under ``args.output_dir`` (videos for a ``video`` family) and the
    run's logs (``run_logs``); ``log_outputs`` leaves out what does not exist. Not a
    collective."""
    samples = "validation videos" if video else "validation images"
    return log_outputs([weights, (samples, os.path.join(args.output_dir, "validation")), *run_logs(args)])
