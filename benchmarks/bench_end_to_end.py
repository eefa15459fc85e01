"""The text-to-image script end to end: ZeRO-3 (N=2) against plain DDP on the same job.

A UNet of tens of millions of parameters (``WIDTH``), fp32, batch 2 per rank, 32 px, on two
CPU processes (gloo). ZeRO-3 runs with the frozen text encoder and VAE all replicated, all
sharded, and cached; DDP runs them replicated. Each run's numbers come from the script's own
log (``training.report.log_memory_per_rank``): peak RSS per rank, RSS per phase, the trained
model's state bytes per rank, and the time of the steps after the first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import DEEPSPEED_DEFAULTS_ENV, LEVERS_ENV, REPO_ROOT, markdown_table, print_section
from diffusers_zero3.runtime.huge_pages import HUGE_PAGES_ENV
from diffusers_zero3.testing import free_port

WIDTH = 224  # a UNet of 38.5 M parameters (demo.tiny_component_configs)
STEPS = 12
PLACEMENTS = {
    "replicated": ("replicate", "replicate"),
    "sharded": ("shard", "shard"),
    "cache": ("cache", "cache"),
}


def run_script(
    pipe: Path,
    data: Path,
    out: Path,
    *,
    zero3: bool,
    te: str,
    vae: str,
    env: dict | None = None,
    steps=STEPS,
    extra: tuple[str, ...] = (),
) -> str:
    """Run the text-to-image script on 2 CPU ranks; returns its output (raises on failure)."""
    script = str(REPO_ROOT / "scripts" / "train_text_to_image.py")
    if zero3:
        launch = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO_ROOT / "configs" / "accelerate_zero3.yaml"),
            "--num_processes", "2", "--main_process_port", str(free_port()),
        ]  # fmt: skip
    else:
        launch = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()),
        ]  # fmt: skip
    argv = [
        *launch, script,
        "--pretrained_model_name_or_path", str(pipe), "--train_data_dir", str(data),
        "--output_dir", str(out), "--resolution", "32", "--center_crop",
        "--train_batch_size", "2", "--max_train_steps", str(steps), "--learning_rate", "1e-4",
        "--checkpointing_steps", "100000", "--seed", "0", "--report_to", "none",
        "--text_encoder_placement", te, "--vae_placement", vae, *extra,
    ]  # fmt: skip
    full_env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(REPO_ROOT),
        "ACCELERATE_USE_DEEPSPEED": "true" if zero3 else "false",
        **(env or {}),
    }
    proc = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=1800)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(
            f"run failed ({proc.returncode}), log {out / 'launch.log'}:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc.stdout + proc.stderr


_PHASE = re.compile(
    r"^\s+(.+?)\s+RSS\s+([\d.]+) MiB\s+peak\s+([\d.]+) MiB \(\+\s*[\d.]+\)\s+([\d.]+) s(?:\s+device peak .*)?$"
)
_STATES = re.compile(r"model states per rank: (.*) \(total ([\d.]+) MiB\)")
_HEAP = re.compile(
    r"glibc heap per rank at the end: in use ([\d.]+) MiB, freed but held ([\d.]+) MiB, mmapped ([\d.]+) MiB"
)


def parse_memory(output: str) -> dict:
    """The per-phase table and model-state bytes of a run's log (MiB, seconds)."""
    phases = {}
    for line in output.splitlines():
        m = _PHASE.match(line)
        if m:
            phases[m.group(1)] = {"rss": float(m.group(2)), "peak": float(m.group(3)), "s": float(m.group(4))}
    states_line = _STATES.search(output)
    if not phases or not states_line:
        raise RuntimeError(f"no memory report in the run's log:\n{output[-3000:]}")
    states = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) MiB", states_line.group(1))}
    heap = _HEAP.search(output)  # absent without glibc's mallinfo2
    heap = (
        {"in_use": float(heap.group(1)) + float(heap.group(3)), "held": float(heap.group(2))}
        if heap
        else None
    )
    return {"phases": phases, "states": states, "state_total": float(states_line.group(2)), "heap": heap}


