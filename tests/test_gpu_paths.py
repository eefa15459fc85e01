"""GPU-only failures of the default paths (issue 21), shown on a CPU-only build.

The ``meta`` device stands in for a GPU: an op mixing a meta tensor with a CPU one raises, as
CUDA with CPU does, and a tensor left on the CPU shows in its ``.device``. Each test below
failed before its fix.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

META = torch.device("meta")


def test_sdxl_time_ids_follow_the_batch_device():
    """Item 1: a prepared data loader puts ``original_size``/``crop_top_left`` on the GPU; the
    target size was built on the CPU and ``torch.cat`` of the two failed at step 1."""
    from diffusers_zero3.families import time_ids

    sizes = torch.tensor([[40, 48], [32, 32]], device=META)
    crops = torch.tensor([[4, 0], [0, 0]], device=META)
    ids = time_ids(sizes, crops, 32)
    assert ids.device == META and ids.shape == (2, 6)
    real = time_ids(torch.tensor([[40, 48]]), torch.tensor([[4, 0]]), (32, 24))
    assert real.tolist() == [[40.0, 48.0, 4.0, 0.0, 32.0, 24.0]]


@pytest.mark.parametrize(
    "family_name, cached, live",
    [
        ("sdxl", {"prompt_embeds_1": (2, 77, 32)}, {"prompt_embeds_2": (2, 77, 32), "text_embeds": (2, 32)}),
        ("sd3", {"prompt_embeds_1": (2, 77, 32), "pooled_1": (2, 32), "t5_embeds": (2, 16, 64)},
         {"prompt_embeds_2": (2, 77, 32), "pooled_2": (2, 32)}),
    ],
)  # fmt: skip
def test_cached_and_live_encoder_outputs_meet_on_the_device(family_name, cached, live):
    """Item 2: cached outputs are CPU tensors from safetensors, live ones are on the GPU, and
    the family concatenates them (``make train MODEL=sd3`` and ``auto`` placements do this)."""
    from diffusers_zero3.families import FAMILIES
    from diffusers_zero3.placement.frozen_inputs import conditioning_on

    family = next(f for f in FAMILIES.values() if f.name == family_name)
    outputs = {k: torch.zeros(shape) for k, shape in cached.items()}  # as the cache returns them
    outputs.update({k: torch.zeros(shape, dtype=torch.bfloat16, device=META) for k, shape in live.items()})
    with pytest.raises((RuntimeError, NotImplementedError)):  # the family alone mixes devices
        family.conditioning(outputs)
    cond = conditioning_on(family, outputs, META, torch.bfloat16)
    assert cond and all(v.device == META and v.dtype == torch.bfloat16 for v in cond.values())


class _Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 1, 3)

    def forward(self, x):
        return self.conv(x).mean(dim=(1, 2, 3))


def test_reward_function_scores_land_on_the_images_device():
    """Item 3: a plain-function reward returned CPU scores in ``all_ranks`` mode, which a
    following ``accelerator.gather`` (NCCL) refuses."""
    from diffusers_zero3 import ParallelReward

    reward = ParallelReward(lambda images, prompts: [1.0] * len(images))
    scores = reward(torch.zeros(3, 3, 8, 8, device=META), ["a", "b", "c"])
    assert scores.device == META and scores.shape == (3,)


def test_reward_model_gets_its_inputs_on_its_device_and_dtype():
    """Item 3 and the reported bf16 crash: rank 0 of ``main_process`` mode scores every rank's
    images, gathered on the CPU, with a model on the GPU; a bf16 reward model got fp32 images
    ("Input type (float) and bias type (c10::BFloat16) should be the same")."""
    from diffusers_zero3 import ParallelReward
    from diffusers_zero3.placement.frozen import FrozenModel

    model = _Scorer().to(META, torch.bfloat16)
    reward = ParallelReward(FrozenModel(model, "replicate"), mode="main_process")
    batch = reward._model_input(torch.rand(2, 3, 8, 8))
    assert batch.device == META and batch.dtype == torch.bfloat16
    assert reward._model_input(torch.zeros(2, 4, dtype=torch.long)).dtype == torch.long  # ids stay ids

    cpu_bf16 = ParallelReward(FrozenModel(_Scorer().to(torch.bfloat16), "replicate"))
    scores = cpu_bf16(torch.rand(2, 3, 8, 8))  # fp32 images, as a VAE decode gives them
    assert scores.dtype == torch.float32 and scores.shape == (2,)


def test_offload_and_shard_partitions_go_where_the_placement_says():
    """Item 4: frozen ``shard`` and ``offload`` models were partitioned under the training
    config's ``offload_param`` (none in the shipped config: an ``offload`` model landed on the
    GPU; with the offload config every ``shard`` model landed in host memory)."""
    from diffusers_zero3.runtime.ds_config import zero_init_config
    from tests.common import zero3_config

    plain = zero3_config()
    offloaded = zero3_config(offload_param={"device": "cpu"})
    assert "offload_param" not in zero_init_config(plain, None)["zero_optimization"]
    assert zero_init_config(offloaded, None)["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert (
        zero_init_config(plain, None, offload=True)["zero_optimization"]["offload_param"]["device"] == "cpu"
    )
    assert "offload_param" not in zero_init_config(offloaded, None, offload=False)["zero_optimization"]


def test_load_frozen_component_asks_for_its_placements_offload(monkeypatch, tmp_path):
    """Item 4, the wiring: ``shard`` loads with ``offload_param=False``, ``offload`` with True,
    whatever the training config says; and a bf16 model is partitioned in bf16."""
    import diffusers_zero3.placement.frozen as frozen

    calls = []

    def record(model_cls, source, name, **kwargs):
        calls.append(kwargs)
        raise StopIteration  # the load itself is tested elsewhere (2 ranks)

    monkeypatch.setattr(frozen, "load_pretrained_zero3", record)
    monkeypatch.setattr(frozen, "check_placement_supported", lambda placement, name: None)
    for placement in ("shard", "offload"):
        with pytest.raises(StopIteration):
            frozen.load_frozen_component(None, tmp_path, "vae", placement, object, dtype=torch.bfloat16)
    assert [c["offload_param"] for c in calls] == [False, True]
    assert all(c["torch_dtype"] == torch.bfloat16 for c in calls)


def test_a_replicated_model_is_cast_before_it_moves():
    """Item 5: ``prepare_frozen(..., "replicate")`` moved the fp32 model to the device, then
    cast it: a T5-XXL held 19 GB of a GPU for a moment instead of 9.5 GB."""
    from diffusers_zero3 import prepare_frozen

    model = _Scorer()
    seen = []
    original_to = model.to

    def spy(*args, **kwargs):
        seen.append((kwargs.get("device"), next(model.parameters()).dtype))
        return original_to(*args, **kwargs)

    model.to = spy
    prepare_frozen(model, "replicate", dtype=torch.bfloat16)
    moves = [dtype for device, dtype in seen if device is not None]
    assert moves and all(dtype == torch.bfloat16 for dtype in moves), seen
