"""Resume on a different number of processes: a checkpoint written by 2 ZeRO-3 ranks, loaded by
4 and by 1. After the load, every rank's gathered state equals the one saved, exactly: fp32
master weights, both Adam moments, the learning rate and the EMA averages (which are checked
through the live weights, not through the shards they were re-cut from). The universal form
the ranks convert it into, spread over 2 and over 4 ranks, is DeepSpeed's own single-process
conversion, tensor for tensor."""

from __future__ import annotations

import argparse
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import run_on_ranks


def _model() -> torch.nn.Module:
    # sizes that no world size divides: partitions are padded differently at 1, 2 and 4 ranks
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))


def _prepare(world_size: int):
    from diffusers.optimization import get_scheduler

    from diffusers_zero3 import ShardedEMA
    from tests.common import accelerator_with_zero3

    # small optimizer sub-groups: several per rank, each with its own Adam step counter
    accelerator = accelerator_with_zero3(world_size=world_size, sub_group_size=16)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # accelerate steps a prepared scheduler once per process at every optimizer step
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=3 * world_size,
                              num_training_steps=10 * world_size)  # fmt: skip
    engine, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, engine, optimizer, scheduler, ShardedEMA(engine, decay=0.9)


def _gathered_state(engine, scheduler, ema) -> dict:
    """Every parameter's full fp32 master weights and Adam moments, the EMA averages and the
    learning rate (collectives: every rank)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from diffusers_zero3 import gathered_parameters

    state = {"lr": scheduler.get_last_lr()[0]}
    for name, p in engine.module.named_parameters():
        state[name] = [safe_get_full_fp32_param(p).clone()] + [
            safe_get_full_optimizer_state(p, key).clone() for key in ("exp_avg", "exp_avg_sq")
        ]
    with ema.averaged_weights(), gathered_parameters(engine.module):
        for name, p in engine.module.named_parameters():
            state[name].append(p.detach().float().clone())
    return state


def _train(accelerator, engine, optimizer, scheduler, ema, steps: int = 1) -> None:
    """``steps`` optimizer steps of the tiny engine on random data (this rank's RNG), the EMA after each."""
    for _ in range(steps):
        loss = engine(torch.randn(1, 7)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ema.step()


def worker_save(out: str):
    from diffusers_zero3 import get_rank, save_training_checkpoint

    accelerator, engine, optimizer, scheduler, ema = _prepare(world_size=2)
    torch.manual_seed(get_rank())
    _train(accelerator, engine, optimizer, scheduler, ema, steps=2)  # each rank its own data
    state = {"epoch": 0, "batches_in_epoch": 2, "train_batch_size": 1}
    save_training_checkpoint(accelerator, out, 2, state, ema=ema)
    reference = _gathered_state(engine, scheduler, ema)
    if get_rank() == 0:
        torch.save(reference, f"{out}/reference.pt")
    _convert_a_copy_on_a_slow_disk(Path(out))


SLOW_WRITE_S = 0.25  # per file DeepSpeed's converter writes: a disk (or network filesystem) that is slow


@contextmanager
def _slow_disk_and_timed_collectives(waits: list[float]):
    """Every file ``ds_to_universal`` writes takes ``SLOW_WRITE_S`` longer; the seconds this
    rank spends in each collective are appended to ``waits``."""
    import deepspeed.checkpoint.ds_to_universal as dsu
    import torch.distributed as dist

    def slow_save(path, obj, _save=dsu._save_checkpoint):
        time.sleep(SLOW_WRITE_S)
        _save(path, obj)

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                waits.append(time.perf_counter() - start)

        return wrapper

    saved = dsu._save_checkpoint, dist.all_gather_object, dist.barrier
    dsu._save_checkpoint, dist.all_gather_object, dist.barrier = slow_save, timed(saved[1]), timed(saved[2])
    try:
        yield
    finally:
        dsu._save_checkpoint, dist.all_gather_object, dist.barrier = saved


def _convert_a_copy_on_a_slow_disk(out: Path) -> None:
    """Convert a copy of the checkpoint on these 2 ranks (the loads convert the original on 4),
    on a slow disk: no rank may wait in one collective for half of the conversion or more (one
    rank converting alone made the others wait for all of it, under the collective timeout)."""
    from diffusers_zero3.runtime.distributed import all_gather_object, barrier, get_rank
    from diffusers_zero3.state.resume import convert_to_universal

    copy = out / "copy" / "checkpoint-2"
    if get_rank() == 0:
        shutil.copytree(out / "checkpoint-2", copy)
    barrier()
    waits: list[float] = []
    start = time.perf_counter()
    with _slow_disk_and_timed_collectives(waits):
        convert_to_universal(copy, ["pytorch_model"])
    took = time.perf_counter() - start
    for rank, (longest, seconds) in enumerate(all_gather_object((max(waits), took))):
        assert longest < 0.5 * seconds, (
            f"rank {rank} waited {longest:.1f} s in one collective of a {seconds:.1f} s conversion"
        )


def worker_load(out: str, ranks: int):
    from diffusers_zero3.state.resume import load_training_checkpoint

    accelerator, engine, optimizer, scheduler, ema = _prepare(world_size=ranks)
    state = load_training_checkpoint(accelerator, f"{out}/checkpoint-2", ema=ema)
    assert state["world_size"] == 2 and state["global_step"] == 2
    loaded = _gathered_state(engine, scheduler, ema)
    reference = torch.load(f"{out}/reference.pt")
    assert loaded["lr"] == pytest.approx(reference["lr"], rel=1e-12), (loaded["lr"], reference["lr"])
    for name, tensors in reference.items():
        if name == "lr":
            continue
        for kind, want, got in zip(("fp32", "exp_avg", "exp_avg_sq", "ema"), tensors, loaded[name]):
            assert torch.equal(want, got), (name, kind, (want - got).abs().max())
    assert ema.optimization_step == 2
    # training goes on from there on the new number of ranks, every sub-group at Adam step 3
    # (DeepSpeed's universal load gave them one shared step tensor, counted once per sub-group)
    loss = engine(torch.randn(1, 7)).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    steps = [int(state["step"]) for state in engine.optimizer.optimizer.state.values()]
    assert len(steps) > 1 and steps == [3] * len(steps), steps
    print("OK resharded", ranks)


@pytest.mark.multirank
def test_a_two_rank_checkpoint_resumes_on_one_and_on_four_ranks(tmp_path):
    run_on_ranks(worker_save, world_size=2, out=str(tmp_path))
    for ranks in (4, 1):  # converted by the 4 ranks, then reused
        run_on_ranks(worker_load, world_size=ranks, out=str(tmp_path), ranks=ranks)
    assert (tmp_path / "checkpoint-2" / "universal" / "pytorch_model").is_dir()  # converted once, kept
    assert (tmp_path / "checkpoint-2" / "pytorch_model").is_dir()  # the original left as it was
    # DeepSpeed's own conversion, in this one process: the spread ones are the same.
    from deepspeed.checkpoint import ds_to_universal

    deepspeed_folder = tmp_path / "deepspeed"
    ds_to_universal.main(
        argparse.Namespace(input_folder=str(tmp_path / "checkpoint-2" / "pytorch_model"),
                           output_folder=str(deepspeed_folder / "pytorch_model"), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    )  # fmt: skip
    for ranks, spread in ((4, tmp_path / "checkpoint-2"), (2, tmp_path / "copy" / "checkpoint-2")):
        _assert_same_folder(spread / "universal", deepspeed_folder, ranks)


def _assert_same_folder(ours: Path, reference: Path, ranks: int) -> None:
    """The same files, each file's tensors (and other values) equal, exactly."""
    names = sorted(str(p.relative_to(reference)) for p in reference.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file()) == names, ranks
    assert len([n for n in names if n.endswith("fp32.pt")]) == 4, names  # every parameter
    for name in names:
        if name.endswith(".pt"):
            _assert_same(torch.load(ours / name, weights_only=False), torch.load(reference / name, weights_only=False),
                         f"{ranks} ranks: {name}")  # fmt: skip
        else:
            assert (ours / name).read_bytes() == (reference / name).read_bytes(), (ranks, name)


def _assert_same(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__"):  # e.g. DeepSpeed's loss scaler, which has no __eq__
        _assert_same(vars(a), vars(b), where)
    else:
        assert a == b, where


@pytest.mark.unit
def test_the_data_resumes_at_the_first_sample_no_rank_has_seen():
    from diffusers_zero3.training.schedule import batches_to_skip

    saved = {"batches_in_epoch": 3, "world_size": 2, "train_batch_size": 2}  # 12 samples done
    assert batches_to_skip(saved, 2, 2) == 3
    assert batches_to_skip(saved, 4, 1) == 3  # same global batch
    assert batches_to_skip(saved, 1, 4) == 3
    assert batches_to_skip(saved, 1, 2) == 6  # a smaller global batch that divides the samples
    with pytest.raises(ValueError, match="keep processes x --train_batch_size at 4"):
        batches_to_skip(saved, 3, 3)
    older = {"batches_in_epoch": 3, "world_size": 2}
    assert batches_to_skip(older, 2, 2) == 3
    with pytest.raises(ValueError, match="older layout"):
        batches_to_skip(older, 4, 1)


@pytest.mark.unit
def test_a_resumed_run_trains_to_max_train_steps_whatever_its_epoch_length():
    """Issue 49, defect 1: the epochs a resumed run loops over come from the steps it has left,
    not from ``max_train_steps / steps per epoch`` of the new loader. 2 processes x 2 on 8
    samples (2 steps an epoch) checkpointed at step 6 (epoch 3 next); resumed on 1 x 2 (4 steps
    an epoch), ``ceil(8 / 4) = 2`` epochs gave ``range(3, 2)``: no step, exit 0."""
    from diffusers_zero3.training.schedule import epochs_to_run, updates_per_epoch

    def steps_run(epochs, first_batches, per_epoch, done, max_steps, accumulation=1):
        """The steps the loop trains over ``epochs`` (stopping at ``max_steps``)."""
        steps = done
        for epoch in epochs:
            batches = first_batches if epoch == epochs.start else per_epoch
            steps = min(max_steps, steps + updates_per_epoch(batches, accumulation))
        return steps

    # the run: epoch 3 from its start, 4 batches an epoch now, steps 7 and 8 to train
    epochs = epochs_to_run(3, 6, 8, first_epoch_batches=4, batches_per_epoch=4, gradient_accumulation_steps=1)
    assert epochs == range(3, 4)
    # mid-epoch, another epoch length, accumulation: always reaches max_train_steps, never
    # loops over epochs that cannot train a step
    for first, done, max_steps, left, per_epoch, acc in [
        (0, 0, 8, 4, 4, 1), (3, 6, 8, 0, 4, 1), (5, 2, 20, 3, 7, 2), (1, 5, 6, 1, 8, 4), (2, 9, 9, 5, 5, 1),
    ]:  # fmt: skip
        epochs = epochs_to_run(first, done, max_steps, left, per_epoch, acc)
        assert epochs.start == first
        assert steps_run(epochs, left, per_epoch, done, max_steps, acc) == max_steps, (first, done, max_steps)
        if len(epochs) > 1:  # one epoch fewer would not reach it
            assert steps_run(epochs[:-1], left, per_epoch, done, max_steps, acc) < max_steps
    assert len(epochs_to_run(2, 9, 9, 5, 5, 1)) == 0  # complete: nothing to run