def measure(
    pipe: Path, data: Path, work: Path, name: str, *, zero3: bool, te: str, vae: str, env=None, extra=()
) -> dict:
    """Run the script once; its memory report, peak RSS per rank (MiB) and seconds per step
    and per sample."""
    out = parse_memory(run_script(pipe, data, work / name, zero3=zero3, te=te, vae=vae, env=env, extra=extra))
    ph = out["phases"]
    step_s = ph["training done"]["s"] / (STEPS - 1)  # steps 2..STEPS (the first one warms up)
    return {**out, "peak": max(p["peak"] for p in ph.values()), "step_s": step_s, "sample_s": step_s / 4}


def prepare(work: Path, width: int = WIDTH, shape: str = "tiny") -> tuple[Path, Path]:
    """A tiny pipeline whose UNet has ``width`` and the layout ``shape``
    (``demo.UNET_SHAPES``), and the shapes dataset."""
    from diffusers_zero3.demo import save_tiny_sd_pipeline, write_shapes_dataset

    pipe = work / f"pipe-{shape}-{width}"
    if not pipe.exists():
        save_tiny_sd_pipeline(pipe, width=width, unet_shape=shape)
    data = work / "shapes"
    if not data.exists():
        write_shapes_dataset(data, num_images=32)
    return pipe, data


# UNets with the module counts of the published ones at small width (demo.UNET_SHAPES): where
# ZeRO-3's per-module hooks and collectives show. width -> 34.0 M (SD 1.5 shape), 23.4 M (SDXL).
FINE_GRAINED = {"sd15": 64, "sdxl": 32}
# Each lever of this package set back to DeepSpeed's own (DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS).
WITHOUT_LEAVES = "without blocks as leaf modules (a fetch unit per module)"
LEVER_RUNS = {  # label: the environment of the run
    "DeepSpeed's defaults (every lever off)": DEEPSPEED_DEFAULTS_ENV,
    "without the persistence share (10 x hidden)": {LEVERS_ENV: "persistence"},
    "without dropping idle module hooks": {LEVERS_ENV: "hooks"},
    "with NVTX ranges": {LEVERS_ENV: "nvtx"},
    "10^9 live parameters (the whole model gathered)": {LEVERS_ENV: "live"},
    "kept-whole parameters gathered one by one after the step": {LEVERS_ENV: "coalesce"},
    "host tensors without huge pages (THP_MEM_ALLOC_ENABLE=0)": {HUGE_PAGES_ENV: "0"},
    WITHOUT_LEAVES: {LEVERS_ENV: "leaves"},
    "gradient reduce-scatters blocking the backward": {LEVERS_ENV: "overlap"},
}
# the runs of the other shapes: DeepSpeed's defaults and the one lever that depends most on
# the module count
SHAPE_LEVERS = [next(iter(LEVER_RUNS)), WITHOUT_LEAVES]

SIZES = (96, 160)  # smaller UNets, for the size at which ZeRO-3's peak RSS drops below DDP's


def calibration_rows(pipe: Path, ddp: dict, zero3: dict) -> list[dict]:
    """The planner's model-state bytes per rank against the ones measured (N=2): parameters,
    gradients, optimizer state (and EMA), without buffers."""
    from diffusers_zero3.placement.plan import PlanOptions, make_plan

    plan = make_plan(str(pipe), PlanOptions(num_processes=2))["components"]["unet"]["placements"]
    kinds = ("parameters", "gradients", "optimizer", "ema")
    rows = []
    for name, placement, res in (("DDP", "replicate", ddp), ("ZeRO-3", "shard", zero3)):
        planned = sum(plan[placement][k] for k in kinds) / 2**20
        measured = sum(res["states"].get(k, 0.0) for k in kinds)
        rows.append(
            {
                "run": name,
                "planned MiB / rank": f"{planned:.1f}",
                "measured MiB / rank": f"{measured:.1f}",
                "planned / measured": f"{planned / measured:.3f}",
            }
        )
    return rows


