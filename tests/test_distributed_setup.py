"""Process-group setup outside and inside accelerate: each rank's GPU before NCCL starts
(``init_distributed_if_needed``) and NCCL's error handling (``enable_nccl_error_handling``).

No GPU exists on the test machine: ``torch.cuda`` is replaced by a stand-in that records what
is asked of it, and ``deepspeed.init_distributed`` by a recorder, so the order of the calls
is what is checked.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.unit

NCCL_VARS = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
)


@pytest.fixture
def clean_nccl_env(monkeypatch):
    for name in NCCL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _record_init(monkeypatch, calls: list) -> None:
    import deepspeed

    monkeypatch.setattr(deepspeed.comm, "is_initialized", lambda: False)
    monkeypatch.setattr(
        deepspeed,
        "init_distributed",
        lambda *a, **k: calls.append(("init_distributed", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))),
    )


def _fake_cuda(monkeypatch, calls: list, count: int = 2) -> None:
    """A stand-in for a CUDA host with ``count`` GPUs, on device 0 until set_device."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    def set_device(device):
        calls.append(("set_device", device))
        current[0] = device

    monkeypatch.setattr(torch.cuda, "set_device", set_device)


def test_init_distributed_selects_the_local_gpu_before_the_process_group(clean_nccl_env):
    from diffusers_zero3.runtime.distributed import init_distributed_if_needed

    monkeypatch, calls = clean_nccl_env, []
    monkeypatch.setenv("LOCAL_RANK", "1")
    _fake_cuda(monkeypatch, calls)
    _record_init(monkeypatch, calls)
    init_distributed_if_needed()
    # rank 1's GPU first, then NCCL's error handling, then the process group
    assert calls == [("set_device", 1), ("init_distributed", "1")]


def test_init_distributed_on_one_visible_gpu_per_process_keeps_device_0(clean_nccl_env):
    from diffusers_zero3.runtime.distributed import init_distributed_if_needed

    monkeypatch, calls = clean_nccl_env, []
    monkeypatch.setenv("LOCAL_RANK", "1")  # CUDA_VISIBLE_DEVICES gives each process its own GPU
    _fake_cuda(monkeypatch, calls, count=1)
    _record_init(monkeypatch, calls)
    init_distributed_if_needed()
    assert calls == [("init_distributed", "1")]


def test_init_distributed_on_a_cpu_host_sets_no_device(clean_nccl_env):
    from diffusers_zero3.runtime.distributed import init_distributed_if_needed

    monkeypatch, calls = clean_nccl_env, []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    _record_init(monkeypatch, calls)
    init_distributed_if_needed()
    assert calls == [("init_distributed", "1")]


def test_init_distributed_does_nothing_once_started(clean_nccl_env):
    import deepspeed

    from diffusers_zero3.runtime.distributed import init_distributed_if_needed

    monkeypatch, calls = clean_nccl_env, []
    _fake_cuda(monkeypatch, calls)
    _record_init(monkeypatch, calls)
    monkeypatch.setattr(deepspeed.comm, "is_initialized", lambda: True)
    init_distributed_if_needed()
    assert calls == []


def test_nccl_error_handling_on_cuda_and_cpu_hosts(clean_nccl_env):
    from diffusers_zero3.runtime.distributed import enable_nccl_error_handling

    monkeypatch = clean_nccl_env
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert enable_nccl_error_handling() == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert enable_nccl_error_handling() == {
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert enable_nccl_error_handling() == {}  # idempotent


def test_nccl_error_handling_keeps_what_the_user_set(clean_nccl_env):
    from diffusers_zero3.runtime.distributed import enable_nccl_error_handling

    monkeypatch = clean_nccl_env
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")  # the old name still counts
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    assert enable_nccl_error_handling() == {"TORCH_NCCL_ENABLE_MONITORING": "1"}
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_build_accelerator_sets_nccl_error_handling_before_the_process_group(clean_nccl_env):
    import accelerate

    from diffusers_zero3 import build_accelerator

    monkeypatch, seen = clean_nccl_env, []

    class RecordingAccelerator:  # stands for accelerate's, which creates the process group
        def __init__(self, **kwargs):
            seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    monkeypatch.setattr(accelerate, "Accelerator", RecordingAccelerator)
    import torch.distributed.distributed_c10d as c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):  # restored after the test
        monkeypatch.setattr(c10d, name, getattr(c10d, name), raising=False)
    build_accelerator()
    assert seen == ["1"]
