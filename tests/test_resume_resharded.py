"""Resume on a different number of processes: a checkpoint written by 2 ZeRO-3 ranks, loaded by
1 and by 4. After the load, every rank's gathered state equals the one saved, exactly: fp32
master weights, both Adam moments, the learning rate and the EMA averages (which are checked
through the live weights, not through the shards they were re-cut from)."""

from __future__ import annotations

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


def worker_save(out: str):
    from diffusers_zero3 import get_rank, save_training_checkpoint

    accelerator, engine, optimizer, scheduler, ema = _prepare(world_size=2)
    torch.manual_seed(get_rank())
    for _ in range(2):  # each rank its own data
        loss = engine(torch.randn(1, 7)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ema.step()
    state = {"epoch": 0, "batches_in_epoch": 2, "train_batch_size": 1}
    save_training_checkpoint(accelerator, out, 2, state, ema=ema)
    reference = _gathered_state(engine, scheduler, ema)
    if get_rank() == 0:
        torch.save(reference, f"{out}/reference.pt")


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
    for ranks in (1, 4):
        run_on_ranks(worker_load, world_size=ranks, out=str(tmp_path), ranks=ranks)
    assert (tmp_path / "checkpoint-2" / "universal" / "pytorch_model").is_dir()  # converted once, kept
    assert (tmp_path / "checkpoint-2" / "pytorch_model").is_dir()  # the original left as it was


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
