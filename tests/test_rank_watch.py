"""A rank that dies or freezes is noticed within a bounded time (``runtime.rank_watch``).

Under gloo a killed peer's sockets close and the others fail at once; NCCL has no such signal,
and a frozen peer (SIGSTOP: its sockets stay open) shows the others what NCCL shows of a dead
one: their collective blocks until the process-group timeout. So these tests freeze a rank,
with a process-group timeout far longer than the harness's, and each has a positive control
(the watch off: the ranks hang until the harness kills them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from diffusers_zero3.testing import ZERO3_ENV, RanksFailed
from tests.distributed_harness import FRESH_RANKS, REPO_ROOT, _test_env

pytestmark = pytest.mark.multirank

WATCH_S = 2.0  # the tests' heartbeat timeout
LONG_PG_TIMEOUT = "600"  # far beyond every harness timeout here
# the earliest a live rank may leave after its neighbour froze: the neighbour's last beat can
# precede the freeze by one poll interval (``start_rank_watch``: timeout / 6)
EARLIEST_S = WATCH_S - WATCH_S / 6


def _ranks(fn, timeout: float, env=None, **kwargs) -> RanksFailed | list[str]:
    """Run ``fn(**kwargs)`` on 2 ranks; the ``RanksFailed`` if they failed, else the outputs.
    The others are killed 1 s after the first rank exits non-zero."""
    from diffusers_zero3.testing import run_function_on_ranks, start_rank_forkserver

    if not FRESH_RANKS:
        start_rank_forkserver(["tests.rank_preload"], _test_env(None))
    try:
        return run_function_on_ranks(
            f"{fn.__module__}:{fn.__qualname__}", kwargs, world_size=2, timeout_s=timeout,
            preloaded=not FRESH_RANKS, env=_test_env({**(env or {}), "DIFFUSERS_ZERO3_PG_TIMEOUT": LONG_PG_TIMEOUT}),
            cwd=str(REPO_ROOT), grace_s=1.0,
        )  # fmt: skip
    except RanksFailed as e:
        return e


def _init(watch_s: float) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from diffusers_zero3.runtime.rank_watch import start_rank_watch

    dist.init_process_group("gloo", timeout=timedelta(seconds=float(LONG_PG_TIMEOUT)))
    start_rank_watch(watch_s)
    return dist.get_rank()


def _freeze(stamp: str) -> None:
    Path(stamp).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _frozen_rank(frozen: int, watch_s: float, stamp: str, announce: bool = False) -> None:
    """Rank ``frozen`` freezes (after announcing a failure of its own, with ``announce``);
    the other waits in a barrier."""
    import torch.distributed as dist

    from diffusers_zero3.runtime.rank_watch import leave_rank_watch

    if _init(watch_s) == frozen:
        if announce:
            leave_rank_watch(failed=True)
        _freeze(stamp)
    dist.barrier()


def _left_in(failed: RanksFailed, stamp: Path) -> float:
    return time.time() - float(stamp.read_text())


@pytest.mark.parametrize("frozen", [1, 0], ids=["a-peer", "the-store-host"])
def test_a_frozen_rank_ends_the_others_within_the_heartbeat_timeout(frozen, tmp_path):
    """Rank ``frozen`` freezes while the other waits in a collective: the other prints one
    ``error:`` line naming it and exits with 69 within the heartbeat timeout plus a poll or two
    (rank 0 hosts the harness's rendezvous store: frozen, the store stops answering too)."""
    from diffusers_zero3.runtime.rank_watch import DEAD_RANK_EXIT

    stamp = tmp_path / "frozen_at"
    failed = _ranks(_frozen_rank, timeout=60, frozen=frozen, watch_s=WATCH_S, stamp=str(stamp))
    assert isinstance(failed, RanksFailed) and not failed.timed_out, failed
    waited = _left_in(failed, stamp) - 1.0  # the harness's grace before it kills the frozen rank
    print(f"frozen rank {frozen}: the other left {waited:.1f} s after")
    live = 1 - frozen
    assert failed.codes[live] == DEAD_RANK_EXIT, failed
    out = failed.outputs[live]
    assert out.count("error: ") == 1, out
    expected = "rank 1 is gone: no heartbeat" if frozen == 1 else "rank 0 is gone: no heartbeat"
    assert expected in out or (frozen == 0 and "has not answered" in out), out
    assert EARLIEST_S <= waited < WATCH_S + 6, waited


def test_a_store_that_does_not_answer_a_new_client_is_named_within_the_timeout(monkeypatch):
    """A frozen store host's kernel still accepts connections; ``TCPStore``'s constructor then
    waits for the handshake forever (seen in CI: both ranks killed by the harness, no output).
    The watch's client gives up after the timeout; the positive control, a store that answers."""
    import socket

    import torch.distributed as dist

    from diffusers_zero3.runtime.rank_watch import StoreUnreachable, _store_client

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel's backlog), never answers: a frozen process
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(silent.getsockname()[1]))
    started = time.monotonic()
    with pytest.raises(StoreUnreachable, match="has not answered"):
        _store_client(1.0)
    assert time.monotonic() - started < 4.0
    silent.close()

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_PORT", str(host.port))
    store, where = _store_client(1.0)
    store.set("k", "v")
    assert store.get("k") == b"v" and where == f"127.0.0.1:{host.port}"


