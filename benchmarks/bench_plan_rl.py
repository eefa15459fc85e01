"""The planner's RL plans on the published configs (``diffusers-zero3-plan --rl``): the policy
(full or LoRA), its reference, PickScore and a 7 B VLM judge (``vlm``; ``hpsv3`` and
``unifiedreward`` on Qwen-Image), the round, on 8 x 80 GB in bf16.
Each job is a documented command line; the table and the commands are docs/rl.md's, between its
markers:

    python -m benchmarks.bench_plan_rl            # print the table
    python -m benchmarks.bench_plan_rl --rl-md    # rewrite docs/rl.md's section (--check: compare)

No rank is launched: every model is built on the meta device.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from benchmarks.common import markdown_table, print_section

GIB = 2**30
BASE = "--reference --num_processes 8 --device_memory 80GiB --mixed_precision bf16 --reward pickscore"
COMMON = f"{BASE} --reward vlm"
JUDGES = ("vlm", "hpsv3", "unifiedreward")  # the 7 B judges a job may hold, one at a time
ROUND = "--group_size 24 --prompts_per_round 48 --num_inference_steps 10"  # the references' SD3 rounds
# (pipeline title, policy, the planner's arguments)
RL_JOBS = [
    ("Qwen-Image, 1024 px", "full, GRPO", f"Qwen/Qwen-Image --rl grpo {COMMON} --resolution 1024 {ROUND}"),
    ("Qwen-Image, 1024 px", "full, NFT", f"Qwen/Qwen-Image --rl nft {COMMON} --resolution 1024 {ROUND}"),
    ("Qwen-Image, 1024 px", "LoRA r64, GRPO", f"Qwen/Qwen-Image --rl grpo --rank 64 {COMMON} --resolution 1024 {ROUND}"),
    ("Qwen-Image, 1024 px", "full, GRPO", f"Qwen/Qwen-Image --rl grpo {BASE} --reward hpsv3 --resolution 1024 {ROUND}"),
    ("Qwen-Image, 1024 px", "full, GRPO",
     f"Qwen/Qwen-Image --rl grpo {BASE} --reward unifiedreward --resolution 1024 {ROUND}"),
    ("FLUX.1 [dev], 1024 px", "full, GRPO", f"black-forest-labs/FLUX.1-dev --rl grpo {COMMON} --resolution 1024 {ROUND}"),
    ("FLUX.1 [dev], 1024 px", "LoRA r64, GRPO",
     f"black-forest-labs/FLUX.1-dev --rl grpo --rank 64 {COMMON} --resolution 1024 {ROUND}"),
    ("SD3 medium, 512 px", "full, GRPO",
     f"stabilityai/stable-diffusion-3-medium-diffusers --rl grpo {COMMON} --resolution 512 {ROUND}"),
    ("Wan 2.1 T2V 1.3B, 33 x 480 x 832", "full, GRPO",
     f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers --rl grpo {COMMON} --height 480 --width 832 --num_frames 33 "
     "--group_size 8 --prompts_per_round 16 --num_inference_steps 10"),
]  # fmt: skip
SHORT = {"replicate": "R", "shard": "S", "offload": "O"}


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _pair(component: dict | None) -> str:
    """``replicated / sharded`` GiB per rank of a frozen component; ``-`` without it."""
    if component is None:
        return "-"
    places = component["placements"]
    return f"{_gib(places['replicate']['bytes_per_rank'])} / {_gib(places['shard']['bytes_per_rank'])}"


def rl_row(title: str, policy: str, args: str) -> dict:
    """One job's row: the plan of ``diffusers-zero3-plan ARGS`` in GiB per rank."""
    from diffusers_zero3.placement.plan import options_from_args, parser
    from diffusers_zero3.placement.rl_plan import make_rl_plan, rl_options_from_args

    parsed = parser().parse_args(shlex.split(args))
    plan = make_rl_plan(parsed.pipeline, options_from_args(parsed), rl_options_from_args(parsed))
    comps, rl = plan["components"], plan["rl"]
    denoiser = next(n for n, c in comps.items() if c["trainable"])
    combos = rl["combinations"]

    def combo(c: dict) -> str:
        return "".join(SHORT[p] for p in c["placements"].values()) + " " + _gib(c["total_bytes_per_rank"])

    fitting = [combo(c) for c in combos if c["fits"]]
    if fitting:
        fit = ", ".join(fitting)
    else:
        fit = "none (the smallest: " + combo(min(combos, key=lambda c: c["total_bytes_per_rank"])) + ")"
    if plan["fits"]:
        chosen = ", ".join(
            f"{k.removeprefix('reward:')}={v}" for k, v in plan["recommended"].items() if k != denoiser
        )
        recommended = f"{chosen} ({_gib(plan['total_bytes_per_rank'])})"
    else:
        recommended = "does not fit; " + "; ".join(plan.get("advice", []))
    old = rl["old_policy_bytes_per_rank"]
    return {
        "pipeline": f"{title} ({comps[denoiser]['parameters'] / 1e9:.2f} B)",
        "policy, objective": policy,
        "policy GiB": _gib(comps[denoiser]["placements"]["shard"]["bytes_per_rank"]),
        "old policy": _gib(old) if old else "-",
        "reference R / S": _pair(comps.get("reference")) if "reference" in comps else "(the base: free)",
        "PickScore R / S (fp32)": _pair(comps.get("reward:pickscore")),
        "judge: R / S": next(f"{j} {_pair(comps[f'reward:{j}'])}" for j in JUDGES if f"reward:{j}" in comps),
        "round (samples / rank)": f"{rl['round']['bytes_per_rank'] / GIB:.2f} ({rl['round']['samples_per_rank']})",
        "placements that fit (reference, PickScore, judge): total": fit,
        "recommended (total)": recommended,
    }


