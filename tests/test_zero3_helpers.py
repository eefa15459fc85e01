"""The transformers-free ZeRO-3 helpers, single-process and on 2 real ZeRO-3 ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.distributed_harness import REPO_ROOT, run_on_ranks

# --------------------------------------------------------------------------- single process


@pytest.mark.unit
def test_import_does_not_pull_deepspeed_or_transformers():
    code = (
        "import sys, diffusers_zero3 as d;"
        "d.is_zero3_enabled();"
        "bad=[m for m in ('deepspeed','transformers','accelerate','diffusers') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.unit
def test_plain_process_is_not_zero3():
    from diffusers_zero3 import is_zero3_enabled

    assert is_zero3_enabled() is False


@pytest.mark.unit
def test_gathered_parameters_is_nullcontext_without_zero_params():
    import contextlib

    from diffusers_zero3 import gathered_parameters

    lin = torch.nn.Linear(3, 3)
    for arg in (lin, lin.weight, list(lin.parameters()), iter(lin.parameters())):
        assert isinstance(gathered_parameters(arg), contextlib.nullcontext)
    assert isinstance(gathered_parameters(lin, enabled=False), contextlib.nullcontext)


@pytest.mark.unit
def test_zero3_init_disabled_restores_transformers_ref_on_exception():
    """Without deepspeed in the process: the weakref is hidden inside and restored after a raise."""
    import transformers.integrations.deepspeed as hf_ds

    from diffusers_zero3 import zero3_init_disabled

    class FakeZero3Config:  # stands in only for the registration object; no DeepSpeed involved
        def is_zero3(self):
            return True

    cfg = FakeZero3Config()
    hf_ds.set_hf_deepspeed_config(cfg)
    try:
        assert hf_ds.is_deepspeed_zero3_enabled()
        with pytest.raises(RuntimeError, match="boom"):
            with zero3_init_disabled():
                assert not hf_ds.is_deepspeed_zero3_enabled()
                with zero3_init_disabled():  # nested
                    assert not hf_ds.is_deepspeed_zero3_enabled()
                assert not hf_ds.is_deepspeed_zero3_enabled()
                raise RuntimeError("boom")
        assert hf_ds.is_deepspeed_zero3_enabled()
    finally:
        hf_ds.unset_hf_deepspeed_config()


# --------------------------------------------------------------------------- 2 ranks


def reference_outputs(pipe_dir: str) -> dict[str, torch.Tensor]:
    """Outputs of a plain single-process load of the text encoder and VAE."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    te = CLIPTextModel.from_pretrained(pipe_dir, subfolder="text_encoder").eval()
    vae = AutoencoderKL.from_pretrained(pipe_dir, subfolder="vae").eval()
    ids, pixels = _inputs()
    with torch.no_grad():
        return {"text": te(ids)[0], "latents": vae.encode(pixels).latent_dist.mean}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 500, (2, 77), generator=g), torch.rand(2, 3, 32, 32, generator=g) * 2 - 1


def worker_upstream_bug_and_fix(pipe_dir: str, ref_path: str):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    from diffusers_zero3 import is_zero3_enabled, is_zero3_param, zero3_init_disabled
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=True)
    assert accelerator.num_processes == 2, accelerator.num_processes
    assert is_zero3_enabled()
    ids, pixels = _inputs()

    # The upstream workaround: accelerate's zero3_init_context_manager(enable=False).
    plugin = accelerator.state.deepspeed_plugin
    with plugin.zero3_init_context_manager(enable=False):
        te_broken = CLIPTextModel.from_pretrained(pipe_dir, subfolder="text_encoder")
    assert all(is_zero3_param(p) for p in te_broken.parameters()), "upstream bug no longer reproduces"
    with pytest.raises((RuntimeError, ValueError, IndexError)):  # partitioned, never in an engine
        te_broken(ids)

    with zero3_init_disabled():
        te = CLIPTextModel.from_pretrained(pipe_dir, subfolder="text_encoder").eval()
        vae = AutoencoderKL.from_pretrained(pipe_dir, subfolder="vae").eval()
    assert not any(is_zero3_param(p) for m in (te, vae) for p in m.parameters())
    assert is_zero3_enabled()  # ZeRO-3 stays on for everything else
    ref = torch.load(ref_path)
    with torch.no_grad():
        torch.testing.assert_close(te(ids)[0], ref["text"])
        torch.testing.assert_close(vae.encode(pixels).latent_dist.mean, ref["latents"])
    print("OK upstream-bug-and-fix")


