"""Frozen-model placements and lockstep, on 2 real ZeRO-3 ranks (CPU, gloo)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed_harness import run_on_ranks
from tests.test_zero3_helpers import _inputs, reference_outputs


def _load_whole(pipe_dir):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    from diffusers_zero3 import zero3_init_disabled

    with zero3_init_disabled():
        te = CLIPTextModel.from_pretrained(pipe_dir, subfolder="text_encoder")
        vae = AutoencoderKL.from_pretrained(pipe_dir, subfolder="vae")
    return te, vae


def _full_bytes(module):
    return sum((p.ds_numel if hasattr(p, "ds_numel") else p.numel()) * 4 for p in module.parameters())


def _record_moves(module: torch.nn.Module) -> list[bool]:
    """Record, at each ``module.to(...)`` call, whether all its parameters were partitioned."""
    from diffusers_zero3 import is_zero3_param

    moves, original_to = [], module.to

    def to(*args, **kwargs):
        moves.append(all(is_zero3_param(p) for p in module.parameters()))
        return original_to(*args, **kwargs)

    module.to = to
    return moves


def worker_placements(pipe_dir: str, ref_path: str):
    from transformers import CLIPTextModel

    from diffusers_zero3 import is_zero3_param, prepare_frozen
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=True)
    ref = torch.load(ref_path)
    ids, pixels = _inputs()
    # every rank sees its own half of the inputs: uneven data, same call count
    rank = accelerator.process_index

    for placement in ("replicate", "shard"):
        te, vae = _load_whole(pipe_dir)
        full = _full_bytes(te) + _full_bytes(vae)
        # A model loaded whole is partitioned before anything moves it: DeepSpeed's engine
        # moved the whole module to the device first (all of a T5-XXL on every GPU at once).
        moves = _record_moves(te)  # per .to() call: were all parameters partitioned?
        te = prepare_frozen(te, placement, accelerator=accelerator, name="text_encoder")
        assert all(moves) if placement == "shard" else moves, (placement, moves)
        vae = prepare_frozen(vae, placement, accelerator=accelerator, name="vae")
        assert not any(p.requires_grad for p in te.parameters()) and not te.training
        held = te.local_parameter_bytes() + vae.local_parameter_bytes()
        with torch.no_grad():
            torch.testing.assert_close(te(ids[rank : rank + 1])[0], ref["text"][rank : rank + 1])
            torch.testing.assert_close(
                vae.encode(pixels[rank : rank + 1]).latent_dist.mean, ref["latents"][rank : rank + 1]
            )
            decoded = vae.decode(ref["latents"][:1] / vae.config.scaling_factor).sample
        assert decoded.shape == (1, 3, 32, 32)
        if placement == "shard":
            assert all(is_zero3_param(p) for p in te.parameters())
            assert held <= 0.5 * full + 0.05 * full, (held, full)  # ~1/N, persistence threshold aside
        else:
            assert held == full
        print(f"{placement}: held {held} of {full}")

    # A text encoder partitioned at load time goes straight into a "shard" engine...
    from diffusers_zero3 import load_pretrained_zero3

    te_partitioned = load_pretrained_zero3(CLIPTextModel, pipe_dir, "text_encoder", accelerator=accelerator)
    assert all(is_zero3_param(p) for p in te_partitioned.parameters())
    with pytest.raises(ValueError, match="zero3_init_disabled"):  # ...and cannot be replicated
        prepare_frozen(te_partitioned, "replicate", accelerator=accelerator)
    te_sharded = prepare_frozen(te_partitioned, "shard", accelerator=accelerator)
    with torch.no_grad():
        torch.testing.assert_close(te_sharded(ids)[0], ref["text"])

    with pytest.raises(RuntimeError, match="CPU accelerator"):
        prepare_frozen(_load_whole(pipe_dir)[1], "offload", accelerator=accelerator)
    with pytest.raises(ValueError, match="unknown placement 'cach'"):
        prepare_frozen(_load_whole(pipe_dir)[1], "cach", accelerator=accelerator)
    print("OK placements")


@pytest.mark.multirank
def test_placements_match_unsharded_outputs(tiny_pipeline, tmp_path):
    ref_path = tmp_path / "ref.pt"
    torch.save(reference_outputs(tiny_pipeline), ref_path)
    outs = run_on_ranks(worker_placements, pipe_dir=tiny_pipeline, ref_path=str(ref_path))
    assert all("OK placements" in o for o in outs)


def worker_train_beside_frozen_engines(pipe_dir: str, save_dir: str):
    from diffusers import UNet2DConditionModel

    from diffusers_zero3 import prepare_frozen, zero3_init_disabled
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    te, vae = _load_whole(pipe_dir)
    te = prepare_frozen(te, "shard", accelerator=accelerator, name="text_encoder")  # before the UNet
    with zero3_init_disabled():
        unet = UNet2DConditionModel.from_pretrained(pipe_dir, subfolder="unet")
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    vae = prepare_frozen(vae, "shard", accelerator=accelerator, name="vae")  # after the UNet
    ids, pixels = _inputs()
    losses = []
    for _ in range(3):
        with torch.no_grad():
            states = te(ids)[0]
            latents = vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor
        pred = unet(latents, torch.tensor([10, 500]), states).sample
        loss = torch.nn.functional.mse_loss(pred, torch.zeros_like(pred))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    accelerator.save_state(save_dir)
    if accelerator.is_main_process:
        saved = sorted(os.listdir(save_dir))
        assert "pytorch_model" in saved and not any(s.startswith("pytorch_model_") for s in saved), saved
    print("OK train", losses)


@pytest.mark.multirank
def test_training_beside_frozen_engines_prepared_before_and_after(tiny_pipeline, tmp_path):
    outs = run_on_ranks(
        worker_train_beside_frozen_engines, pipe_dir=tiny_pipeline, save_dir=str(tmp_path / "state")
    )
    assert all("OK train" in o for o in outs)


def worker_lockstep(pipe_dir: str, ref_path: str):
    from diffusers_zero3 import LockstepError, lockstep_map, prepare_frozen
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    rank = accelerator.process_index
    ref = torch.load(ref_path)["text"]
    ids, _ = _inputs()
    te = prepare_frozen(_load_whole(pipe_dir)[0], "shard", accelerator=accelerator, name="text_encoder")

    def encode(batch):
        with torch.no_grad():
            return te(batch)[0]

    for counts in ((3, 1), (0, 2), (1, 0)):
        mine = [ids[i % 2 : i % 2 + 1] for i in range(counts[rank])]
        with te.lockstep_check():  # would raise if lockstep_map let the counts differ
            outs = lockstep_map(encode, mine, name="text_encoder")
        assert len(outs) == counts[rank]
        for i, out in enumerate(outs):
            torch.testing.assert_close(out, ref[i % 2 : i % 2 + 1])

    # A naive loop with uneven call counts: an error naming the model and counts, not a hang.
    with pytest.raises(LockstepError, match=r"'text_encoder'.*finished after 1 call"):
        with te.lockstep_check():
            for _ in range(2 if rank == 0 else 1):
                encode(ids[:1])
    print("OK lockstep")


@pytest.mark.multirank
def test_lockstep_uneven_counts_and_mismatch_check(tiny_pipeline, tmp_path):
    ref_path = tmp_path / "ref.pt"
    torch.save(reference_outputs(tiny_pipeline), ref_path)
    outs = run_on_ranks(worker_lockstep, pipe_dir=tiny_pipeline, ref_path=str(ref_path), timeout=200)
    assert all("OK lockstep" in o for o in outs)


@pytest.mark.unit
def test_replicate_placement_makes_no_fp32_module_warning(tiny_pipeline):
    """diffusers warns "There are modules in AutoencoderKL that should be kept in float32"
    on every dtype cast of a VAE, even to its own dtype; the replicate placement casts only
    when the dtype changes."""
    import logging

    from diffusers import AutoencoderKL

    from diffusers_zero3 import prepare_frozen

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    diffusers_logger = logging.getLogger("diffusers.models.modeling_utils")
    diffusers_logger.addHandler(handler)
    try:
        vae = AutoencoderKL.from_pretrained(tiny_pipeline, subfolder="vae")
        vae.to(dtype=torch.float32)  # positive control: the warning is there to be seen
        assert any("should be kept in float32" in m for m in seen), seen
        seen.clear()
        prepare_frozen(vae, "replicate", dtype=torch.float32)
        assert not any("should be kept in float32" in m for m in seen), seen
        assert prepare_frozen(vae, "replicate", dtype=torch.bfloat16).dtype == torch.bfloat16
    finally:
        diffusers_logger.removeHandler(handler)


@pytest.mark.unit
def test_scalar_parameters_become_buffers_of_the_same_name_shape_and_value():
    """DeepSpeed 0.19's ``zero.Init(module=...)`` refuses a 0-dim parameter (CLIP's
    ``logit_scale``: "self.dim() cannot be 0 to view Float as Byte"); the shard placement keeps
    such scalars whole as buffers. The state dict and the forward are unchanged."""
    from transformers import CLIPConfig, CLIPModel

    from diffusers_zero3.placement.frozen import scalar_parameters_to_buffers

    config = CLIPConfig(
        text_config={"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2},
        vision_config={"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8},
        projection_dim=8,
    )  # fmt: skip
    model = CLIPModel(config).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pixels, ids = torch.randn(2, 3, 16, 16), torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels).logits_per_image
    assert scalar_parameters_to_buffers(model) == ["logit_scale"]
    assert all(p.dim() > 0 for p in model.parameters())
    assert model.logit_scale.shape == () and "logit_scale" in dict(model.named_buffers())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, pixel_values=pixels).logits_per_image, expected)
