"""Tensors built inside the package follow their inputs' device (issue 21).

A tensor built on the CPU and mixed with model data only fails on a GPU. The ``meta``
device shows the same mistake on a CPU-only build: any op mixing a meta tensor with a CPU
tensor (other than a 0-dim one, which CUDA accepts too) raises, and a tensor left on the CPU
shows in its ``.device``. Each test feeds meta inputs and checks that every output (and every
tensor handed on to a model) is on meta.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.unit

META = torch.device("meta")


def _on_meta(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.device == META, f"a tensor of shape {tuple(t.shape)} is on {t.device}, not on meta"


# ------------------------------------------------------------------------ training.py


@pytest.mark.parametrize("noise_offset", [0.0, 0.1])
def test_sample_noise_follows_the_latents(noise_offset):
    from diffusers_zero3.families.objectives import sample_noise

    latents = torch.empty(2, 4, 8, 8, dtype=torch.bfloat16, device=META)
    noise = sample_noise(latents, noise_offset)
    _on_meta(noise)
    assert noise.shape == latents.shape and noise.dtype == latents.dtype


def test_sample_timesteps_land_on_the_requested_device():
    """Uniform draws are made there; biased ones are drawn from the CPU weights of
    ``timestep_bias_weights`` (a CPU bookkeeping tensor, by design) and then moved."""
    from diffusers_zero3.families.objectives import sample_timesteps, timestep_bias_weights

    weights = timestep_bias_weights(1000, "later", multiplier=2.0)
    for w in (None, weights):
        t = sample_timesteps(3, 1000, META, w)
        _on_meta(t)
        assert t.shape == (3,) and t.dtype == torch.long


def test_compute_snr_moves_the_schedulers_table():
    """A fresh scheduler's ``alphas_cumprod`` is on the CPU (``add_noise`` moves it to the
    latents' device as a side effect, which would hide a missing move in the loss test). A CPU
    table indexed by meta timesteps gives a CPU tensor; by CUDA timesteps it raises."""
    from diffusers import DDPMScheduler

    from diffusers_zero3.families.objectives import compute_snr

    scheduler = DDPMScheduler(num_train_timesteps=1000)
    assert scheduler.alphas_cumprod.device == torch.device("cpu")
    _on_meta(compute_snr(scheduler, torch.empty(3, dtype=torch.long, device=META)))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("snr_gamma", [None, 5.0])
def test_diffusion_loss_stays_on_the_latents_device(prediction_type, snr_gamma):
    """The scheduler's tables (CPU) meet meta latents in ``add_noise``, ``get_velocity`` and
    ``compute_snr``: each must be moved first."""
    from diffusers import DDPMScheduler

    from diffusers_zero3.families.objectives import (
        DDPMDraw,
        ObjectiveSettings,
        diffusion_loss,
        sample_noise,
        sample_timesteps,
    )

    latents = torch.empty(2, 4, 8, 8, device=META)
    noise = sample_noise(latents, 0.1)
    timesteps = sample_timesteps(2, 1000, META)
    seen = []

    def predict(x, t):
        seen.extend([x, t])
        return x * 1.0

    loss = diffusion_loss(
        predict,
        DDPMScheduler(num_train_timesteps=1000),
        latents,
        DDPMDraw(noise, timesteps, perturbation=torch.randn_like(noise)),
        settings=ObjectiveSettings(snr_gamma=snr_gamma, input_perturbation=0.1),
        prediction_type=prediction_type,
    )
    _on_meta(loss, *seen)


@pytest.mark.parametrize("weighting_scheme", ["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"])
def test_flow_matching_sampling_meets_the_latents_device(weighting_scheme):
    """``compute_density_for_timestep_sampling`` draws on the CPU and indexes the scheduler's
    CPU tables; the timesteps and sigmas must then move to the latents' device."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusers_zero3.families.objectives import ObjectiveSettings, flow_matching_loss

    latents = torch.empty(2, 4, 8, 8, device=META)
    seen = []

    def predict(noisy, timesteps):
        seen.extend([noisy, timesteps])
        return noisy * 1.0

    loss = flow_matching_loss(
        predict,
        FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000),
        latents,
        torch.empty_like(latents),
        settings=ObjectiveSettings(weighting_scheme=weighting_scheme),
    )
    _on_meta(loss, *seen)


