#!/usr/bin/env python
"""`make smoke-gpu`: a few steps of each training script on every GPU of this host, one table.

Each case runs a training script on a tiny default pipeline (``diffusers_zero3.demo``: SD,
SDXL, SD3, Flux.1, the redness reward model, a preference dataset) under ``accelerate
launch --num_processes N``, N = the GPUs (``diffusers_zero3.runtime.launch``; ``NUM_PROCESSES``
overrides), for 2 steps (4 when it resumes). Every launch runs under a timeout: past it the
whole process group is killed and the case is a ``timeout`` (a hang is a failure). The
table, case | result | seconds | peak device GiB per rank, is printed and written to
``outputs/smoke-gpu/table.md``; each case's log is ``outputs/smoke-gpu/logs/<case>.log``.
The peak is the largest ``device peak`` of the trainer's memory report (``MemoryLog``:
torch's ``max_memory_allocated``, the maximum over ranks), ``n/a`` where the log has none
(a script without that report).

    make smoke-gpu                                        # every case (a few minutes on one GPU)
    SMOKE_CASES=sd-bf16-ema-shard-resume,dpo-bf16-lora8 make smoke-gpu
    SMOKE_TIMEOUT=600 make smoke-gpu                      # seconds per launch (default 240)
    python scripts/smoke_gpu.py --list                    # the cases and their flags

Exit status: 0 when every case is ok, 1 when one failed, 2 without a CUDA GPU or for an
unknown case name.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "outputs" / "smoke-gpu"
ZERO3 = "configs/accelerate_zero3.yaml"
ZERO3_BF16 = "configs/accelerate_zero3_bf16.yaml"
ZERO3_OFFLOAD = "configs/accelerate_zero3_offload.yaml"
SCRIPTS = {
    "t2i": "scripts/train_text_to_image.py",
    "reward": "scripts/train_reward.py",
    "dpo": "scripts/train_dpo.py",
}
STEPS = 2
VALIDATION = ["--validation_prompts", "a red circle", "--num_validation_inference_steps", "2"]


@dataclass
class Case:
    """A training script (``t2i``, ``reward`` or ``dpo``) on a tiny ``model`` under
    ``config`` with ``flags`` (one string, split as a shell would), validation images at the
    last step when ``validate``; ``resume`` runs it again to ``2 * STEPS`` from its checkpoint."""

    name: str
    script: str
    model: str
    flags: str = ""
    config: str = ZERO3_BF16
    validate: bool = True
    resume: bool = False
    timeout: float | None = None  # seconds per launch; None: SMOKE_TIMEOUT


EMA_SHARD = "--use_ema --text_encoder_placement shard"
CASES = [
    Case("sd-fp32-ema-shard-resume", "t2i", "sd", EMA_SHARD, config=ZERO3, resume=True),
    Case("sd-bf16-ema-shard-resume", "t2i", "sd", EMA_SHARD, resume=True),
    Case("sdxl-bf16-vae-replicate", "t2i", "sdxl", "--vae_placement replicate"),
    Case("sdxl-bf16-vae-cache", "t2i", "sdxl", "--vae_placement cache"),
    Case("sdxl-bf16-te2-cache", "t2i", "sdxl", "--text_encoder_2_placement cache"),
    Case(
        "sd3-bf16-t5-cache",
        "t2i",
        "sd3",
        "--text_encoder_placement replicate --text_encoder_2_placement replicate "
        "--text_encoder_3_placement cache --max_sequence_length 32",
    ),
    Case(
        "flux-bf16-t5-shard-lora4",
        "t2i",
        "flux",
        "--text_encoder_2_placement shard --rank 4 --max_sequence_length 32",
    ),
    Case(
        "reward-bf16",
        "reward",
        "sd",
        "--reward_placement shard --use_ema --num_inference_steps 4 --truncated_backprop_steps 1",
        validate=False,  # the reward script has no validation images; it logs the reward per step
    ),
    Case("dpo-bf16-lora8", "dpo", "sd", "--rank 8 --text_encoder_placement shard"),
    Case(
        "sd-bf16-offload-placements",
        "t2i",
        "sd",
        "--use_ema --text_encoder_placement offload --vae_placement offload",
    ),
    # DeepSpeed builds its CPU Adam op at the first use of optimizer offload: a longer timeout.
    Case("sd-fp32-offload-config", "t2i", "sd", EMA_SHARD, config=ZERO3_OFFLOAD, timeout=480),
]


def case_argv(case: Case, data: Path, run: Path, steps: int) -> list[str]:
    """The script's flags for ``case`` on the tiny pipelines under ``data``, writing ``run``."""
    argv = [SCRIPTS[case.script], "--pretrained_model_name_or_path", str(data / f"tiny-{case.model}")]
    argv += ["--output_dir", str(run), "--resolution", "32", "--train_batch_size", "2", "--seed", "0"]
    argv += ["--max_train_steps", str(steps), "--learning_rate", "1e-4", "--checkpointing_steps", str(STEPS)]
    argv += ["--process_group_timeout", "120", "--report_to", "none"]
    if case.script == "reward":
        argv += ["--prompts", "a red circle", "a blue square"]
        argv += ["--reward_model_name_or_path", str(data / "redness-reward")]
    elif case.script == "dpo":
        argv += ["--dataset_name", str(data / "preferences"), "--center_crop", "--lr_warmup_steps", "0"]
    else:
        images = data / ("shapes-varied" if case.model == "sdxl" else "shapes")
        argv += ["--train_data_dir", str(images), "--center_crop", "--lr_warmup_steps", "0"]
    argv += shlex.split(case.flags)
    if case.validate:
        argv += [*VALIDATION, "--validation_steps", str(STEPS)]
    return argv


