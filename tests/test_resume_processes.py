"""scripts/train_text_to_image.py resumed on another number of processes, same global batch
(processes x --train_batch_size): a checkpoint of 2 ZeRO-3 ranks goes on with 4 ranks, and
resumed at its final step with 1 rank it writes the same output as the 2-rank run (whole
fine-tune with EMA, and LoRA with EMA)."""

from __future__ import annotations

import shutil

import pytest

from tests.distributed_harness import accelerate_launch, run_launcher, run_launchers_side_by_side, step_values

pytestmark = pytest.mark.e2e


def _argv(pipe, data, out, processes: int, batch: int, extra: list[str]) -> list[str]:
    return [*accelerate_launch("scripts/train_text_to_image.py", num_processes=processes),
            "--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--output_dir", str(out),
            "--resolution", "32", "--center_crop", "--train_batch_size", str(batch), "--max_train_steps", "4",
            "--checkpointing_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3",
            "--report_to", "none", "--use_ema", *extra]  # fmt: skip


def _resume_run(argv: list[str], source, folder, checkpoint: str) -> dict:
    """A run for ``run_launchers_side_by_side``: ``folder`` holds a copy of ``source/checkpoint``
    and ``argv`` resumes from it."""
    folder.mkdir()
    shutil.copytree(source / checkpoint, folder / checkpoint)
    return {"argv": [*argv, "--resume_from_checkpoint", "latest"]}


@pytest.mark.parametrize("lora", [False, True], ids=["full-ema", "lora-ema"])
def test_resume_on_four_and_on_one_process(default_data, tmp_path, lora):
    pipe, data, _ = default_data
    extra = ["--rank", "4"] if lora else ["--text_encoder_placement", "shard"]
    out = tmp_path / "n2"
    _, log = run_launcher(_argv(pipe, data, out, 2, 2, extra), timeout=500)
    assert sorted(step_values(log)) == [1, 2, 3, 4], log[-3000:]
    output = "pytorch_lora_weights.safetensors" if lora else "unet/diffusion_pytorch_model.safetensors"

    # The resumes below read `out` alone: they run side by side.
    runs = {}
    if not lora:  # the mechanism is the same for LoRA's engine: one continued run is enough
        for name, processes in (("n4", 4), ("n3", 3)):
            folder = tmp_path / name
            runs[name] = _resume_run(
                _argv(pipe, data, folder, processes, 1, extra), out, folder, "checkpoint-2"
            )
        runs["n3"]["expect_rc"] = None
    one = tmp_path / "n1"
    runs["n1"] = _resume_run(_argv(pipe, data, one, 1, 4, extra), out, one, "checkpoint-4")
    if lora:  # a smaller global batch, two more steps (issue 49, defect 1): 1 x 2 on 16 images
        more = tmp_path / "n1-more"
        runs["more"] = _resume_run(
            _argv(pipe, data, more, 1, 2, [*extra, "--max_train_steps", "6"]), out, more, "checkpoint-4"
        )
    results = dict(zip(runs, run_launchers_side_by_side(list(runs.values()), timeout=500)))

    if not lora:
        # 2 -> 4 processes at step 2 (batch 1 per process): steps 3 and 4 are trained from
        # the first sample neither of the 2 ranks had seen (batch 2 of each rank's epoch).
        four = tmp_path / "n4"
        _, log4 = results["n4"]
        assert "written by 2 processes; resharded for 4 (batch 2 of epoch 0 next)" in log4, log4[-3000:]
        continued, uninterrupted = step_values(log4), step_values(log)
        assert sorted(continued) == [3, 4], log4[-3000:]
        # The same global batches (2 x 2 = 4 x 1), each sample with its own noise and timestep
        # (seed, epoch, index), and the optimizer state re-cut exactly: the losses go on as the
        # 2-process run's. They differ only by the order of floating-point sums (a mean over 2
        # samples per rank and 2 ranks, or 1 and 4; a different GEMM shape): about 1e-7 here, so
        # 1e-5 absolute on losses of about 0.1 to 1.
        for step in (3, 4):
            assert continued[step] == pytest.approx(uninterrupted[step], abs=1e-5), (
                step,
                continued,
                uninterrupted,
            )
        assert (four / output).exists()
        assert (four / "checkpoint-2" / "universal" / "pytorch_model").is_dir()

        # 8 samples done cannot resume at a step boundary of 3 processes x batch 1: one error
        # line that says what to keep, before anything is loaded or written.
        three = tmp_path / "n3"
        rc, log3 = results["n3"]
        assert rc != 0
        assert "error: cannot resume from step 2" in log3, log3[-3000:]
        assert "keep processes x --train_batch_size at 4" in log3, log3[-3000:]
        assert sorted(p.name for p in three.iterdir()) == ["checkpoint-2"]
        assert not (three / "checkpoint-2" / "universal").exists()

    # 2 -> 1 process at the final step: the output is the 2-rank run's, byte for byte.
    _, log1 = results["n1"]
    assert "resharded for 1" in log1 and not step_values(log1), log1[-3000:]
    assert (one / output).read_bytes() == (out / output).read_bytes()

    if lora:
        # 2 x 2 ended epoch 0 at step 4 (16 images); on 1 x 2 an epoch is 8 steps, and the
        # epochs were counted as ceil(6 / 8) = 1 (range(1, 1)): exit 0, no step, the model of
        # step 4 written as final. Steps 5 and 6 are trained, from epoch 1's first batch.
        rc, log_more = results["more"]
        assert rc == 0 and "(batch 0 of epoch 1 next)" in log_more, log_more[-3000:]
        assert sorted(step_values(log_more)) == [5, 6], log_more[-3000:]
        assert (more / output).read_bytes() != (out / output).read_bytes()
