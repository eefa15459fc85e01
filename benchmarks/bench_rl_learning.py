"""Does online RL learn with one and with several optimizer steps a round? (issue 50, item 2)

``scripts/train_grpo.py`` with ``make train-grpo``'s flags (a tiny SD3 built locally, 4 prompts x 4
images on 2 CPU ranks, the redness reward, lr 3e-3) for ``ROUNDS`` rounds, per variant: the
objective, how the round's updates are cut (one micro-batch of a rank's 8 samples: 1 step; two
micro-batches or two inner epochs: 2 steps; ``--gradient_accumulation_steps 2`` over two
micro-batches: 1 step), DiffusionNFT's old policy (``--nft_decay_type``) and the learning rate; each
run also with the reward's weight -1 (the direction must follow the reward). The table gives the
mean reward of the first and last ``TAIL`` rounds of each and the rise; the curves go to
``rewards.json`` of each run (the folder is printed). Runs go two at a time side by side.

``python -m benchmarks.run --only rl_learning`` (or ``python -m benchmarks.bench_rl_learning
[--rounds N] [--only NAME ...]``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO_ROOT, markdown_table, print_section

ROUNDS, TAIL = 20, 4
REDNESS = "diffusers_zero3.demo.rewards:redness"
# name: (flags over the default's, what it is)
VARIANTS: dict[str, tuple[list[str], str]] = {
    "nft-1step": ([], "NFT, 1 step a round (the default)"),
    "nft-2batches": (["--train_batch_size", "4"], "NFT, 2 micro-batches: 2 steps a round"),
    "nft-2epochs": (["--num_inner_epochs", "2"], "NFT, 2 inner epochs: 2 steps a round"),
    "nft-2batches-decay0": (
        ["--train_batch_size", "4", "--nft_decay_type", "0"],
        "NFT, 2 steps, old policy = the round's start (before the decay type)",
    ),
    "nft-2batches-lr3e-4": (["--train_batch_size", "4", "--learning_rate", "3e-4"], "NFT, 2 steps, lr 3e-4"),
    "nft-2batches-gas2": (
        ["--train_batch_size", "4", "--gradient_accumulation_steps", "2"],
        "NFT, 2 micro-batches accumulated: 1 step",
    ),
    "nft-2batches-beta0.1": (
        ["--train_batch_size", "4", "--nft_beta", "0.1"],
        "NFT, 2 steps, beta 0.1 (DiffusionNFT's 2-step OCR config's beta)",
    ),
    "nft-2epochs-beta0.1": (
        ["--num_inner_epochs", "2", "--nft_beta", "0.1"],
        "NFT, 2 inner epochs, beta 0.1",
    ),
    "nft-2batches-ocr": (
        ["--train_batch_size", "4", "--nft_beta", "0.1", "--nft_decay_type", "2"],
        "NFT, 2 steps, beta 0.1, decay type 2 (DiffusionNFT's OCR config)",
    ),
    "nft-1step-beta0.1": (["--nft_beta", "0.1"], "NFT, 1 step, beta 0.1"),
    "grpo-1step": (["--objective", "grpo"], "GRPO, 1 step a round"),
    "grpo-2batches": (["--objective", "grpo", "--train_batch_size", "4"], "GRPO, 2 steps a round"),
    "grpo-window2": (
        ["--objective", "grpo", "--sde_window_size", "2", "--sde_window_range", "0", "4"],
        "GRPO, an SDE window of 2 of the 6 steps in [0, 4) (MixGRPO / Flow-GRPO-Fast)",
    ),
    "grpo-window2-cps-shared": (
        [
            "--objective",
            "grpo",
            "--sde_window_size",
            "2",
            "--sde_window_range",
            "0",
            "4",
            "--sampler",
            "cps",
            "--noise_level",
            "0.8",
            "--same_noise_per_group",
        ],
        "GRPO, the window with CPS at 0.8 and shared noise (flow_grpo's fast recipe, with CFG off)",
    ),  # fmt: skip
    "grpo-ratio-norm": (["--objective", "grpo", "--ratio_norm"], "GRPO with GRPO-Guard's ratio"),
}


def default_flags(pipe: str, out: str) -> list[str]:
    """``make train-grpo``'s flags to ``scripts/train_grpo.py`` (read from its script), its pipeline
    and output folder replaced."""
    text = (REPO_ROOT / "scripts" / "train_grpo_default.sh").read_text()
    call = text.split("scripts/train_grpo.py", 1)[1].split('"$@"', 1)[0].replace("\\\n", " ")
    return [{"$OUT/tiny-sd3": pipe, "$OUT/grpo-run": out}.get(f, f) for f in shlex.split(call)]


def with_flags(flags: list[str], extra: list[str]) -> list[str]:
    """``flags`` with each ``--name value`` of ``extra`` replacing the default's (one value) or
    added (any number of values, or none)."""
    flags = list(flags)
    groups: list[list[str]] = []
    for item in extra:
        if item.startswith("--"):
            groups.append([item])
        else:
            groups[-1].append(item)
    for name, *values in groups:
        if name in flags and len(values) == 1:
            flags[flags.index(name) + 1] = values[0]
        else:
            flags += [name, *values]
    return flags


def launch(flags: list[str], port: int) -> list[str]:
    config = REPO_ROOT / "configs" / "accelerate_zero3.yaml"
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
            "--main_process_port", str(port), str(REPO_ROOT / "scripts" / "train_grpo.py"), *flags]  # fmt: skip


def run_pairs(jobs: list[tuple[str, list[str]]], folder: Path) -> None:
    """Run the launches two at a time; a failed one raises with its log's tail."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for start in range(0, len(jobs), 2):
        running = []
        for name, argv in jobs[start : start + 2]:
            log = open(folder / f"{name}.log", "w")
            running.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        for name, proc, log in running:
            if proc.wait(timeout=3600) != 0:
                log.close()
                raise RuntimeError(f"{name} failed:\n{(folder / f'{name}.log').read_text()[-3000:]}")
            log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS))
    parser.add_argument("--output", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    folder = Path(args.output or tempfile.mkdtemp(prefix="bench-rl-learning-"))
    folder.mkdir(parents=True, exist_ok=True)
    pipe = folder / "tiny-sd3"
    if not (pipe / "model_index.json").exists():
        from diffusers_zero3.demo import save_tiny_pipeline
        from diffusers_zero3.families import SD3

        save_tiny_pipeline(SD3, pipe)
    jobs, port = [], 29600
    for name in args.only or VARIANTS:
        extra, _ = VARIANTS[name]
        for weight in ("1", "-1"):
            out = folder / f"{name}_w{weight}"
            flags = with_flags(
                default_flags(str(pipe), str(out)), ["--max_train_steps", str(args.rounds), *extra]
            )
            flags = with_flags(flags, ["--reward", f"{REDNESS}={weight}", "--checkpointing_steps", "1000"])
            jobs.append((f"{name}_w{weight}", launch([*flags, "--report_to", "none"], port)))
            port += 7
    run_pairs(jobs, folder)
    rows = []
    for name in args.only or VARIANTS:
        row = {"variant": name, "what": VARIANTS[name][1]}
        for weight in ("1", "-1"):
            curve = json.loads((folder / f"{name}_w{weight}" / "rewards.json").read_text())["mean"]
            first, last = sum(curve[:TAIL]) / TAIL, sum(curve[-TAIL:]) / TAIL
            row[f"w{weight} first->last"] = f"{first:.4f} -> {last:.4f}"
            row[f"w{weight} rise"] = f"{last - first:+.4f}"
            seconds = json.loads((folder / f"{name}_w{weight}" / "rewards.json").read_text())["seconds"]
            if weight == "1":  # a round's seconds (the first left out: it warms up), both runs side by side
                row["s / round"] = f"{sum(sum(v[1:]) for v in seconds.values()) / (len(curve) - 1):.2f}"
        rows.append(row)
    columns = ["variant", "what", "w1 first->last", "w1 rise", "w-1 first->last", "w-1 rise", "s / round"]
    print_section(
        f"Learning on the tiny default, {args.rounds} rounds, mean of the first / last {TAIL} (runs in {folder})",
        markdown_table(rows, columns),
    )


if __name__ == "__main__":
    main()
