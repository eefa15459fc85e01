"""Non-finite updates (issue 54, item 2): a non-finite loss on one rank skips that update on
every rank (weights, optimizer moments, schedule and EMA bit for bit as before it), is counted,
and more than ``--max_nonfinite_steps`` skips in a row stop the job with one error naming the
step and the rank. The real text-to-image trainer on 2 ranks, under ZeRO-3 (fp32, bf16) and
DDP, the GRPO and reward trainers under ZeRO-3; the loss of rank 1 is made NaN at chosen steps."""

from __future__ import annotations

import pytest

from diffusers_zero3.testing import DDP_ENV, ZERO3_ENV
from tests.distributed_harness import run_on_ranks
from tests.test_parts_numerics import _diff, _part_state, _same

pytestmark = pytest.mark.multirank


def _wrong_moves(states: list[dict], poisoned: list[int]) -> list[str]:
    """What moved over a poisoned (0-based) step or stayed over a clean one, from the part's
    states at each step's start and at the end (``_part_state``; a schedule when there is one)."""
    moved = []
    for step, (before, after) in enumerate(zip(states, states[1:])):
        for kind in ("weights", "moments", "ema"):
            if _same(before[kind], after[kind]) == (step not in poisoned):
                moved.append(f"step {step + 1}: {kind} {'stayed' if step not in poisoned else 'moved'}: "
                             f"{_diff(before[kind], after[kind])}")  # fmt: skip
        lr = (before["position"]["last_epoch"], after["position"]["last_epoch"])
        if lr[0] is not None and (lr[0] == lr[1]) != (step in poisoned):
            moved.append(f"step {step + 1}: schedule {lr}")
    return moved


def _poisoned_run(pipe: str, data: str, out: str, mixed_precision: str, poisoned: list[int], limit: int):
    """Train 4 steps with rank 1's loss NaN at the (0-based) steps ``poisoned``; print the
    parts' states at each step's start and the outcome."""
    import torch

    from diffusers_zero3.recipes.text_to_image import TextToImageTrainer
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings
    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.training.faults import NonFiniteError

    argv = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--train_batch_size", "1", "--max_train_steps", "4", "--learning_rate", "1e-3",
            "--lr_scheduler", "linear", "--lr_warmup_steps", "0", "--adam_weight_decay", "0.1", "--seed", "0",
            "--report_to", "none", "--use_ema", "--checkpointing_steps", "100", "--mixed_precision", mixed_precision,
            "--max_nonfinite_steps", str(limit), "--output_dir", out]  # fmt: skip
    trainer = TextToImageTrainer(TextToImageSettings.parse(argv))
    trainer.setup()
    part = trainer.denoiser_part
    states: list[dict] = []
    loss = trainer.loss

    def poisoned_loss(batch):
        if len(states) == trainer.global_step:  # the step's first micro-batch
            states.append(_part_state(part))
        value = loss(batch)
        if get_rank() == 1 and trainer.global_step in poisoned:
            value = value * float("nan")
        return value

    trainer.loss = poisoned_loss
    try:
        trainer.train()
    except NonFiniteError as e:
        print(f"STOPPED {e}")
        return
    states.append(_part_state(part))
    moved = _wrong_moves(states, poisoned)
    assert not moved, "\n".join(moved)
    assert len(states) == 5 and trainer.nonfinite.skipped == len(poisoned), (
        len(states),
        trainer.nonfinite.skipped,
    )
    weights = states[-1]["weights"] + states[-1]["ema"]["shadow"]
    assert all(torch.isfinite(w).all() for w in weights), "a non-finite value reached the weights or the EMA"
    print(f"TRAINED skipped {trainer.nonfinite.skipped}")


@pytest.mark.parametrize(
    "env, mixed_precision",
    [(ZERO3_ENV, "no"), (ZERO3_ENV, "bf16"), (DDP_ENV, "no")],
    ids=["zero3-fp32", "zero3-bf16", "ddp"],
)
def test_a_nan_loss_on_one_rank_skips_the_update_on_every_rank(
    tiny_pipeline, default_data, tmp_path, env, mixed_precision
):
    _, data, _ = default_data
    outputs = run_on_ranks(
        _poisoned_run, pipe=tiny_pipeline, data=data, out=str(tmp_path / "out"), mixed_precision=mixed_precision,
        poisoned=[1], limit=3, env=env, timeout=300,
    )  # fmt: skip
    assert all("TRAINED skipped 1" in o for o in outputs), outputs


def test_more_skips_in_a_row_than_the_limit_stop_the_job_naming_the_step_and_rank(
    tiny_pipeline, default_data, tmp_path
):
    _, data, _ = default_data
    outputs = run_on_ranks(
        _poisoned_run, pipe=tiny_pipeline, data=data, out=str(tmp_path / "out"), mixed_precision="no",
        poisoned=[1, 2, 3], limit=1, env=ZERO3_ENV, timeout=300,
    )  # fmt: skip
    for output in outputs:  # the first skip is tolerated, the second in a row (step 3) stops every rank
        assert (
            "STOPPED step 3: 2 updates in a row skipped" in output and "a non-finite loss on rank 1" in output
        ), output


