"""``rl.schedules`` and the trainer's CFG against transcriptions of the references' code:
DiffusionNFT's ``return_decay`` and per-sample timestep permutation (``train_nft_sd3.py``),
flow_grpo's ``EMAModuleWrapper`` (``flow_grpo/ema.py``), its zero-advantage filter and its
detached unconditional branch (``train_sd3.py``, ``compute_log_prob``)."""

from __future__ import annotations

import collections

import pytest
import torch

from diffusers_zero3.rl import (
    kept_sample_weight,
    nft_old_decay,
    reference_ema_decay,
    reference_ema_updates,
    trained_timestep_indices,
)

pytestmark = pytest.mark.unit


def _return_decay(step, decay_type):  # DiffusionNFT, scripts/train_nft_sd3.py, as written there
    if decay_type == 0:
        flat, uprate, uphold = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, uprate, uphold = 0, 0.001, 0.5
    elif decay_type == 2:
        flat, uprate, uphold = 75, 0.0075, 0.999
    else:
        raise AssertionError
    if step < flat:
        return 0.0
    decay = (step - flat) * uprate
    return min(decay, uphold)


@pytest.mark.parametrize("decay_type", [0, 1, 2])
def test_nft_old_decay_is_return_decay(decay_type):
    steps = [0, 1, 2, 74, 75, 76, 100, 208, 499, 500, 501, 1000, 10_000]
    assert [nft_old_decay(s, decay_type) for s in steps] == [_return_decay(s, decay_type) for s in steps]
    assert nft_old_decay(1000, decay_type) == {0: 0.0, 1: 0.5, 2: 0.999}[decay_type]  # positive control


class _EMAModuleWrapper:  # flow_grpo/ema.py, the parts that average (step, get_current_decay)
    def __init__(self, parameters, decay, update_step_interval):
        self.ema_parameters = [p.clone().detach() for p in parameters]
        self.decay, self.update_step_interval = decay, update_step_interval

    def get_current_decay(self, optimization_step):
        return min((1 + optimization_step) / (10 + optimization_step), self.decay)

    @torch.no_grad()
    def step(self, parameters, optimization_step):
        one_minus_decay = 1 - self.get_current_decay(optimization_step)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters, strict=True):
                ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