def crossover(points: list[tuple[float, float]]) -> str:
    """Where the ratio ZeRO-3 / DDP of peak RSS crosses 1, from (params, ratio) points."""
    points = sorted(points)
    for (p0, r0), (p1, r1) in zip(points, points[1:]):
        if r0 >= 1 > r1:
            at = p0 + (p1 - p0) * (r0 - 1) / (r0 - r1)
            return f"below DDP's from about {at / 1e6:.0f} M UNet parameters"
    if points and points[0][1] < 1:
        return f"below DDP's at every size measured (from {points[0][0] / 1e6:.0f} M)"
    return f"above DDP's at every size measured (up to {points[-1][0] / 1e6:.0f} M)"


def main() -> None:
    from diffusers_zero3.placement.plan import PlanOptions, make_plan

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pipe, data = prepare(work)
        params = make_plan(str(pipe), PlanOptions(num_processes=2))["components"]["unet"]["parameters"]
        ddp = measure(pipe, data, work, "ddp", zero3=False, te="replicate", vae="replicate")
        rows = [_row("DDP (replicated)", ddp, ddp)]
        phases = {"DDP": ddp["phases"]}
        results = {}
        for name, (te, vae) in PLACEMENTS.items():
            results[name] = res = measure(pipe, data, work, name, zero3=True, te=te, vae=vae)
            rows.append(_row(f"ZeRO-3, frozen {name}", res, ddp))
            phases[f"ZeRO-3 {name}"] = res["phases"]
        # the same two jobs with glibc handing freed blocks back to the OS (--return_freed_memory)
        freed = ("--return_freed_memory",)
        freed_res = measure(
            pipe, data, work, "zero3-freed", zero3=True, te="replicate", vae="replicate", extra=freed
        )
        rows.append(_row("ZeRO-3, frozen replicated, --return_freed_memory", freed_res, ddp))
        phases["ZeRO-3 replicated, freed"] = freed_res["phases"]
        res = measure(
            pipe, data, work, "ddp-freed", zero3=False, te="replicate", vae="replicate", extra=freed
        )
        rows.append(_row("DDP, --return_freed_memory", res, ddp))
        print_section(
            f"End to end: text-to-image script, UNet {params / 1e6:.1f} M parameters, N=2 CPU ranks, "
            "fp32, batch 2 per rank, 32 px",
            markdown_table(rows, list(rows[0])),
        )
        names = list(phases["DDP"])
        table = [
            {
                "phase": n,
                **{k: f"{v[n]['rss']:.0f} / {v[n]['peak']:.0f}" for k, v in phases.items() if n in v},
            }
            for n in names
        ]
        print_section("RSS / peak RSS per rank (MiB) after each phase", markdown_table(table, list(table[0])))
        cal = calibration_rows(pipe, ddp, results["replicated"])
        print_section("Planner calibration: model states per rank, N=2", markdown_table(cal, list(cal[0])))
        size_sweep(work, data, {WIDTH: (ddp, results["replicated"], freed_res)})
        fine_grained(work, data, {"tiny": (ddp, results["replicated"])})


def module_counts(pipe: Path) -> tuple[int, int, int]:
    """``(parameters, parameter tensors, modules holding parameters)`` of a pipeline's UNet."""
    import torch
    from diffusers import UNet2DConditionModel

    config = UNet2DConditionModel.load_config(str(pipe / "unet"))
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    modules = sum(1 for m in unet.modules() if next(m.parameters(recurse=False), None) is not None)
    return sum(p.numel() for p in unet.parameters()), len(list(unet.parameters())), modules


