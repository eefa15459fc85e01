"""The tokenizers of the tiny pipelines, written locally from a vocabulary.

No model hub is reachable where the tests and the default runs go, so every tokenizer is
written here: a byte-level CLIP tokenizer, a unigram T5 tokenizer (and umT5, Wan's), and
byte-level BPE tokenizers of the kind the LLM text encoders use (Qwen2.5-VL, Qwen3, Llama 3,
Mistral 3), each with the special tokens and chat template of the published one, loadable
with ``AutoTokenizer.from_pretrained`` of the folder. The prompt templates they must encode
are the families' own (imported from ``diffusers_zero3.families``).
"""

from __future__ import annotations

import os
import shutil
import string
from collections.abc import Callable
from pathlib import Path

from ..families.flux2 import SYSTEM_MESSAGE
from ..families.qwenimage import DROPPED_TEMPLATE_TOKENS, PROMPT_TEMPLATE

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


# -------------------------------------------------------------------------------- per family


# Wan (umT5): a few non-ASCII letters, as umT5's vocabulary is multilingual (a caption in them tokenizes)
UMT5_EXTRA_CHARS = "àáâäçèéêëíîïñóôöúùûüßæøåœ中文日本語한국어"


def write_umt5_tokenizer(folder: str | os.PathLike, model_max_length: int = 512) -> Path:
    """Write a small unigram umT5 tokenizer (``T5TokenizerFast``, ids of google/umt5-xxl's
    special tokens: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2) to ``folder`` and return the path:
    T5's construction (``write_t5_tokenizer``: letters, digits and punctuation alone and
    after ``▁``, whole caption words) plus accented and CJK characters."""
    from transformers import T5TokenizerFast

    folder = Path(folder)
    chars = string.ascii_lowercase + string.digits + ",.!?'-:;()" + UMT5_EXTRA_CHARS
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + c, -3.0) for c in chars]
    pieces += [(c, -4.0) for c in chars + string.ascii_uppercase]
    pieces += [("\u2581" + w, -1.0) for w in (*CAPTION_WORDS, "moving", "left", "right", "up", "down")]
    tok = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
    tok.save_pretrained(folder)
    return folder


