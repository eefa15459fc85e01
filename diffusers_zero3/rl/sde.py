"""One stochastic sampling step of a flow-matching model, with the log-probability of its result.

Flow-GRPO (arXiv:2505.05470; yifan123/flow_grpo, ``flow_grpo/diffusers_patch/
sd3_sde_with_logprob.py``, ``sde_step_with_logprob``) turns the deterministic Euler step of
diffusers' ``FlowMatchEulerDiscreteScheduler`` into an SDE step with the same marginals, so that
each step is a Gaussian policy whose log-probability a policy-gradient loss can use. With
``sigma`` the current noise level, ``dt = sigma_next - sigma < 0`` and ``v`` the predicted
velocity::

    std_dev_t = noise_level * sqrt(sigma / (1 - sigma))
    mean      = sample + (v + std_dev_t**2 / (2 * sigma) * (sample + (1 - sigma) * v)) * dt
    prev      = mean + std_dev_t * sqrt(-dt) * N(0, I)

``sampler="cps"`` is Coefficients-Preserving Sampling (arXiv 2509.05952; flow_grpo's
``sde_type == "cps"``): the step's noise is ``std = sigma_next * sin(noise_level * pi / 2)`` and
its mean keeps the coefficients of the clean and noise estimates::

    x0_hat = sample - sigma * v;   x1_hat = sample + (1 - sigma) * v
    mean   = (1 - sigma_next) * x0_hat + sqrt(sigma_next**2 - std**2) * x1_hat
    prev   = mean + std * N(0, I)

with the reference's log-probability ``-(prev - mean)**2`` (its constants and variance dropped:
they cancel in a policy ratio of one step), averaged like the SDE's. At ``noise_level=0`` both
samplers are the Euler step.

The reference's scheduler sigmas start at exactly 1 (``sigma / (1 - sigma)`` would divide by
zero), so where ``sigma == 1`` it puts ``sigmas[1]`` in the denominator: the *second* sigma of
the schedule, which it calls ``sigma_max``. The step here puts ``sigma_next`` there, which is
that value wherever sigma is 1 at a schedule's first step (every ``FlowMatchEulerDiscreteScheduler``
schedule, and the Wan schedule a GRPO round samples at). The last step (``sigma_next == 0``) needs nothing
special: ``dt = -sigma``.
"""

from __future__ import annotations

import math

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the rl functions compute in: float32 for bf16 / fp16 / fp32 inputs (the reference casts everything to float32: bf16
    can overflow in the mean, says its comment), float64 kept as it is."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def per_sample(value: float | torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (a number, a 0-d tensor, one per sample ``[B]``, or already ``[B, 1, ...]``) as a
    tensor on ``like``'s device that broadcasts over ``like`` (``[B or 1, 1, ..., 1]``).

    Example:
        >>> per_sample(torch.tensor([0.5, 0.25]), torch.zeros(2, 4, 3, 8, 8), torch.float32).shape
        torch.Size([2, 1, 1, 1, 1])
    """
    t = torch.as_tensor(value, dtype=dtype, device=like.device)
    trailing = [1] * (like.ndim - 1)
    if t.ndim == 0:
        return t.reshape(1, *trailing)
    if t.ndim == 1:
        if t.shape[0] not in (1, like.shape[0]):
            raise ValueError(f"{t.shape[0]} values for a batch of {like.shape[0]}")
        return t.reshape(-1, *trailing)
    if t.ndim == like.ndim and all(n == 1 for n in t.shape[1:]):
        return t
    raise ValueError(f"a per-sample value of shape {tuple(t.shape)} for samples of shape {tuple(like.shape)}")


def _standard_normal(
    like: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None
) -> torch.Tensor:
    """Standard normal noise shaped like ``like``, on its device, drawn as diffusers'
    ``randn_tensor`` does (a generator per sample when given a list; a generator on another
    device than ``like``, e.g. a CPU generator for CUDA latents, draws there and moves)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != like.shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {like.shape[0]}")
        # on each generator's device (CPU ones: the draws are moved), one sample each
        draws = [
            torch.randn((1, *like.shape[1:]), generator=g, device=g.device, dtype=like.dtype)
            for g in generator
        ]
        return torch.cat([d.to(like.device) for d in draws])
    if generator is not None and generator.device != like.device:
        # CPU (the generator's device): a CPU generator cannot draw on another device
        return torch.randn(like.shape, generator=generator, device=generator.device, dtype=like.dtype).to(
            like.device
        )
    return torch.randn(like.shape, generator=generator, device=like.device, dtype=like.dtype)


