"""diffusers_zero3.runtime.launch: one process per GPU on a CUDA host, 2 CPU ranks with
DS_ACCELERATOR=cpu elsewhere (what `make train`, `train-reward`, `train-dpo` launch), and
the `make smoke-gpu` refusal on a host without CUDA. CUDA is faked by monkeypatching torch."""

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
    script += '; echo "CVD=${CUDA_VISIBLE_DEVICES-unset}"'
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}
    )
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_cuda_host_gets_one_process_per_gpu_and_no_ds_accelerator(monkeypatch):
    _fake_gpus(monkeypatch, 4)
    settings = launch_settings({})
    assert settings == LaunchSettings(4, "cuda", {})
    assert _eval(settings) == {"N": "4", "DS": "unset", "CVD": "unset"}
    assert launch_settings({"NUM_PROCESSES": "2"}).num_processes == 2
    with pytest.raises(ValueError, match="NUM_PROCESSES=8 but this host has 4 CUDA device"):
        launch_settings({"NUM_PROCESSES": "8"})


def test_cpu_host_keeps_two_cpu_ranks(monkeypatch):
    _fake_gpus(monkeypatch, 0)
    settings = launch_settings({})
    assert settings == LaunchSettings(2, "cpu", {"DS_ACCELERATOR": "cpu"})
    assert _eval(settings) == {"N": "2", "DS": "cpu", "CVD": "unset"}
    assert launch_settings({"NUM_PROCESSES": "3"}).num_processes == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="NUM_PROCESSES must be a positive integer"):
            launch_settings({"NUM_PROCESSES": bad})


def test_ds_accelerator_cpu_on_a_cuda_host_hides_the_gpus(monkeypatch):
    """Asking for CPU ranks on a GPU host: gloo for accelerate too, not NCCL beside them."""
    _fake_gpus(monkeypatch, 2)
    settings = launch_settings({"DS_ACCELERATOR": "cpu"})
    assert settings == LaunchSettings(2, "cpu", {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    assert _eval(settings) == {"N": "2", "DS": "cpu", "CVD": ""}


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_smoke_gpu_refuses_a_host_without_cuda():
    proc = subprocess.run(
        [sys.executable, "scripts/smoke_gpu.py"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == "error: make smoke-gpu needs a CUDA GPU (none found)"


def _script(name: str):
    """``scripts/<name>.py`` as a module (its ``main`` is not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"scripts_{name}"] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _smoke_module():
    return _script("smoke_gpu")


def test_smoke_gpu_reads_the_device_peak_of_the_memory_report():
    """The table's peak column parses the trainer's own report (MemoryLog.format); a CPU
    report has no device numbers: n/a."""
    from diffusers_zero3.runtime.memory import MIB, MemoryLog, PhaseMemory

    smoke = _smoke_module()
    gpu = [
        PhaseMemory("after prepare", 10 * MIB, 20 * MIB, 0.0, 5 * MIB, 1536 * MIB, 2048 * MIB),
        PhaseMemory("first backward", 10 * MIB, 20 * MIB, 1.0, 5 * MIB, 3072 * MIB, 4096 * MIB),
    ]
    log = "step 2 loss 0.5\nmemory per rank (maximum over ranks):\n" + MemoryLog.format(gpu)
    assert smoke.device_peak_gib(log) == pytest.approx(3.0, abs=1e-3)
    cpu = [PhaseMemory("after prepare", 10 * MIB, 20 * MIB, 0.0)]
    assert smoke.device_peak_gib(MemoryLog.format(cpu)) is None
    rows = [
        ("a", {"result": "ok", "seconds": 1.25, "peak": 3.0}),
        ("b", {"result": "timeout", "seconds": 9, "peak": None}),
    ]
    assert smoke.format_table(rows).splitlines()[2:] == [
        "| a | ok | 1.2 | 3.00 |",
        "| b | timeout | 9.0 | n/a |",
    ]


def test_smoke_gpu_cases_and_their_selection():
    smoke = _smoke_module()
    assert [c.name for c in smoke.select_cases("")] == [c.name for c in smoke.CASES]
    names = [smoke.CASES[3].name, smoke.CASES[0].name]
    assert [c.name for c in smoke.select_cases(",".join(names))] == names[::-1]  # the matrix's order
    with pytest.raises(ValueError, match="unknown case"):
        smoke.select_cases("no-such-case")
    assert len({c.name for c in smoke.CASES}) == len(smoke.CASES)
    # every case's flags parse with its script's own parser
    from pathlib import Path

    from diffusers_zero3.args import parse_args

    parsers = {
        "t2i": parse_args,
        "reward": _script("train_reward").parse_args,
        "dpo": _script("train_dpo").parse_args,
    }
    for case in smoke.CASES:
        argv = smoke.case_argv(case, Path("/data"), Path("/run"), smoke.STEPS)
        assert argv[0] == smoke.SCRIPTS[case.script]
        args = parsers[case.script](argv[1:])
        assert args.max_train_steps == smoke.STEPS and args.checkpointing_steps == smoke.STEPS, case.name
