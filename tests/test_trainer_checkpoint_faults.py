"""Checkpoint faults through the real trainers (issue 54, items 4 and 5): the text-to-image and
GRPO trainers on 2 ZeRO-3 ranks, each launch under the scripts' exit protocol (``run_script``,
its ``os._exit`` noted instead of taken), three launches per trainer on one output folder:

1. A full disk on rank 1 while the scheduled checkpoint-3 is written (DeepSpeed's optimizer
   partition of rank 1 goes into ``/dev/full``): both ranks exit 2 with one ``error:`` line
   naming the file and ENOSPC; checkpoints 1 and 2 are intact, checkpoint-2 is the latest, no
   ``.tmp-*`` folder is left.
2. Checkpoint-2 then truncated: ``--resume_from_checkpoint latest`` exits 2 with one
   ``error:`` line naming the file and "(truncated)", nothing trained.
3. ``--resume_from_checkpoint latest --resume_fallback``: resumes checkpoint-1 (checkpoint-2
   renamed ``abandoned-checkpoint-2``) and trains to step 3, exit 0.

The library-level cases (every file of a checkpoint, each damage) are tests/test_checkpoint_faults.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusers_zero3.testing import ZERO3_ENV
from tests.distributed_harness import run_on_ranks
from tests.test_checkpoint_faults import _damage, _full_disk

pytestmark = pytest.mark.multirank

FULL = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # rank 1's DeepSpeed optimizer partition
TRUNCATED = "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"  # what _damage(.., "truncate") cuts


def _launch(make_trainer, full_disk_at: int | None, trained: str = "trained_steps") -> None:
    """Build, set up and train the trainer ``make_trainer()`` gives under ``run_script``, the
    scripts' exit protocol; with ``full_disk_at``, rank 1's file ``FULL`` of that step's
    checkpoint (and of no other) is written into ``/dev/full``. Prints ``EXIT <status>`` and
    ``TRAINED <steps this launch trained>`` (the trainer's attribute ``trained``), then leaves as ``run_script`` would have."""
    import os
    import sys
    from unittest import mock

    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.runtime.user_errors import error_claim_path
    from diffusers_zero3.training.job import run_script

    if get_rank() == 0:
        # The ranks' parent (the harness's fork server) outlives a launch: a claim to print the
        # error line left by an earlier launch would silence this one's (a real launcher is new).
        # Before setup's first collective, so before any rank can claim.
        error_claim_path(os.getppid()).unlink(missing_ok=True)
    made = []

    def body() -> None:
        trainer = make_trainer()
        made.append(trainer)
        trainer.setup()
        checkpoint = trainer._checkpoint

        def checkpoint_on_a_full_disk(*args):
            at = trainer.global_step == full_disk_at and get_rank() == 1
            with _full_disk(FULL if at else None):
                checkpoint(*args)

        trainer._checkpoint = checkpoint_on_a_full_disk
        trainer.train()

    real_exit = os._exit
    # run_script leaves a distributed rank with os._exit(status): note the status instead
    with mock.patch("os._exit", side_effect=SystemExit) as leave:
        try:
            run_script(body)
        except SystemExit:
            pass
    print(f"EXIT {leave.call_args.args[0] if leave.called else None}")
    print(f"TRAINED {vars(made[0])[trained] if made else None}")
    sys.stdout.flush()
    sys.stderr.flush()
    real_exit(0)  # as run_script leaves (every rank is past its last collective)


def _t2i(pipe: str, data: str, out: str, flags: list[str], full_disk_at: int | None) -> None:
    """The text-to-image trainer to step 3, a checkpoint every step."""
    from diffusers_zero3.recipes.text_to_image import TextToImageTrainer
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    argv = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--train_batch_size", "1", "--max_train_steps", "3", "--learning_rate", "1e-3", "--seed", "0",
            "--report_to", "none", "--checkpointing_steps", "1", "--output_dir", out, *flags]  # fmt: skip
    _launch(lambda: TextToImageTrainer(TextToImageSettings.parse(argv)), full_disk_at)