def fine_grained(work: Path, data: Path, measured: dict | None = None) -> None:
    """ZeRO-3 against DDP on UNets with the module counts of SD 1.5 and SDXL (and the coarse
    one of the tables above, from ``measured``), at this package's defaults and at
    DeepSpeed's; then, on the SD 1.5 shape, each lever set back alone."""
    from benchmarks.figures import ratio_bars

    runs = dict(measured or {})
    common = dict(te="replicate", vae="replicate")
    levers = {}
    for shape, width in {"tiny": WIDTH, **FINE_GRAINED}.items():
        pipe, _ = prepare(work, width, shape)
        if shape not in runs:
            ddp = measure(pipe, data, work, f"ddp-{shape}", zero3=False, **common)
            runs[shape] = (ddp, measure(pipe, data, work, f"zero3-{shape}", zero3=True, **common))
        names = LEVER_RUNS if shape == "sd15" else {label: LEVER_RUNS[label] for label in SHAPE_LEVERS}
        for index, (label, env) in enumerate(names.items()):
            levers[(shape, label)] = measure(
                pipe, data, work, f"zero3-{shape}-lever{index}", zero3=True, env=env, **common
            )
    rows = []
    for shape, (ddp, ours) in runs.items():
        width = {"tiny": WIDTH, **FINE_GRAINED}[shape]
        params, tensors, modules = module_counts(work / f"pipe-{shape}-{width}")
        ds, leafless = (levers.get((shape, label)) for label in SHAPE_LEVERS)
        rows.append(
            {
                "UNet shape": f"{shape} (width {width})",
                "M params": f"{params / 1e6:.1f}",
                "tensors / modules": f"{tensors} / {modules}",
                "DDP s / step": f"{ddp['step_s']:.3f}",
                "ZeRO-3 s / step": f"{ours['step_s']:.3f}",
                "time vs DDP (goal <= 1.5)": f"{ours['step_s'] / ddp['step_s']:.2f}",
                "DeepSpeed's defaults vs DDP": f"{ds['step_s'] / ddp['step_s']:.2f}" if ds else "",
                "without leaf blocks vs DDP": f"{leafless['step_s'] / ddp['step_s']:.2f}" if leafless else "",
                "DDP peak MiB": f"{ddp['peak']:.0f}",
                "ZeRO-3 peak MiB": f"{ours['peak']:.0f}",
                "RSS vs DDP (goal <= 0.9)": f"{ours['peak'] / ddp['peak']:.2f}",
                "in use at the end, DDP / ZeRO-3 MiB": _heap(ddp, ours, "in_use"),
                "freed but held by glibc, DDP / ZeRO-3 MiB": _heap(ddp, ours, "held"),
            }
        )
    print_section(
        "ZeRO-3 per module: UNets shaped like the published ones, N=2 CPU ranks, fp32, batch 2 per rank, 32 px "
        "(frozen models replicated)",
        markdown_table(rows, list(rows[0])),
    )
    ddp, ours = runs["sd15"]
    lever_rows = [{"run (SD 1.5 shape)": "this package's defaults", "s / step": f"{ours['step_s']:.3f}",
                   "vs DDP": f"{ours['step_s'] / ddp['step_s']:.2f}", "peak RSS MiB": f"{ours['peak']:.0f}"}]  # fmt: skip
    for label in LEVER_RUNS:
        res = levers[("sd15", label)]
        lever_rows.append(
            {
                "run (SD 1.5 shape)": label,
                "s / step": f"{res['step_s']:.3f}",
                "vs DDP": f"{res['step_s'] / ddp['step_s']:.2f}",
                "peak RSS MiB": f"{res['peak']:.0f}",
            }
        )
    print_section(
        "Each lever set back to DeepSpeed's own, SD 1.5 shape",
        markdown_table(lever_rows, list(lever_rows[0])),
    )
    labels = [r["UNet shape"] for r in rows]
    series = {
        "this package": [float(r["time vs DDP (goal <= 1.5)"]) for r in rows],
        "DeepSpeed's defaults": [float(r["DeepSpeed's defaults vs DDP"] or "nan") for r in rows],
    }
    print(ratio_bars("end_to_end_time", labels, series, goal=1.5, ylabel="ZeRO-3 time per step / DDP's",
                     title="ZeRO-3 time per step against DDP (N=2, CPU)"))  # fmt: skip
    rss = {"this package": [float(r["RSS vs DDP (goal <= 0.9)"]) for r in rows]}
    print(ratio_bars("end_to_end_rss", labels, rss, goal=0.9, ylabel="ZeRO-3 peak RSS per rank / DDP's",
                     title="ZeRO-3 peak RSS per rank against DDP (N=2, CPU)"))  # fmt: skip


