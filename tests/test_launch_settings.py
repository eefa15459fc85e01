"""diffusers_zero3.runtime.launch: one process per GPU on a CUDA host, 2 CPU ranks with
DS_ACCELERATOR=cpu elsewhere (what `make train`, `train-reward`, `train-dpo` launch). CUDA is
faked by monkeypatching torch. `make smoke-gpu`'s own tests are in test_smoke_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from diffusers_zero3.runtime.launch import LaunchSettings, launch_settings
from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit


def _fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _eval(settings: LaunchSettings) -> dict[str, str]:
    """The variables a shell has after ``eval`` of the settings' lines."""
    script = settings.shell() + '\necho "N=$NUM_PROCESSES"; echo "DS=${DS_ACCELERATOR-unset}"'
    script += '; echo "CVD=${CUDA_VISIBLE_DEVICES-unset}"; echo "CONFIG=$(basename "$CONFIG")"'
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}
    )
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_cuda_host_gets_one_process_per_gpu_and_no_ds_accelerator(monkeypatch):
    _fake_gpus(monkeypatch, 4)
    settings = launch_settings({})
    assert settings == LaunchSettings(4, "cuda", {})
    # bf16 on GPUs (the default targets ran the fp32 config there)
    assert _eval(settings) == {
        "N": "4",
        "DS": "unset",
        "CVD": "unset",
        "CONFIG": "accelerate_zero3_bf16.yaml",
    }
    assert settings.config.is_file()
    assert launch_settings({"NUM_PROCESSES": "2"}).num_processes == 2
    with pytest.raises(ValueError, match="NUM_PROCESSES=8 but this host has 4 CUDA device"):
        launch_settings({"NUM_PROCESSES": "8"})


def test_cpu_host_keeps_two_cpu_ranks(monkeypatch):
    _fake_gpus(monkeypatch, 0)
    settings = launch_settings({})
    assert settings == LaunchSettings(2, "cpu", {"DS_ACCELERATOR": "cpu"})
    assert _eval(settings) == {"N": "2", "DS": "cpu", "CVD": "unset", "CONFIG": "accelerate_zero3.yaml"}
    assert settings.config.is_file()
    assert launch_settings({"NUM_PROCESSES": "3"}).num_processes == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="NUM_PROCESSES must be a positive integer"):
            launch_settings({"NUM_PROCESSES": bad})


def test_ds_accelerator_cpu_on_a_cuda_host_hides_the_gpus(monkeypatch):
    """Asking for CPU ranks on a GPU host: gloo for accelerate too, not NCCL beside them."""
    _fake_gpus(monkeypatch, 2)
    settings = launch_settings({"DS_ACCELERATOR": "cpu"})
    assert settings == LaunchSettings(2, "cpu", {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    assert _eval(settings) == {"N": "2", "DS": "cpu", "CVD": "", "CONFIG": "accelerate_zero3.yaml"}


def test_command_line_on_this_host_and_bad_override():
    """``python -m diffusers_zero3.runtime.launch`` prints the assignments (stdout) the default
    scripts eval; a bad NUM_PROCESSES is an error line and exit status 2."""
    run = [sys.executable, "-m", "diffusers_zero3.runtime.launch"]
    ok = subprocess.run(run, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    expected = launch_settings().shell()  # this host and environment, whatever they are
    assert ok.stdout.strip() == expected
    env = {**os.environ, "NUM_PROCESSES": "x"}
    bad = subprocess.run(run, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1] == "error: NUM_PROCESSES must be a positive integer, got 'x'"