@pytest.mark.parametrize("every", [1, 8])
def test_the_trainers_ema_is_the_references(every):
    """``ShardedEMA.update`` driven as ``GRPOTrainer._update_ema`` drives it equals flow_grpo's
    ``EMAModuleWrapper`` over 40 optimizer steps of a moving model (8: flow_grpo's interval, 1:
    DiffusionNFT's); diffusers' schedule (``ShardedEMA.step``) is not (positive control)."""
    from diffusers_zero3.state.ema import ShardedEMA

    model = torch.nn.Linear(4, 3)
    ours, diffusers_schedule = ShardedEMA(model), ShardedEMA(model)
    reference = _EMAModuleWrapper(model.parameters(), decay=0.9, update_step_interval=every)
    g = torch.Generator().manual_seed(0)
    for step in range(1, 41):  # the optimizer step count after each step, as the references pass it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        if reference_ema_updates(step, every):
            ours.update(reference_ema_decay(step, 0.9))
        diffusers_schedule.step()
        reference.step(list(model.parameters()), step)
    for mine, theirs, other in zip(ours.shadow, reference.ema_parameters, diffusers_schedule.shadow):
        torch.testing.assert_close(mine.view_as(theirs), theirs, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(other.view_as(theirs), theirs, atol=1e-3)


def test_timestep_subsets():
    assert trained_timestep_indices(10, 4, "first").tolist() == [0, 1, 2, 3]
    # random: the first k of a permutation drawn with the generator (DiffusionNFT's
    # torch.randperm(num_timesteps)[:num_train_timesteps] per sample)
    g = torch.Generator().manual_seed(7)
    want = torch.randperm(10, generator=torch.Generator().manual_seed(7))[:4]
    assert trained_timestep_indices(10, 4, "random", g).tolist() == want.tolist()
    # over many samples every step is trained, the least-noisy ones too ("first" never trains 9)
    seen = collections.Counter(
        i
        for s in range(200)
        for i in trained_timestep_indices(10, 4, "random", torch.Generator().manual_seed(s)).tolist()
    )
    assert set(seen) == set(range(10)) and min(seen.values()) > 40, seen
    with pytest.raises(ValueError):
        trained_timestep_indices(3, 4, "first")


def test_zero_advantage_filter_is_flow_grpos_mean_over_the_kept():
    """flow_grpo drops the samples whose advantages are all 0 and re-batches the rest
    (``num_batches`` micro-batches of ``kept / num_batches``), each micro-batch's loss a mean;
    the weights here, summed over a rank's fixed micro-batches of ``--train_batch_size``, give
    the same total (the loss of each kept sample weighs ``num_batches / kept``)."""
    advantages = torch.tensor([0.7, 0.0, -1.2, 0.0, 0.5, 0.0, 0.9, 0.0])  # 4 of 8 kept
    real = torch.ones(8, dtype=torch.bool)
    per_sample = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])  # any per-sample losses
    batch_size, num_batches = 4, 2  # the rank's 8 samples: 2 micro-batches
    weight = kept_sample_weight(advantages, real, filter_zero=True)
    ours = sum(
        (weight[i : i + batch_size] * per_sample[i : i + batch_size]).sum() / batch_size for i in (0, 4)
    )
    # the reference: samples[mask], re-batched into num_batches micro-batches, a mean each
    kept = per_sample[advantages.abs() != 0]
    reference = sum(chunk.mean() for chunk in kept.reshape(num_batches, -1))
    assert ours.item() == pytest.approx(reference.item())
    # positive control: without the filter the zero-advantage samples dilute the mean
    unfiltered = kept_sample_weight(advantages, real, filter_zero=False)
    assert sum(
        (unfiltered[i : i + 4] * per_sample[i : i + 4]).sum() / 4 for i in (0, 4)
    ).item() != pytest.approx(reference.item())
    # dummies weigh nothing and leave the kept samples' mean as the real samples' count sets it
    real[6:] = False
    assert kept_sample_weight(advantages, real, filter_zero=True).tolist() == [2.0, 0, 2.0, 0, 2.0, 0, 0, 0]
    # no filter: every real sample weighs 1, dummies 0; a rank that keeps none weighs nothing
    assert kept_sample_weight(advantages, real, filter_zero=False).tolist() == [1.0] * 6 + [0.0] * 2
    assert kept_sample_weight(torch.zeros(4), torch.ones(4, dtype=torch.bool), True).sum() == 0


def test_training_cfg_detaches_the_unconditional_branch():
    """``GRPOTrainer._velocity(train=True)``: the gradient of the guided velocity is flow_grpo's
    (``noise_pred_uncond.detach()``), ``--train_guidance_scale`` is the scale used, and sampling
    (``train=False``) runs at ``--guidance_scale`` with both branches live. A real tiny SD3
    transformer, on the CPU."""
    from types import SimpleNamespace

    from diffusers import SD3Transformer2DModel

    from diffusers_zero3.families import SD3
    from diffusers_zero3.recipes.grpo import GRPOTrainer

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
    )  # fmt: skip
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.args = SimpleNamespace(guidance_scale=4.5, train_guidance_scale=3.0)
    trainer.family, trainer.dtype, trainer.guidance_embeds = SD3, torch.float32, False
    cond = {"encoder_hidden_states": torch.randn(2, 5, 16), "pooled_projections": torch.randn(2, 8)}
    uncond = {"encoder_hidden_states": torch.randn(2, 5, 16), "pooled_projections": torch.randn(2, 8)}
    batch = SimpleNamespace(cond=cond, uncond=uncond)
    x, sigma, rows = torch.randn(2, 4, 8, 8), torch.tensor([0.7, 0.4]), slice(0, 2)
    direction = torch.randn(2, 4, 8, 8)

    def grads(fn):
        model.zero_grad()
        (fn() * direction).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    def branch(c):
        return model(hidden_states=x, timestep=sigma * 1000, return_dict=False, **c)[0]

    def reference(scale):  # flow_grpo's compute_log_prob
        noise_pred_uncond, noise_pred_text = branch(uncond).detach(), branch(cond)
        return noise_pred_uncond + scale * (noise_pred_text - noise_pred_uncond)

    ours = grads(lambda: trainer._velocity(model, x, sigma, batch, rows, train=True))
    torch.testing.assert_close(ours, grads(lambda: reference(3.0)), rtol=1e-4, atol=1e-6)
    # positive controls: the sampling scale, and both branches live, give other gradients
    assert not torch.allclose(ours, grads(lambda: reference(4.5)), rtol=1e-3, atol=1e-6)
    live = grads(lambda: branch(uncond) + 3.0 * (branch(cond) - branch(uncond)))
    assert not torch.allclose(ours, live, rtol=1e-3, atol=1e-6)
    with torch.no_grad():
        sampled = trainer._velocity(model, x, sigma, batch, rows)
        torch.testing.assert_close(sampled, branch(uncond) + 4.5 * (branch(cond) - branch(uncond)))


