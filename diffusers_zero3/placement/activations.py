"""Activation bytes per rank of a Wan transformer (``WanTransformer3DModel``) for the backward of
one training micro-batch, with and without gradient checkpointing, by context-parallel size K.

Derived from diffusers 0.42.1's ``WanTransformerBlock`` (what autograd saves for each op) and
calibrated against the bytes of the tensors autograd saves (``saved_tensors_hooks``, storages
counted once, parameters left out) for small real models in fp32 and bf16
(``tests/test_activations.py``: within 3 %). Symbols: ``s`` tokens of a sample on this rank,
``d`` hidden size, ``f`` FFN size, ``h`` heads, ``c`` text tokens, ``b`` bytes of the training
dtype (the FP32 layer norms, the modulation and the RMSNorm statistics are fp32 whatever it is).

Per block and token: ``48·d + 10·b·d + 2·b·f + 36 + 8·h`` bytes:

* fp32, 12 tensors of ``d``: the three layer norms' inputs (``hidden_states.float()``), norm1's
  and norm3's outputs (kept by the modulation product), ``ff_output.float()`` (kept by the
  gate), and for each of the query and key of self-attention and the query of cross-attention
  the RMSNorm's fp32 input and normalised product (``torch.nn.RMSNorm``'s composite form, as
  measured on the CPU; a fused GPU kernel keeps less, so the count is an upper bound there).
* dtype ``b``, 10 tensors of ``d``: the modulated input of the self-attention projections, the
  rotated query and key, value and output of self-attention, its projected output (kept by the
  gate), the cross-attention's normalised input, its query and output, the FFN's input; and
  2 of ``f``: the FFN's hidden before and after the GELU.
* the attention op: torch SDPA's flash / memory-efficient kernels keep their inputs, output
  and log-sum-exp (``h`` fp32 per token and attention, the ``8·h``), never the ``s x s``
  matrix (assumed; the math fallback would keep it). Layer-norm mean and rstd and RMSNorm rstd:
  the ``36``.

Per block, not split by K (the text): ``c·(8·d + 2·b·d + 4)`` (cross-attention's key through its
RMSNorm, its normalised key and value), and ``44·d`` of fp32 modulation slices. Outside the
blocks: per token ``(8 + b)·d + 8`` (the output norm and projection's input), the rotary
tables ``2·b·d/h`` and the patch embedding's input; the text projection ``c·(text_dim + 3·d)·b``;
and the loss on the whole gathered prediction (K ranks each compute it): two fp32 copies of the
clip's latent prediction. Wan 2.2 TI2V-5B's per-token timesteps add ``32·d`` fp32 per token and
block (the per-token modulation; derived, not measured).

Context parallelism (``runtime.context_parallel``, Ulysses or ring): every token-dependent term
is for ``s = ceil(tokens / K)``; Ulysses's attention works on all tokens for ``h / K`` heads,
which is the same bytes. The text states and the loss stay whole on every rank. (With the
``native`` backend diffusers' Ulysses op keeps its query, key and value and recomputes the
attention in the backward: the output and log-sum-exp counted above are then not kept, a few %
less.)

With gradient checkpointing (``--gradient_checkpointing``: each block recomputed in the backward)
a rank keeps each block's input, ``L·s·d·b``, plus one block's activations while it is
recomputed, plus what is outside the blocks.

Not counted: transient buffers of a single op (the GELU's output before the second projection
runs, the all-to-all buffers, the attention's workspace), the allocator's fragmentation, and
the gradients of the activations in flight during the backward (about one block's worth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PER_TOKEN_TIMESTEP_FP32 = 8  # fp32 tensors of d per token and block that per-token timesteps add


@dataclass(frozen=True)
class TransformerShape:
    """The sizes of a Wan transformer that its activations depend on.

    Attributes:
        hidden: ``num_attention_heads x attention_head_dim`` (``d``).
        ffn: ``ffn_dim`` (``f``).
        heads: ``num_attention_heads`` (``h``).
        layers: ``num_layers`` (``L``).
        text_dim: the text encoder's width (``text_dim``).
        in_channels: latent channels in.
        out_channels: latent channels out.
        patch: ``patch_size`` (frames, height, width).
        per_token_timesteps: Wan 2.2 TI2V-5B's expanded timesteps.
    """

    hidden: int
    ffn: int
    heads: int
    layers: int
    text_dim: int
    in_channels: int
    out_channels: int
    patch: tuple[int, int, int]
    per_token_timesteps: bool = False


def wan_shape(config: dict, per_token_timesteps: bool = False) -> TransformerShape:
    """The ``TransformerShape`` of a ``WanTransformer3DModel`` config (its ``config.json``)."""
    heads = int(config.get("num_attention_heads", 40))
    patch = tuple(int(p) for p in config.get("patch_size", (1, 2, 2)))
    in_channels = int(config.get("in_channels", 16))
    return TransformerShape(
        hidden=heads * int(config.get("attention_head_dim", 128)),
        ffn=int(config.get("ffn_dim", 13824)),
        heads=heads,
        layers=int(config.get("num_layers", 40)),
        text_dim=int(config.get("text_dim", 4096)),
        in_channels=in_channels,
        out_channels=int(config.get("out_channels") or in_channels),
        patch=(patch[0], patch[1], patch[2]),
        per_token_timesteps=per_token_timesteps,
    )


def latent_tokens(
    latent_frames: int, latent_height: int, latent_width: int, patch: tuple[int, int, int]
) -> int:
    """Tokens of one sample: its latent grid divided by the patch (Wan 2.1 at 81 x 480 x 832:
    21 x 60 x 104 latents, 21 x 30 x 52 = 32,760 tokens)."""
    return (latent_frames // patch[0]) * (latent_height // patch[1]) * (latent_width // patch[2])


def per_token_block_bytes(shape: TransformerShape, dtype_bytes: int) -> int:
    """Bytes one block keeps per token of this rank (the module doc)."""
    d, b = shape.hidden, dtype_bytes
    extra = 4 * PER_TOKEN_TIMESTEP_FP32 * d if shape.per_token_timesteps else 0
    return 48 * d + 10 * b * d + 2 * b * shape.ffn + 36 + 8 * shape.heads + extra


def text_block_bytes(shape: TransformerShape, dtype_bytes: int, text_length: int) -> int:
    """Bytes one block keeps for the text (whole on every rank) and its modulation."""
    d = shape.hidden
    return text_length * (8 * d + 2 * dtype_bytes * d + 4) + 44 * d


def activation_bytes(
    shape: TransformerShape,
    tokens: int,
    text_length: int,
    dtype_bytes: int,
    batch: int = 1,
    context_parallel_size: int = 1,
    gradient_checkpointing: bool = False,
) -> dict[str, int]:
    """Bytes a rank keeps for the backward of one micro-batch of ``batch`` samples of
    ``tokens`` tokens each (``latent_tokens``) and ``text_length`` text tokens, in a dtype of
    ``dtype_bytes``, with the sequence split over ``context_parallel_size`` ranks.

    Returns ``tokens_per_rank``, ``blocks`` (what the blocks keep; with checkpointing their
    inputs plus one block recomputed), ``outside`` (embeddings, output layer), ``loss`` (the
    gathered prediction's fp32 copies) and ``bytes`` (the sum). ``ValueError`` for a size below 1.
    """
    if min(tokens, batch, context_parallel_size, shape.layers) < 1 or text_length < 0:
        raise ValueError("tokens, batch, context parallel size and layers must be at least 1")
    s = math.ceil(tokens / context_parallel_size)
    b, d = dtype_bytes, shape.hidden
    block = s * per_token_block_bytes(shape, b) + text_block_bytes(shape, b, text_length)
    blocks = shape.layers * s * d * b + block if gradient_checkpointing else shape.layers * block
    rope = 2 * b * (d // shape.heads)
    patch_elements = shape.patch[0] * shape.patch[1] * shape.patch[2]
    outside = s * ((8 + b) * d + 8 + rope + shape.in_channels * patch_elements * b)
    outside += text_length * (shape.text_dim + 3 * d) * b
    loss = 2 * 4 * tokens * shape.out_channels * patch_elements  # the gathered prediction, fp32
    total = batch * (blocks + outside + loss)
    return {
        "tokens_per_rank": s,
        "blocks": batch * blocks,
        "outside": batch * outside,
        "loss": batch * loss,
        "bytes": total,
    }
