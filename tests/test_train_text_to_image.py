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

# Every flag of diffusers' examples/text_to_image/train_text_to_image.py, with its default and what a
# value given for it becomes: flag -> (default, kind); kind is the type, bool for a store_true flag,
# list for nargs="+" of strings, or the tuple of choices. Read from its parse_args at
# huggingface/diffusers@58eb52c0803ea9af3abec60841c2a093bdf1f951 (Aug 2026); diffusers' own
# --image_interpolation_mode (added Apr 2025) is not accepted here yet.
DIFFUSERS_FLAGS = {
    "--pretrained_model_name_or_path": (None, str),
    "--revision": (None, str),
    "--variant": (None, str),
    "--dataset_name": (None, str),
    "--dataset_config_name": (None, str),
    "--train_data_dir": (None, str),
    "--image_column": ("image", str),
    "--caption_column": ("text", str),
    "--max_train_samples": (None, int),
    "--validation_prompts": (None, list),
    "--output_dir": ("sd-model-finetuned", str),
    "--cache_dir": (None, str),
    "--seed": (None, int),
    "--resolution": (512, int),
    "--center_crop": (False, bool),
    "--random_flip": (False, bool),
    "--train_batch_size": (16, int),
    "--num_train_epochs": (100, int),
    "--max_train_steps": (None, int),
    "--gradient_accumulation_steps": (1, int),
    "--gradient_checkpointing": (False, bool),
    "--learning_rate": (1e-4, float),
    "--scale_lr": (False, bool),
    "--lr_scheduler": ("constant", str),
    "--lr_warmup_steps": (500, int),
    "--snr_gamma": (None, float),
    "--dream_training": (False, bool),
    "--dream_detail_preservation": (1.0, float),
    "--use_8bit_adam": (False, bool),
    "--allow_tf32": (False, bool),
    "--use_ema": (False, bool),
    "--offload_ema": (False, bool),
    "--foreach_ema": (False, bool),
    "--non_ema_revision": (None, str),
    "--dataloader_num_workers": (0, int),
    "--adam_beta1": (0.9, float),
    "--adam_beta2": (0.999, float),
    "--adam_weight_decay": (1e-2, float),
    "--adam_epsilon": (1e-08, float),
    "--max_grad_norm": (1.0, float),
    "--push_to_hub": (False, bool),
    "--hub_token": (None, str),
    "--prediction_type": (None, str),
    "--hub_model_id": (None, str),
    "--logging_dir": ("logs", str),
    "--mixed_precision": (None, ("no", "fp16", "bf16")),
    "--report_to": ("tensorboard", str),
    "--local_rank": (-1, int),
    "--checkpointing_steps": (500, int),
    "--checkpoints_total_limit": (None, int),
    "--resume_from_checkpoint": (None, str),
    "--enable_xformers_memory_efficient_attention": (False, bool),
    "--noise_offset": (0, float),
    "--input_perturbation": (0, float),
    "--validation_epochs": (5, int),
    "--tracker_project_name": ("text2image-fine-tune", str),
}
# Defaults resolved when a run starts, from its host: None here, diffusers' default on the CPU
# (--dataloader_num_workers: 0 workers on the CPU; workers and pinned batches on a CUDA host,
# issue 51; the samples' draws do not depend on which process loads them).
RESOLVED_AT_START = {"--dataloader_num_workers"}


def _losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([0-9.]+)\b", output)}


def _common(pipe, data, out, steps=6):
    return [
        "--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--output_dir", str(out),
        "--resolution", "32", "--center_crop", "--train_batch_size", "2", "--max_train_steps", str(steps),
        "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "tensorboard",
    ]  # fmt: skip


