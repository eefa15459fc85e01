"""The multi-rank harness itself: a hang and a failing rank must fail, with the ranks' output."""

import pytest

from diffusers_zero3.testing import RanksFailed, run_function_on_ranks

pytestmark = pytest.mark.multirank  # each test starts 2 real ranks (one waits out a 12 s hang)


def worker_rank1_hangs():
    import torch.distributed as dist

    from diffusers_zero3.runtime.distributed import get_rank

    dist.init_process_group("gloo")
    print(f"rank {get_rank()} started", flush=True)
    if get_rank() == 0:
        dist.barrier()  # rank 1 never joins: a hang
    else:
        import threading

        threading.Event().wait()


def worker_rank1_raises():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("deliberate failure on rank 1")


def test_hang_becomes_failure_with_outputs():
    with pytest.raises(RanksFailed) as info:
        run_function_on_ranks(
            "tests.test_harness:worker_rank1_hangs",
            timeout_s=12,
            env={"DIFFUSERS_ZERO3_PG_TIMEOUT": "600"},
        )
    err = info.value
    assert err.timed_out
    assert "rank 0 started" in str(err) and "rank 1 started" in str(err)


def test_failing_rank_traceback_is_reported():
    with pytest.raises(RanksFailed) as info:
        run_function_on_ranks("tests.test_harness:worker_rank1_raises", timeout_s=60)
    assert info.value.codes[1] == 1 and not info.value.timed_out
    assert "ValueError: deliberate failure on rank 1" in str(info.value)