def rl_rows() -> list[dict]:
    return [rl_row(*job) for job in RL_JOBS]


def commands_block() -> str:
    """The fenced block of the jobs' command lines, as docs/rl.md prints them."""
    return "```bash\n" + "\n".join(f"diffusers-zero3-plan {args}" for _, _, args in RL_JOBS) + "\n```"


# docs/rl.md's RL plan: the lines between these two markers are generated
RL_MD = Path(__file__).resolve().parent.parent / "docs" / "rl.md"
BEGIN = "<!-- RL plans: generated by `python -m benchmarks.bench_plan_rl --rl-md` -->"
END = "<!-- end of the generated RL plans -->"


def section(rows: list[dict]) -> str:
    """The commands and the table that docs/rl.md holds between ``BEGIN`` and ``END``."""
    return (
        commands_block()
        + "\n\nGiB per rank; R / S: replicated / sharded.\n\n"
        + markdown_table(rows, list(rows[0]))
    )


def documented_section(text: str) -> str:
    """What ``text`` (docs/rl.md) holds between the markers; ValueError without them."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"no RL plans between {BEGIN!r} and {END!r}")
    return text[begin + len(BEGIN) : end].strip("\n")


def main() -> None:
    table = rl_rows()
    print_section(
        "Planner, RL jobs: PickScore and a 7 B judge on 8 x 80 GB, bf16 (GiB per rank; activations not included)",
        markdown_table(table, list(table[0])),
    )


if __name__ == "__main__":
    import argparse
    import sys

    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument(
        "--rl-md", action="store_true", help="rewrite docs/rl.md's RL plans (between its markers)"
    )
    cli.add_argument(
        "--check", action="store_true", help="with --rl-md: write nothing, exit 1 if they differ"
    )
    args = cli.parse_args()
    if args.check and not args.rl_md:
        sys.exit("error: --check goes with --rl-md")
    if not args.rl_md:
        main()
        sys.exit(0)
    text = RL_MD.read_text()
    try:
        documented_section(text)
    except ValueError as e:
        sys.exit(f"error: {RL_MD}: {e}")
    begin, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:begin] + "\n" + section(rl_rows()) + "\n" + text[end:]
    if args.check:
        if new != text:
            sys.exit(f"error: {RL_MD}'s RL plans are stale: run python -m benchmarks.bench_plan_rl --rl-md")
        print(f"{RL_MD}: RL plans current")
    else:
        RL_MD.write_text(new)
        print(f"{RL_MD}: RL plans {'rewritten' if new != text else 'already current'}")
