"""Checkpoint rotation, rollback, resume checks, atomic outputs, the accelerator on CPU, and
the log filter: single-process units and one 2-rank run."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import run_on_ranks


def _fake_checkpoint(out: Path, step: int, world_size: int = 1) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "training_state.json").write_text(json.dumps({"global_step": step, "world_size": world_size}))
    for r in range(world_size):
        (path / f"random_states_{r}.pkl").write_bytes(b"")
    return path


def _names(out: Path, prefix: str = "checkpoint-") -> list[str]:
    return sorted(
        (p.name for p in out.iterdir() if p.name.startswith(prefix)), key=lambda n: int(n.split("-")[-1])
    )


# --------------------------------------------------------------------------- rotation and rollback


@pytest.mark.unit
def test_rotation_keeps_the_newest_by_step_and_the_new_one(tmp_path):
    from diffusers_zero3.state.resume import prune_checkpoints

    for step in (2, 4):
        _fake_checkpoint(tmp_path, step)
    # A resumed run (from checkpoint-4) writes 6, then 8, with a limit of 2.
    _fake_checkpoint(tmp_path, 6)
    prune_checkpoints(tmp_path, 2)
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-6"]
    _fake_checkpoint(tmp_path, 8)
    prune_checkpoints(tmp_path, 2)
    assert _names(tmp_path) == ["checkpoint-6", "checkpoint-8"]
    _fake_checkpoint(tmp_path, 10)
    prune_checkpoints(tmp_path, 1)
    assert _names(tmp_path) == ["checkpoint-10"]  # with limit 1 the new one survives
    with pytest.raises(ValueError, match="at least 1"):
        prune_checkpoints(tmp_path, 0)


@pytest.mark.unit
def test_rollback_abandons_newer_checkpoints_so_latest_and_rotation_ignore_them(tmp_path):
    from diffusers_zero3.state.resume import (
        abandon_newer_checkpoints,
        prune_checkpoints,
        resolve_resume_checkpoint,
    )

    for step in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, step)
    moved = abandon_newer_checkpoints(tmp_path, 4)
    assert sorted(p.name for p in moved) == ["abandoned-checkpoint-6", "abandoned-checkpoint-8"]
    assert resolve_resume_checkpoint(tmp_path, "latest").name == "checkpoint-4"
    _fake_checkpoint(tmp_path, 6)  # the new run's step 6
    prune_checkpoints(tmp_path, 1)
    assert _names(tmp_path) == ["checkpoint-6"]
    assert _names(tmp_path, "abandoned-") == ["abandoned-checkpoint-6", "abandoned-checkpoint-8"]
    # Rolling back again keeps both abandoned folders of step 6.
    abandon_newer_checkpoints(tmp_path, 2)
    assert {p.name for p in tmp_path.iterdir()} >= {"abandoned-checkpoint-6", "abandoned-checkpoint-6.1"}


@pytest.mark.unit
def test_resume_with_another_world_size_needs_every_saved_ranks_files(tmp_path):
    """A checkpoint of 2 processes resumed by 1: this rank re-cuts every saved rank's state,
    so it must see all of them (the control: one file missing is one error naming it)."""
    from diffusers_zero3.state.pretrained import CheckpointError
    from diffusers_zero3.state.resume import check_resumable

    path = _fake_checkpoint(tmp_path, 4, world_size=2)
    assert check_resumable(path)["world_size"] == 2
    (path / "random_states_1.pkl").unlink()
    with pytest.raises(
        CheckpointError, match=r"incomplete as seen from rank 0 \(missing random_states_1.pkl"
    ):
        check_resumable(path)
    assert check_resumable(_fake_checkpoint(tmp_path, 6, world_size=1))["global_step"] == 6


@pytest.mark.unit
@pytest.mark.parametrize("prefix", ["", "bf16_"])
def test_a_deepspeed_checkpoint_is_resumable_in_fp32_and_bf16(tmp_path, prefix):
    """Under bf16 DeepSpeed names the optimizer states ``bf16_zero_pp_rank_*``: every bf16
    run was refused at resume ("incomplete ... missing ..._optim_states.pt")."""
    from diffusers_zero3.state.pretrained import CheckpointError
    from diffusers_zero3.state.resume import check_resumable

    path = _fake_checkpoint(tmp_path, 2)
    model = path / "pytorch_model"
    model.mkdir()
    (model / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(
        CheckpointError, match=r"missing pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states"
    ):
        check_resumable(path)  # the control: no optimizer states at all
    (model / f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert check_resumable(path)["global_step"] == 2


@pytest.mark.unit
def test_ema_shards_are_not_unpickled(tmp_path):
    """A pickle that runs code is refused (weights_only=True); plain tensors load."""
    from diffusers_zero3.state.pretrained import CheckpointError
    from diffusers_zero3.state.resume import load_ema_shard

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("true",))

    bad = tmp_path / "ema_rank0.pt"
    torch.save({"shadow": [torch.ones(2)], "payload": RunsCode()}, bad)
    with pytest.raises(CheckpointError, match="not a plain tensor file"):
        load_ema_shard(bad)
    good = tmp_path / "ema_ok.pt"
    torch.save({"shadow": [torch.ones(2)], "names": ["w"], "decay": 0.9}, good)
    assert load_ema_shard(good)["names"] == ["w"]


@pytest.mark.unit
def test_interrupted_writes_are_removed_at_start(tmp_path):
    from diffusers_zero3.state.folders import remove_interrupted_writes

    for name in (".tmp-checkpoint-4", ".old-unet-1234abcd", ".tmp-pipeline-99"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    _fake_checkpoint(tmp_path, 2)
    removed = remove_interrupted_writes(tmp_path)
    assert len(removed) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


# --------------------------------------------------------------------------- final output


@pytest.mark.unit
def test_output_dir_in_the_source_and_bad_component_names_are_refused(tiny_pipeline, tmp_path):
    import shutil

    from diffusers_zero3.state.pipeline_io import check_output_dir, pipeline_components
    from diffusers_zero3.state.pretrained import CheckpointError

    for out in (tiny_pipeline, os.path.join(tiny_pipeline, "run"), os.path.join(tiny_pipeline, "unet", "x")):
        with pytest.raises(CheckpointError, match="is the source pipeline folder"):
            check_output_dir(out, tiny_pipeline)
    check_output_dir(tmp_path / "elsewhere", tiny_pipeline)

    source = tmp_path / "src"
    shutil.copytree(tiny_pipeline, source)
    assert "unet" in pipeline_components(source)
    for bad in ("../escape", "/abs/olute", ".."):
        index = json.loads((Path(tiny_pipeline) / "model_index.json").read_text())
        index[bad] = ["diffusers", "AutoencoderKL"]
        (source / "model_index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="not a plain folder name"):
            pipeline_components(source)


@pytest.mark.unit
def test_failed_save_leaves_the_previous_output_complete(tiny_pipeline, tmp_path):
    import shutil

    from diffusers import UNet2DConditionModel

    from diffusers_zero3.state.pipeline_io import save_final_pipeline
    from diffusers_zero3.state.pretrained import CheckpointError

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    out = tmp_path / "out"
    save_final_pipeline(tiny_pipeline, out, unet, readme="first")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert Path("model_index.json") in before

    # A source whose VAE folder cannot be copied (a dangling link): the save fails late,
    # after the UNet was written.
    broken = tmp_path / "broken-src"
    shutil.copytree(tiny_pipeline, broken)
    (broken / "vae" / "dangling.bin").symlink_to(tmp_path / "nowhere")
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(1.0)
    with pytest.raises(CheckpointError, match="pipeline failed on rank 0: Error"):
        save_final_pipeline(broken, out, unet, readme="second")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


# --------------------------------------------------------------------------- log filter


@pytest.mark.unit
def test_only_deepspeeds_collective_deprecations_are_filtered():
    from diffusers_zero3.runtime.accelerator import silence_deepspeed_collective_deprecations

    msg = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `all_gather_single`."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(msg, FutureWarning, stacklevel=1)  # positive control: seen before the filter
        silence_deepspeed_collective_deprecations()
        warnings.warn(msg, FutureWarning, stacklevel=1)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("`torch.distributed.some_other_call` is deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
    assert [str(w.message)[:40] for w in caught] == [
        msg[:40],
        "`torch.distributed.some_other_call` is d",
        "an unrelated warning",
    ]


# --------------------------------------------------------------------------- 2 ranks


_KEPT_UNTIL_EXIT: list = []


def _ranks_resolve_check_and_ddp(work: str):
    from accelerate.utils import DistributedType

    from diffusers_zero3 import build_accelerator, get_rank
    from diffusers_zero3.state.pretrained import CheckpointError
    from diffusers_zero3.state.resume import check_resumable, resolve_resume_checkpoint

    rank = get_rank() if torch.distributed.is_initialized() else int(os.environ["RANK"])

    # torchrun-style launch without DeepSpeed on a CPU host: really distributed (DDP).
    accelerator = build_accelerator()
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    assert accelerator.num_processes == 2
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    x = torch.full((2, 4), float(rank + 1))  # different data on each rank
    accelerator.backward(model(x).pow(2).mean())
    opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(2)]
    torch.distributed.all_gather(gathered, weights)
    assert torch.equal(gathered[0], gathered[1]), "ranks trained different replicas"

    # `latest` is rank 0's answer on every rank, even where a rank's listing differs (here
    # each rank has an output folder of its own, as machines with node-local disks do).
    mine = Path(work) / f"rank{rank}"
    _fake_checkpoint(mine, 4 if rank == 0 else 6, world_size=2)
    resolved = resolve_resume_checkpoint(mine, "latest")
    assert resolved == mine / "checkpoint-4", resolved

    # That checkpoint is not on rank 1's disk: one clear error on both ranks.
    with pytest.raises(CheckpointError, match="incomplete as seen from rank 1 .*shares"):
        check_resumable(resolved)

    # The scripts end their trackers with finish_trackers, which keeps the process group for
    # the exit protocol; accelerate's end_training (the control) destroys it.
    from diffusers_zero3.training.job import finish_trackers

    finish_trackers(accelerator)
    assert torch.distributed.is_initialized()
    accelerator.end_training()
    assert not torch.distributed.is_initialized()
    # Kept until the rank's os._exit: freeing the DDP model here would run the destroyed
    # group's ~ProcessGroupGloo with the GIL held while a gloo worker thread waits for the GIL
    # (a deadlock seen in 1 of 5 runs; the scripts never free their process group either).
    _KEPT_UNTIL_EXIT.append((accelerator, model, opt))


@pytest.mark.multirank
def test_two_ranks_ddp_on_cpu_latest_from_rank_zero_and_node_local_checkpoints(tmp_path):
    run_on_ranks(_ranks_resolve_check_and_ddp, work=str(tmp_path), env={"ACCELERATE_USE_DEEPSPEED": "false"})


def _rank_zero_loads_a_pipeline_alone(pipe_dir: str):
    from diffusers import StableDiffusionPipeline

    from diffusers_zero3 import barrier, get_rank, is_zero3_enabled
    from tests.common import accelerator_with_zero3

    accelerator_with_zero3(zero3_init_flag=True)  # accelerate registers transformers' ZeRO-3 config
    assert is_zero3_enabled()
    if get_rank() == 0:  # the naive pattern: look at a sample on rank 0 only
        pipe = StableDiffusionPipeline.from_pretrained(pipe_dir)
        image = pipe("a red circle", num_inference_steps=2, height=32, width=32).images[0]
        assert image.size == (32, 32)
    barrier()
    print("OK rank-0 load")


@pytest.mark.multirank
def test_a_from_pretrained_on_rank_zero_alone_does_not_hang(tiny_pipeline):
    """transformers partitions every from_pretrained while accelerate's ZeRO-3 config is
    registered, with collectives the other ranks never join: this hung until the timeout."""
    outs = run_on_ranks(
        _rank_zero_loads_a_pipeline_alone,
        pipe_dir=tiny_pipeline,
        timeout=90,
        env={"DIFFUSERS_ZERO3_PG_TIMEOUT": "40"},
    )
    assert "OK rank-0 load" in outs[0]


def _ranks_leave_no_shared_memory():
    import glob

    from tests.common import accelerator_with_zero3

    accelerator_with_zero3()
    # LOCAL_SIZE is set (no numactl subprocess at every reduce-scatter), but only after
    # DeepSpeed's backend started: set before, DeepSpeed maps a 66 MiB all-reduce buffer per
    # rank in /dev/shm, named after the master port, that is never unlinked.
    assert os.environ.get("LOCAL_SIZE") == os.environ.get("LOCAL_WORLD_SIZE", "1")
    port = os.environ["MASTER_PORT"]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"), "shared memory left behind"


@pytest.mark.multirank
def test_zero3_ranks_leave_no_shared_memory_behind():
    run_on_ranks(_ranks_leave_no_shared_memory)


@pytest.mark.unit
def test_a_launched_rank_leaves_without_interpreter_teardown_even_without_a_process_group():
    """A finished run whose process group is gone (accelerate's end_training destroys it)
    still leaves with os._exit: the interpreter's teardown of a gloo run aborted now and
    then (SIGABRT after the output was written)."""
    import subprocess
    import sys

    code = (
        "import atexit; atexit.register(lambda: print('interpreter teardown ran'));"
        "from diffusers_zero3.runtime.distributed import exit_after_teardown; exit_after_teardown(3)"
    )
    for world_size, rc, teardown in (("2", 3, False), ("1", 0, True)):  # "1": the control
        env = {**os.environ, "WORLD_SIZE": world_size}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == rc and ("interpreter teardown ran" in out.stdout) == teardown, out


@pytest.mark.unit
def test_log_rank_zero_prints_without_logging_configuration():
    import subprocess
    import sys

    code = "from diffusers_zero3 import log_rank_zero; log_rank_zero('hello %s', 'there')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and "hello there" in res.stderr, res.stderr
