"""The planner on the carried configs of SD 1.5, SDXL, SD3 medium and FLUX.1 [dev]: bytes per
rank at N = 1, 8 and 64 (bf16, AdamW, no EMA), computed on the meta device, and the
placements it recommends for 24 GiB devices. No rank is launched."""

from __future__ import annotations

from benchmarks.common import markdown_table, print_section

GIB = 2**30
DEVICE = 24 * GIB  # an L4 / A10 / RTX 4090 class device; 25 % of it kept for activations


def rows() -> list[dict]:
    from diffusers_zero3.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.plan import PlanOptions, make_plan

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


def main() -> None:
    table = rows()
    print_section(
        "Planner: bytes per rank from the published configs (bf16, AdamW, no EMA; activations not included)",
        markdown_table(table, list(table[0])),
    )


if __name__ == "__main__":
    main()
