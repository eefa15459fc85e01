"""The multi-rank harness itself: a hang and a failing rank must fail, with the ranks' output,
whether the ranks are new interpreters or forked from the preloading server."""

import pytest

from diffusers_zero3.testing import RanksFailed, run_function_on_ranks, start_rank_forkserver
from tests.distributed_harness import _test_env

pytestmark = pytest.mark.multirank  # each test starts 2 real ranks (one waits out a hang)

LAUNCHES = pytest.mark.parametrize("preloaded", [False, True], ids=["fresh", "forked"])


def _launch(target: str, preloaded: bool, timeout_s: float, env: dict | None = None) -> list[str]:
    if preloaded:
        start_rank_forkserver(["tests.rank_preload"], _test_env(None))
    return run_function_on_ranks(target, timeout_s=timeout_s, preloaded=preloaded, env=_test_env(env))


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


@LAUNCHES
def test_hang_becomes_failure_with_outputs(preloaded):
    with pytest.raises(RanksFailed) as info:  # a forked rank starts in well under a second
        _launch(
            "tests.test_harness:worker_rank1_hangs",
            preloaded,
            timeout_s=6 if preloaded else 12,
            env={"DIFFUSERS_ZERO3_PG_TIMEOUT": "600"},
        )
    err = info.value
    assert err.timed_out
    assert "rank 0 started" in str(err) and "rank 1 started" in str(err)


@LAUNCHES
def test_failing_rank_traceback_is_reported(preloaded):
    with pytest.raises(RanksFailed) as info:
        _launch("tests.test_harness:worker_rank1_raises", preloaded, timeout_s=60)
    assert info.value.codes[1] == 1 and not info.value.timed_out
    assert "ValueError: deliberate failure on rank 1" in str(info.value)


# A launcher as torch elastic is one: it starts its worker in a session of its own, writes the
# worker's pid, and then both wait forever.
_LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(600)
"""


@pytest.mark.timeout(60)  # before the fix the harness itself hung: the orphan held its output pipe
def test_a_hung_launch_is_killed_with_every_worker_it_started(tmp_path):
    """run_launcher's timeout kills the launcher and its workers, which sit in sessions of their
    own (killing the launcher's process group alone left them running, orphaned, holding the
    output pipe, so that the harness waited on it as well)."""
    import os
    import sys
    import time

    from tests.distributed_harness import run_launcher

    pid_file = tmp_path / "worker.pid"
    with pytest.raises(pytest.fail.Exception, match="timed out"):
        run_launcher([sys.executable, "-c", _LAUNCHER, str(pid_file)], timeout=5)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        try:  # reaped by init once dead: a zombie still answers kill(0) for a moment
            state = open(f"/proc/{worker}/stat").read().split(")")[-1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.1)
    os.kill(worker, 9)
    pytest.fail(f"the launcher's worker {worker} outlived the killed launch")


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    """Side-by-side launches each take free_port(): a port of the kernel's ephemeral range could
    be taken by any outgoing connection (a running rank's gloo pairs) before the launcher binds
    it (EADDRINUSE at the rendezvous, seen), and two calls could give the same one."""
    from diffusers_zero3.testing import _ephemeral_ports_start, free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert max(ports) < _ephemeral_ports_start()


def test_a_launch_whose_rendezvous_port_was_taken_is_given_a_new_port():
    """EADDRINUSE at the launcher's rendezvous (seen once in CI: the port ``free_port`` checked
    was taken before the agent bound it; accelerate's own check had passed) is retried on a new
    port; any other failure, and a success, is not."""
    from tests.distributed_harness import PORT_TAKEN, _on_a_new_port

    argv = ["python", "-m", "accelerate.commands.launch", "--main_process_port", "12039", "train.py"]
    taken = f"torch.distributed.DistNetworkError: {PORT_TAKEN}. port: 12039, code: -98, name: EADDRINUSE"
    retry = _on_a_new_port(argv, 1, taken)
    assert retry is not None and retry[:4] == argv[:4] and retry[5:] == argv[5:]
    assert retry[4] != "12039" and int(retry[4]) > 0
    assert _on_a_new_port(argv, 1, "RuntimeError: a bug") is None
    assert _on_a_new_port(argv, 0, taken) is None
    assert _on_a_new_port(["torchrun", "train.py"], 1, taken) is None
