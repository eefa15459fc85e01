"""The planner on the carried published configs of every family: bytes per rank at N = 1, 8
and 64 (bf16, AdamW, no EMA), computed on the meta device, the placements it recommends for
24 GiB devices, and what each placement of each frozen model holds per rank at N = 8. No rank
is launched."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import markdown_table, print_section

GIB = 2**30
DEVICE = 24 * GIB  # an L4 / A10 / RTX 4090 class device; 25 % of it kept for activations


def rows() -> list[dict]:
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import PlanOptions, make_plan

    out = []
    for key, known in KNOWN_PIPELINES.items():
        for n in (1, 8, 64):
            plan = make_plan(key, PlanOptions(num_processes=n, mixed_precision="bf16", device_memory=DEVICE))
            comps = plan["components"]
            denoiser = next(c for c in comps.values() if c["trainable"])
            frozen = [c for c in comps.values() if not c["trainable"]]
            total = {
                p: sum(c["placements"][p]["bytes_per_rank"] for c in frozen) / GIB
                for p in ("replicate", "shard")
            }

            chosen = [f"{k}={v}" for k, v in plan["recommended"].items() if not comps[k]["trainable"]]
            out.append(
                {
                    "pipeline": known["title"],
                    "N": n,
                    "denoiser params": f"{denoiser['parameters'] / 1e9:.2f} B",
                    "denoiser ZeRO-3 GiB / rank": f"{denoiser['placements']['shard']['bytes_per_rank'] / GIB:.1f}",
                    "frozen replicated GiB": f"{total['replicate']:.2f}",
                    "frozen sharded GiB": f"{total['shard']:.2f}",
                    f"recommended for {DEVICE // GIB} GiB devices": ", ".join(chosen)
                    if plan["fits"]
                    else "does not fit; " + "; ".join(plan["advice"]),
                    "total GiB / rank": f"{plan['total_bytes_per_rank'] / GIB:.1f}",
                }
            )
    return out


PLACEMENT_COLUMNS = ["pipeline", "component", "class", "params", "replicate GiB", "shard GiB", "LoRA 16 GiB",
                     "offload host GiB", "cache MiB / image"]  # fmt: skip


def placement_rows(n: int = 8, resolution: int = 1024, pipelines=None) -> list[dict]:
    """Per published pipeline (``pipelines``: keys of ``KNOWN_PIPELINES``, default all) and
    component: parameters and the GiB per rank each placement holds at ``n`` processes in bf16
    (the denoiser: ZeRO-3 full fine-tuning with AdamW, and LoRA rank 16), and the MiB per image
    a cached model stores at ``resolution`` ("(live only)" where it is never cached, "(live:
    sources)" for an editing family's VAE, which encodes each step's source images)."""
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import PlanOptions, make_plan, pipeline_components

    out = []
    for key in pipelines or KNOWN_PIPELINES:
        known = KNOWN_PIPELINES[key]
        family, _ = pipeline_components(key)
        options = dict(num_processes=n, mixed_precision="bf16", resolution=resolution)
        plan = make_plan(key, PlanOptions(**options))
        lora = make_plan(key, PlanOptions(**options, rank=16))
        for name, comp in plan["components"].items():
            row = {"pipeline": known["title"], "component": name, "class": comp["class"],
                   "params": f"{comp['parameters'] / 1e9:.2f} B"}  # fmt: skip
            places = comp["placements"]
            if comp["trainable"]:
                row["shard GiB"] = f"{places['shard']['bytes_per_rank'] / GIB:.2f} (trained)"
                row["replicate GiB"] = f"{places['replicate']['bytes_per_rank'] / GIB:.1f} (DDP)"
                row["LoRA 16 GiB"] = (
                    f"{lora['components'][name]['placements']['shard']['bytes_per_rank'] / GIB:.2f}"
                )
            else:
                row["replicate GiB"] = f"{places['replicate']['bytes_per_rank'] / GIB:.2f}"
                row["shard GiB"] = f"{places['shard']['bytes_per_rank'] / GIB:.2f}"
                row["offload host GiB"] = f"{places['offload']['host_bytes_per_rank'] / GIB:.2f}"
                if getattr(family, "edits", False) and name == "vae":
                    row["cache MiB / image"] = "(live: sources)"
                elif "cache" not in places or (
                    getattr(family, "encodes_source_images", False) and name != "vae"
                ):
                    row["cache MiB / image"] = "(live only)"
                else:
                    row["cache MiB / image"] = f"{places['cache']['cache_bytes_per_image'] / 2**20:.2f}"
            out.append(row)
    return out


