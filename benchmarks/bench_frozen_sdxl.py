"""SDXL's two frozen text encoders: per-rank weight bytes and time per prompt batch, by
placement of each encoder (N=2).

The encoders have SDXL's structure (CLIP-L-like ``CLIPTextModel`` and a bigG-like
``CLIPTextModelWithProjection``, the second the larger), scaled down to run on a CPU; each is
placed on its own (``--text_encoder_placement`` / ``--text_encoder_2_placement``). The
"forward" is the family's prompt encoding (penultimate hidden states of both, the pooled
projection of the second); "cache" looks precomputed outputs up.
"""

from __future__ import annotations

import tempfile
import time

from benchmarks.common import markdown_table, mib, print_section, report, run_case

ENCODER_1 = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6)
ENCODER_2 = dict(hidden_size=640, intermediate_size=2560, num_hidden_layers=8, num_attention_heads=10)
PROMPTS, STEPS = 4, 5
CASES = [("replicate", "replicate"), ("replicate", "shard"), ("shard", "shard"), ("cache", "cache")]


def case_encoders(placements: tuple[str, str], tmp: str):
    import torch
    from accelerate.utils import DeepSpeedPlugin
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from diffusers_zero3 import build_accelerator, prepare_frozen, zero3_init_disabled
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.demo import tiny_component_configs, write_clip_tokenizer
    from diffusers_zero3.families import SDXL
    from diffusers_zero3.placement.cache import FrozenEncoders, precompute_frozen_outputs

    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "zero_optimization": {"stage": 3}}
    accelerator = build_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    base = tiny_component_configs()["text_encoder"]
    with zero3_init_disabled():
        torch.manual_seed(0)
        models = {
            "text_encoder": CLIPTextModel(CLIPTextConfig(**{**base, **ENCODER_1})),
            "text_encoder_2": CLIPTextModelWithProjection(
                CLIPTextConfig(**{**base, **ENCODER_2}, projection_dim=ENCODER_2["hidden_size"])
            ),
        }
    tokenizer = CLIPTokenizer.from_pretrained(write_clip_tokenizer(tmp + "/tok"))
    tokenizers = {name: tokenizer for name in models}
    prompts = [f"a red circle number {i}" for i in range(PROMPTS)]
    ids = SDXL.tokenize(tokenizers, prompts)
    if placements[0] == "cache":
        import datasets

        placed = {n: prepare_frozen(m, "replicate", name=n) for n, m in models.items()}
        cache = precompute_frozen_outputs(
            datasets.Dataset.from_dict({"text": prompts}), tmp + "/cache", FrozenEncoders(placed, tokenizers, family=SDXL),
            RowsToPixels(image_column="text"), batch_size=PROMPTS,
        )  # fmt: skip
        for m in placed.values():
            m.release()
        held = 0

        def forward():
            SDXL.conditioning(cache.get(torch.arange(PROMPTS)))
    else:
        placed = {
            name: prepare_frozen(models[name], p, accelerator=accelerator, name=name)
            for name, p in zip(models, placements)
        }
        held = sum(m.local_parameter_bytes() for m in placed.values())

        def forward():
            with torch.no_grad():
                SDXL.conditioning(SDXL.encode_texts(placed, ids))

    forward()  # warm-up
    start = time.perf_counter()
    for _ in range(STEPS):
        forward()
    report(held=held, seconds=(time.perf_counter() - start) / STEPS)


def main() -> None:
    rows, base = [], None
    for placements in CASES:
        with tempfile.TemporaryDirectory() as tmp:  # shared by the ranks (the cache folder)
            res = run_case("benchmarks.bench_frozen_sdxl:case_encoders", placements=placements, tmp=tmp)
        held, secs = max(r["held"] for r in res), max(r["seconds"] for r in res)
        base = base or (held, secs)
        rows.append(
            {
                "text_encoder / text_encoder_2": " / ".join(placements),
                "encoder MiB / rank": mib(held),
                "bytes vs replicate": f"{held / base[0]:.2f}",
                "ms / prompt batch": f"{secs * 1e3:.1f}",
                "time vs replicate": f"{secs / base[1]:.2f}",
            }
        )
    cols = list(rows[0])
    print_section(
        f"SDXL's two text encoders (CLIP {ENCODER_1['hidden_size']}x{ENCODER_1['num_hidden_layers']} + "
        f"{ENCODER_2['hidden_size']}x{ENCODER_2['num_hidden_layers']} with projection), {PROMPTS} prompts, N=2, CPU",
        markdown_table(rows, cols),
    )
