"""End to end under ``accelerate launch``: gradient accumulation under the shipped config,
rotation after a resume, rollback, resuming a finished run, a stopped rank in every phase
that waits on a collective, and one job across two (simulated) machines."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffusers_zero3.testing import kill_process_tree
from tests.distributed_harness import (
    REPO_ROOT,
    _test_env,
    accelerate_launch,
    run_launcher,
    run_launchers_side_by_side,
)
from tests.test_train_text_to_image import assert_trained_pipeline

pytestmark = pytest.mark.e2e

T2I = "scripts/train_text_to_image.py"
REWARD = "scripts/train_reward.py"


def _losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([0-9.]+)\b", output)}


def _t2i_args(pipe, data, out, steps):
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--output_dir", str(out),
            "--resolution", "32", "--center_crop", "--train_batch_size", "2", "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--seed", "3", "--report_to", "none"]  # fmt: skip


def _checkpoints(folder: Path, prefix: str = "checkpoint-") -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(prefix))


def test_accumulation_rotation_rollback_and_finished_run(default_data, tmp_path):
    """k=2 under the shipped config (which says 1), with a warmup scheduler; then a rollback
    to checkpoint-4 with limit 2; then resuming the finished run."""
    pipe, data, _ = default_data
    sched = ["--gradient_accumulation_steps", "2", "--lr_scheduler", "constant_with_warmup",
             "--lr_warmup_steps", "3", "--checkpointing_steps", "2"]  # fmt: skip
    launch = accelerate_launch(T2I)
    a = tmp_path / "a"
    _, log_a = run_launcher([*launch, *_t2i_args(pipe, data, a, 8), *sched], timeout=400)
    losses = _losses(log_a)
    assert sorted(losses) == list(range(1, 9)), log_a[-3000:]
    assert "all_gather_into_tensor` is deprecated" not in log_a  # the one noisy warning is filtered
    # 16 images, batch 2, 2 ranks: 4 micro-batches per rank per epoch. With k=2 step 2 ends
    # epoch 0 (2 micro-batches per optimizer step); with k ignored it would be mid-epoch.
    state = json.loads((a / "checkpoint-2" / "training_state.json").read_text())
    assert (state["epoch"], state["batches_in_epoch"], state["world_size"]) == (1, 0, 2), state
    model_states = torch.load(
        a / "checkpoint-2" / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False
    )
    assert model_states["ds_config"]["gradient_accumulation_steps"] == 2
    assert model_states["ds_config"]["train_batch_size"] == 2 * 2 * 2

    # Roll back to checkpoint-4 while 6 and 8 exist, with a limit of 2.
    b = tmp_path / "b"
    b.mkdir()
    for step in (4, 6, 8):
        shutil.copytree(a / f"checkpoint-{step}", b / f"checkpoint-{step}")
    _, log_b = run_launcher(
        [*launch, *_t2i_args(pipe, data, b, 8), *sched, "--checkpoints_total_limit", "2",
         "--resume_from_checkpoint", "checkpoint-4"],
        timeout=400,
    )  # fmt: skip
    again = _losses(log_b)
    assert sorted(again) == [5, 6, 7, 8], log_b[-3000:]
    for step in again:  # the warmup and accumulation resume exactly
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    assert _checkpoints(b) == ["checkpoint-6", "checkpoint-8"]
    assert _checkpoints(b, "abandoned-") == ["abandoned-checkpoint-6", "abandoned-checkpoint-8"]

    # Resume the finished run with its output missing: no step, and the output is written.
    for name in ("model_index.json", "unet"):
        path = b / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    _, log_c = run_launcher(
        [*launch, *_t2i_args(pipe, data, b, 8), *sched, "--checkpoints_total_limit", "2",
         "--resume_from_checkpoint", "latest"],
        timeout=400,
    )  # fmt: skip
    assert "resumed from" in log_c and "checkpoint-8 at step 8" in log_c, log_c[-3000:]
    assert _losses(log_c) == {} and "no step to train" in log_c
    assert (b / "model_index.json").exists() and (b / "unet" / "config.json").exists()
    assert _checkpoints(b) == ["checkpoint-6", "checkpoint-8"]


# --------------------------------------------------------------------------- a stopped rank

PHASES = {
    "train_step": [],
    "frozen_forward": ["--text_encoder_placement", "shard"],
    "checkpoint": ["--checkpointing_steps", "2"],
    "validation": [
        "--validation_prompts",
        "a red circle",
        "--validation_steps",
        "2",
        "--num_validation_inference_steps",
        "2",
    ],  # fmt: skip
    "final_save": [],
}


STOP_TIMEOUT_S = 15  # --process_group_timeout of the run without the rank watch
WATCH_S = 5  # --dead_rank_timeout of the others (their --process_group_timeout: 600 s)
UNWATCHED = "train_step"  # the phase run with the watch off: the collective timeout ends it
# accelerate's launcher (torch elastic) sends the stopped rank SIGTERM when rank 0 fails, which a
# stopped process does not act on, and SIGKILLs it 30 s later: the test kills it at once instead.
LAUNCHER_GRACE_S = 30


def test_a_stopped_rank_is_named_and_ends_the_job_in_every_phase(default_data, tmp_path):
    """Rank 1 freezes itself (SIGSTOP: its sockets stay open, unlike a kill under gloo, which is
    what NCCL shows of a dead rank) on entering a phase. With the rank watch
    (``--dead_rank_timeout 5``, ``--process_group_timeout 600``) rank 0 prints one ``error:`` line
    naming rank 1 and exits with 69 about 5 s after the stop (seen as the launcher's SIGTERM to
    the stopped rank); nothing of the interrupted checkpoint is published. With the watch off
    (``--dead_rank_timeout 0``, one phase), rank 0 fails on the collective timeout instead (gloo's
    "Timed out waiting 15000ms" with --process_group_timeout 15). The test then kills the frozen
    rank (the launcher would after its 30 s grace) and the launcher exits non-zero. The five
    runs go side by side."""
    pipe, data, _ = default_data
    runs = {}
    for phase, extra in PHASES.items():
        log = tmp_path / f"{phase}.log"
        timeouts = (
            ["--process_group_timeout", str(STOP_TIMEOUT_S), "--dead_rank_timeout", "0"]
            if phase == UNWATCHED
            else ["--process_group_timeout", "600", "--dead_rank_timeout", str(WATCH_S)]
        )
        argv = [*accelerate_launch(T2I), *_t2i_args(pipe, data, tmp_path / phase, 3), *timeouts, *extra]
        env = {**os.environ, **_test_env({"DIFFUSERS_ZERO3_FAULT": f"{phase}:1",
                                          "DIFFUSERS_ZERO3_PHASE_HOOK": "diffusers_zero3.testing:fault_point"})}  # fmt: skip
        env.pop("DIFFUSERS_ZERO3_PG_TIMEOUT")  # the flag decides
        with open(log, "w") as fh:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        runs[phase] = (proc, log)
    stopped_at: dict[str, float] = {}
    failed_at: dict[str, float] = {}  # rank 0's exit, as the launcher saw it
    ended_at: dict[str, float] = {}
    deadline = time.monotonic() + 300
    try:
        while len(ended_at) < len(runs) and time.monotonic() < deadline:
            for phase, (proc, log) in runs.items():
                text = log.read_text()
                if phase not in stopped_at and f"stopping rank 1 at {phase}" in text:
                    stopped_at[phase] = time.monotonic()
                if phase not in failed_at and "closing signal SIGTERM" in text:
                    failed_at[phase] = time.monotonic()
                    # the launcher now waits its grace (30 s) for the frozen rank to act on the
                    # SIGTERM, then SIGKILLs it: spare the test that wait
                    frozen = re.search(rf"stopping rank 1 at {phase} \(pid (\d+)\)", text)
                    if frozen:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(frozen.group(1)), signal.SIGKILL)
                if phase not in ended_at and proc.poll() is not None:
                    ended_at[phase] = time.monotonic()
            time.sleep(0.5)
    finally:
        for proc, _ in runs.values():
            if proc.poll() is None:
                kill_process_tree(proc.pid)
                proc.wait()
    waits = {}
    for phase, (proc, log) in runs.items():
        text = log.read_text()
        assert phase in stopped_at, f"{phase}: rank 1 never reached the fault point\n{text[-3000:]}"
        assert phase in ended_at, f"{phase}: still running long after rank 1 stopped (a hang)\n{text[-3000:]}"
        assert proc.returncode != 0, f"{phase}\n{text[-3000:]}"
        assert phase in failed_at, f"{phase}: the launcher never stopped the frozen rank\n{text[-3000:]}"
        waits[phase] = waited = failed_at[phase] - stopped_at[phase]
        if phase == UNWATCHED:  # rank 0 fails on the collective timeout, not sooner and not much later
            assert f"Timed out waiting {STOP_TIMEOUT_S * 1000}ms" in text, f"{phase}\n{text[-3000:]}"
            assert STOP_TIMEOUT_S - 5 < waited < STOP_TIMEOUT_S + 25, (
                f"{phase}: {waited:.0f} s\n{text[-3000:]}"
            )
            assert f"collective timeout: {STOP_TIMEOUT_S} s (--process_group_timeout" in text  # said at start
        else:  # the watch names rank 1 after its timeout (plus a poll; 5 runs share 2 cores)
            assert "error: rank 1 is gone: no heartbeat for" in text, f"{phase}\n{text[-3000:]}"
            assert "Timed out waiting" not in text, f"{phase}\n{text[-3000:]}"
            assert WATCH_S - 1 < waited < WATCH_S + 15, f"{phase}: {waited:.0f} s\n{text[-3000:]}"
        waited = ended_at[phase] - stopped_at[phase]
        assert waited < failed_at[phase] - stopped_at[phase] + LAUNCHER_GRACE_S + 30, (
            f"{phase}: ended {waited:.0f} s after the stop\n{text[-3000:]}"
        )
    # the checkpoint rank 1 froze in is not published (an unpublished temporary folder may stay)
    assert not (tmp_path / "checkpoint" / "checkpoint-2").exists()
    print("stop -> rank 0's exit (s): " + ", ".join(f"{p} {w:.1f}" for p, w in waits.items()))


# --------------------------------------------------------------------------- two machines


def _two_machines_side_by_side(jobs: list[dict], timeout: float = 420) -> list[tuple[list, list[str]]]:
    """Run each job (a dict: ``script``, ``args`` and optionally ``env_extra`` and
    ``per_machine``) as 2 machines x 1 process on this host (accelerate's multi-node launch,
    each process the local main of its "machine"), all jobs at once (``run_launchers_side_by_side``:
    a hang fails the test); a job with ``argv`` instead is one launcher command. Returns each
    job's (return codes, outputs), one per process."""
    from diffusers_zero3.testing import free_port

    runs, owners = [], []  # one run per process; owners[k]: the job of run k
    for j, job in enumerate(jobs):
        env = job.get("env_extra")
        if "argv" in job:
            runs.append({"argv": job["argv"], "env": env, "expect_rc": None})
            owners.append(j)
            continue
        port = free_port()
        for machine in (0, 1):
            argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    "configs/accelerate_zero3.yaml", "--num_processes", "2", "--num_machines", "2",
                    "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port",
                    str(port), "--deepspeed_multinode_launcher", "standard", job["script"], *job["args"],
                    *((job.get("per_machine") or {}).get(machine, []))]  # fmt: skip
            runs.append({"argv": argv, "env": env, "expect_rc": None})
            owners.append(j)
    results = run_launchers_side_by_side(runs, timeout=timeout)
    return [
        (
            [rc for (rc, _), o in zip(results, owners) if o == j],
            [out for (_, out), o in zip(results, owners) if o == j],
        )
        for j in range(len(jobs))
    ]


