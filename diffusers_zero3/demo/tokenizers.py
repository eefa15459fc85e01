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


def qwen_pretokenizer():
    """The byte-level pre-tokenizer of Qwen2's tokenizer (its split regex), as the LLM
    tokenizers of Qwen2/2.5/3, Llama 3 and Mistral split text."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[])._tokenizer.pre_tokenizer


def byte_bpe_vocab(texts: list[str], words: tuple[str, ...] = CAPTION_WORDS) -> tuple[dict[str, int], list]:
    """A byte-level BPE vocabulary and merges learnt here on ``texts`` and ``words`` (each word
    with and without a leading space), so that each of them encodes as one token as in a real
    LLM vocabulary; any other text falls back to the 256 byte symbols, which come first."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = qwen_pretokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=100_000,  # never reached: training stops when every word is one token
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    trainer_tok.train_from_iterator(
        [*texts, *(w for word in words for w in (word, " " + word))], trainer=trainer
    )
    state = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = {}
    for ch in bytes_to_unicode().values():  # byte symbols first, in a fixed order
        vocab.setdefault(ch, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab, merges


def write_qwen2_tokenizer(
    folder: str | os.PathLike,
    special_tokens: tuple[str, ...],
    *,
    texts: tuple[str, ...] = (),
    chat_template: str | None = None,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
) -> Path:
    """Write a small byte-level ``Qwen2Tokenizer`` (the tokenizer class of Qwen2.5 and Qwen3) to
    ``folder``: the merges of ``byte_bpe_vocab(texts)`` (a prompt template's words become one
    token each, as in the real vocabulary, so that a template's fixed token counts hold), the
    ``special_tokens`` after them, and ``chat_template`` when the pipeline renders one."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = byte_bpe_vocab(list(texts))
    for special in special_tokens:
        vocab.setdefault(special, len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=eos_token,
        pad_token=pad_token,
        model_max_length=131072,
        padding_side="right",
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens], special_tokens=True
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    return folder