def test_a_trajectorys_noise_drawn_up_front_is_the_step_by_steps():
    """``GRPOTrainer.sample_round`` draws each sample's initial latents and every step's noise up
    front (one copy to the device) instead of per step: the same trajectories, to the bit, as
    ``sde_step_with_logprob`` drawing from each sample's generator at each step."""
    from diffusers_zero3.recipes.grpo import sample_generator
    from diffusers_zero3.rl import sde_step_with_logprob

    shape, steps, sigmas = (4, 8, 8), 3, torch.tensor([1.0, 0.6, 0.3, 0.0])
    pairs = [(0, 0), (0, 1), (2, 1)]

    def velocity(x):
        return -0.5 * x + 0.1

    gens = [sample_generator(0, 0, p, m) for p, m in pairs]
    x = torch.cat([torch.randn(1, *shape, generator=g) for g in gens])
    per_step = []
    for i in range(steps):
        x, lp, _, _ = sde_step_with_logprob(
            velocity(x), sigmas[i], sigmas[i + 1], x, noise_level=0.7, noise=gens
        )
        per_step.append((x, lp))
    gens = [sample_generator(0, 0, p, m) for p, m in pairs]
    x = torch.cat([torch.randn(1, *shape, generator=g) for g in gens])
    noise = torch.stack(
        [torch.cat([torch.randn(1, *shape, generator=g) for _ in range(steps)]) for g in gens]
    )
    for i in range(steps):
        x, lp, _, _ = sde_step_with_logprob(
            velocity(x), sigmas[i], sigmas[i + 1], x, noise_level=0.7, noise=noise[:, i]
        )
        assert torch.equal(x, per_step[i][0]) and torch.equal(lp, per_step[i][1]), i
    # positive control: another sample's noise gives another trajectory
    x2, _, _, _ = sde_step_with_logprob(
        velocity(x), sigmas[0], sigmas[1], x, noise_level=0.7, noise=noise[:, 0].flip(0)
    )
    x1, _, _, _ = sde_step_with_logprob(
        velocity(x), sigmas[0], sigmas[1], x, noise_level=0.7, noise=noise[:, 0]
    )
    assert not torch.equal(x1, x2)


