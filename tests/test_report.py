"""What a run shows its user (diffusers_zero3.training.report): on a real terminal (a
pseudo-terminal here) the progress bar is the only per-step output and the step lines go to the
log file; on a pipe the step lines print unchanged; the end-of-run summary names only what
exists (no validation folder for a run without validation, videos for a video family)."""

from __future__ import annotations

import logging
import os
import types

import pytest

from diffusers_zero3.training.report import (
    StepOutput,
    is_terminal,
    log_outputs,
    step_log_path,
    summary_lines,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def terminal():
    """A real pseudo-terminal of 100 columns: ``(the stream a program writes to, read())``,
    ``read()`` giving everything written so far."""
    import fcntl
    import pty
    import struct
    import termios

    controller, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    stream = os.fdopen(follower, "w", buffering=1)
    os.set_blocking(controller, False)

    def read() -> str:
        stream.flush()
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    yield stream, read
    stream.close()
    os.close(controller)


def test_is_terminal_tells_a_terminal_from_a_pipe_and_a_file(terminal, tmp_path):
    stream, _ = terminal
    assert is_terminal(stream)
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe:
        assert not is_terminal(pipe)
    os.close(read_end)
    with open(tmp_path / "log.txt", "w") as f:
        assert not is_terminal(f)
    closed = open(tmp_path / "other.txt", "w")
    closed.close()
    assert not is_terminal(closed)  # "I/O operation on closed file" is not a terminal
    assert not is_terminal(types.SimpleNamespace())  # no isatty


def _run(steps: StepOutput, n: int = 3) -> list[str]:
    lines = [f"step {i} loss {0.5 / i:.6f}" for i in range(1, n + 1)]
    with steps:
        for line in lines:
            steps.step(line, loss=line.split()[-1][:6])
    return lines


def test_on_a_terminal_the_bar_is_the_only_per_step_output(terminal, tmp_path, caplog):
    stream, read = terminal
    log = step_log_path(tmp_path, "logs")
    handlers = list(logging.root.handlers)
    with caplog.at_level(logging.INFO, logger="diffusers_zero3"):
        lines = _run(StepOutput(3, log_file=log, stream=stream))
    shown = read()
    assert "3/3" in shown and "loss=" in shown, shown  # tqdm's bar, with its postfix
    assert not any(line in shown for line in lines), shown
    assert not [r for r in caplog.records if r.getMessage().startswith("step ")]  # nor logged
    assert log == tmp_path / "logs" / "train.log"
    assert log.read_text().splitlines() == lines
    assert logging.root.handlers == handlers  # the logging redirect is undone


def test_elsewhere_the_step_lines_print_unchanged_and_no_bar(tmp_path, caplog):
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    log = step_log_path(tmp_path, "logs")
    with os.fdopen(write_end, "w") as pipe, caplog.at_level(logging.INFO, logger="diffusers_zero3"):
        lines = _run(StepOutput(3, initial=0, log_file=log, stream=pipe))
    try:
        drawn = os.read(read_end, 65536).decode()
    except BlockingIOError:
        drawn = ""
    os.close(read_end)
    assert drawn == ""  # no bar into a pipe
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")] == lines
    assert log.read_text().splitlines() == lines


def test_only_the_process_that_draws_it_has_a_bar(terminal, tmp_path):
    stream, read = terminal
    _run(StepOutput(3, log_file=None, bar=False, stream=stream))
    assert read() == ""  # another rank on the same terminal: no second bar, no lines


def test_the_summary_names_only_what_exists(tmp_path, caplog):
    """A run without validation names no validation folder; one with it does."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "model_index.json").write_text("{}")
    (out / "logs" / "train.log").write_text("step 1 loss 0.5\n")
    outputs = [
        ("pipeline", out, "StableDiffusionPipeline.from_pretrained"),
        ("validation images", out / "validation"),
        ("step log", step_log_path(out, "logs")),
        ("TensorBoard logs", None),
    ]
    with caplog.at_level(logging.INFO, logger="diffusers_zero3"):
        lines = log_outputs(outputs)
    assert lines == [
        f"pipeline: {out.resolve()} (StableDiffusionPipeline.from_pretrained)",
        f"step log: {(out / 'logs' / 'train.log').resolve()}",
    ]
    assert "validation" not in caplog.text and "TensorBoard" not in caplog.text
    (out / "validation").mkdir()
    assert f"validation images: {(out / 'validation').resolve()}" in summary_lines(outputs)


@pytest.mark.parametrize("video", [False, True])
def test_the_trainers_summary_says_videos_for_a_video_family(tmp_path, video):
    from types import SimpleNamespace

    from diffusers_zero3.training.report import log_run_outputs, run_logs

    (tmp_path / "validation").mkdir()
    (tmp_path / "logs").mkdir()
    args = SimpleNamespace(output_dir=str(tmp_path), logging_dir="logs", report_to="none")
    lines = log_run_outputs(("pipeline", str(tmp_path), "WanPipeline.from_pretrained"), args, video)
    samples = "validation videos" if video else "validation images"
    assert lines == [
        f"pipeline: {tmp_path.resolve()} (WanPipeline.from_pretrained)",
        f"{samples}: {(tmp_path / 'validation').resolve()}",
    ], lines  # no train.log yet, no TensorBoard
    (tmp_path / "logs" / "train.log").write_text("step 1 loss 0.5\n")
    args.report_to = "tensorboard"
    assert summary_lines(run_logs(args)) == [
        f"step log: {(tmp_path / 'logs' / 'train.log').resolve()}",
        f"TensorBoard logs: {(tmp_path / 'logs').resolve()}",
    ]


def test_reward_curves_are_named_for_their_reward():
    from diffusers_zero3.recipes.grpo import reward_plot_name

    assert reward_plot_name("clip_score") == "rewards-clip_score.png"
    assert (
        reward_plot_name("diffusers_zero3.demo.rewards:redness")
        == "rewards-diffusers_zero3.demo.rewards-redness.png"
    )
    assert reward_plot_name("org/model name") == "rewards-org-model-name.png"
    assert reward_plot_name("a:b", taken={"rewards-a-b.png"}) == "rewards-a-b-2.png"
