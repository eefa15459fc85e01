"""Precision of online RL whatever the training dtype (issue 50, item 5): the denoiser gets its
timestep in fp32 as the pipelines give it, and the built-in rewards score in fp32.

A bf16 run rounded ``sigma * 1000`` to bf16 before the model saw it (999.5 -> 1000: bf16 has
steps of 4 between 512 and 1024), and scored with reward models cast to bf16, whose outputs
round in steps of 0.125 near PickScore's 21.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffusers_zero3.families import FAMILY_NAMES
from diffusers_zero3.recipes.grpo import GRPOTrainer


class _RecordingTransformer(torch.nn.Module):
    """Stands in for ``SD3Transformer2DModel``: records the ``timestep`` it is called with."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros((), dtype=torch.bfloat16))
        self.timesteps: list[torch.Tensor] = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict):
        self.timesteps.append(timestep)
        return (hidden_states * self.weight,)


@pytest.mark.unit
@pytest.mark.parametrize("cfg", [False, True])
def test_a_bf16_run_gives_the_denoiser_its_timestep_in_fp32(cfg):
    """``GRPOTrainer._velocity`` (sampling, the GRPO loss and NFT's points all call it) in a bf16
    run: sigma 0.9995 reaches SD3's transformer as 999.5 in fp32, as ``StableDiffusion3Pipeline``
    passes the scheduler's fp32 timesteps (it reached it as 1000.0 in bf16)."""
    model = _RecordingTransformer()
    cond = {"encoder_hidden_states": torch.zeros(2, 3, 4), "pooled_projections": torch.zeros(2, 4)}
    trainer = SimpleNamespace(
        family=FAMILY_NAMES["sd3"], dtype=torch.bfloat16, guidance_embeds=False,
        args=SimpleNamespace(guidance_scale=4.5),
    )  # fmt: skip
    batch = SimpleNamespace(
        cond=cond, uncond={k: torch.ones_like(v) for k, v in cond.items()} if cfg else None
    )
    sigma = torch.tensor([0.9995, 0.25])
    v = GRPOTrainer._velocity(trainer, model, torch.randn(2, 4, 2, 2), sigma, batch, slice(0, 2))
    assert v.dtype == torch.float32 and v.shape == (2, 4, 2, 2)
    (t,) = model.timesteps
    assert t.dtype == torch.float32
    expected = torch.tensor([999.5, 250.0])
    assert torch.equal(t, torch.cat([expected, expected]) if cfg else expected)