def _poisoned_grpo_rounds(pipe_dir: str, out: str) -> None:
    """Two GRPO rounds (one optimizer step each): the first applies (the control; after it the
    EMA lags the weights, so an EMA step would move it), rank 1's loss is NaN in the second,
    whose update every rank skips (state bit for bit, EMA included)."""
    from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer
    from diffusers_zero3.runtime.distributed import get_rank

    settings = GRPOSettings.parse([
        "--pretrained_model_name_or_path", pipe_dir, "--reward", "diffusers_zero3.demo.rewards:redness",
        "--output_dir", out, "--prompts", "a red circle", "a blue square", "--group_size", "2",
        "--resolution", "32", "--num_inference_steps", "3", "--timestep_fraction", "0.67",
        "--sample_batch_size", "2", "--train_batch_size", "2", "--report_to", "none", "--seed", "3", "--use_ema",
        "--ema_update_every", "1",
    ])  # fmt: skip
    trainer = GRPOTrainer(settings)
    trainer.setup()
    loss = trainer._loss
    poison = {"on": False}

    def poisoned_loss(*args, **kwargs):
        value, stats = loss(*args, **kwargs)
        if poison["on"] and get_rank() == 1:
            value = value * float("nan")
        return value, stats

    trainer._loss = poisoned_loss
    states = [_part_state(trainer.part)]
    for round_index in range(2):
        batch = trainer.sample_round(round_index)
        trainer.score_round(batch)
        trainer.train_round(batch)
        states.append(_part_state(trainer.part))
        poison["on"] = True
    for kind in ("weights", "moments", "ema"):
        assert not _same(states[0][kind], states[1][kind]), f"the clean round left the {kind}"
        skipped = _same(states[1][kind], states[2][kind])
        assert skipped, f"the skipped round moved the {kind}: {_diff(states[1][kind], states[2][kind])}"
    assert trainer.nonfinite.skipped == 1, trainer.nonfinite.skipped
    print("GRPO skipped 1")


def test_grpo_skips_a_round_update_with_a_nan_loss_on_one_rank(tiny_sd3, tmp_path):
    outputs = run_on_ranks(_poisoned_grpo_rounds, pipe_dir=tiny_sd3[0], out=str(tmp_path / "out"),
                           env={**ZERO3_ENV, "ACCELERATE_MIXED_PRECISION": "no"}, timeout=300)  # fmt: skip
    assert all("GRPO skipped 1" in o for o in outputs), outputs


def _poisoned_reward_steps(pipe: str, reward: str, out: str) -> None:
    """The reward trainer, 5 steps, ``--max_nonfinite_steps 1``, rank 1's loss NaN at steps 2,
    4 and 5: step 2 is skipped on every rank (state bit for bit; the step after it applies and
    resets the count), the skips of steps 4 and 5 are two in a row: every rank stops at step 5."""
    import torch

    from diffusers_zero3.recipes.reward import RewardSettings, RewardTrainer
    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.training.faults import NonFiniteError

    poisoned = [1, 3, 4]  # 0-based
    argv = ["--pretrained_model_name_or_path", pipe, "--reward_model_name_or_path", reward,
            "--prompts", "a red circle", "a blue square", "--resolution", "32", "--train_batch_size", "1",
            "--num_inference_steps", "2", "--max_train_steps", "5", "--learning_rate", "1e-3",
            "--adam_weight_decay", "0.1", "--use_ema", "--checkpointing_steps", "100", "--report_to", "none",
            "--max_nonfinite_steps", "1", "--output_dir", out]  # fmt: skip
    trainer = RewardTrainer(RewardSettings.parse(argv))
    trainer.setup()
    states: list[dict] = []
    loss = trainer._loss

    def poisoned_loss(prompts):
        states.append(_part_state(trainer.part))  # one call per step, at its start
        value, *rest = loss(prompts)
        if get_rank() == 1 and trainer.global_step in poisoned:
            value = value * float("nan")
        return (value, *rest)

    trainer._loss = poisoned_loss
    try:
        trainer.train()
    except NonFiniteError as e:
        print(f"STOPPED {e}")
    states.append(_part_state(trainer.part))
    moved = _wrong_moves(states, poisoned)
    assert not moved, "\n".join(moved)
    assert len(states) == 6 and trainer.nonfinite.skipped == 3, (len(states), trainer.nonfinite.skipped)
    weights = states[-1]["weights"] + states[-1]["ema"]["shadow"]
    assert all(torch.isfinite(w).all() for w in weights), "a non-finite value reached the weights or the EMA"


def test_the_reward_trainer_skips_a_nan_update_on_every_rank_and_stops_past_the_limit(default_data, tmp_path):
    pipe, _, reward = default_data
    outputs = run_on_ranks(_poisoned_reward_steps, pipe=pipe, reward=reward, out=str(tmp_path / "out"),
                           env=ZERO3_ENV, timeout=300)  # fmt: skip
    assert "step 2: update skipped for a non-finite loss on rank 1 (1 in a row, 1 in all;" in outputs[0], (
        outputs
    )
    for output in outputs:  # step 4's skip is tolerated, the second in a row (step 5) stops every rank
        assert (
            "STOPPED step 5: 2 updates in a row skipped" in output and "a non-finite loss on rank 1" in output
        ), output