# ------------------------------------------------------------------------ families (Flux)


def test_flux_position_ids_are_built_on_the_latents_device():
    from diffusers_zero3.families import latent_image_ids

    ids = latent_image_ids(8, 6, META, torch.bfloat16)
    _on_meta(ids)
    assert ids.shape == (4 * 3, 3) and ids.dtype == torch.bfloat16


def test_flux_predict_hands_the_transformer_tensors_on_the_latents_device():
    """``guidance``, ``txt_ids`` and ``img_ids`` are built inside ``Flux.predict``."""
    from diffusers_zero3.families import FLUX

    seen = {}

    def transformer(**kwargs):
        seen.update({k: v for k, v in kwargs.items() if torch.is_tensor(v)})
        return (kwargs["hidden_states"] * 1.0,)

    transformer.config = SimpleNamespace(guidance_embeds=True)
    cond = {
        "encoder_hidden_states": torch.empty(2, 7, 32, device=META),
        "pooled_projections": torch.empty(2, 16, device=META),
    }
    latents = torch.empty(2, 4, 8, 6, device=META)
    out = FLUX.predict(transformer, latents, torch.empty(2, device=META), cond, guidance_scale=3.5)
    assert {"guidance", "txt_ids", "img_ids", "timestep", "hidden_states"} <= set(seen)
    _on_meta(out, *seen.values())
    assert out.shape == latents.shape


# ------------------------------------------------------------------------ dpo.py


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_loss_and_metrics_stay_on_the_losses_device(loss_type):
    from diffusers_zero3.recipes.dpo import dpo_loss

    loss, metrics = dpo_loss(torch.empty(6, device=META), torch.empty(6, device=META), 50.0, loss_type)
    _on_meta(loss, *metrics.values())


# ------------------------------------------------------------------------ lockstep.py


class _TwoRanks:
    """``lockstep``'s collectives for a 2-rank world played in one process: rank 0 holds one
    item, rank 1 none, so rank 1 pads with a dummy borrowed from rank 0."""

    def __init__(self, monkeypatch):
        import diffusers_zero3.runtime.lockstep as lockstep

        self.rank, self.sent = 0, None
        monkeypatch.setattr(lockstep, "get_rank", lambda: self.rank)
        monkeypatch.setattr(lockstep, "all_gather_ints", lambda values: [[1], [0]])
        monkeypatch.setattr(lockstep, "all_gather_object", self._all_gather_object)

    def _all_gather_object(self, obj):
        if self.rank == 0:
            self.sent = obj
            return [obj, None]
        return [self.sent, obj]

    def run(self, item: torch.Tensor) -> torch.Tensor:
        """Both ranks' ``lockstep_map``; returns what rank 1's dummy call received."""
        from diffusers_zero3.runtime.lockstep import lockstep_map

        got = []
        self.rank = 0
        assert len(lockstep_map(lambda x: x, [item])) == 1
        self.rank = 1
        assert lockstep_map(got.append, []) == []
        assert len(got) == 1
        return got[0]


def test_lockstep_dummy_lands_on_the_senders_device_type(monkeypatch):
    item = torch.empty(2, 3, device=META, requires_grad=True)
    dummy = _TwoRanks(monkeypatch).run(item)
    _on_meta(dummy)
    assert dummy.shape == item.shape


def test_lockstep_dummy_for_a_cpu_model_stays_on_the_cpu_on_a_gpu_host(monkeypatch):
    """A reward model held on the CPU of a GPU host: the dummy must not go to the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    item = torch.arange(6.0).view(2, 3)
    dummy = _TwoRanks(monkeypatch).run(item)
    assert dummy.device == torch.device("cpu")
    torch.testing.assert_close(dummy, item)