def test_two_machines_train_checkpoint_rotate_validate_save_and_resume(default_data, tmp_path):
    pipe, data, reward = default_data
    out = tmp_path / "shared"
    args = [*_t2i_args(pipe, data, out, 4), "--report_to", "tensorboard", "--checkpointing_steps", "2",
            "--checkpoints_total_limit", "1", "--validation_prompts", "a red circle", "--validation_steps", "4",
            "--num_validation_inference_steps", "2", "--text_encoder_placement", "shard"]  # fmt: skip
    local0, local1 = tmp_path / "local0", tmp_path / "local1"
    local = [*args]
    local[local.index("--output_dir") + 1] = str(local0)
    local[local.index("--max_train_steps") + 1] = "2"
    reward_args = ["--pretrained_model_name_or_path", pipe, "--reward_model_name_or_path", reward,
                   "--prompts", "a red circle", "a blue square", "--resolution", "32", "--train_batch_size", "2",
                   "--max_train_steps", "2", "--num_inference_steps", "2", "--learning_rate", "1e-3",
                   "--checkpointing_steps", "1", "--checkpoints_total_limit", "1", "--report_to", "none",
                   "--output_dir", str(tmp_path / "reward")]  # fmt: skip
    # Four independent jobs side by side (each checked below): the job on one machine, for
    # reference; the job on two; a save to node-local disks; the reward script on two.
    one_argv = [*accelerate_launch(T2I), *args[:args.index("--output_dir") + 1], str(tmp_path / "one"),
                *args[args.index("--output_dir") + 2 :]]  # fmt: skip
    (one_codes, (one,)), (codes, logs), local_run, reward_run = _two_machines_side_by_side(
        [{"argv": one_argv}, {"script": T2I, "args": args},
         {"script": T2I, "args": local, "per_machine": {1: ["--output_dir", str(local1)]}},
         {"script": REWARD, "args": reward_args}]
    )  # fmt: skip
    assert one_codes == [0], one[-3000:]
    assert codes == [0, 0], "\n=====\n".join(log[-3000:] for log in logs)
    reference, losses = _losses(one), _losses(logs[0])
    assert sorted(losses) == [1, 2, 3, 4]
    for step in losses:
        assert losses[step] == pytest.approx(reference[step], abs=2e-6), (losses, reference)
    assert "step 1 loss" not in logs[1]  # rank 1 (a local main) does not log the job's lines
    # Once per job: one rotation result, one validation image, one TensorBoard run, one pipeline.
    assert _checkpoints(out) == ["checkpoint-4"]
    assert [p.name for p in (out / "validation").iterdir()] == ["step-000004.png"]
    events = list((out / "logs").rglob("events.out.tfevents*"))  # events.out.tfevents.<time>.<host>.<pid>.<n>
    assert events and len({p.name.split(".")[-2] for p in events}) == 1, events  # one writing process
    assert len(events) == len(list((tmp_path / "one" / "logs").rglob("events.out.tfevents*")))
    assert (out / "model_index.json").exists() and not [p for p in out.iterdir() if p.name.startswith(".")]
    assert_trained_pipeline(out, pipe, steps=4, learning_rate=1e-3)  # one job's whole, trained UNet

    # Node-local disks when saving: each machine's --output_dir is its own folder (what the
    # same path on two machines' own disks is). The first checkpoint fails on both machines
    # with one error line, before any partition is written, and no machine keeps a
    # temporary folder or a checkpoint that lacks the other machine's files.
    codes, logs = local_run
    assert all(code != 0 for code in codes), (codes, "\n=====\n".join(log[-3000:] for log in logs))
    for log in logs:
        errors = [line for line in log.splitlines() if "error:" in line]
        assert len(errors) == 1 and "--output_dir" in errors[0], log[-3000:]
        assert "storage that every node sees" in errors[0] and "exitcode  : 2" in log, log[-3000:]
        assert "diffusers_zero3/" not in log and 'scripts/train_text_to_image.py", line' not in log
    for node in (local0, local1):
        left = [p.name for p in node.glob("*") if p.name.startswith((".tmp-", "checkpoint-"))]
        assert left == [], (node, left)

    # The reward script across two machines: each rank samples its own prompts and latents.
    codes, logs = reward_run
    assert codes == [0, 0], "\n=====\n".join(log[-3000:] for log in logs)
    rewards = json.loads((tmp_path / "reward" / "rewards.json").read_text())
    assert len(rewards["per_rank"]) == 2 and rewards["per_rank"][0][0] != rewards["per_rank"][0][1]
    assert _checkpoints(tmp_path / "reward") == ["checkpoint-2"]
    assert (tmp_path / "reward" / "model_index.json").exists()

    # Node-local disks: each machine sees only what it wrote itself (of checkpoint-4).
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    shutil.copytree(out, node0, ignore=shutil.ignore_patterns("zero_pp_rank_1_*", "random_states_1.pkl"))
    node1.mkdir()
    shutil.copytree(out / "checkpoint-4", node1 / ".tmp-checkpoint-4",
                    ignore=shutil.ignore_patterns("zero_pp_rank_0_*", "random_states_0.pkl", "*.json", "latest"))  # fmt: skip

    # Three jobs side by side: the resume across the two machines (steps 5-6), the resume from
    # node-local disks, and the reward job's resume across the two machines.
    resumed_args = [
        a if a != "4" or i != args.index("--max_train_steps") + 1 else "6" for i, a in enumerate(args)
    ]
    base = [a for a in resumed_args]
    base[base.index("--output_dir") + 1] = str(node0)
    reward_resumed = [*reward_args, "--resume_from_checkpoint", "latest"]
    reward_resumed[reward_resumed.index("--max_train_steps") + 1] = "3"
    (codes, logs), node_run, reward_resumed_run = _two_machines_side_by_side(
        [{"script": T2I, "args": [*resumed_args, "--resume_from_checkpoint", "latest"]},
         {"script": T2I, "args": [*base, "--resume_from_checkpoint", "latest"],
          "per_machine": {1: ["--output_dir", str(node1)]}},
         {"script": REWARD, "args": reward_resumed}]
    )  # fmt: skip
    assert codes == [0, 0], "\n=====\n".join(log[-3000:] for log in logs)
    assert sorted(_losses(logs[0])) == [5, 6]
    assert _checkpoints(out) == ["checkpoint-6"]

    codes, logs = node_run
    assert all(code != 0 for code in codes), "\n=====\n".join(log[-3000:] for log in logs)
    for log in logs:
        assert "error: checkpoint" in log and "incomplete as seen from rank 1" in log, log[-3000:]
        assert "every machine shares" in log and "exitcode  : 2" in log, log[-3000:]
        # The launcher reports the failed child with its own traceback; the script prints none.
        assert "diffusers_zero3/" not in log and 'scripts/train_text_to_image.py", line' not in log

    codes, logs = reward_resumed_run
    assert codes == [0, 0], "\n=====\n".join(log[-3000:] for log in logs)
    assert re.findall(r"step (\d+) reward", logs[0]) == ["3"], logs[0][-3000:]
    assert _checkpoints(tmp_path / "reward") == ["checkpoint-3"]
    assert len(json.loads((tmp_path / "reward" / "rewards.json").read_text())["per_rank"]) == 3
