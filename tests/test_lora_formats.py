"""LoRA files of every family load whole: each trained adapter tensor that ``save_lora_zero3``
writes comes back, with its value, from the pipeline class's own ``load_lora_weights``. (A
file in another key format loads partly and silently: peft warns, the rest is dropped.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

FIXTURES = {
    "sd": "tiny_pipeline",
    "sdxl": "tiny_sdxl",
    "sd3": "tiny_sd3",
    "flux": "tiny_flux",
    "qwenimage": "tiny_qwenimage",
    "zimage": "tiny_zimage",
    "flux2": "tiny_flux2",
    "flux2-klein": "tiny_flux2_klein",
    "hidream": "tiny_hidream",
    "krea2": "tiny_krea2",
    "nucleusmoe": "tiny_nucleusmoe",
    "kontext": "tiny_kontext",
    "qwenimage-edit": "tiny_qwenimage_edit",
    "ideogram4": "tiny_ideogram4",
    "wan": "tiny_wan",
    "wan22": "tiny_wan22",
    "wan22_5b": "tiny_wan22_5b",
    "hunyuanvideo15": "tiny_hunyuanvideo15",
    "ltx2": "tiny_ltx2",
}


def test_every_family_is_covered():
    from diffusers_zero3.families import FAMILY_NAMES

    assert set(FIXTURES) == set(FAMILY_NAMES)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_saved_lora_loads_every_adapter_in_the_pipeline(name, request, tmp_path):
    from diffusers import DiffusionPipeline

    from diffusers_zero3.families import family_named
    from diffusers_zero3.training.lora import add_lora_adapters, load_lora_into, save_lora_zero3
    from tests.test_train_families import _supplied

    family = family_named(name)
    value = request.getfixturevalue(FIXTURES[name])
    folder = value if isinstance(value, str) else value[0]
    denoiser = family.denoiser_cls().from_pretrained(folder, subfolder=family.denoiser)
    add_lora_adapters(denoiser, rank=4, target_modules=family.lora_target_modules)
    torch.manual_seed(0)
    trained = {}
    with torch.no_grad():
        for key, p in denoiser.named_parameters():
            if "lora_" in key:
                p.normal_()  # B is zero at init: give every tensor a value of its own
                trained[key.replace(".default", "")] = p.detach().clone()
    save_lora_zero3(denoiser, family, tmp_path)
    pipeline = DiffusionPipeline.from_pretrained(folder, **_supplied(family, folder))
    load_lora_into(pipeline, family, tmp_path)  # load_lora_weights; NucleusMoE-Image's transformer's own
    loaded = {
        key.replace(".default_0", "").replace(".default", ""): p
        for key, p in getattr(pipeline, family.denoiser).named_parameters()
        if "lora_" in key
    }
    assert sorted(loaded) == sorted(trained), sorted(set(trained) ^ set(loaded))[:6]
    for key, tensor in trained.items():
        torch.testing.assert_close(loaded[key], tensor, msg=key)
