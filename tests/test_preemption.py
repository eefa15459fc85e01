"""Preemption (issue 54, item 1): a SIGTERM (what SLURM and Kubernetes send before they kill a
job) reaching one rank mid-step makes every rank finish that step, publish its checkpoint by the
scheduled path and stop (``Preempted``, exit status 75 from ``run_script``);
``--resume_from_checkpoint latest`` then ends with the uninterrupted run's weights, optimizer
moments and EMA. The real text-to-image and reward trainers on 2 ZeRO-3 ranks; the GRPO loop
stops alike after its round."""

from __future__ import annotations

import pytest

from diffusers_zero3.testing import ZERO3_ENV
from tests.distributed_harness import run_on_ranks
from tests.test_parts_numerics import _diff, _part_state, _same


def _assert_resumed_equals_whole(folder) -> None:
    """Each rank's weights, Adam moments and EMA saved by the resumed run (``resumed-<rank>.pt``)
    equal the uninterrupted run's (``whole-<rank>.pt``) bit for bit."""
    import torch

    for rank in (0, 1):
        a = torch.load(folder / f"whole-{rank}.pt", weights_only=False)
        b = torch.load(folder / f"resumed-{rank}.pt", weights_only=False)
        for kind in ("weights", "moments", "ema"):
            assert _same(a[kind], b[kind]), (
                f"rank {rank}'s {kind} after the resume: {_diff(a[kind], b[kind])}"
            )


def _run(pipe: str, data: str, out: str, signal_at: int | None, resume: bool, states: str) -> None:
    """Train to step 4 (``resume``: from ``out``'s latest checkpoint); with ``signal_at``, rank 1
    sends itself SIGTERM during that (0-based) step. Saves this rank's final state to
    ``states`` + rank, or prints how the run stopped."""
    import os
    import signal

    import torch

    from diffusers_zero3.recipes.text_to_image import TextToImageTrainer
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings
    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.training.faults import Preempted

    argv = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--train_batch_size", "1", "--max_train_steps", "4", "--learning_rate", "1e-3", "--seed", "0",
            "--lr_scheduler", "linear", "--lr_warmup_steps", "0", "--report_to", "none", "--use_ema",
            "--checkpointing_steps", "3", "--output_dir", out]  # fmt: skip
    if resume:
        argv += ["--resume_from_checkpoint", "latest"]
    trainer = TextToImageTrainer(TextToImageSettings.parse(argv))
    trainer.setup()
    loss = trainer.loss

    def signalled_loss(batch):
        if get_rank() == 1 and trainer.global_step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # noted by the handler; the step goes on
        return loss(batch)

    trainer.loss = signalled_loss
    try:
        trainer.train()
    except Preempted as e:
        print(f"PREEMPTED at {trainer.global_step}: {e}")
        return
    torch.save(_part_state(trainer.denoiser_part), f"{states}{get_rank()}.pt")
    print(f"FINISHED at {trainer.global_step}")


@pytest.mark.multirank
def test_a_sigterm_checkpoints_the_step_and_the_resume_equals_the_uninterrupted_run(
    tiny_pipeline, default_data, tmp_path
):

    _, data, _ = default_data
    common = dict(pipe=tiny_pipeline, data=data, env=ZERO3_ENV, timeout=300)
    whole = run_on_ranks(_run, out=str(tmp_path / "whole"), signal_at=None, resume=False,
                         states=str(tmp_path / "whole-"), **common)  # fmt: skip
    assert all("FINISHED at 4" in o for o in whole), whole
    out = tmp_path / "preempted"
    stopped = run_on_ranks(
        _run, out=str(out), signal_at=1, resume=False, states=str(tmp_path / "x-"), **common
    )
    # the signal came during step 2 (checkpoints are scheduled every 3): step 2 finished, its checkpoint published
    assert all("PREEMPTED at 2: preempted at step 2 (" in o for o in stopped), stopped
    assert "(SIGTERM)" in stopped[1] and "(a signal on another rank)" in stopped[0], stopped
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"] and not list(
        out.glob(".tmp-*")
    )
    resumed = run_on_ranks(
        _run, out=str(out), signal_at=None, resume=True, states=str(tmp_path / "resumed-"), **common
    )
    assert all("FINISHED at 4" in o for o in resumed), resumed
    _assert_resumed_equals_whole(tmp_path)


@pytest.mark.unit
def test_save_on_signal_names_signals_a_process_can_catch():
    from diffusers_zero3.training.faults import parse_signals

    assert [s.name for s in parse_signals("SIGTERM, usr1")] == ["SIGTERM", "SIGUSR1"]
    assert parse_signals("none") == ()
    for bad in ("SIGKILL", "SIGBOGUS"):
        with pytest.raises(ValueError, match="not a signal a process can catch"):
            parse_signals(bad)