def prepare_data(cases: list[Case], data: Path, log_path: Path) -> bool:
    """Make (once; later runs reuse them) the tiny pipelines, datasets and reward model the
    cases need with ``python -m diffusers_zero3.demo``, its output appended to ``log_path``.
    False when it failed."""
    for model in sorted({c.model for c in cases}):
        argv = [sys.executable, "-m", "diffusers_zero3.demo", str(data), "--model", model]
        if model == "sd" and any(c.script == "dpo" for c in cases):
            argv.append("--preferences")
        if run_launch(argv, dict(os.environ), log_path, timeout=600) != 0:
            return False
    return True


# MemoryLog.format's "device peak X MiB" (torch's max_memory_allocated, maximum over ranks).
_DEVICE_PEAK = re.compile(r"device peak\D{0,12}?([0-9.]+)\s*(GiB|MiB|KiB|GB|MB|KB)\b", re.IGNORECASE)
_UNIT = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 1e9, "mb": 1e6, "kb": 1e3}


def device_peak_gib(log: str) -> float | None:
    """The largest ``device peak <x> <unit>`` in a training log, in GiB (None if absent)."""
    values = [float(v) * _UNIT[u.lower()] / 2**30 for v, u in _DEVICE_PEAK.findall(log)]
    return max(values) if values else None


