"""The built-in rewards' scores in bf16 against fp32 (issue 50, item 5), at their published
architectures with random weights (no published weights on the benchmark host).

Three ways to score the same images and prompts, each against the fp32 scores:

* ``bf16 (before)``: the module cast to bf16 and its inputs too (what ``ParallelReward`` did in
  a bf16 run before issue 50), the score cast to fp32 at the end;
* ``bf16 weights, fp32 score``: the towers in bf16, their embeddings (or features) upcast and
  the final score (normalisation, cosine, logit scale, head) computed in fp32;
* ``fp32``: every weight, input and operation in fp32 (what the built-ins do now).

The harm of an error is its size against the differences the advantages are made of: the
standard deviation of the fp32 scores over the images of the run ("spread"; a prompt's group
in training is the same kind of set). Random weights are not the trained ones (trained CLIPs
carry a few large activation channels, which bf16 treats worse), so the ratios here are a
lower bound of the harm, not its measure.

Usage: ``python -m benchmarks.bench_reward_precision [--images 8] [--only pickscore,hpsv2]``
(single process, CPU: ViT-H-14 at fp32 takes about 20 s per image on two cores).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from types import SimpleNamespace

import torch

from benchmarks.common import markdown_table, print_section

PROMPT_TOKENS = 20


def _images(n: int, size: int = 512, seed: int = 0) -> torch.Tensor:
    """Smooth images in [0, 1] (upsampled 8x8 noise plus fine noise), ``[n, 3, size, size]``."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 8, 8, generator=g)
    fine = torch.rand(n, 3, size, size, generator=g) * 0.1
    smooth = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    return (smooth * 0.9 + fine).clamp(0, 1)


def _clip_ids(n: int, vocab: int, eos: int, seed: int = 1) -> torch.Tensor:
    """``[n, 2 * PROMPT_TOKENS]`` ids and mask: two prompts, each for half the images, ending at EOS."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab - 2, (2, PROMPT_TOKENS), generator=g)
    prompts[:, 0], prompts[:, -1] = eos - 1, eos  # <|startoftext|> ... <|endoftext|>
    ids = prompts[torch.arange(n) * 2 // n]
    return torch.cat([ids, torch.ones_like(ids)], dim=1)


def _clip_vit_l14_config():
    """``openai/clip-vit-large-patch14``'s config (text 12 x 768, vision 24 x 1024 patch 14, 768 projection)."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                         max_position_embeddings=77, vocab_size=49408, hidden_act="quick_gelu", projection_dim=768,
                         bos_token_id=49406, eos_token_id=49407, pad_token_id=49407),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                           image_size=224, patch_size=14, hidden_act="quick_gelu", projection_dim=768),
        projection_dim=768,
    )  # fmt: skip


def _tokenizer():
    return SimpleNamespace(model_max_length=77)


def _clip_final(module, rows: torch.Tensor, scale: bool) -> torch.Tensor:
    """The bf16 towers' normalised embeddings upcast; the cosine (times ``logit_scale.exp()``) in fp32."""
    out = module.clip_output(rows)
    cos = (out.image_embeds.float() * out.text_embeds.float()).sum(-1)
    return module.clip.logit_scale.float().exp() * cos if scale else cos