def _grpo(pipe: str, out: str, flags: list[str], full_disk_at: int | None) -> None:
    """GRPO to round 3, a checkpoint every round."""
    from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer

    argv = ["--pretrained_model_name_or_path", pipe, "--reward", "diffusers_zero3.demo.rewards:redness",
            "--output_dir", out, "--prompts", "a red circle", "a blue square", "--group_size", "2",
            "--resolution", "32", "--num_inference_steps", "2", "--timestep_fraction", "0.5",
            "--max_train_steps", "3", "--sample_batch_size", "2", "--train_batch_size", "2",
            "--report_to", "none", "--seed", "3", "--checkpointing_steps", "1", *flags]  # fmt: skip

    _launch(lambda: GRPOTrainer(GRPOSettings.parse(argv)), full_disk_at, "trained_rounds")


def _errors(outputs: list[str]) -> list[str]:
    return [line for o in outputs for line in o.splitlines() if line.startswith("error:")]


def _checkpoints(out: Path) -> list[str]:
    """The checkpoint folders of ``out`` and any hidden entry (a ``.tmp-*`` left by a save)."""
    return sorted(p.name for p in out.iterdir() if "checkpoint" in p.name or p.name.startswith("."))


def _checks(run, out: Path, step_word: str) -> None:
    """The three launches on ``out``; ``run(flags, full_disk_at)`` launches the trainer on 2 ranks."""
    from diffusers_zero3.state.manifest import manifest_problems
    from diffusers_zero3.state.resume import list_checkpoints

    # 1. a full disk while checkpoint-3 is written: exit 2 on both ranks, one error line
    full = run([], 3)
    assert all("EXIT 2" in o for o in full), full
    errors = _errors(full)
    assert len(errors) == 1, errors
    assert FULL in errors[0] and "checkpoint-3" in errors[0], errors
    assert "no space left on device (ENOSPC)" in errors[0], errors
    assert _checkpoints(out) == ["checkpoint-1", "checkpoint-2"]
    assert list_checkpoints(out)[-1].name == "checkpoint-2"
    for step in (1, 2):
        assert manifest_problems(out / f"checkpoint-{step}") == [], step  # intact

    # 2. checkpoint-2 damaged: the resume stops before anything is loaded or trained
    _damage(out / "checkpoint-2", "truncate")
    refused = run(["--resume_from_checkpoint", "latest"], None)
    assert all("EXIT 2" in o and "TRAINED 0" in o for o in refused), refused
    errors = _errors(refused)
    assert len(errors) == 1, errors
    assert TRUNCATED in errors[0] and "(truncated)" in errors[0], errors
    assert _checkpoints(out) == ["checkpoint-1", "checkpoint-2"]

    # 3. --resume_fallback: checkpoint-1 resumed, checkpoint-2 abandoned, the run finished
    resumed = run(["--resume_from_checkpoint", "latest", "--resume_fallback"], None)
    assert all("EXIT 0" in o and "TRAINED 2" in o for o in resumed), resumed
    assert not _errors(resumed), resumed
    assert "--resume_fallback: not resuming checkpoint-2" in resumed[0], resumed[0][-3000:]
    assert f"resumed from {out / 'checkpoint-1'} at {step_word} 1" in resumed[0], resumed[0][-3000:]
    assert _checkpoints(out) == [
        "abandoned-checkpoint-2", "checkpoint-1", "checkpoint-2", "checkpoint-3"
    ]  # fmt: skip
    assert list_checkpoints(out)[-1].name == "checkpoint-3"


def test_the_text_to_image_trainer_stops_on_a_full_disk_and_refuses_then_falls_back_from_a_damaged_checkpoint(
    default_data, tiny_pipeline, tmp_path
):
    _, data, _ = default_data
    out = tmp_path / "out"

    def run(flags, full_disk_at):
        return run_on_ranks(_t2i, pipe=tiny_pipeline, data=data, out=str(out), flags=flags,
                            full_disk_at=full_disk_at, env=ZERO3_ENV, timeout=300)  # fmt: skip

    _checks(run, out, "step")


def test_the_grpo_trainer_stops_on_a_full_disk_and_refuses_then_falls_back_from_a_damaged_checkpoint(
    tiny_sd3, tmp_path
):
    out = tmp_path / "out"

    def run(flags, full_disk_at):
        return run_on_ranks(_grpo, pipe=tiny_sd3[0], out=str(out), flags=flags, full_disk_at=full_disk_at,
                            env=ZERO3_ENV, timeout=300)  # fmt: skip

    _checks(run, out, "round")