def assert_trained_pipeline(out, source, steps: int, learning_rate: float, resolution: int = 32) -> None:
    """``out`` holds the pipeline trained from ``source`` for ``steps`` Adam steps:

    * its UNet files hold every tensor of the source's UNet, whole (the source's shapes: no
      empty ZeRO-3 placeholder), finite, changed, and moved by at most what the steps can move
      a weight (Adam moves one by about the learning rate per step; a tensor assembled from
      partitions in the wrong order, or another model's, is much further off);
    * its text encoder and VAE are the source's, tensor for tensor;
    * it loads as a pipeline and generates a finite, non-blank image of the training resolution.
    """
    import numpy as np
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    for name in ("unet", "text_encoder", "vae"):
        saved, original = weights(Path(out) / name), weights(Path(source) / name)
        assert original and saved.keys() == original.keys(), (name, sorted(saved.keys() ^ original.keys()))
        shapes = {k: tuple(v.shape) for k, v in saved.items() if v.shape != original[k].shape}
        assert not shapes, f"{name}: tensors of other shapes than the source's {shapes}"
        if name != "unet":
            assert all(torch.equal(saved[k], original[k]) for k in original), f"{name} is not the source's"
            continue
        moved = {k: (saved[k] - original[k]).abs().max().item() for k in original}
        assert all(np.isfinite(list(moved.values()))), "non-finite UNet weights"
        unchanged = [k for k, d in moved.items() if d == 0]
        assert not unchanged, f"UNet tensors the training did not change: {unchanged[:10]}"
        bound = 2 * steps * learning_rate
        far = {k: d for k, d in moved.items() if d > bound}
        assert not far, (
            f"UNet tensors moved more than {bound} by {steps} steps: {dict(list(far.items())[:10])}"
        )

    pipeline = StableDiffusionPipeline.from_pretrained(out)
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(
        "a red circle", num_inference_steps=2, height=resolution, width=resolution, output_type="np"
    ).images
    assert images.shape == (1, resolution, resolution, 3), images.shape
    assert np.isfinite(images).all() and images.std() > 0, "a blank or non-finite image"


@pytest.mark.unit
def test_parser_accepts_every_diffusers_flag(monkeypatch):
    """A launch command of diffusers' script means the same here: each flag's default (value and
    type), what a value given for it becomes (type, nargs, choices), the required model, and
    LOCAL_RANK and --non_ema_revision applied after parsing as diffusers' parse_args does."""
    from diffusers_zero3.data.loading import loader_settings
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    parse_args = TextToImageSettings.parse

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    required = ["--pretrained_model_name_or_path", "model"]
    with pytest.raises(SystemExit):  # required, as in diffusers
        parse_args([])
    defaults = vars(parse_args(required))
    for flag, (default, kind) in DIFFUSERS_FLAGS.items():
        dest = flag[2:]
        if flag in RESOLVED_AT_START:
            assert defaults[dest] is None, f"{flag} is resolved at start, not parsed to {defaults[dest]!r}"
            got = loader_settings("cpu", defaults[dest], 8).num_workers
            assert (got, type(got)) == (default, type(default)), f"{flag} resolves to {got!r} on the CPU"
        elif dest != "pretrained_model_name_or_path":
            got = defaults[dest]
            assert (got, type(got)) == (default, type(default)), (
                f"{flag} defaults to {got!r}, not {default!r}"
            )
        if isinstance(kind, tuple):
            for choice in kind:
                assert getattr(parse_args([*required, flag, choice]), dest) == choice, flag
            with pytest.raises(SystemExit):
                parse_args([*required, flag, "fp8"])
            continue
        if kind is bool:
            given, expected = [flag], True
        elif kind is list:  # nargs="+": one value or more
            with pytest.raises(SystemExit):
                parse_args([*required, flag])
            given, expected = [flag, "a red circle", "a blue square"], ["a red circle", "a blue square"]
        else:
            given, expected = [flag, "7"], kind("7")  # 7, 7.0 or "7"
        got = getattr(parse_args([*required, *given]), dest)
        assert (got, type(got)) == (expected, type(expected)), f"{given} parses to {got!r}, not {expected!r}"

    assert parse_args([*required, "--revision", "r"]).non_ema_revision == "r"
    monkeypatch.setenv("LOCAL_RANK", "1")  # launchers set it; it wins over --local_rank
    assert parse_args([*required, "--local_rank", "0"]).local_rank == 1


@pytest.mark.e2e
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
    # as a user types it after `make install`: accelerate's console command, the command module
    # (tests/test_commands.py: the console commands' own launches and errors)
    accelerate = [str(Path(sys.executable).parent / "accelerate"), "launch", *LAUNCH[3:-1]]
    module = ["-m", "diffusers_zero3.commands.train_text_to_image"]
    _, log = run_launcher([*accelerate, *module, *_common(pipe, data, out), *extra], timeout=400)
    losses = _losses(log)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], log[-3000:]
    assert "placement plan (--*_placement auto)" in log and "auto placements: vae=replicate" in log
    # The logged memory report, and the planner's model states within 10 % of the measured ones.
    assert "memory per rank (maximum over ranks)" in log and "first backward" in log
    logged = dict(re.findall(r"(\w+) ([\d.]+) MiB", log.split("model states per rank: ")[1].splitlines()[0]))
    from diffusers_zero3.placement.plan import PlanOptions, make_plan

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
    # the model card's snippet runs as printed (its call: validation's 3 steps at 32 px)
    from tests.common import run_card_snippet

    (tmp_path / "card").mkdir()
    assert run_card_snippet(out, tmp_path / "card")["image"].size == (32, 32)
    assert (tmp_path / "card" / "image.png").exists()
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