def _cps_step(sample, model_output, sigma, sigma_prev, noise_level, variance_noise):
    """flow_grpo's ``sde_step_with_logprob`` branch ``sde_type == "cps"``, as written there (fp32)."""
    import math

    model_output, sample = model_output.float(), sample.float()
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)  # sigma_t in paper
    pred_original_sample = sample - sigma * model_output  # predicted x_0 in paper
    noise_estimate = sample + model_output * (1 - sigma)  # predicted x_1 in paper
    prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(
        sigma_prev**2 - std_dev_t**2
    )
    prev_sample = prev_sample_mean + std_dev_t * variance_noise
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)  # remove all constants
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cps_step_is_flow_grpos(dtype):
    from diffusers_zero3.rl import sde_step_with_logprob

    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(3, 4, 8, 8, generator=g).to(dtype) for _ in range(3))
    for sigma, sigma_next in [(1.0, 0.8), (0.5, 0.3), (0.2, 0.0)]:
        s, s_next = torch.tensor(sigma), torch.tensor(sigma_next)
        ours = sde_step_with_logprob(v, s, s_next, x, noise_level=0.8, noise=noise, sampler="cps")
        theirs = _cps_step(x, v, s, s_next, 0.8, noise.float())
        for a, b in zip(ours[:3], theirs[:3]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        # scoring the sampled step gives the same log-probability (0: the sample is the mean + noise)
        _, lp, _, _ = sde_step_with_logprob(
            v, s, s_next, x, noise_level=0.8, prev_sample=ours[0], sampler="cps"
        )
        torch.testing.assert_close(lp, theirs[1], rtol=1e-6, atol=1e-6)
    # at noise level 0 both samplers are the Euler step; positive control: the SDE differs at 0.8
    s, s_next = torch.tensor(0.6), torch.tensor(0.4)
    euler = x.float() + (s_next - s) * v.float()
    for sampler in ("sde", "cps"):
        step = sde_step_with_logprob(v, s, s_next, x, noise_level=0.0, noise=noise, sampler=sampler)[0]
        torch.testing.assert_close(step, euler, rtol=1e-6, atol=1e-6)
    sde = sde_step_with_logprob(v, s, s_next, x, noise_level=0.8, noise=noise)[0]
    cps = sde_step_with_logprob(v, s, s_next, x, noise_level=0.8, noise=noise, sampler="cps")[0]
    assert not torch.allclose(sde, cps, atol=1e-3)


def test_sde_window_is_flow_grpos():
    """``rl.sde_window`` against flow_grpo's ``start = random.randint(range[0], range[1] -
    size)``: the same window from the same generator state; every start reachable."""
    import random

    from diffusers_zero3.recipes.grpo import round_window
    from diffusers_zero3.rl import sde_window

    for seed in range(50):
        a, b = random.Random(seed), random.Random(seed)
        start = b.randint(1, 8 - 3)
        assert sde_window(3, (1, 8), a) == (start, start + 3)
    starts = {round_window(0, r, 2, (0, 6))[0] for r in range(200)}
    assert starts == {0, 1, 2, 3, 4}, starts  # (0, 6) with 2 steps: starts 0..4
    assert round_window(0, 7, 2, (0, 6)) == round_window(0, 7, 2, (0, 6))  # per (seed, round)
    with pytest.raises(ValueError):
        sde_window(4, (0, 3), random.Random(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guard_log_ratio_is_grpo_guards(dtype):
    """``rl.guard_log_ratio`` against GRPO-Guard's ratio as Flow-GRPO trainers write it
    (Flow-Factory's ``GRPOGuardTrainer``: ``exp((log_prob - old_log_prob) * scale + mse / (2 *
    scale))``, ``scale = sqrt(-dt) * std_dev_t``), on the trainer's own SDE steps; and what it is
    for: over many draws from the old policy the plain log-ratio's mean is ``-mse / (2 s**2)``
    (negative: the bias RatioNorm removes), the guarded one's about 0."""
    from diffusers_zero3.rl import guard_log_ratio, sde_step_with_logprob

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, 8, 8, generator=g).to(dtype)
    v_old = torch.randn(256, 4, 8, 8, generator=g).to(dtype)
    v_new = (v_old.float() + 0.3 * torch.randn(256, 4, 8, 8, generator=g)).to(dtype)
    sigma, sigma_next = torch.tensor(0.6), torch.tensor(0.5)
    sampled, old_lp, old_mean, _ = sde_step_with_logprob(
        v_old, sigma, sigma_next, x, noise_level=0.7, noise=g
    )
    _, new_lp, new_mean, std = sde_step_with_logprob(
        v_new, sigma, sigma_next, x, noise_level=0.7, prev_sample=sampled
    )
    scale_factor = torch.sqrt(sigma - sigma_next) * std  # sqrt(-dt) * std_dev_t
    mse = (new_mean - old_mean).flatten(1).pow(2).mean(dim=1)
    reference = (new_lp - old_lp) * scale_factor.reshape(-1) + mse / (2 * scale_factor.reshape(-1))
    ours = guard_log_ratio(new_lp, old_lp, new_mean, old_mean, scale_factor)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)
    s2 = (scale_factor.reshape(-1) ** 2).item()
    plain = new_lp - old_lp
    assert plain.mean().item() == pytest.approx(-(mse / (2 * s2)).mean().item(), rel=0.1)
    assert abs(ours.mean().item()) < 0.2 * abs(plain.mean().item()) * scale_factor.item()
    assert torch.equal(guard_log_ratio(old_lp, old_lp, old_mean, old_mean, scale_factor), torch.zeros(256))