@pytest.mark.multirank
def test_zero3_init_disabled_fixes_upstream_text_encoder_bug(tiny_pipeline, tmp_path):
    ref_path = tmp_path / "ref.pt"
    torch.save(reference_outputs(tiny_pipeline), ref_path)
    outs = run_on_ranks(worker_upstream_bug_and_fix, pipe_dir=tiny_pipeline, ref_path=str(ref_path))
    assert all("OK upstream-bug-and-fix" in o for o in outs)


def worker_helpers_under_explicit_zero_init():
    import deepspeed

    from diffusers_zero3 import gathered_parameters, get_rank, is_zero3_param, zero3_init_disabled
    from tests.common import zero3_config

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = zero3_config()
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        partitioned = torch.nn.Linear(64, 64)
        with zero3_init_disabled():
            whole = torch.nn.Linear(64, 64)
            with zero3_init_disabled():  # nested
                whole2 = torch.nn.Linear(8, 8)
            whole3 = torch.nn.Linear(8, 8)  # still disabled after the inner exit
        # exception path: the Init patches come back
        with pytest.raises(ValueError):
            with zero3_init_disabled():
                raise ValueError("inside")
        partitioned_again = torch.nn.Linear(64, 64)
    assert is_zero3_param(partitioned.weight) and is_zero3_param(partitioned_again.weight)
    assert not any(is_zero3_param(p) for m in (whole, whole2, whole3) for p in m.parameters())
    assert partitioned.weight.ds_tensor.numel() == 64 * 64 // 2
    after = torch.nn.Linear(4, 4)  # outside Init: whole
    assert not is_zero3_param(after.weight)

    # read-only gather: writes are discarded on exit
    with gathered_parameters(partitioned):
        assert partitioned.weight.shape == (64, 64)
        before = partitioned.weight.detach().clone()
        partitioned.weight.data.add_(1.0)
    with gathered_parameters(partitioned.weight):
        torch.testing.assert_close(partitioned.weight.detach(), before)

    # modifier_rank: rank 0's writes persist on every rank
    with gathered_parameters([partitioned.weight, whole.weight], modifier_rank=0):
        if get_rank() == 0:
            partitioned.weight.data.fill_(3.0)
    with gathered_parameters(partitioned.weight):
        assert torch.all(partitioned.weight == 3.0)

    # a mixed iterable: the non-ZeRO parameter is filtered out and left alone
    w_before = whole.weight.detach().clone()
    with gathered_parameters(iter([whole.weight, partitioned_again.weight])):
        assert partitioned_again.weight.shape == (64, 64)
    torch.testing.assert_close(whole.weight.detach(), w_before)
    # disabled: nothing gathered
    with gathered_parameters(partitioned, enabled=False):
        assert partitioned.weight.numel() == 0

    # docs/api.md's gathered_parameters example, as printed, on a partitioned conv_in that
    # requires grad (as a trained UNet's does)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        unet = torch.nn.Module()
        unet.conv_in = torch.nn.Conv2d(4, 32, 3)
    with gathered_parameters(unet.conv_in):
        original = unet.conv_in.weight.detach().clone()
    exec(api_doc_block("from diffusers_zero3 import gathered_parameters"), {"unet": unet})
    with gathered_parameters(unet.conv_in):
        torch.testing.assert_close(unet.conv_in.weight.detach(), original * 0.5)
    print("OK helpers")


def api_doc_block(containing: str) -> str:
    """The python block of docs/api.md that contains ``containing``, as printed."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "docs" / "api.md").read_text(), re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


@pytest.mark.multirank
def test_helpers_under_explicit_zero_init():
    outs = run_on_ranks(worker_helpers_under_explicit_zero_init)
    assert all("OK helpers" in o for o in outs)


def worker_gloo_for_a_cpu_launch():
    from diffusers_zero3.runtime.accelerator import needs_gloo_backend
    from tests.common import accelerator_with_zero3

    # What the gloo decision is for: on a CPU host accelerate picks no backend by itself, sees
    # one process, and DeepSpeed's batch-size check fails against its world of 2.
    accelerator = accelerator_with_zero3()
    assert accelerator.num_processes == 2, accelerator.num_processes
    assert torch.distributed.get_backend() == "gloo", torch.distributed.get_backend()
    assert needs_gloo_backend()  # the launcher's environment: 2 processes, no CUDA
    print("OK gloo")


@pytest.mark.multirank
def test_gloo_only_for_multi_process_cpu_launches():
    """A 2-rank launch on a CPU host asks for gloo and gets a 2-process ZeRO-3 accelerator;
    this single pytest process (no launcher) asks for nothing."""
    from diffusers_zero3.runtime.accelerator import needs_gloo_backend

    assert not needs_gloo_backend()
    outs = run_on_ranks(worker_gloo_for_a_cpu_launch)
    assert all("OK gloo" in o for o in outs)
