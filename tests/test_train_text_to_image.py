"""scripts/train_text_to_image.py end to end: 2 ZeRO-3 ranks under `accelerate launch`, resume,
the cache placement, bad inputs, and diffusers' flags."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import accelerate_launch, run_launcher

SCRIPT = "scripts/train_text_to_image.py"
LAUNCH = accelerate_launch(SCRIPT)

DIFFUSERS_FLAGS = """--pretrained_model_name_or_path --revision --variant --dataset_name --dataset_config_name
--train_data_dir --image_column --caption_column --max_train_samples --validation_prompts --output_dir --cache_dir
--seed --resolution --center_crop --random_flip --train_batch_size --num_train_epochs --max_train_steps
--gradient_accumulation_steps --gradient_checkpointing --learning_rate --scale_lr --lr_scheduler --lr_warmup_steps
--snr_gamma --dream_training --dream_detail_preservation --use_8bit_adam --allow_tf32 --use_ema --offload_ema
--foreach_ema --non_ema_revision --dataloader_num_workers --adam_beta1 --adam_beta2 --adam_weight_decay
--adam_epsilon --max_grad_norm --prediction_type --logging_dir --mixed_precision --report_to --local_rank
--checkpointing_steps --checkpoints_total_limit --resume_from_checkpoint
--enable_xformers_memory_efficient_attention --noise_offset --input_perturbation --validation_epochs
--tracker_project_name""".split()


def _losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([0-9.]+)\b", output)}


def _common(pipe, data, out, steps=6):
    return [
        "--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--output_dir", str(out),
        "--resolution", "32", "--center_crop", "--train_batch_size", "2", "--max_train_steps", str(steps),
        "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "tensorboard",
    ]  # fmt: skip


def test_parser_accepts_every_diffusers_flag():
    from diffusers_zero3.args import text_to_image_parser

    known = {s for a in text_to_image_parser()._actions for s in a.option_strings}
    missing = [f for f in DIFFUSERS_FLAGS if f not in known]
    assert not missing, missing
    argv = []
    for action in text_to_image_parser()._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv.append(flag)
        elif action.choices:
            argv += [flag, list(action.choices)[0]]
        elif action.type in (int, float):
            argv += [flag, "1"]
        else:
            argv += [flag, "x"]
    from diffusers_zero3.args import parse_args

    args = parse_args(argv)
    assert args.use_ema and args.train_batch_size == 1 and args.validation_prompts == ["x"]


def test_end_to_end_zero3_ema_shard_checkpoint_validation_and_resume(default_data, tmp_path):
    pipe, data, _ = default_data
    out = tmp_path / "run"
    extra = ["--use_ema", "--text_encoder_placement", "shard", "--checkpointing_steps", "3"]
    extra += ["--vae_placement", "auto"]  # the planner: a tiny VAE fits replicated
    extra += [
        "--checkpoints_total_limit",
        "2",
        "--validation_prompts",
        "a red circle",
        "--validation_steps",
        "6",
    ]
    extra += ["--num_validation_inference_steps", "3"]
    _, log = run_launcher([*LAUNCH, *_common(pipe, data, out), *extra], timeout=400)
    losses = _losses(log)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], log[-3000:]
    assert "placement plan (--*_placement auto)" in log and "auto placements: vae=replicate" in log
    # The logged memory report, and the planner's model states within 10 % of the measured ones.
    assert "memory per rank (maximum over ranks)" in log and "first backward" in log
    logged = dict(re.findall(r"(\w+) ([\d.]+) MiB", log.split("model states per rank: ")[1].splitlines()[0]))
    from diffusers_zero3.plan import PlanOptions, make_plan

    plan = make_plan(pipe, PlanOptions(num_processes=2, use_ema=True))["components"]["unet"]["placements"]
    for kind in ("parameters", "gradients", "optimizer", "ema"):
        planned = plan["shard"][kind] / 2**20
        assert abs(float(logged[kind]) - planned) <= 0.1 * planned, (kind, logged, planned)

    # The output folder: a loadable pipeline whose UNet was trained, plus checkpoints, images, logs.
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    pipeline = StableDiffusionPipeline.from_pretrained(out)
    image = pipeline("a red circle", num_inference_steps=2, height=32, width=32).images[0]
    assert image.size == (32, 32)
    before = UNet2DConditionModel.from_pretrained(pipe, subfolder="unet")
    changed = [not torch.equal(a, b) for a, b in zip(pipeline.unet.parameters(), before.parameters())]
    assert all(changed) and all(torch.isfinite(p).all() for p in pipeline.unet.parameters())
    assert (out / "README.md").read_text().startswith("---")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    ck = out / "checkpoint-3"
    assert {"ema_rank0.pt", "ema_rank1.pt", "training_state.json", "random_states_1.pkl"} <= {
        p.name for p in ck.iterdir()
    }
    assert not list(out.glob(".tmp-*"))
    assert (out / "validation" / "step-000006.png").exists()
    assert list((out / "logs").rglob("events.out.tfevents*"))

    # Resume from checkpoint-3 in a fresh folder: steps 4-6 repeat the uninterrupted losses.
    # With --checkpoints_total_limit 1 the checkpoint written after the resume is the one kept.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(ck, resumed / "checkpoint-3")
    _, log2 = run_launcher(
        [*LAUNCH, *_common(pipe, data, resumed), "--use_ema", "--text_encoder_placement", "shard",
         "--checkpointing_steps", "3", "--checkpoints_total_limit", "1", "--resume_from_checkpoint", "latest"],
        timeout=400,
    )  # fmt: skip
    again = _losses(log2)
    assert sorted(again) == [4, 5, 6], log2[-3000:]
    for step in (4, 5, 6):
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    assert sorted(p.name for p in resumed.glob("checkpoint-*")) == ["checkpoint-6"]


def test_cache_placement_end_to_end(default_data, tmp_path):
    pipe, data, _ = default_data
    out = tmp_path / "cached"
    extra = ["--text_encoder_placement", "cache", "--vae_placement", "cache", "--random_flip"]
    extra += [
        "--validation_prompts",
        "a red circle",
        "--validation_steps",
        "4",
        "--num_validation_inference_steps",
        "2",
    ]
    _, log = run_launcher([*LAUNCH, *_common(pipe, data, out, steps=4), *extra], timeout=400)
    assert sorted(_losses(log)) == [1, 2, 3, 4]
    assert "encoding 16 rows" in log
    cache_dirs = [p for p in (out / "frozen_cache").iterdir() if not p.name.startswith(".")]
    assert len(cache_dirs) == 1
    meta = json.loads((cache_dirs[0] / "meta.json").read_text())
    assert set(meta["tensors"]) == {"encoder_hidden_states", "latent_params", "latent_params_flipped"}
    assert (out / "validation" / "step-000004.png").exists()  # validation reloads the cached models
    from diffusers import StableDiffusionPipeline

    assert StableDiffusionPipeline.from_pretrained(out).unet is not None


# --------------------------------------------------------------------------- bad input


def _plain(argv, expect_rc):
    return run_launcher([sys.executable, SCRIPT, *argv], timeout=200, expect_rc=expect_rc)[1]


def test_single_process_without_deepspeed_runs(default_data, tmp_path):
    pipe, data, _ = default_data
    objective = [
        "--dream_training",
        "--snr_gamma",
        "5",
        "--noise_offset",
        "0.1",
        "--input_perturbation",
        "0.1",
    ]
    log = _plain(
        [*_common(pipe, data, tmp_path / "plain", steps=2), "--report_to", "none", *objective,
         "--text_encoder_placement", "auto"],
        expect_rc=0,
    )  # fmt: skip
    assert sorted(_losses(log)) == [1, 2]
    assert "auto placements: text_encoder=replicate" in log  # without DeepSpeed nothing is sharded
    assert (tmp_path / "plain" / "model_index.json").exists()


def test_corrupt_image_is_skipped_with_a_warning(default_data, tmp_path):
    pipe, data, _ = default_data
    broken = tmp_path / "data"
    shutil.copytree(data, broken)
    Path(broken / "00003.png").write_bytes(b"not a png at all")
    log = _plain([*_common(pipe, str(broken), tmp_path / "out", steps=3), "--report_to", "none"], expect_rc=0)
    assert "skipping row 3: unreadable image" in log
    assert "skipped 1 unreadable image row(s)" in log


def test_dead_rank_makes_the_other_exit_instead_of_hanging(default_data, tmp_path):
    """Without torchrun's agent (e.g. under srun or a bare launcher) a killed rank must not
    leave the other waiting forever: its next collective fails and it exits non-zero."""
    import os
    import signal
    import subprocess
    import time

    from diffusers_zero3.testing import free_port, rank_env
    from tests.distributed_harness import _test_env

    pipe, data, _ = default_data
    argv = [sys.executable, SCRIPT, *_common(pipe, data, tmp_path / "dead", steps=200)]
    argv += ["--report_to", "none", "--process_group_timeout", "30"]
    accelerate_env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_MIXED_PRECISION": "no",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    port = free_port()
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with open(logs[r], "w") as fh:
            env = rank_env(r, 2, port, _test_env(accelerate_env))
            procs.append(
                subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            )
    try:
        deadline = time.monotonic() + 240
        while "step 2 loss" not in logs[0].read_text() and time.monotonic() < deadline:
            assert procs[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        assert "step 2 loss" in logs[0].read_text(), logs[0].read_text()[-3000:]
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            rc = procs[0].wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(
                "rank 0 still running 90 s after rank 1 died (a hang)\n" + logs[0].read_text()[-3000:]
            )
        assert rc != 0
        assert time.monotonic() - killed_at < 90
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