def size_sweep(work: Path, data: Path, measured: dict | None = None) -> None:
    """Peak RSS of ZeRO-3 (frozen replicated; with and without ``--return_freed_memory``)
    against DDP at several UNet sizes, and the size where ZeRO-3's drops below DDP's.
    ``measured`` holds runs already made, by width."""
    from diffusers_zero3.placement.plan import PlanOptions, make_plan

    runs = dict(measured or {})
    for width in sorted({*SIZES, WIDTH}):
        if width in runs:
            continue
        pipe, _ = prepare(work, width)
        common = dict(te="replicate", vae="replicate")
        runs[width] = (
            measure(pipe, data, work, f"ddp-{width}", zero3=False, **common),
            measure(pipe, data, work, f"zero3-{width}", zero3=True, **common),
            measure(
                pipe, data, work, f"freed-{width}", zero3=True, extra=("--return_freed_memory",), **common
            ),
        )
    rows, default, freed = [], [], []
    for width, (d, z, f) in sorted(runs.items()):
        pipe = work / f"pipe-tiny-{width}"
        n = make_plan(str(pipe), PlanOptions(num_processes=2))["components"]["unet"]["parameters"]
        default.append((n, z["peak"] / d["peak"]))
        freed.append((n, f["peak"] / d["peak"]))
        rows.append(
            {
                "UNet M params": f"{n / 1e6:.1f}",
                "DDP peak MiB": f"{d['peak']:.0f}",
                "ZeRO-3 peak MiB": f"{z['peak']:.0f}",
                "ZeRO-3 / DDP": f"{z['peak'] / d['peak']:.2f}",
                "time ZeRO-3 / DDP": f"{z['sample_s'] / d['sample_s']:.2f}",
                "ZeRO-3 --return_freed_memory peak MiB": f"{f['peak']:.0f}",
                "/ DDP": f"{f['peak'] / d['peak']:.2f}",
                "time / DDP": f"{f['sample_s'] / d['sample_s']:.2f}",
            }
        )
    print_section(
        "Peak RSS per rank by UNet size, ZeRO-3 (frozen replicated) vs DDP, N=2. Default allocator: "
        + crossover(default)
        + ". With --return_freed_memory: "
        + crossover(freed),
        markdown_table(rows, list(rows[0])),
    )
    from benchmarks.figures import ratio_lines

    xs = [n / 1e6 for n, _ in default]
    series = {"default allocator": [r for _, r in default], "--return_freed_memory": [r for _, r in freed]}
    print(ratio_lines("size_sweep_rss", xs, series, goal=0.9, xlabel="UNet parameters (M)",
                      ylabel="ZeRO-3 peak RSS per rank / DDP's", title="Peak RSS per rank by UNet size (N=2, CPU)"))  # fmt: skip


def _heap(ddp: dict, ours: dict, key: str) -> str:
    """``DDP / ZeRO-3`` of one of the runs' glibc heap numbers (``memory.heap_bytes``)."""
    if not (ddp["heap"] and ours["heap"]):
        return "n/a"
    return f"{ddp['heap'][key]:.0f} / {ours['heap'][key]:.0f}"


def _row(name: str, res: dict, ddp: dict) -> dict:
    return {
        "run": name,
        "s / sample": f"{res['sample_s']:.3f}",
        "time vs DDP": f"{res['sample_s'] / ddp['sample_s']:.2f}",
        "peak RSS MiB / rank": f"{res['peak']:.0f}",
        "RSS vs DDP": f"{res['peak'] / ddp['peak']:.2f}",
        "model states MiB / rank": f"{res['state_total']:.1f}",
        "states vs DDP": f"{res['state_total'] / ddp['state_total']:.2f}",
    }


if __name__ == "__main__":
    if sys.argv[1:] == ["sweep"]:  # the size sweep alone
        with tempfile.TemporaryDirectory() as tmp:
            size_sweep(Path(tmp), prepare(Path(tmp), SIZES[0])[1])
    elif sys.argv[1:] == ["fine"]:  # the fine-grained shapes alone
        with tempfile.TemporaryDirectory() as tmp:
            fine_grained(Path(tmp), prepare(Path(tmp), SIZES[0])[1])
    else:
        main()
