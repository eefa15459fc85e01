"""The activation count of a Wan transformer (``placement.activations``) against the bytes autograd
saves for a small real ``WanTransformer3DModel``, its 1/K scaling, and the planner's use of it."""

from __future__ import annotations

import pytest
import torch

from diffusers_zero3.placement.activations import activation_bytes, wan_shape
from diffusers_zero3.placement.plan import PlanOptions, main, make_plan

WAN = "Wan-AI/Wan2.1-T2V-14B-Diffusers"


def _model(hidden: int, heads: int, ffn: int, layers: int, dtype: torch.dtype):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=hidden // heads,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=ffn,
        num_layers=layers,
        rope_max_seq_len=64,
    )
    return model.to(dtype).train()


def saved_bytes(model, frames: int, side: int, text: int, checkpointing: bool = False) -> int:
    """Bytes of the tensors autograd saves in one forward (storages once, parameters left out)."""
    dtype = next(model.parameters()).dtype
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    if checkpointing:
        model.enable_gradient_checkpointing()
    latents = torch.randn(1, 4, frames, side, side, dtype=dtype)
    states = torch.randn(1, text, 32, dtype=dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(latents, torch.tensor([500]), states, return_dict=False)
    return sum(seen.values())


def _estimate(model, frames: int, side: int, text: int, k: int = 1, checkpointing: bool = False) -> int:
    """The formula's bytes for what a forward saves: the loss (outside the model) left out, and
    with checkpointing the block recomputed in the backward left out."""
    tokens = frames * (side // 2) ** 2
    b = next(model.parameters()).dtype.itemsize
    shape = wan_shape(dict(model.config))
    est = activation_bytes(
        shape, tokens, text, b, context_parallel_size=k, gradient_checkpointing=checkpointing
    )
    held = est["bytes"] - est["loss"]
    if checkpointing:
        held -= est["blocks"] - shape.layers * est["tokens_per_rank"] * shape.hidden * b
    return held


SIZES = [
    (64, 4, 128, 2, 2, 8, 16),
    (128, 8, 512, 3, 4, 16, 32),
]  # hidden, heads, ffn, layers, frames, side, text


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES)
def test_formula_matches_the_saved_tensors_within_one_percent(dtype, size):
    hidden, heads, ffn, layers, frames, side, text = size
    model = _model(hidden, heads, ffn, layers, dtype)
    measured = saved_bytes(model, frames, side, text)
    assert _estimate(model, frames, side, text) == pytest.approx(measured, rel=0.01)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_gradient_checkpointing_the_formula_is_an_upper_bound_within_eight_percent(dtype):
    hidden, heads, ffn, layers, frames, side, text = SIZES[1]
    model = _model(hidden, heads, ffn, layers, dtype)
    measured = saved_bytes(model, frames, side, text, checkpointing=True)
    assert measured <= _estimate(model, frames, side, text, checkpointing=True) <= 1.08 * measured
    assert measured < 0.2 * saved_bytes(_model(hidden, heads, ffn, layers, dtype), frames, side, text)


@pytest.mark.unit
@pytest.mark.parametrize("k", [2, 4])
def test_the_token_part_scales_as_one_over_k(k):
    """A rank of a group of K holds the activations of tokens / K tokens (the sequence split by
    hand: a clip of frames / K), the text's whole."""
    hidden, heads, ffn, layers, frames, side, text = 128, 8, 512, 2, 8, 16, 32
    model = _model(hidden, heads, ffn, layers, torch.bfloat16)
    whole = saved_bytes(model, frames, side, text)
    share = saved_bytes(model, frames // k, side, text)
    assert _estimate(model, frames, side, text, k=k) == pytest.approx(share, rel=0.01)
    text_part = _estimate(model, frames, side, text) - (
        _estimate(model, 2 * frames, side, text) - _estimate(model, frames, side, text)
    )  # the bytes that do not grow with tokens
    assert share - text_part == pytest.approx((whole - text_part) / k, rel=0.01)


@pytest.mark.unit
def test_the_planner_counts_a_clips_activations_by_k_and_names_the_smallest_that_fits():
    options = dict(num_processes=8, mixed_precision="bf16", num_frames=81, height=720, width=1280)
    plan = make_plan(WAN, PlanOptions(**options, context_parallel_size=2))
    assert plan["activations"]["tokens"] == 21 * 45 * 80
    assert plan["activations"]["tokens_per_rank"] == 21 * 45 * 80 // 2
    assert not any("frames x height x width" in n for n in plan["notes"])
    fits = make_plan(
        WAN, PlanOptions(**options, device_memory=80 * 2**30, margin=0.1, gradient_checkpointing=True)
    )["context_parallel_fits"]
    assert [r["context_parallel_size"] for r in fits["rows"]] == [1, 2, 4, 8]
    assert fits["smallest"] == 2 and not fits["rows"][0]["fits"]
    none = make_plan(WAN, PlanOptions(**options, device_memory=80 * 2**30))["context_parallel_fits"]
    assert none["smallest"] is None  # without checkpointing not even K=8 holds 75,600 tokens


@pytest.mark.unit
def test_a_context_parallel_size_not_dividing_the_processes_is_one_error_line(capsys):
    assert main([WAN, "--num_processes", "8", "--context_parallel_size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --context_parallel_size (3)")