# Qwen-Image (Qwen2.5-VL)
QWEN_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def write_qwenimage_tokenizer(folder: str | os.PathLike) -> Path:
    """A small byte-level ``Qwen2Tokenizer`` with Qwen2.5-VL's special tokens whose learnt merges
    make every word of the prompt template one token, as in the real vocabulary: the template's
    prefix is then exactly the 34 tokens that the pipeline drops (checked here)."""
    folder = write_qwen2_tokenizer(
        folder, QWEN_VL_SPECIAL_TOKENS, texts=(PROMPT_TEMPLATE.replace("{}", " "),)
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    if len(tokenizer(prefix).input_ids) != DROPPED_TEMPLATE_TOKENS:
        raise AssertionError(f"the template prefix is not {DROPPED_TEMPLATE_TOKENS} tokens")
    return folder


def write_qwenimage_edit_tokenizer(folder: str | os.PathLike) -> Path:
    """``write_qwenimage_tokenizer``'s construction on Qwen-Image-Edit-Plus's template: its system
    prompt is then exactly the 64 tokens the pipeline drops, and each ``Picture k: ...`` block 8
    tokens, as in the real vocabulary (both checked here)."""
    from transformers import AutoTokenizer

    from ..families import qwenimage_edit as edit

    template = edit.PROMPT_TEMPLATE
    folder = write_qwen2_tokenizer(
        folder, QWEN_VL_SPECIAL_TOKENS, texts=(template.replace("{}", edit.PICTURE_TEMPLATE.format(1) + " "),)
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if len(tokenizer(template.split("{}")[0]).input_ids) != edit.DROPPED_TEMPLATE_TOKENS:
        raise AssertionError(f"the template prefix is not {edit.DROPPED_TEMPLATE_TOKENS} tokens")
    if len(tokenizer(edit.PICTURE_TEMPLATE.format(1)).input_ids) != edit.PICTURE_TOKENS:
        raise AssertionError(f"a picture block is not {edit.PICTURE_TOKENS} tokens")
    return folder


# Krea 2 (Qwen3-VL): Qwen2.5-VL's special tokens and Qwen3's thinking tags
QWEN3_VL_SPECIAL_TOKENS = (*QWEN_VL_SPECIAL_TOKENS, "<think>", "</think>")


def write_krea2_tokenizer(folder: str | os.PathLike) -> Path:
    """A small byte-level ``Qwen2Tokenizer`` (Qwen3-VL's class) with Qwen3-VL's special tokens
    whose learnt merges make every word of the Qwen-Image template one token, as in the real
    vocabulary: Krea 2's block then holds, as the pipeline counts, the 34 prefix tokens it drops
    and the 5 suffix tokens it appends after the padding (both checked here)."""
    from transformers import AutoTokenizer

    from ..families.krea2 import DROPPED_PREFIX_TOKENS, PROMPT_PREFIX, PROMPT_SUFFIX, SUFFIX_TOKENS

    folder = write_qwen2_tokenizer(
        folder, QWEN3_VL_SPECIAL_TOKENS, texts=(PROMPT_TEMPLATE.replace("{}", " "),)
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text, count in ((PROMPT_PREFIX, DROPPED_PREFIX_TOKENS), (PROMPT_SUFFIX, SUFFIX_TOKENS)):
        if len(tokenizer(text).input_ids) != count:
            raise AssertionError(f"the template part {text!r} is not {count} tokens")
    return folder


# NucleusMoE-Image (Qwen3-VL 8 B): what Qwen3-VL's chat template renders for system and user
# messages whose content is a string or a list of text parts, and the generation prompt.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if 'text' in part %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_qwen3_vl_tokenizer(folder: str | os.PathLike, template: str) -> Path:
    """A small byte-level ``Qwen2Tokenizer`` (Qwen3-VL's class) with Qwen3-VL's special tokens,
    right padding, Qwen3-VL's chat template for text messages and merges that make every word of
    ``template`` (what the pipeline renders, ``{}`` for the caption) one token, as in the real
    vocabulary."""
    return write_qwen2_tokenizer(
        folder,
        QWEN3_VL_SPECIAL_TOKENS,
        texts=(template.replace("{}", " "),),
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
    )


def write_nucleusmoe_tokenizer(folder: str | os.PathLike) -> Path:
    """``write_qwen3_vl_tokenizer`` on NucleusMoE-Image's system prompt."""
    from ..families.nucleusmoe import PROMPT_TEMPLATE

    return write_qwen3_vl_tokenizer(folder, PROMPT_TEMPLATE)


def write_ideogram4_tokenizer(folder: str | os.PathLike) -> Path:
    """``write_qwen3_vl_tokenizer`` on Ideogram 4's prompt (one user turn and the generation
    prompt)."""
    from ..families.ideogram4 import CHAT_PROMPT

    return write_qwen3_vl_tokenizer(folder, CHAT_PROMPT)


# HunyuanVideo 1.5 (Qwen2.5-VL, and ByT5 for the glyph text)
def write_hunyuanvideo15_tokenizer(folder: str | os.PathLike) -> Path:
    """A small byte-level ``Qwen2Tokenizer`` with Qwen2.5-VL's special tokens, a chat template that
    renders system and user messages as Qwen2.5-VL's does, and merges that make every word of the
    pipeline's system message one token, as in the real vocabulary: the rendered prefix is then
    exactly the 108 tokens that the pipeline drops (checked here)."""
    from transformers import AutoTokenizer

    from ..families.hunyuanvideo15 import DROPPED_TEMPLATE_TOKENS as HV15_DROPPED
    from ..families.hunyuanvideo15 import SYSTEM_MESSAGE as HV15_SYSTEM

    prefix = f"<|im_start|>system\n{HV15_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    folder = write_qwen2_tokenizer(
        folder,
        QWEN_VL_SPECIAL_TOKENS,
        texts=(prefix + " <|im_end|>\n<|im_start|>assistant\n",),
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
    )
    if len(AutoTokenizer.from_pretrained(folder)(prefix).input_ids) != HV15_DROPPED:
        raise AssertionError(f"the template prefix is not {HV15_DROPPED} tokens")
    return folder


def write_byt5_tokenizer(folder: str | os.PathLike) -> Path:
    """google/byt5-small's tokenizer (``ByT5Tokenizer``: bytes + 3 special tokens, 125 extra ids;
    it needs no vocabulary file), written to ``folder``."""
    from transformers import ByT5Tokenizer

    folder = Path(folder)
    ByT5Tokenizer().save_pretrained(folder)
    return folder


# Z-Image and Flux.2 [klein] (Qwen3)
QWEN3_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Renders [system?, user...] + generation prompt as Qwen3's chat template does for such
# conversations (no tools, no assistant turns): ZImagePipeline passes enable_thinking=True, which
# adds no <think> block, so a caption becomes families.common.QWEN3_PROMPT; Flux2KleinPipeline
# passes enable_thinking=False: families.common.QWEN3_PROMPT_NO_THINKING.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def write_zimage_tokenizer(folder: str | os.PathLike) -> Path:
    """A small byte-level ``Qwen2Tokenizer`` (Qwen3's class) with Qwen3's special tokens, its pad
    (``<|endoftext|>``) and eos (``<|im_end|>``), right padding and a chat template that
    renders a user message as Qwen3-4B's does (``QWEN3_CHAT_TEMPLATE``)."""
    return write_qwen2_tokenizer(
        folder, QWEN3_SPECIAL_TOKENS, texts=("user", "assistant"), chat_template=QWEN3_CHAT_TEMPLATE
    )


# HiDream-I1 (Llama 3)
LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


def write_llama3_tokenizer(folder: str | os.PathLike) -> Path:
    """Write a small byte-level BPE tokenizer in Llama-3's layout to ``folder``: the merges of
    ``byte_bpe_vocab`` (the caption words are one token each), Llama-3's split regex and
    special tokens, ``<|begin_of_text|>`` prepended (no EOS appended), ``<|eot_id|>`` as EOS
    (Llama-3.1-Instruct's) and no pad token (the family pads with the EOS, as the pipeline)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = byte_bpe_vocab([])
    for special in LLAMA3_SPECIAL_TOKENS:
        vocab.setdefault(special, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = qwen_pretokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(LLAMA3_SPECIAL_TOKENS))
    bos = LLAMA3_SPECIAL_TOKENS[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token="<|eot_id|>", model_max_length=131072
    )
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    return folder


def special_first_bpe(specials: tuple[str, ...], bos: str, texts: list[str] = ()):
    """A byte-level BPE ``tokenizers.Tokenizer`` whose ``specials`` take the first ids (as in
    Mistral's and Gemma's vocabularies), ``byte_bpe_vocab(texts)`` after them with ``<unk>`` as
    its unknown token, Qwen2's split regex, and ``bos`` prepended by a plain call."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    bpe_vocab, merges = byte_bpe_vocab(list(texts))
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({t: len(specials) + i for t, i in bpe_vocab.items()})
    assert all(ch in vocab for ch in bytes_to_unicode().values())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=False))
    tok.pre_tokenizer = qwen_pretokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    return tok