def _grpo_signalled(pipe_dir: str, out: str) -> None:
    """GRPO, 3 rounds asked; rank 1 signals itself during the first round's training."""
    import os
    import signal

    from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer
    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.training.faults import Preempted

    settings = GRPOSettings.parse([
        "--pretrained_model_name_or_path", pipe_dir, "--reward", "diffusers_zero3.demo.rewards:redness",
        "--output_dir", out, "--prompts", "a red circle", "a blue square", "--group_size", "2",
        "--resolution", "32", "--num_inference_steps", "3", "--timestep_fraction", "0.67", "--max_train_steps", "3",
        "--sample_batch_size", "2", "--train_batch_size", "2", "--report_to", "none", "--seed", "3",
        "--checkpointing_steps", "10",
    ])  # fmt: skip
    trainer = GRPOTrainer(settings)
    trainer.setup()
    loss = trainer._loss

    def signalled_loss(*args, **kwargs):
        if get_rank() == 1 and trainer.global_step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss(*args, **kwargs)

    trainer._loss = signalled_loss
    try:
        trainer.train()
    except Preempted as e:
        print(f"PREEMPTED at {trainer.global_step}: {e}")


@pytest.mark.multirank
def test_grpo_stops_after_the_round_with_its_checkpoint(tiny_sd3, tmp_path):
    out = tmp_path / "out"
    outputs = run_on_ranks(_grpo_signalled, pipe_dir=tiny_sd3[0], out=str(out), env=ZERO3_ENV, timeout=300)
    assert all("PREEMPTED at 1: preempted after round 1" in o for o in outputs), outputs
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]


def _reward_run(pipe: str, reward: str, out: str, signal_at: int | None, resume: bool, states: str) -> None:
    """The reward trainer to step 4 (``resume``: from ``out``'s latest checkpoint). With
    ``signal_at``, rank 1 sends itself SIGTERM during that (0-based) step and ``train`` runs
    under ``run_script`` (the scripts' exit protocol): prints how it stopped, its exit status
    and, on rank 1, the seconds from the signal to the exit. Else saves this rank's final state
    to ``states`` + rank."""
    import os
    import signal
    import time
    from unittest import mock

    import torch

    from diffusers_zero3.recipes.reward import RewardSettings, RewardTrainer
    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.training.faults import Preempted
    from diffusers_zero3.training.job import run_script

    argv = ["--pretrained_model_name_or_path", pipe, "--reward_model_name_or_path", reward,
            "--prompts", "a red circle", "a blue square", "--resolution", "32", "--train_batch_size", "1",
            "--num_inference_steps", "2", "--max_train_steps", "4", "--learning_rate", "1e-3",
            "--use_ema", "--checkpointing_steps", "3", "--report_to", "none", "--output_dir", out]  # fmt: skip
    if resume:
        argv += ["--resume_from_checkpoint", "latest"]
    trainer = RewardTrainer(RewardSettings.parse(argv))
    trainer.setup()
    loss, sent = trainer._loss, []

    def signalled_loss(prompts):
        if get_rank() == 1 and trainer.global_step == signal_at:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)  # noted by the handler; the step goes on
        return loss(prompts)

    trainer._loss = signalled_loss
    if signal_at is None:
        trainer.train()
        torch.save(_part_state(trainer.part), f"{states}{get_rank()}.pt")
        print(f"FINISHED at {trainer.global_step}")
        return

    def body() -> None:
        try:
            trainer.train()
        except Preempted as e:
            print(f"PREEMPTED at {trainer.global_step}: {e}")
            raise

    # run_script leaves a distributed rank with os._exit(status): note the status instead
    with mock.patch("os._exit", side_effect=SystemExit) as leave:
        try:
            run_script(body)
        except SystemExit:
            pass
    took = f" {time.monotonic() - sent[0]:.2f}s after the signal" if sent else ""
    print(f"EXIT {leave.call_args.args[0] if leave.called else None}{took}")


@pytest.mark.multirank
def test_the_reward_trainer_checkpoints_the_signalled_step_exits_75_and_resumes_exactly(
    default_data, tmp_path
):

    pipe, _, reward = default_data
    common = dict(pipe=pipe, reward=reward, env=ZERO3_ENV, timeout=300)
    whole = run_on_ranks(_reward_run, out=str(tmp_path / "whole"), signal_at=None, resume=False,
                         states=str(tmp_path / "whole-"), **common)  # fmt: skip
    assert all("FINISHED at 4" in o for o in whole), whole
    out = tmp_path / "preempted"
    stopped = run_on_ranks(
        _reward_run, out=str(out), signal_at=1, resume=False, states=str(tmp_path / "x-"), **common
    )
    # the signal came during step 2 (checkpoints are scheduled every 3): step 2 finished, its checkpoint published
    assert all("PREEMPTED at 2: preempted at step 2 (" in o and "EXIT 75" in o for o in stopped), stopped
    assert "(SIGTERM)" in stopped[1] and "(a signal on another rank)" in stopped[0], stopped
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"] and not list(
        out.glob(".tmp-*")
    )
    resumed = run_on_ranks(
        _reward_run, out=str(out), signal_at=None, resume=True, states=str(tmp_path / "resumed-"), **common
    )
    assert all("FINISHED at 4" in o for o in resumed), resumed
    _assert_resumed_equals_whole(tmp_path)
