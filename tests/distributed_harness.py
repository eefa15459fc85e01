"""pytest glue over ``diffusers_zero3.testing``: run a test function on N real ranks.

A rank's failure or a hang (past ``timeout``) fails the test with every rank's output and
the failing rank's traceback in the report.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from diffusers_zero3.testing import (
    RanksFailed,
    kill_process_tree,
    run_function_on_ranks,
    start_rank_forkserver,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT = float(os.environ.get("DZ3_TEST_RANK_TIMEOUT", 300))
# Ranks are forked from a server that imported torch, DeepSpeed, diffusers... once
# (tests/rank_preload.py): each is a new process without the ~5 s of imports.
# DZ3_TEST_FRESH_RANKS=1 starts every rank as a new interpreter instead.
FRESH_RANKS = os.environ.get("DZ3_TEST_FRESH_RANKS") == "1"


def _test_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        # A hung collective fails on its own too, well before the harness timeout.
        "DIFFUSERS_ZERO3_PG_TIMEOUT": os.environ.get("DIFFUSERS_ZERO3_PG_TIMEOUT", "120"),
        "DS_ACCELERATOR": "cpu",
        # CPU ranks on a GPU host too: accelerate would pick NCCL beside DeepSpeed's CPU
        # accelerator. The gpu tests pass their own CUDA_VISIBLE_DEVICES and DS_ACCELERATOR.
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.update(extra or {})
    return env


def run_on_ranks(fn, world_size: int = 2, timeout: float = DEFAULT_TIMEOUT, env=None, **kwargs) -> list[str]:
    """Run the module-level function ``fn(**kwargs)`` on every rank; return their outputs.

    The ranks are forked from the harness's preloading server (``rank_preload``) unless
    ``DZ3_TEST_FRESH_RANKS=1``.
    """
    if not FRESH_RANKS:
        start_rank_forkserver(["tests.rank_preload"], _test_env(None))
    try:
        return run_function_on_ranks(
            f"{fn.__module__}:{fn.__qualname__}",
            kwargs,
            world_size=world_size,
            timeout_s=timeout,
            preloaded=not FRESH_RANKS,
            env=_test_env(env),
            cwd=str(REPO_ROOT),
        )
    except RanksFailed as e:
        pytest.fail(str(e), pytrace=False)


def accelerate_launch(script: str, num_processes: int = 2) -> list[str]:
    """``accelerate launch`` argv for ``script`` with the repository's ZeRO-3 config, on a port
    of its own (launches that run side by side would otherwise all take 29500)."""
    from diffusers_zero3.testing import free_port

    config = "configs/accelerate_zero3.yaml"
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()), script]  # fmt: skip


# the launcher's own rendezvous could not bind its port: nothing of the script ran yet
PORT_TAKEN = "The server socket has failed to listen on any local network address"


def _on_a_new_port(argv: list[str], rc: int | None, out: str) -> list[str] | None:
    """``argv`` with a fresh ``--main_process_port`` when the launch failed to bind its
    rendezvous port (EADDRINUSE: taken between ``free_port``'s check and the launcher's bind, by
    a process outside this one's choice), else None. A retry then is a launch like the first."""
    if rc == 0 or PORT_TAKEN not in out or "--main_process_port" not in argv:
        return None
    from diffusers_zero3.testing import free_port

    argv = list(argv)
    argv[argv.index("--main_process_port") + 1] = str(free_port())
    return argv


def run_launcher(argv, timeout: float = DEFAULT_TIMEOUT, env=None, expect_rc: int | None = 0):
    """Run a launcher command (e.g. ``accelerate launch``) that starts its own ranks.

    The whole process group is killed after ``timeout`` seconds and the test fails with the
    output. Returns ``(returncode, output)``; fails when ``expect_rc`` is given and differs. A
    launch whose rendezvous port was taken before it started is run again on a new port.
    """
    rc, out = _run_launcher_once(argv, timeout, env)
    retry = _on_a_new_port(argv, rc, out)
    if retry is not None:
        rc, out = _run_launcher_once(retry, timeout, env)
    if expect_rc is not None and rc != expect_rc:
        pytest.fail(f"{argv[:4]} exited {rc}, expected {expect_rc}\n{out[-8000:]}", pytrace=False)
    return rc, out


def _run_launcher_once(argv, timeout: float, env) -> tuple[int, str]:
    import subprocess

    proc = subprocess.Popen(
        argv,
        cwd=str(REPO_ROOT),
        env={**os.environ, **_test_env(env)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)  # the launcher's workers too: each sits in a session of its own
        out, _ = proc.communicate()
        pytest.fail(f"{argv[:4]} timed out after {timeout:.0f}s (a hang)\n{out[-8000:]}", pytrace=False)
    return proc.returncode, out


def run_launchers_side_by_side(
    runs: list[dict], timeout: float = DEFAULT_TIMEOUT, max_running: int | None = None
) -> list[tuple[int, str]]:
    """Run independent launcher commands at once, each as ``run_launcher`` would (a dict with
    ``argv`` and optionally ``env`` and ``expect_rc``, 0 unless given; None accepts any). One
    launch keeps about 1.3 of 2 cores busy (its launcher and a 1-rank run use one), so side by
    side they end sooner than one after another. At most ``max_running`` run at a time (all
    when None): the next starts as one ends. Every command is killed ``timeout`` seconds after
    it started. Returns ``[(returncode, output)]`` in order; fails like ``run_launcher``."""
    import subprocess
    import tempfile
    import time

    procs, started, hung = [], [], []
    limit = max_running or len(runs)
    try:
        while len(procs) < len(runs) or any(p.poll() is None for p, _ in procs):
            running = [i for i, (p, _) in enumerate(procs) if p.poll() is None]
            for i in running:
                if time.monotonic() > started[i] + timeout:
                    hung.append(i)
                    kill_process_tree(procs[i][0].pid)  # the launcher's workers too
                    procs[i][0].wait()
            if len(procs) < len(runs) and len(running) < limit:
                run = runs[len(procs)]
                fh = tempfile.TemporaryFile(mode="w+")
                proc = subprocess.Popen(
                    run["argv"],
                    cwd=str(REPO_ROOT),
                    env={**os.environ, **_test_env(run.get("env"))},
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
                procs.append((proc, fh))
                started.append(time.monotonic())
                continue
            time.sleep(0.2)
    finally:
        for i, (proc, _) in enumerate(procs):
            if proc.poll() is None:
                hung.append(i)
                kill_process_tree(proc.pid)  # the launcher's workers too
                proc.wait()
    results = []
    for proc, fh in procs:
        fh.seek(0)
        results.append((proc.returncode, fh.read()))
        fh.close()
    for i, (run, (rc, out)) in enumerate(zip(runs, results)):
        retry = None if i in hung else _on_a_new_port(run["argv"], rc, out)
        if retry is not None:  # its port was taken before it started: once more, on a new port
            results[i] = _run_launcher_once(retry, timeout, run.get("env"))
    for i, (run, (rc, out)) in enumerate(zip(runs, results)):
        if i in hung:
            pytest.fail(
                f"{run['argv'][:4]} timed out after {timeout:.0f}s (a hang)\n{out[-8000:]}", pytrace=False
            )
        expect = run.get("expect_rc", 0)
        if expect is not None and rc != expect:
            pytest.fail(f"{run['argv'][:4]} exited {rc}, expected {expect}\n{out[-8000:]}", pytrace=False)
    return results


def step_values(output: str, name: str = "loss") -> dict[int, float]:
    """``{step: value}`` of a metric from a training script's ``step N loss X ...`` log lines."""
    import re

    return {int(s): float(v) for s, v in re.findall(rf"step (\d+) .*?\b{name} (-?[0-9.]+)\b", output)}


def resume_in_fresh_folder(
    argv: list[str], out, folder, checkpoint: str = "checkpoint-2", timeout: float = 400
) -> str:
    """Copy ``out/checkpoint`` into a new ``folder`` and run ``argv`` there with
    ``--resume_from_checkpoint latest``; returns the log."""
    import shutil

    folder.mkdir()
    shutil.copytree(out / checkpoint, folder / checkpoint)
    _, log = run_launcher(
        [*argv, "--output_dir", str(folder), "--resume_from_checkpoint", "latest"], timeout=timeout
    )
    return log


def launches_of_selected_tests(request, launch_for, max_running: int = 4, timeout: float = 400) -> dict:
    """For a module-scoped fixture: the launches of the tests this session selected in the
    fixture's module, run side by side (``run_launchers_side_by_side``, ``max_running`` at a
    time) instead of one test after another. ``launch_for(item)`` gives a test's run (a dict
    as ``run_launchers_side_by_side`` takes, its ``expect_rc`` None unless given) or None.
    Returns ``{test name: (returncode, output)}``; each test checks its own return code, so
    that a failed run fails its test alone (a hang still fails every test that shares the
    fixture). A test run alone launches only its own."""
    items = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    runs = {item.name: launch_for(item) for item in items}
    runs = {name: {"expect_rc": None, **run} for name, run in runs.items() if run is not None}
    results = run_launchers_side_by_side(list(runs.values()), timeout=timeout, max_running=max_running)
    return dict(zip(runs, results))


def first_launches_fixture(builders: dict, timeout: float = 400, max_running: int = 4):
    """A module-scoped fixture (assign it to a module-level name, e.g. ``first_runs``) that
    runs the first launch of every selected test named in ``builders`` side by side
    (``launches_of_selected_tests``). ``builders[test function name](request, folder, **params)``
    gives the launch's argv, writing its output under ``folder`` (a fresh folder of the test's
    own) with the fixtures it reads through ``request.getfixturevalue`` (module or session
    scoped) and the test's parameters. The fixture's value is ``{test name: ((returncode,
    output), folder)}``: a test reads its own with ``first_run``. Later launches of a test
    (resumes) stay in the test."""

    @pytest.fixture(scope="module")
    def first_runs(request, tmp_path_factory):
        folders = {}

        def launch_for(item):
            build = builders.get(getattr(item, "originalname", item.name))
            if build is None:
                return None
            folders[item.name] = tmp_path_factory.mktemp(item.name.removeprefix("test_")[:30])
            params = item.callspec.params if hasattr(item, "callspec") else {}
            return {"argv": build(request, folders[item.name], **params)}

        results = launches_of_selected_tests(request, launch_for, max_running=max_running, timeout=timeout)
        return {test: (result, folders[test]) for test, result in results.items()}

    return first_runs


def first_run(first_runs: dict, request) -> tuple[str, Path]:
    """This test's first launch (``first_launches_fixture``): its output and the test's folder.
    Fails with the output when the launch failed."""
    (code, out), folder = first_runs[request.node.name]
    assert code == 0, out[-8000:]
    return out, folder
