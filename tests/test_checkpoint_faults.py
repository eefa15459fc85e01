"""Faults met while writing and reading checkpoints (issue 54, items 4 and 5), on 2 ZeRO-3 ranks.

* A full disk on one rank while a checkpoint is written (inside DeepSpeed's collective save,
  in our own files, in the manifest): every rank raises one ``CheckpointError`` naming the
  file and "no space left on device", no rank is left waiting (the harness's timeout turns a
  hang into a failure, and a save that follows must succeed on both), no temporary folder is
  left, and the previous checkpoint is unchanged and still the latest. The full disk is the
  kernel's own: the chosen file is written into ``/dev/full`` (ENOSPC on every write).
* A damaged checkpoint at resume (a truncated shard, a flipped byte, a deleted file) is one
  ``CorruptCheckpointError`` naming the file and what differs; the intact checkpoint resumes
  (the control); ``--resume_fallback`` resumes the newest intact one, and a checkpoint without
  a manifest (an older version's) still resumes.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import run_on_ranks
from tests.test_resume_resharded import _gathered_state, _prepare, _train


@contextmanager
def _full_disk(name: str | None):
    """Every file whose name contains ``name`` is written into ``/dev/full`` instead: the
    kernel answers each write with ENOSPC. Both ways files are written here are covered:
    ``open`` (our files, DeepSpeed's through ``deferred_engine_writes``; ``io.open`` for pathlib) and ``torch.save``
    given a path (accelerate's own files, torch's C++ writer)."""
    if name is None:
        yield
        return
    real_open, real_save = builtins.open, torch.save

    def full_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and name in os.fspath(file) and ("w" in mode or "a" in mode):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    def full_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and name in os.fspath(f):
            f = "/dev/full"
        return real_save(obj, f, *args, **kwargs)

    builtins.open = io.open = full_open  # pathlib's write_text calls io.open
    torch.save = full_save
    try:
        yield
    finally:
        builtins.open = io.open = real_open
        torch.save = real_save


def _contents(folder: Path) -> dict:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


# (the rank whose disk is full, the file it fails on, the error's text that names the file)
WRITE_FAULTS = [
    (
        1,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ),  # DeepSpeed
    (
        0,
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
    ),  # DeepSpeed
    (1, "ema_rank1.pt", "ema_rank1.pt"),
    (0, "training_state.json", "training_state.json"),
    (0, "manifest.json", "manifest.json"),
    (1, "random_states_1.pkl", "a write failed"),  # accelerate's torch.save(path): no errno to give
]


def worker_write_errors(out: str):
    from diffusers_zero3 import get_rank, save_training_checkpoint
    from diffusers_zero3.runtime.distributed import barrier
    from diffusers_zero3.state.pretrained import CheckpointError
    from diffusers_zero3.state.resume import resolve_resume_checkpoint

    accelerator, engine, optimizer, scheduler, ema = _prepare(world_size=2)
    torch.manual_seed(get_rank())
    _train(accelerator, engine, optimizer, scheduler, ema)
    state = {"epoch": 0, "batches_in_epoch": 1, "train_batch_size": 1}
    save_training_checkpoint(accelerator, out, 1, state, ema=ema)
    before = _contents(Path(out) / "checkpoint-1")
    assert "manifest.json" in before
    _train(accelerator, engine, optimizer, scheduler, ema)
    for failing, name, named in WRITE_FAULTS:
        with _full_disk(name if get_rank() == failing else None):
            with pytest.raises(CheckpointError, match=".") as caught:
                save_training_checkpoint(accelerator, out, 2, state, ema=ema)
        message = str(caught.value)
        assert f"checkpoint-2 failed on rank {failing}" in message, message
        assert named in message, message
        if named != "a write failed":
            assert "no space left on device (ENOSPC)" in message, message
        if get_rank() == 0:
            names = sorted(p.name for p in Path(out).iterdir())
            assert names == ["checkpoint-1"], (name, names)  # no .tmp-*, no checkpoint-2
            assert _contents(Path(out) / "checkpoint-1") == before, name
        assert resolve_resume_checkpoint(out, "latest").name == "checkpoint-1"
        barrier()
    # The control: the ranks are still in step (a misaligned collective would fail or hang
    # here), and the same save succeeds with a disk that is not full.
    save_training_checkpoint(accelerator, out, 2, state, ema=ema)
    assert resolve_resume_checkpoint(out, "latest").name == "checkpoint-2"
    print("OK write errors", get_rank())


@pytest.mark.multirank
def test_a_full_disk_on_one_rank_stops_every_rank_with_one_error_and_keeps_the_previous_checkpoint(tmp_path):
    outs = run_on_ranks(worker_write_errors, out=str(tmp_path / "out"), timeout=240)
    assert sum("OK write errors" in o for o in outs) == 2


# how a file is damaged: (the file, what the error says about it)
DAMAGES = {
    "truncate": ("pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", "(truncated)"),
    "flip": ("ema_rank0.pt", "(its bytes changed)"),
    "delete": ("scheduler.bin", "is missing"),  # rank 0's: not among the files checked for presence
}


def _damage(checkpoint: Path, how: str) -> None:
    path = checkpoint / DAMAGES[how][0]
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.unlink()


def worker_damaged_checkpoints(out: str):
    from diffusers_zero3 import get_rank, save_training_checkpoint
    from diffusers_zero3.errors import CorruptCheckpointError
    from diffusers_zero3.runtime.distributed import barrier
    from diffusers_zero3.state.resume import check_resumable, load_training_checkpoint, resume_training

    accelerator, engine, optimizer, scheduler, ema = _prepare(world_size=2)
    torch.manual_seed(get_rank())
    state = {"epoch": 0, "batches_in_epoch": 1, "train_batch_size": 1}
    _train(accelerator, engine, optimizer, scheduler, ema)
    save_training_checkpoint(accelerator, out, 1, state, ema=ema)
    at_step_1 = _gathered_state(engine, scheduler, ema)
    _train(accelerator, engine, optimizer, scheduler, ema)
    save_training_checkpoint(accelerator, out, 2, state, ema=ema)
    source = Path(out)

    # The control: an intact checkpoint passes the check and resumes.
    assert check_resumable(source / "checkpoint-2", ema=True)["global_step"] == 2
    for how, (rel, expected) in DAMAGES.items():
        folder = source.parent / how
        if get_rank() == 0:
            shutil.copytree(source, folder)
            _damage(folder / "checkpoint-2", how)
        barrier()
        with pytest.raises(CorruptCheckpointError) as caught:
            check_resumable(folder / "checkpoint-2", ema=True)
        message = str(caught.value)
        assert rel in message and expected in message, message
        with pytest.raises(CorruptCheckpointError):  # without --resume_fallback: an error
            resume_training(accelerator, folder, "latest", ema=ema)

    # --resume_fallback: the truncated checkpoint-2 is passed over for checkpoint-1, whose
    # state is loaded exactly; checkpoint-2 is abandoned, so `latest` never picks it again.
    path, resumed = resume_training(accelerator, source.parent / "truncate", "latest", ema=ema, fallback=True)
    assert path.name == "checkpoint-1" and resumed["global_step"] == 1
    loaded = _gathered_state(engine, scheduler, ema)
    for key, want in at_step_1.items():
        if key == "lr":
            assert loaded[key] == want
            continue
        for a, b in zip(want, loaded[key]):
            assert torch.equal(a, b), key
    if get_rank() == 0:
        assert (source.parent / "truncate" / "abandoned-checkpoint-2").is_dir()

    # A checkpoint of an older version (no manifest) resumes, its files checked for presence.
    if get_rank() == 0:
        (source / "checkpoint-2" / "manifest.json").unlink()
    barrier()
    assert load_training_checkpoint(accelerator, source / "checkpoint-2", ema=ema)["global_step"] == 2
    print("OK damaged checkpoints", get_rank())


@pytest.mark.multirank
def test_a_damaged_checkpoint_is_found_at_resume_and_fallback_takes_the_newest_intact_one(tmp_path):
    outs = run_on_ranks(worker_damaged_checkpoints, out=str(tmp_path / "out"), timeout=240)
    assert sum("OK damaged checkpoints" in o for o in outs) == 2
    assert "--resume_fallback: not resuming checkpoint-2" in outs[0], outs[0][-2000:]
    assert "has no manifest (written by an older version)" in outs[0], outs[0][-2000:]


# --------------------------------------------------------------------------- single process


@pytest.mark.unit
def test_a_full_disk_during_the_final_save_leaves_the_previous_output_and_names_the_file(
    tiny_pipeline, tmp_path
):
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.state.pipeline_io import save_final_pipeline
    from diffusers_zero3.state.pretrained import CheckpointError

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    out = tmp_path / "out"
    save_final_pipeline(tiny_pipeline, out, unet, readme="first")
    before = _contents(out)
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(1.0)
    with _full_disk("diffusion_pytorch_model.safetensors"):
        with pytest.raises(CheckpointError) as caught:
            save_final_pipeline(tiny_pipeline, out, unet, readme="second")
    message = str(caught.value)
    assert "diffusion_pytorch_model.safetensors: no space left on device (ENOSPC)" in message, message
    assert _contents(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.unit
def test_write_errors_are_described_by_path_and_errno_and_bugs_are_not_write_errors(tmp_path):
    import errno

    from diffusers_zero3.state.folders import WriteErrors, describe_write_error, is_write_error, naming

    error = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/out/ema_rank1.pt")
    assert describe_write_error(error) == "/out/ema_rank1.pt: disk quota exceeded (EDQUOT)"
    with pytest.raises(OSError) as caught, naming(tmp_path / "x.pt"):
        raise OSError(errno.EIO, os.strerror(errno.EIO))  # as a failed write() raises it
    assert describe_write_error(caught.value) == f"{tmp_path / 'x.pt'}: input/output error (EIO)"
    assert is_write_error(
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    )
    assert not is_write_error(RuntimeError("a bug"))
    errors = WriteErrors()
    assert errors.run(lambda: 3) == 3
    errors.run(lambda: (_ for _ in ()).throw(error))
    errors.run(lambda: (_ for _ in ()).throw(OSError(errno.EIO, "second")))
    assert errors.error is error  # the first one is kept
    with pytest.raises(ValueError):
        errors.run(lambda: (_ for _ in ()).throw(ValueError("a bug propagates at once")))
    with pytest.raises(OSError):
        errors.raise_first()
