"""A tiny judge of whole clips for the embedded video RL default (``make train-grpo MODEL=wan``).

``save_tiny_video_judge`` writes a folder that ``--reward unifiedreward_video
--reward_model unifiedreward_video=FOLDER`` loads as it would the published
``CodeGoat24/UnifiedReward-qwen-7b``: a Qwen2.5-VL at the published head widths (text heads of
128 with the published mRoPE sections, vision heads of 80), 2 layers of each, random weights;
its tokenizer (byte-level with Qwen2-VL's special tokens, the authors' video question one token)
and image processor config; a generation config whose ``sequence_bias`` makes it answer
``Final Score: N`` and stop, ``N`` (1-9) the digit its own logits favour for the clip. It scores
nothing meaningful: it stands where the 7 B judge goes, sharded like it, so that a run shows the
judge's placement, lockstep and cost.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

GRADES = "123456789"


def answer_bias(tokenizer, strength: float = 40.0) -> list:
    """``sequence_bias`` entries (``GenerationConfig``) that make a judge with ``tokenizer``
    answer ``\\nFinal Score: <digit>`` then end its turn (``<|im_end|>``), the digit its own
    choice: each consecutive pair of those tokens gets ``strength``."""
    newline = tokenizer.encode("\n", add_special_tokens=False)
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    pairs = set()
    for digit in GRADES:
        chain = newline + tokenizer.encode(f"Final Score: {digit}", add_special_tokens=False) + end
        pairs.update(zip(chain, chain[1:]))
    return [[list(pair), strength] for pair in sorted(pairs)]


def save_tiny_video_judge(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny UnifiedReward judge of whole clips (see the module docstring) to
    ``folder``; returns it. Not a collective (run it once, before the launch)."""
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..families.published import shrink
    from ..families.qwenimage import PUBLISHED_TEXT_ENCODER as QWEN2_5_VL_7B
    from ..rewards.vlm_judges import UNIFIEDREWARD_VIDEO_QUESTION
    from ..runtime.zero3 import zero3_init_disabled
    from .pipelines import vl_token_ids
    from .tokenizers import QWEN_VL_SPECIAL_TOKENS, write_qwen2_tokenizer

    folder = Path(folder)
    words = ("system", "user", "assistant", "You are a helpful assistant.", UNIFIEDREWARD_VIDEO_QUESTION,
             "Final Score: " + " ".join(GRADES))  # fmt: skip
    write_qwen2_tokenizer(folder, QWEN_VL_SPECIAL_TOKENS, texts=words)
    tok = AutoTokenizer.from_pretrained(folder)
    tid = tok.convert_tokens_to_ids
    vision = shrink(
        QWEN2_5_VL_7B["vision_config"], depth=2, hidden_size=160, intermediate_size=320, num_heads=2,
        out_hidden_size=256, fullatt_block_indexes=[1],
    )  # fmt: skip
    text = shrink(
        QWEN2_5_VL_7B["text_config"], vocab_size=len(tok), hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    ) | dict(
        rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default"}, bos_token_id=tid("<|endoftext|>"),
        eos_token_id=tid("<|im_end|>"), pad_token_id=tid("<|endoftext|>"),
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **vl_token_ids(tid)
    )
    with zero3_init_disabled():
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        do_sample=False, bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
        pad_token_id=tid("<|endoftext|>"), max_new_tokens=8, sequence_bias=answer_bias(tok),
    )  # fmt: skip
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    return folder