def run_launch(argv: list[str], env: dict[str, str], log_path: Path, timeout: float) -> int | None:
    """Run one launch in a new session, its output appended to ``log_path``; kill its whole
    process group past ``timeout`` seconds. The exit code, or None on a timeout."""
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\n[smoke-gpu] killed after {timeout:.0f} s (a hang or too slow)\n")
            return None
        except BaseException:  # Ctrl-C: leave no rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def run_case(case: Case, num_processes: int, env: dict[str, str], data: Path, timeout: float) -> dict:
    """Run ``case`` (and its resume); returns ``{result, seconds, peak, reason}``."""
    from diffusers_zero3.testing import free_port

    run, log_path = OUT / "runs" / case.name, OUT / "logs" / f"{case.name}.log"
    shutil.rmtree(run, ignore_errors=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    launches = [(STEPS, [])] + ([(2 * STEPS, ["--resume_from_checkpoint", "latest"])] if case.resume else [])
    start, result, reason = time.monotonic(), "ok", ""
    for steps, extra in launches:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", case.config,
                    "--num_processes", str(num_processes), "--main_process_port", str(free_port())]  # fmt: skip
        offset = len(log_path.read_text())
        rc = run_launch([*launcher, *case_argv(case, data, run, steps), *extra], env, log_path, timeout)
        log = log_path.read_text()[offset:]
        if rc is None:
            result, reason = "timeout", f"killed after {timeout:.0f} s"
        elif rc != 0:
            result, reason = "FAIL", f"exit code {rc}"
        elif not re.search(rf"\bstep {steps} (loss|reward) ", log):
            result, reason = "FAIL", f"exit code 0 but no 'step {steps}' line"
        elif extra and not re.search(rf"resumed from \S*checkpoint-{STEPS} at step {STEPS}\b", log):
            result, reason = "FAIL", f"exit code 0 but no 'resumed from ...checkpoint-{STEPS}' line"
        if result != "ok":
            break
    return {
        "result": result,
        "seconds": time.monotonic() - start,
        "peak": device_peak_gib(log_path.read_text()),
        "reason": reason,
    }


def format_table(rows: list[tuple[str, dict]]) -> str:
    """A markdown table: case | result | seconds | peak device GiB per rank."""
    lines = ["| case | result | seconds | peak device GiB per rank |", "|---|---|---:|---:|"]
    for name, r in rows:
        peak = "n/a" if r["peak"] is None else f"{r['peak']:.2f}"
        lines.append(f"| {name} | {r['result']} | {r['seconds']:.1f} | {peak} |")
    return "\n".join(lines)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in ("torch", "deepspeed", "accelerate", "diffusers", "transformers"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} missing")
    return ", ".join(parts)


def select_cases(names: str) -> list[Case]:
    """The cases named in ``names`` (comma-separated, in the matrix's order); all when empty.
    Raises ValueError for an unknown name."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(c.name for c in CASES)}")
    return [c for c in CASES if not wanted or c.name in wanted]


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for case in CASES:
            print(f"{case.name}: {SCRIPTS[case.script]} tiny-{case.model} {case.config} {case.flags}")
        return 0
    from diffusers_zero3.runtime.launch import launch_settings

    # DS_ACCELERATOR=cpu (left over from a CPU run) would ask for CPU ranks: these cases are for GPUs.
    env = {k: v for k, v in os.environ.items() if not (k == "DS_ACCELERATOR" and v == "cpu")}
    try:
        settings = launch_settings(env)
        cases = select_cases(os.environ.get("SMOKE_CASES", ""))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if settings.device != "cuda":
        print("error: make smoke-gpu needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    env.update(settings.env)
    timeout = float(os.environ.get("SMOKE_TIMEOUT", 240))
    n = settings.num_processes
    data = OUT / "data"
    print(f"smoke-gpu: {len(cases)} case(s) on {n} GPU process(es); {_versions()}", flush=True)
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    if not prepare_data(cases, data, OUT / "logs" / "data.log"):
        print(f"error: making the tiny pipelines failed: {OUT / 'logs' / 'data.log'}", file=sys.stderr)
        return 1
    rows = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.name} ...", end=" ", flush=True)
        r = run_case(case, n, env, data, case.timeout or timeout)
        print(f"{r['result']} ({r['seconds']:.1f} s){': ' + r['reason'] if r['reason'] else ''}", flush=True)
        rows.append((case.name, r))
    table = format_table(rows)
    header = f"make smoke-gpu: {n} GPU process(es); {_versions()}"
    (OUT / "table.md").write_text(f"{header}\n\n{table}\n")
    print(f"\n{table}\n\ntable: {OUT / 'table.md'}")
    failed = [name for name, r in rows if r["result"] != "ok"]
    for name in failed:
        tail = (OUT / "logs" / f"{name}.log").read_text().splitlines()[-15:]
        print(f"\n--- {name}: {OUT / 'logs' / f'{name}.log'} (last lines)\n" + "\n".join(tail))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
