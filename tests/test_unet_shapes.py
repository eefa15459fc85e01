"""The UNet layouts of the tiny pipelines (``demo.UNET_SHAPES``) that the benchmarks run:
"sd15" and "sdxl" have the block structure of the published UNets, so at the published width
they have the published parameter counts, and at any width the same number of parameter
tensors and of modules holding parameters (what ZeRO-3's hooks and collectives scale with)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def _counts(unet: torch.nn.Module) -> tuple[int, int, int]:
    modules = sum(1 for m in unet.modules() if next(m.parameters(recurse=False), None) is not None)
    return sum(p.numel() for p in unet.parameters()), len(list(unet.parameters())), modules


def _unet(width: int, cross_dim: int, shape: str) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.demo import tiny_component_configs

    with torch.device("meta"):
        return UNet2DConditionModel(
            **tiny_component_configs(width, cross_dim=cross_dim, unet_shape=shape)["unet"]
        )


def test_the_sd15_shape_at_sd15s_width_is_the_published_unet():
    # SD 1.5: width 320, CLIP-L's 768 for cross-attention; 859,520,964 parameters (model card)
    assert _counts(_unet(320, 768, "sd15")) == (859_520_964, 686, 391)


def test_the_sdxl_shape_at_sdxls_width_is_the_published_unet_less_its_time_id_embedding():
    # SDXL base: 2,567,463,684 parameters in 1,680 tensors and 1,050 modules; its add_embedding
    # (Linear(2816, 1280), Linear(1280, 1280)) is left out: an SD pipeline passes no time ids
    add_embedding = 2816 * 1280 + 1280 + 1280 * 1280 + 1280
    assert _counts(_unet(320, 2048, "sdxl")) == (2_567_463_684 - add_embedding, 1_676, 1_048)


@pytest.mark.parametrize(
    ("shape", "tensors", "modules"), [("tiny", 208, 116), ("sd15", 686, 391), ("sdxl", 1676, 1048)]
)
def test_a_shape_keeps_its_module_count_at_small_width(shape, tensors, modules):
    _, n_tensors, n_modules = _counts(_unet(64, 64, shape))
    assert (n_tensors, n_modules) == (tensors, modules)


def test_an_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown UNet shape 'sd21'"):
        _unet(32, 32, "sd21")