def _cases(names: set[str], n: int):
    """``(name, shape, fp32 module, rows, fp32-final function of the bf16 module)`` per reward."""
    from transformers import CLIPModel

    from diffusers_zero3.rewards.builtin import (
        CLIP_SCORE_DIVISOR,
        PICKSCORE_DIVISOR,
        AestheticHead,
        AestheticPredictor,
        ClipScore,
        PickScore,
    )
    from diffusers_zero3.rewards.hps import HPSv2, resize_longest_and_pad, vit_h14_config
    from diffusers_zero3.rewards.images import ClipImageConfig, clip_pixel_values, pack_rows

    images = _images(n)
    crop = ClipImageConfig(shortest_edge=224, crop=(224, 224))
    if names & {"pickscore", "hpsv2"}:
        torch.manual_seed(0)
        clip_h = CLIPModel(vit_h14_config()).eval()
        clip_h.logit_scale.data.fill_(
            math.log(100.0)
        )  # CLIP's trained (clamped) scale: PickScore's logits ~ 100 cos
        ids = _clip_ids(n, 49408, 49407)
        if "pickscore" in names:
            rows = pack_rows(ids, clip_pixel_values(images, crop).reshape(n, -1))
            yield ("pickscore", "CLIP ViT-H-14 (PickScore_v1), 224 px", PickScore(clip_h, _tokenizer(), crop), rows,
                   lambda m, r: _clip_final(m, r, scale=True) / PICKSCORE_DIVISOR)  # fmt: skip
        if "hpsv2" in names:
            hps = HPSv2(clip_h, _tokenizer())
            pixels = clip_pixel_values(resize_longest_and_pad(images, 224), hps.image_config)
            yield ("hpsv2", "open_clip ViT-H-14 (HPSv2), 224 px", hps, pack_rows(ids, pixels.reshape(n, -1)),
                   lambda m, r: _clip_final(m, r, scale=False))  # fmt: skip
        del clip_h
    if names & {"clip_score", "aesthetic"}:
        torch.manual_seed(0)
        clip_l = CLIPModel(_clip_vit_l14_config()).eval()
        clip_l.logit_scale.data.fill_(math.log(100.0))  # OpenAI's trained scale: clip_score is the cosine
        if "clip_score" in names:
            rows = pack_rows(_clip_ids(n, 49408, 49407), clip_pixel_values(images, crop).reshape(n, -1))
            yield ("clip_score", "CLIP ViT-L/14, 224 px", ClipScore(clip_l, _tokenizer(), crop), rows,
                   lambda m, r: _clip_final(m, r, scale=True) / CLIP_SCORE_DIVISOR)  # fmt: skip
        if "aesthetic" in names:
            from transformers import CLIPVisionModelWithProjection

            vision = CLIPVisionModelWithProjection(clip_l.config.vision_config).eval()
            vision.vision_model.load_state_dict(clip_l.vision_model.state_dict())
            vision.visual_projection.load_state_dict(clip_l.visual_projection.state_dict())
            torch.manual_seed(1)
            head = AestheticHead(768).eval()
            fp32_head = copy.deepcopy(head)

            def final(m, pixels):
                emb = m.vision(pixel_values=pixels).image_embeds.float()
                return fp32_head(emb / emb.norm(dim=-1, keepdim=True)).squeeze(-1)

            yield ("aesthetic", "CLIP ViT-L/14 vision + LAION MLP, 224 px", AestheticPredictor(vision, head, crop),
                   clip_pixel_values(images, crop), final)  # fmt: skip
        del clip_l
    if "imagereward" in names:
        from transformers import BlipTextModel, BlipVisionConfig, BlipVisionModel

        from diffusers_zero3.rewards.imagereward import (
            PROMPT_MAX_LENGTH,
            ImageRewardHead,
            ImageRewardModel,
            blip_pixel_values,
            text_config,
        )

        # ImageReward's published shapes: BLIP ViT-L/16 at 224 and med_config.json (bert-base, cross-attention)
        torch.manual_seed(0)
        vcfg = BlipVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                image_size=224, patch_size=16, hidden_act="gelu", layer_norm_eps=1e-6)  # fmt: skip
        med = {"vocab_size": 30524, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "max_position_embeddings": 512, "add_cross_attention": True,
               "layer_norm_eps": 1e-12}  # fmt: skip
        model = ImageRewardModel(
            BlipVisionModel(vcfg).eval(), BlipTextModel(text_config(med, 1024), add_pooling_layer=False).eval(),
            ImageRewardHead(768).eval(), _tokenizer(),
        )  # fmt: skip
        fp32_head = copy.deepcopy(model.head)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(1000, 30000, (2, PROMPT_MAX_LENGTH), generator=g)
        prompts[:, 0] = 101
        ids = prompts[torch.arange(n) * 2 // n]
        rows = pack_rows(
            torch.cat([ids, torch.ones_like(ids)], 1), blip_pixel_values(images, 224).reshape(n, -1)
        )

        def final(m, r):
            from diffusers_zero3.rewards.images import unpack_rows

            ints, floats = unpack_rows(r)
            length = ints.shape[1] // 2
            embeds = m.vision(pixel_values=floats.reshape(len(r), 3, 224, 224)).last_hidden_state
            feats = m.text(input_ids=ints[:, :length], attention_mask=ints[:, length:], encoder_hidden_states=embeds,
                           encoder_attention_mask=torch.ones(embeds.shape[:-1], dtype=torch.long),
                           is_decoder=False).last_hidden_state[:, 0]  # fmt: skip
            return (fp32_head(feats.float()).squeeze(-1) - m.mean) / m.std

        yield "imagereward", "BLIP ViT-L/16 + BERT-base (ImageReward), 224 px", model, rows, final


@torch.no_grad()
def measure(names: set[str], n: int) -> list[dict]:
    results = []
    for name, shape, module, rows, final in _cases(names, n):
        start = time.perf_counter()
        fp32 = module(rows).float()
        low = copy.deepcopy(module).to(torch.bfloat16)
        before = low(rows.to(torch.bfloat16)).float()  # ParallelReward cast the rows to the model's dtype
        mixed = final(low, rows.to(torch.bfloat16)).float()
        spread = fp32.std(correction=0).item()
        row = {"reward": name, "shape": shape, "images": n, "fp32 mean": f"{fp32.mean().item():.4g}",
               "fp32 spread (std)": f"{spread:.3g}"}  # fmt: skip
        for label, scores in (("bf16 (before)", before), ("bf16 weights, fp32 score", mixed)):
            err = (scores - fp32).abs().max().item()
            row[f"{label}: max abs diff"] = f"{err:.3g}"
            row[f"{label}: / spread"] = f"{err / spread:.2f}" if spread > 0 else "inf"
        row["seconds"] = f"{time.perf_counter() - start:.0f}"
        print(row, flush=True)
        results.append(row)
        del low
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--only", default="pickscore,hpsv2,clip_score,aesthetic,imagereward")
    args = parser.parse_args()
    rows = measure(set(args.only.split(",")), args.images)
    columns = list(rows[0]) if rows else []
    print_section(
        "Built-in rewards: bf16 against fp32 (random weights, published shapes)",
        markdown_table(rows, columns),
    )


if __name__ == "__main__":
    main()
