"""Pieces of the families' tiny pipelines: tokenizers written locally and small shared models.

No model hub is reachable where the tests and the default runs go, so every tokenizer is
written here from a vocabulary: a byte-level CLIP tokenizer, a unigram T5 tokenizer, and a
byte-level BPE tokenizer of the kind the LLM text encoders use (Qwen, Llama, Mistral), each
loadable with ``AutoTokenizer.from_pretrained`` of the folder.
"""

from __future__ import annotations

import os
import shutil
import string
from collections.abc import Callable
from pathlib import Path

CLIP_SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")
CLIP_VOCAB_SIZE = 256 * 2 + len(CLIP_SPECIAL_TOKENS)
CAPTION_WORDS = ("a", "an", "the", "of", "photo", "picture", "shape", "red", "green", "blue", "yellow",
                 "circle", "square")  # fmt: skip


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-level alphabet: every byte maps to a printable unicode character."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def write_clip_tokenizer(folder: str | os.PathLike) -> Path:
    """Write a byte-level CLIP tokenizer (no merges) to ``folder`` and return the path.

    Every byte is a token (with and without the ``</w>`` end-of-word suffix), so any text
    tokenizes; with an empty merges file words become sequences of characters.
    """
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + list(CLIP_SPECIAL_TOKENS)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    tok.save_pretrained(folder)
    return folder


def write_t5_tokenizer(folder: str | os.PathLike, model_max_length: int = 512) -> Path:
    """Write a small unigram T5 tokenizer to ``folder`` and return the path.

    The vocabulary is T5's three special tokens, every lowercase letter, digit and common
    punctuation mark (alone and with the ``▁`` word-start marker, so any ASCII text
    tokenizes), upper-case letters, and whole words for the default captions.
    """
    from transformers import T5TokenizerFast

    folder = Path(folder)
    chars = string.ascii_lowercase + string.digits + ",.!?'-:;()"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + c, -3.0) for c in chars]
    pieces += [(c, -4.0) for c in chars + string.ascii_uppercase]
    pieces += [("\u2581" + w, -1.0) for w in CAPTION_WORDS]
    tok = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
    tok.save_pretrained(folder)
    return folder


def read_back(write: Callable[[Path], Path], folder: Path, cls=None):
    """A tokenizer written by ``write`` under ``folder`` and read back (the folder it was
    written to is removed: a pipeline saves its own copy)."""
    from transformers import AutoTokenizer

    tok_dir = write(folder / f"_tokenizer_tmp_{write.__name__}")
    try:
        return (cls or AutoTokenizer).from_pretrained(tok_dir)
    finally:
        shutil.rmtree(tok_dir)


def local_clip_tokenizer(folder: Path):
    """A byte-level ``CLIPTokenizer`` (``write_clip_tokenizer``), read back."""
    from transformers import CLIPTokenizer

    return read_back(write_clip_tokenizer, folder, CLIPTokenizer)


def local_t5_tokenizer(folder: Path):
    """A unigram T5 tokenizer (``write_t5_tokenizer``), read back."""
    return read_back(write_t5_tokenizer, folder)


def tiny_clip_config(hidden_size: int = 32, projection_dim: int = 32, layers: int = 2) -> dict:
    """A tiny CLIP text config for the byte-level CLIP tokenizer."""
    return dict(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=37,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=CLIP_VOCAB_SIZE - 2,
        eos_token_id=CLIP_VOCAB_SIZE - 1,
        pad_token_id=CLIP_VOCAB_SIZE - 1,
        projection_dim=projection_dim,
    )


def tiny_t5_encoder(d_model: int, vocab_size: int, layers: int = 2):
    """A tiny ``T5EncoderModel`` (gated-gelu, as T5 v1.1 / T5-XXL)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_kv=8,
            d_ff=d_model * 2,
            num_layers=layers,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def tiny_vae_config(width: int = 32, latent_channels: int = 4) -> dict:
    """A tiny ``AutoencoderKL`` config: two blocks (8x8 latents of 32 px images... x2 down)."""
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(width, width * 2),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=min(32, width // 2),
        sample_size=32,
    )


def tiny_flow_vae(latent_channels: int, width: int = 32):
    """A tiny ``AutoencoderKL`` as the SD3 and Flux.1 VAEs: no quant convs, a shift factor."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        **tiny_vae_config(width, latent_channels),
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