def sde_step_with_logprob(
    model_output: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    sample: torch.Tensor,
    *,
    noise_level: float,
    noise: torch.Tensor | torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    sampler: str = "sde",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SDE step from ``sigma`` to ``sigma_next`` and the log-probability of its result, as
    Flow-GRPO's ``sde_step_with_logprob`` (see the module docstring for the formulas).

    The step is a Gaussian ``N(mean, (std_dev_t * sqrt(sigma - sigma_next))**2)`` per element;
    ``log_prob`` is its log-density at ``prev_sample``, averaged over every dimension but the
    batch (images ``[B, C, H, W]`` and videos ``[B, C, F, H, W]`` alike), as the reference does.
    ``prev_sample`` enters the log-probability detached: gradients flow through the mean only.

    Sampling (``prev_sample=None``) takes the step's ``noise``, or draws it with the generator
    ``noise`` gives (one, or one per sample: Flow-GRPO's ``generator``);
    scoring a stored trajectory passes the stored ``prev_sample``. ``noise_level=0`` is the plain
    Euler step (``log_prob`` is then not finite).

    Inputs in bf16 or fp16 are computed in float32, as the reference does (its comment: bf16 can
    overflow in the mean); every output is float32 then (float64 inputs stay float64, where the
    reference would cast them to float32). Every output is on ``sample``'s device; sigmas given
    on another device are moved there.

    Args:
        model_output: The predicted velocity ``v``, shaped like ``sample``.
        sigma: The current sigma: a number, a 0-d tensor, or one per sample (``[B]``). It must be
            above 0.
        sigma_next: The next (smaller) sigma, likewise; 0 at the last step.
        sample: The current latents ``x_sigma``, ``[B, ...]``.
        noise_level: Flow-GRPO's ``a`` (``config.sample.noise_level``, 0.7 in its configs).
        prev_sample: The next latents to score instead of sampling them.
        noise: When sampling, the standard normal draw of the step (shaped like ``sample``: e.g. a
            trajectory's noise drawn up front and copied to the device at once), or the
            generator(s) to draw it with (one, or a list of one per sample); None: the global RNG.
        sampler: ``"sde"`` (Flow-GRPO's) or ``"cps"`` (coefficients-preserving; see the module
            docstring). With ``"cps"`` the returned ``std_dev_t`` is the step's own standard
            deviation and ``log_prob`` is the reference's ``-mean((prev - mean)**2)``.

    Returns:
        ``(prev_sample, log_prob, prev_sample_mean, std_dev_t)``: the next latents, ``[B]``
        log-probabilities, the step's mean, and ``std_dev_t`` (shaped ``[B or 1, 1, ..., 1]``,
        without the ``sqrt(-dt)`` factor, as the reference returns it).

    Example:
        >>> scheduler.set_timesteps(10)
        >>> sigmas = scheduler.sigmas  # 1.0, ..., 0.0
        >>> x, _, _, _ = sde_step_with_logprob(v, sigmas[0], sigmas[1], x, noise_level=0.7, noise=g)
        >>> # later, the trained policy's log-probability of the same step
        >>> _, log_prob, mean, std = sde_step_with_logprob(v_new, s, s_next, x_old, noise_level=0.7, prev_sample=x)
    """
    dtype = compute_dtype(model_output, sample)
    model_output = model_output.to(dtype)
    sample = sample.to(dtype)
    sigma = per_sample(sigma, sample, dtype)
    sigma_next = per_sample(sigma_next, sample, dtype)

    if sampler == "cps":
        std_dev_t = sigma_next * math.sin(noise_level * math.pi / 2)
        x0_hat = sample - sigma * model_output
        x1_hat = sample + (1 - sigma) * model_output
        prev_sample_mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std_dev_t**2) * x1_hat
        step_std = std_dev_t  # the step's own standard deviation
    elif sampler == "sde":
        dt = sigma_next - sigma  # negative: sigma decreases towards the data
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_next, sigma))) * noise_level
        drift_gain = std_dev_t**2 / (2 * sigma)
        prev_sample_mean = sample * (1 + drift_gain * dt) + model_output * (1 + drift_gain * (1 - sigma)) * dt
        step_std = std_dev_t * torch.sqrt(-dt)  # the step's own standard deviation
    else:
        raise ValueError(f"unknown sampler {sampler!r}: sde or cps")

    if prev_sample is None:
        if not torch.is_tensor(noise):  # a generator, a list of them, or None: drawn here
            noise = _standard_normal(prev_sample_mean, noise)
        prev_sample = prev_sample_mean + step_std * noise.to(device=sample.device, dtype=dtype)
    else:
        prev_sample = prev_sample.to(device=sample.device, dtype=dtype)

    if sampler == "cps":  # the reference's: its constants and variance dropped
        log_density = -((prev_sample.detach() - prev_sample_mean) ** 2)
    else:
        log_density = (
            -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * step_std**2)
            - torch.log(step_std)
            - _LOG_SQRT_2PI
        )
    log_prob = log_density.mean(dim=tuple(range(1, log_density.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t