# docs/families.md's placement table: the lines between these two markers are generated
FAMILIES_MD = Path(__file__).resolve().parent.parent / "docs" / "families.md"
TABLE_BEGIN = "<!-- placement table: generated by `python -m benchmarks.bench_plan --families-md` -->"
TABLE_END = "<!-- end of the generated placement table -->"


def placement_table(pipelines=None) -> str:
    """The markdown table of ``placement_rows()`` (N = 8, bf16, 1024 px) that docs/families.md
    holds between ``TABLE_BEGIN`` and ``TABLE_END``."""
    return markdown_table(placement_rows(pipelines=pipelines), PLACEMENT_COLUMNS)


def documented_table(text: str) -> str:
    """The table between the markers of ``text`` (docs/families.md); ValueError without them."""
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no placement table between {TABLE_BEGIN!r} and {TABLE_END!r}")
    return text[begin + len(TABLE_BEGIN) : end].strip("\n")


def with_table(text: str, table: str) -> str:
    """``text`` with the lines between its markers replaced by ``table``, nothing else."""
    documented_table(text)  # the markers are there
    begin = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    return text[:begin] + "\n" + table + "\n" + text[text.index(TABLE_END) :]


# the published defaults of each video pipeline: (frames, height, width)
VIDEO_CLIPS = {"Wan 2.2 TI2V 5B": (121, 704, 1280), "HunyuanVideo 1.5 480p T2V": (121, 480, 848)}
DEFAULT_CLIP = (81, 480, 832)


def video_cache_rows(n: int = 8) -> list[dict]:
    """Per published video pipeline: the MiB a cached text encoder and VAE store per clip at the
    pipeline's default clip (81 frames of 480 x 832; TI2V-5B 121 of 704 x 1280), bf16."""
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import PlanOptions, make_plan, pipeline_components

    out = []
    for key, known in KNOWN_PIPELINES.items():
        family, _ = pipeline_components(key)
        if not family.video:
            continue
        frames, height, width = VIDEO_CLIPS.get(known["title"], DEFAULT_CLIP)
        options = PlanOptions(
            num_processes=n, mixed_precision="bf16", num_frames=frames, height=height, width=width
        )
        comps = make_plan(key, options)["components"]
        row = {"pipeline": known["title"], "clip": f"{frames} x {height} x {width}"}
        for name, comp in comps.items():
            if not comp["trainable"]:
                row[f"{name} MiB / clip"] = (
                    f"{comp['placements']['cache']['cache_bytes_per_image'] / 2**20:.2f}"
                )
        out.append(row)
    return out


def main() -> None:
    table = rows()
    print_section(
        "Planner: bytes per rank from the published configs (bf16, AdamW, no EMA; activations not included)",
        markdown_table(table, list(table[0])),
    )
    print_section(
        "What each placement holds per rank, N = 8, bf16 (cache: 1024 px images, the default sequence lengths)",
        placement_table(),
    )
    table = video_cache_rows()
    print_section(
        "Video: what a cached text encoder and VAE store per clip (bf16, the default clip of each pipeline)",
        markdown_table(table, list(table[0])),
    )


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families-md", action="store_true",
                        help="rewrite the placement table of docs/families.md (between its markers) and stop")  # fmt: skip
    parser.add_argument("--check", action="store_true",
                        help="with --families-md: write nothing, exit 1 if the table differs")  # fmt: skip
    args = parser.parse_args()
    if args.check and not args.families_md:
        sys.exit("error: --check goes with --families-md")
    if args.families_md:
        try:
            text = FAMILIES_MD.read_text()
            new = with_table(text, placement_table())
        except ValueError as e:
            sys.exit(f"error: {FAMILIES_MD}: {e}")
        if args.check:
            if new != text:
                sys.exit(
                    f"error: {FAMILIES_MD}'s placement table is stale: run python -m benchmarks.bench_plan --families-md"
                )
            print(f"{FAMILIES_MD}: placement table current")
        else:
            FAMILIES_MD.write_text(new)
            print(f"{FAMILIES_MD}: placement table {'rewritten' if new != text else 'already current'}")
    else:
        main()
