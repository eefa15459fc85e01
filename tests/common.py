"""Shared configs and fixtures for the tests (imported by rank workers too)."""

from __future__ import annotations


def zero3_config(micro_batch: int = 1, grad_acc: int = 1, world_size: int = 2, **zero_overrides) -> dict:
    """A minimal fp32 ZeRO-3 DeepSpeed config for CPU tests (fp16 does not run on CPU)."""
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    zero.update(zero_overrides)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_acc,
        "train_batch_size": micro_batch * grad_acc * world_size,
        # explicit: accelerate's plugin otherwise fills in a clipping of 1.0
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def accelerator_with_zero3(zero3_init_flag: bool = True, **ds_overrides):
    """A 2-rank accelerate Accelerator with a ZeRO-3 DeepSpeed plugin (CPU, gloo)."""
    from accelerate.utils import DeepSpeedPlugin

    from diffusers_zero3 import build_accelerator

    cfg = zero3_config(**ds_overrides)
    plugin = DeepSpeedPlugin(hf_ds_config=cfg, zero3_init_flag=zero3_init_flag)
    return build_accelerator(deepspeed_plugin=plugin)


def rank_slice(counts, rank: int) -> slice:
    """The rows of ``rank`` when the ranks hold ``counts[r]`` consecutive rows each."""
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def tiny_qwen2_vl_judge(folder, texts, seed: int, max_position_embeddings: int):
    """A tiny Qwen2-VL judge for ``folder`` (the published patch, merge and temporal sizes;
    narrow and shallow), its lm_head times 3 (an opinion about the images, not saturated): its
    tokenizer (byte-level, Qwen2-VL's special tokens, each of ``texts`` one token) and image
    processor config written there, the model returned for the caller to adjust and save."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusers_zero3.demo.pipelines import vl_token_ids
    from diffusers_zero3.demo.tokenizers import QWEN_VL_SPECIAL_TOKENS, write_qwen2_tokenizer

    write_qwen2_tokenizer(folder, QWEN_VL_SPECIAL_TOKENS, texts=texts)
    tok = AutoTokenizer.from_pretrained(folder)
    tid = tok.convert_tokens_to_ids
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings,
                         rope_scaling={"mrope_section": [2, 1, 1], "rope_type": "default"},
                         bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
                         pad_token_id=tid("<|endoftext|>")),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        **vl_token_ids(tid),
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    return model


def run_card_snippet(folder, workdir, source_image=None) -> dict:
    """Run the python snippet of ``folder``'s README.md (the model card) as printed, its
    ``path/to/this/folder`` replaced by ``folder``, in ``workdir`` (where it writes its output;
    an editing card's ``source.png`` is ``source_image``, a PIL image, written there); returns
    the snippet's globals (``image`` or ``frames``)."""
    import os
    import re
    from pathlib import Path

    card = (Path(folder) / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert snippet.count('"path/to/this/folder"') == 1, snippet
    if source_image is not None:
        source_image.save(Path(workdir) / "source.png")
    here = os.getcwd()
    os.chdir(workdir)
    try:
        scope: dict = {}
        exec(compile(snippet.replace("path/to/this/folder", str(folder)), "README.md", "exec"), scope)
    finally:
        os.chdir(here)
    return scope


PIXEL_FIELDS = ("resolution", "center_crop", "random_flip", "interpolation", "seed", "image_column", "caption_column",
                "buckets", "row_buckets")  # fmt: skip
MODEL_FIELDS = ("text_encoders", "tokenizers", "vae", "family", "max_sequence_length")


def precompute(dataset, cache_dir, **kw):
    """``precompute_frozen_outputs`` with its arguments given flat, as the cache tests vary them
    one at a time: the models' into a ``FrozenEncoders`` (``text_encoder=``/``tokenizer=``:
    SD 1.x's one encoder), the pixel settings into a ``RowsToPixels``, the rest as they are."""
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.placement.cache import FrozenEncoders, precompute_frozen_outputs

    text_encoder, tokenizer = kw.pop("text_encoder", None), kw.pop("tokenizer", None)
    models = {name: kw.pop(name) for name in MODEL_FIELDS if name in kw}
    if text_encoder is not None:
        models["text_encoders"] = {**models.get("text_encoders", {}), "text_encoder": text_encoder}
        if tokenizer is not None:
            models["tokenizers"] = {**models.get("tokenizers", {}), "text_encoder": tokenizer}
    pixels = RowsToPixels(**{name: kw.pop(name) for name in PIXEL_FIELDS if name in kw})
    return precompute_frozen_outputs(dataset, cache_dir, FrozenEncoders(**models), pixels, **kw)


CLIP_FIELDS = ("num_frames", "height", "width", "frame_stride", "fps", "random_start", "video_column")


def clip_dataset(rows, tokenize, **kw):
    """A ``VideoCaptionDataset`` of ``rows`` with its settings given flat, as the cache-key tests
    vary them one at a time: the frames' into a ``ClipSampling``, the rest into a
    ``RowsToPixels``."""
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import ClipSampling, VideoCaptionDataset

    clip = ClipSampling(**{name: kw.pop(name) for name in CLIP_FIELDS if name in kw})
    return VideoCaptionDataset(rows, RowsToPixels(tokenize=tokenize, **kw), clip)