@pytest.mark.e2e
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
    assert_trained_pipeline(out, pipe, steps=4, learning_rate=1e-3)


# --------------------------------------------------------------------------- bad input


def _plain(argv, expect_rc):
    return run_launcher([sys.executable, SCRIPT, *argv], timeout=200, expect_rc=expect_rc)[1]


@pytest.mark.e2e
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
    # the CPU keeps diffusers' loader (a CUDA host gets workers and pinned batches), said once
    assert log.count("data loader: 0 worker processes (chosen for a cpu host), batches not pinned") == 1
    assert (tmp_path / "plain" / "model_index.json").exists()


@pytest.mark.e2e
def test_corrupt_image_is_skipped_with_a_warning(default_data, tmp_path):
    pipe, data, _ = default_data
    broken = tmp_path / "data"
    shutil.copytree(data, broken)
    Path(broken / "00003.png").write_bytes(b"not a png at all")
    log = _plain([*_common(pipe, str(broken), tmp_path / "out", steps=3), "--report_to", "none"], expect_rc=0)
    assert "skipping row 3: unreadable image" in log
    assert "skipped 1 unreadable image row(s)" in log


@pytest.mark.e2e
def test_dead_rank_makes_the_other_exit_instead_of_hanging(default_data, tmp_path):
    """Without torchrun's agent (e.g. under srun or a bare launcher) a killed rank must not
    leave the other waiting forever: its next collective fails and it exits non-zero."""
    import os
    import signal
    import subprocess
    import time

    from diffusers_zero3.testing import free_port, rank_env
    from tests.distributed_harness import _test_env

    PG_TIMEOUT_S = 30  # --process_group_timeout of the run
    pipe, data, _ = default_data
    argv = [sys.executable, SCRIPT, *_common(pipe, data, tmp_path / "dead", steps=200)]
    argv += ["--report_to", "none", "--process_group_timeout", str(PG_TIMEOUT_S)]
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
        # Rank 0's next collective fails on the dead rank's closed sockets (a second here) and
        # it leaves at once (run_script's os._exit): well within the collective timeout, the
        # most run_script promises. An exit only after the timeout means rank 0 sat it out.
        hang_s = PG_TIMEOUT_S + 120  # waits past the timeout, so that a late exit is told from a hang
        try:
            rc = procs[0].wait(timeout=hang_s)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"rank 0 still running {hang_s} s after rank 1 died (a hang)\n" + logs[0].read_text()[-3000:]
            )
        waited = time.monotonic() - killed_at
        log = logs[0].read_text()
        assert rc != 0, log[-3000:]
        assert waited < PG_TIMEOUT_S, (
            f"rank 0 exited {waited:.1f} s after rank 1 died, past the {PG_TIMEOUT_S} s collective timeout\n"
            f"{log[-3000:]}"
        )
        assert "Traceback" in log, log[-3000:]  # the collective's error, not a silent exit
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.unit
def test_caption_dropout_keeps_the_text_encoders_live():
    """An 'auto' cache of a text encoder becomes live under caption dropout (the cache holds each
    row's own caption); without dropout, and for the VAE, the cache stays (the controls)."""
    from diffusers_zero3.families import family_named
    from diffusers_zero3.placement.plan import live_text_for_caption_dropout

    sdxl = family_named("sdxl")
    chosen = {"text_encoder": "cache", "text_encoder_2": "cache", "vae": "cache"}
    auto = {"text_encoder": "auto", "text_encoder_2": "auto", "vae": "auto"}
    assert live_text_for_caption_dropout(chosen, auto, sdxl, 0.0) == chosen
    live = {"text_encoder": "shard", "text_encoder_2": "shard", "vae": "cache"}
    assert live_text_for_caption_dropout(chosen, auto, sdxl, 0.1) == live
    replicated = live_text_for_caption_dropout(chosen, auto, sdxl, 0.1, live="replicate")
    assert replicated["text_encoder"] == "replicate"
