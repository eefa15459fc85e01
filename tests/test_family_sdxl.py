"""The SDXL family against what ``StableDiffusionXLPipeline`` registers in its config
(``model_index.json``): ``force_zeros_for_empty_prompt``, read from the folder, not assumed."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def test_force_zeros_for_empty_prompt_is_the_folders(tiny_sdxl, tmp_path):
    """A folder saved with ``force_zeros_for_empty_prompt=False``: validation's pipeline gives
    CFG the empty prompt's states as the folder's own pipeline does, not zeros (the default's)."""
    from diffusers import StableDiffusionXLPipeline

    from diffusers_zero3.families import SDXL, detect_family

    folder = tiny_sdxl[0]
    assert detect_family(folder) is SDXL
    pipe = StableDiffusionXLPipeline.from_pretrained(folder)
    out = tmp_path / "sdxl-no-zeros"
    StableDiffusionXLPipeline(
        **pipe.components, force_zeros_for_empty_prompt=False, add_watermarker=False
    ).save_pretrained(out)
    own = StableDiffusionXLPipeline.from_pretrained(out, add_watermarker=False)
    family = detect_family(out)
    validation = family.pipeline(
        own.unet, own.vae, {"text_encoder": own.text_encoder, "text_encoder_2": own.text_encoder_2},
        {"text_encoder": own.tokenizer, "text_encoder_2": own.tokenizer_2}, own.scheduler,
    )  # fmt: skip
    with torch.no_grad():
        ours = validation.encode_prompt("a red circle", device="cpu", do_classifier_free_guidance=True)
        theirs = own.encode_prompt("a red circle", device="cpu", do_classifier_free_guidance=True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ours[1].abs().sum() > 0  # the empty prompt's states, not zeros
    assert family.name == SDXL.name and family.force_zeros_for_empty_prompt is False
    assert SDXL.force_zeros_for_empty_prompt  # the pipeline's default