def _frozen_store_host_before_the_watch(stamp: str, ready: str, watch_s: float) -> None:
    """Rank 0 (the harness's store host) freezes once rank 1 is in the group; rank 1 starts its
    watch only when rank 0 is stopped (``/proc``'s state ``T``), so the client meets a frozen host."""
    from datetime import timedelta

    import torch.distributed as dist

    from diffusers_zero3.runtime.rank_watch import start_rank_watch

    dist.init_process_group("gloo", timeout=timedelta(seconds=float(LONG_PG_TIMEOUT)))
    if dist.get_rank() == 0:
        while not Path(ready).exists():
            time.sleep(0.01)  # CPU: waits for rank 1's file; the file is the synchronisation
        Path(stamp + ".pid.tmp").write_text(str(os.getpid()))
        os.replace(stamp + ".pid.tmp", stamp + ".pid")  # whole when rank 1 sees it
        _freeze(stamp)
    Path(ready).touch()
    while not Path(stamp + ".pid").exists():
        time.sleep(0.01)  # CPU: waits for rank 0's file; the file is the synchronisation
    stat = Path(f"/proc/{Path(stamp + '.pid').read_text()}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)  # CPU: waits until rank 0 is stopped, as /proc says
    start_rank_watch(watch_s)
    dist.barrier()


def test_a_store_host_frozen_before_a_rank_starts_its_watch_ends_that_rank():
    """The race CI met: the store host froze before the other rank's watch had connected."""
    import tempfile

    from diffusers_zero3.runtime.rank_watch import DEAD_RANK_EXIT

    with tempfile.TemporaryDirectory() as tmp:
        failed = _ranks(_frozen_store_host_before_the_watch, timeout=60, stamp=f"{tmp}/frozen_at",
                        ready=f"{tmp}/ready", watch_s=WATCH_S)  # fmt: skip
    assert isinstance(failed, RanksFailed) and not failed.timed_out, failed
    assert failed.codes[1] == DEAD_RANK_EXIT, failed
    assert failed.outputs[1].count("error: ") == 1, failed.outputs[1]
    assert "error: the rendezvous store at" in failed.outputs[1] and "has not answered" in failed.outputs[1]


def test_without_the_watch_a_frozen_rank_hangs_the_others(tmp_path):
    """The positive control: the watch off (timeout 0), the live rank waits in its collective
    until the harness's timeout."""
    failed = _ranks(_frozen_rank, timeout=8, frozen=1, watch_s=0, stamp=str(tmp_path / "frozen_at"))
    assert isinstance(failed, RanksFailed) and failed.timed_out, failed


def test_a_rank_that_announces_its_failure_ends_the_others_after_the_grace(tmp_path):
    """A rank that fails with its own error (``leave_rank_watch(failed=True)``, as
    ``run_script`` does) and whose exit leaves the others blocked (NCCL's case; frozen here):
    the others leave after ``FAILED_PEER_GRACE_S``, before the heartbeat timeout would."""
    from diffusers_zero3.runtime.rank_watch import DEAD_RANK_EXIT, FAILED_PEER_GRACE_S

    stamp = tmp_path / "frozen_at"
    watch_s = 30.0
    failed = _ranks(_frozen_rank, timeout=60, frozen=1, watch_s=watch_s, stamp=str(stamp), announce=True)
    assert isinstance(failed, RanksFailed) and not failed.timed_out, failed
    assert failed.codes[0] == DEAD_RANK_EXIT, failed
    assert "error: rank 1 stopped with an error" in failed.outputs[0], failed.outputs[0]
    waited = _left_in(failed, stamp) - 1.0
    print(f"announced failure: the other left {waited:.1f} s after")
    assert FAILED_PEER_GRACE_S <= waited < watch_s, waited


def _one_rank_finishes_late(watch_s: float) -> None:
    """Rank 0 works alone for three heartbeat timeouts after rank 1 finished (as rank 0 writes
    validation images or the final pipeline alone); both then end through
    ``exit_after_teardown`` (the harness's)."""
    if _init(watch_s) == 0:
        time.sleep(3 * watch_s)  # CPU: rank 0's own work, no synchronisation stands on it


def test_a_rank_that_finished_is_not_taken_for_dead():
    outputs = _ranks(_one_rank_finishes_late, timeout=60, watch_s=WATCH_S)
    assert not isinstance(outputs, RanksFailed), outputs
    assert not any("error:" in o for o in outputs), outputs


# ------------------------------------------------------------------------- the GRPO trainer


def _grpo_frozen(pipe_dir: str, out: str, stamp: str, watch_s: float) -> None:
    """GRPO, 3 rounds asked; rank 1 freezes during the first round's training."""
    from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer
    from diffusers_zero3.runtime.distributed import get_rank
    from diffusers_zero3.training.job import run_script

    settings = GRPOSettings.parse([
        "--pretrained_model_name_or_path", pipe_dir, "--reward", "diffusers_zero3.demo.rewards:redness",
        "--output_dir", out, "--prompts", "a red circle", "a blue square", "--group_size", "2",
        "--resolution", "32", "--num_inference_steps", "3", "--timestep_fraction", "0.67", "--max_train_steps", "3",
        "--sample_batch_size", "2", "--train_batch_size", "2", "--report_to", "none", "--seed", "3",
        "--checkpointing_steps", "1", "--dead_rank_timeout", str(watch_s), "--process_group_timeout", LONG_PG_TIMEOUT,
    ])  # fmt: skip
    trainer = GRPOTrainer(settings)

    def body() -> None:
        trainer.setup()
        loss = trainer._loss

        def freezing_loss(*args, **kwargs):
            if get_rank() == 1 and trainer.global_step == 1:
                _freeze(stamp)
            return loss(*args, **kwargs)

        trainer._loss = freezing_loss
        trainer.train()

    run_script(body)


def test_grpo_a_rank_frozen_mid_round_ends_the_job_with_its_checkpoints_intact(tiny_sd3, tmp_path):
    """The real GRPO trainer under ``run_script`` on 2 ZeRO-3 ranks: rank 1 freezes in round 2's
    training; rank 0 names it and leaves with 69 within the heartbeat timeout; checkpoint-1 is
    published and whole (its manifest matches), nothing of round 2 is published."""
    from diffusers_zero3.runtime.rank_watch import DEAD_RANK_EXIT
    from diffusers_zero3.state.manifest import manifest_problems

    out, stamp = tmp_path / "out", tmp_path / "frozen_at"
    failed = _ranks(_grpo_frozen, timeout=240, env=ZERO3_ENV, pipe_dir=tiny_sd3[0], out=str(out),
                    stamp=str(stamp), watch_s=WATCH_S)  # fmt: skip
    assert isinstance(failed, RanksFailed) and not failed.timed_out, failed
    assert failed.codes[0] == DEAD_RANK_EXIT, failed
    assert "error: rank 1 is gone: no heartbeat" in failed.outputs[0], failed.outputs[0]
    waited = _left_in(failed, stamp) - 1.0
    print(f"GRPO: rank 0 left {waited:.1f} s after rank 1 froze")
    assert EARLIEST_S <= waited < WATCH_S + 6, waited
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert manifest_problems(out / "checkpoint-1") == []  # whole: every file as the manifest says