# Flux.2 [dev] (Mistral 3)
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>")  # fmt: skip

# Mistral Small 3.1-style: <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user[/INST] (text or blocks).
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if message['content'] is string %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' }}"
    "{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}"
    "{%- endif %}{%- endfor %}{{- '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- message['content'][0]['text'] + eos_token }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
)


def write_mistral3_tokenizer(folder: str | os.PathLike) -> Path:
    """Write a small byte-level BPE tokenizer with Mistral's special tokens (ids 0-10) to
    ``folder``: merges learnt on the system message and caption words (one token each, as in
    the real vocabulary), left padding with ``<pad>``, a Mistral Small 3.1-style chat template,
    and a ``<s>`` prepended by a plain call, like the published tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=special_first_bpe(MISTRAL_SPECIAL_TOKENS, "<s>", [SYSTEM_MESSAGE]),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        truncation_side="right",
        model_max_length=131072,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_qwen3_tokenizer(folder: str | os.PathLike) -> Path:
    """A small byte-level ``Qwen2Tokenizer`` (Qwen3's class) with Qwen3's special tokens, right
    padding with ``<|endoftext|>`` and a Qwen3-style chat template that honours
    ``enable_thinking``."""
    return write_qwen2_tokenizer(folder, QWEN3_SPECIAL_TOKENS, chat_template=QWEN3_CHAT_TEMPLATE)


# LTX-2 (Gemma 3): Gemma's special tokens at their published ids (0-3), then the turn and image markers
GEMMA3_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                         "<start_of_image>", "<end_of_image>", "<image_soft_token>")  # fmt: skip


def write_gemma3_tokenizer(folder: str | os.PathLike) -> Path:
    """Write a small byte-level BPE tokenizer with Gemma 3's special tokens to ``folder``: a
    ``<bos>`` prepended by a plain call (as Gemma's), ``<pad>`` and left padding (the LTX-2
    pipeline pads on the left), ``<eos>`` as EOS; the caption words one token each."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=special_first_bpe(GEMMA3_SPECIAL_TOKENS, "<bos>"), bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
        padding_side="left", model_max_length=131072,
    )  # fmt: skip
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    return folder
