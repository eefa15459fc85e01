"""The training losses of online RL for flow-matching models: Flow-GRPO's clipped policy gradient
with its KL to the reference model, and DiffusionNFT's negative-aware fine-tuning loss.

* Flow-GRPO (yifan123/flow_grpo, ``scripts/train_sd3.py``, the training loop): advantages
  clamped to ``[-adv_clip_max, adv_clip_max]``, ``ratio = exp(log_prob - old_log_prob)``, PPO's
  clipped surrogate ``mean(max(-A * ratio, -A * clamp(ratio, 1 - clip_range, 1 + clip_range)))``,
  plus ``beta`` times a KL to the reference model (the LoRA with its adapters disabled) formed
  from the two SDE steps' means: ``mean((mean - ref_mean)**2) / (2 * std_dev_t**2)`` per sample.
  That divides by ``std_dev_t**2``, not by the step's variance ``std_dev_t**2 * (sigma -
  sigma_next)``: it is the Gaussian KL of the step times the step size ``|dt|``, averaged over
  elements.
* DiffusionNFT (NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py``, the training loop): no
  likelihoods; the reward becomes an optimality probability ``r`` in [0, 1], and the trained
  velocity ``v`` and the old policy's ``v_old`` define an implicit positive and negative policy,
  ``v+ = beta * v + (1 - beta) * v_old`` and ``v- = (1 + beta) * v_old - beta * v``. Each is
  scored by the error of its clean-image prediction ``x0_hat = x_t - sigma * v±`` against the
  sampled image, divided by that error's own mean absolute value (detached: an adaptive
  weight), and the loss is ``adv_clip_max * mean(r * L+ + (1 - r) * L-) / beta``, plus a second
  beta (``config.train.beta``, not the ``config.beta`` above) times ``mean((v - v_ref)**2)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .sde import compute_dtype, per_sample

NftAdvantageMode = Literal["all", "positive_only", "negative_only", "one_only", "binary"]


def _mean_over_non_batch(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def sde_kl(
    prev_sample_mean: torch.Tensor, ref_prev_sample_mean: torch.Tensor, std_dev_t: float | torch.Tensor
) -> torch.Tensor:
    """Flow-GRPO's per-sample KL term between the trained policy's SDE step and the reference
    model's: ``mean((prev_sample_mean - ref_prev_sample_mean)**2) / (2 * std_dev_t**2)``.

    The mean runs over every dimension but the batch (the reference's ``dim=(1, 2, 3)`` for
    images; videos too here). ``std_dev_t`` is ``sde_step_with_logprob``'s (the same for both
    models: it depends on sigma only). As in the reference this is the Gaussian KL of one step
    times the step size ``sigma - sigma_next``; compute the reference's mean under
    ``torch.no_grad()`` as the reference does. Computed in float32 for bf16 / fp16 inputs.

    Args:
        prev_sample_mean: The trained policy's step mean, ``[B, ...]``.
        ref_prev_sample_mean: The reference model's step mean for the same input.
        std_dev_t: ``[B or 1, 1, ..., 1]``, ``[B]`` or a number.

    Returns:
        ``[B]`` KL terms; ``grpo_loss`` averages them.

    Example:
        >>> _, log_prob, mean, std = sde_step_with_logprob(v, s, s_next, x, noise_level=0.7, prev_sample=x_next)
        >>> with torch.no_grad():
        ...     _, _, ref_mean, _ = sde_step_with_logprob(v_ref, s, s_next, x, noise_level=0.7, prev_sample=x_next)
        >>> kl = sde_kl(mean, ref_mean, std)
    """
    dtype = compute_dtype(prev_sample_mean, ref_prev_sample_mean)
    difference = prev_sample_mean.to(dtype) - ref_prev_sample_mean.to(dtype)
    std = per_sample(std_dev_t, difference, dtype).reshape(-1)
    return _mean_over_non_batch(difference**2) / (2 * std**2)


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO's loss for one denoising step of a batch: PPO's clipped surrogate on the
    advantages clamped to ``adv_clip_max``, plus ``kl_beta`` times the mean KL term.

    Computed in float32 for bf16 / fp16 inputs (an ``exp`` of a bf16 difference is coarse); the
    reference's loss is float64 there, because its advantages come from numpy.

    Args:
        log_prob: ``[B]`` log-probabilities of the stored steps under the trained policy
            (``sde_step_with_logprob(..., prev_sample=stored)``).
        old_log_prob: ``[B]`` the same under the sampling policy (stored while sampling).
        advantages: ``[B]`` advantages (``gather_group_advantages``).
        clip_range: PPO's epsilon (``config.train.clip_range``, 1e-4 in Flow-GRPO's configs).
        adv_clip_max: Advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5 there).
        kl: ``[B]`` (or a 0-d mean of) ``sde_kl`` terms; needed when ``kl_beta > 0``.
        kl_beta: The KL weight (``config.train.beta``); 0 leaves the KL out of the loss, as the
            reference does (the stats report it when given).
        log_ratio: ``[B]`` log policy ratios to use instead of ``log_prob - old_log_prob``
            (e.g. GRPO-Guard's, ``guard_log_ratio``).

    Returns:
        ``(loss, stats)``; the stats are detached 0-d tensors: ``policy_loss``, ``kl_loss`` (0
        without ``kl``), ``approx_kl`` (``0.5 * mean((log_prob - old_log_prob)**2)``),
        ``clipfrac`` (the fraction of ratios outside ``1 ± clip_range``), and
        ``clipfrac_gt_one`` / ``clipfrac_lt_one`` (above / below it).

    Example:
        >>> loss, stats = grpo_loss(log_prob, old_log_prob, advantages, clip_range=1e-4, adv_clip_max=5.0,
        ...                         kl=sde_kl(mean, ref_mean, std), kl_beta=0.04)
        >>> loss.backward()
    """
    if kl_beta and kl is None:
        raise ValueError("kl_beta > 0 needs the kl terms (sde_kl)")
    dtype = compute_dtype(log_prob, old_log_prob, advantages)
    if log_ratio is None:
        log_ratio = log_prob.to(dtype) - old_log_prob.to(dtype)
    log_ratio = log_ratio.to(dtype)
    ratio = torch.exp(log_ratio)
    advantages = advantages.to(dtype).clamp(-adv_clip_max, adv_clip_max)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl_loss = kl.to(dtype).mean() if kl is not None else torch.zeros((), dtype=dtype, device=log_prob.device)
    loss = policy_loss + kl_beta * kl_loss if kl_beta else policy_loss
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "kl_loss": kl_loss.detach(),
            "approx_kl": 0.5 * (log_ratio**2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).to(dtype).mean(),
            "clipfrac_gt_one": (ratio - 1.0 > clip_range).to(dtype).mean(),
            "clipfrac_lt_one": (1.0 - ratio > clip_range).to(dtype).mean(),
        }
    return loss, stats


def guard_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    step_std: torch.Tensor | float,
) -> torch.Tensor:
    """GRPO-Guard's re-centred and re-weighted log policy ratio of one SDE step (arXiv 2510.22319;
    as Flow-GRPO trainers implement it, e.g. Flow-Factory's ``GRPOGuardTrainer``):
    ``(log_prob - old_log_prob) * s + mean((mean - old_mean)**2) / (2 * s)`` with ``s`` the step's
    standard deviation (``std_dev_t * sqrt(sigma - sigma_next)``). The plain log-ratio of a step
    sampled from the old policy has the negative mean ``-|mean - old_mean|**2 / (2 s**2)``
    (elementwise mean); the second term removes it (RatioNorm), and the factor ``s`` evens out the
    steps' gradients (small at the low-noise steps, whose ``1 / s**2`` would dominate). Computed in
    float32 for bf16 / fp16 inputs.

    Args:
        log_prob: ``[B]`` the trained policy's ``sde_step_with_logprob`` log-probability.
        old_log_prob: ``[B]`` the sampling policy's (stored).
        mean: the trained policy's step mean ``[B, ...]``.
        old_mean: the sampling policy's step mean (stored while sampling).
        step_std: the step's standard deviation: a number, ``[B]`` or ``[B, 1, ...]``.

    Returns:
        ``[B]`` log-ratios (0 where the policies agree), for ``grpo_loss(..., log_ratio=...)``.
    """
    dtype = compute_dtype(log_prob, old_log_prob, mean, old_mean)
    mse = _mean_over_non_batch((mean.to(dtype) - old_mean.to(dtype)) ** 2)
    s = per_sample(step_std, mean, dtype).reshape(-1)
    return (log_prob.to(dtype) - old_log_prob.to(dtype)) * s + mse / (2 * s)


def nft_optimality(
    advantages: torch.Tensor, *, adv_clip_max: float, adv_mode: NftAdvantageMode = "all"
) -> torch.Tensor:
    """DiffusionNFT's optimality probability ``r`` in [0, 1] from the advantages:
    ``clamp(clamp(A, ±adv_clip_max) / adv_clip_max / 2 + 0.5, 0, 1)``.

    ``adv_mode`` is the reference's ``config.train.adv_mode`` ("all" in its configs), applied to
    the clamped advantages first: ``positive_only`` / ``negative_only`` zero the other sign,
    ``one_only`` maps positive ones to 1 and the rest to 0, ``binary`` takes their sign. Float32
    for bf16 / fp16 inputs.

    Example:
        >>> nft_optimality(torch.tensor([-10.0, 0.0, 2.5]), adv_clip_max=5.0)
        tensor([0.0000, 0.5000, 0.7500])
    """
    a = advantages.to(compute_dtype(advantages)).clamp(-adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        a = a.clamp(0, adv_clip_max)
    elif adv_mode == "negative_only":
        a = a.clamp(-adv_clip_max, 0)
    elif adv_mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif adv_mode == "binary":
        a = torch.sign(a)
    elif adv_mode != "all":
        raise ValueError(f"unknown adv_mode {adv_mode!r}")
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0, 1)


def _self_normalised_error(x0_prediction: torch.Tensor, x0: torch.Tensor, floor: float) -> torch.Tensor:
    """Per sample ``mean((x0_hat - x0)**2) / w`` with ``w = max(mean|x0_hat - x0|, floor)``
    detached: DiffusionNFT's adaptive weighting (the reference forms ``w`` in float64)."""
    error = x0_prediction - x0
    with torch.no_grad():
        weight = _mean_over_non_batch(error.detach().abs().to(torch.float64)).clamp(min=floor).to(error.dtype)
    return _mean_over_non_batch(error**2) / weight


@dataclass(frozen=True)
class NftSettings:
    """DiffusionNFT's loss settings (``nft_loss``).

    Args:
        beta: DiffusionNFT's guidance strength ``config.beta`` (1.0 by default, 0.1 in some of
            its configs); must be above 0.
        adv_clip_max: As in ``nft_optimality`` (5 in its configs); it also scales the loss.
        adv_mode: As in ``nft_optimality``.
        kl_beta: The KL weight (``config.train.beta``, 1e-4 in its configs).
        weight_floor: The adaptive weight's lower bound (the reference's 1e-5).

    Example:
        >>> NftSettings(beta=1.0, adv_clip_max=5.0, kl_beta=1e-4)
    """

    beta: float
    adv_clip_max: float
    adv_mode: NftAdvantageMode = "all"
    kl_beta: float = 0.0
    weight_floor: float = 1e-5


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: float | torch.Tensor,
    advantages: torch.Tensor,
    settings: NftSettings,
    *,
    v_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's loss for one noise level of a batch (see the module docstring).

    The reference noises the sampled clean latents afresh at each trained step,
    ``x_t = (1 - sigma) * x0 + sigma * noise``, and runs the trained model (``v_theta``), the
    old policy (``v_old``, no gradient; a LoRA adapter of its own there) and, for the KL, the
    reference model (``v_ref``: adapters disabled) on it. In x0 terms the positive loss is
    ``sigma * mean((v+ - (noise - x0))**2) / mean|v+ - (noise - x0)|``: the flow-matching error of
    the implicit positive policy, self-normalised; likewise the negative one.

    The velocities are combined in float32 for bf16 / fp16 inputs (the reference combines them
    in the autocast dtype, then promotes). ``v_old`` and ``v_ref`` are detached.

    Args:
        v_theta: The trained model's velocity at ``(x_t, sigma)``, ``[B, ...]``.
        v_old: The old (sampling) policy's velocity there.
        x_t: The noised latents the models saw.
        x0: The sampled clean latents (the end of the trajectory).
        sigma: The noise level of ``x_t`` (the reference's ``timesteps / 1000``), a number or
            ``[B]``.
        advantages: ``[B]`` advantages (``gather_group_advantages``).
        settings: ``beta``, ``adv_clip_max``, ``adv_mode``, ``kl_beta``, ``weight_floor``
            (``NftSettings``).
        v_ref: The reference model's velocity, for the KL term.

    Returns:
        ``(loss, stats)``; detached 0-d stats: ``policy_loss``, ``unweighted_policy_loss``
        (before the ``adv_clip_max`` factor), ``kl_loss`` (``mean((v_theta - v_ref)**2)``, 0
        without ``v_ref``), ``old_deviate`` (``mean((v_theta - v_old)**2)``).

    Example:
        >>> x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * torch.randn_like(x0)
        >>> with torch.no_grad():
        ...     v_old = old_policy(x_t, t)
        >>> settings = NftSettings(beta=1.0, adv_clip_max=5.0)
        >>> loss, stats = nft_loss(model(x_t, t), v_old, x_t, x0, t, advantages, settings)
    """
    beta, adv_clip_max, kl_beta = settings.beta, settings.adv_clip_max, settings.kl_beta
    if beta <= 0:
        raise ValueError(f"beta must be above 0, got {beta}")
    if kl_beta and v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref")
    dtype = compute_dtype(v_theta, v_old, x_t, x0)
    v_theta = v_theta.to(dtype)
    v_old = v_old.detach().to(dtype)
    x_t, x0 = x_t.to(dtype), x0.to(dtype)
    t = per_sample(sigma, x0, dtype)
    r = nft_optimality(advantages, adv_clip_max=adv_clip_max, adv_mode=settings.adv_mode).to(dtype)

    v_positive = beta * v_theta + (1 - beta) * v_old
    v_negative = (1 + beta) * v_old - beta * v_theta
    positive = _self_normalised_error(x_t - t * v_positive, x0, settings.weight_floor)
    negative = _self_normalised_error(x_t - t * v_negative, x0, settings.weight_floor)
    unweighted = (r * positive + (1 - r) * negative) / beta
    policy_loss = (unweighted * adv_clip_max).mean()

    if v_ref is not None:
        kl_loss = _mean_over_non_batch((v_theta - v_ref.detach().to(dtype)) ** 2).mean()
    else:
        kl_loss = torch.zeros((), dtype=dtype, device=v_theta.device)
    loss = policy_loss + kl_beta * kl_loss if kl_beta else policy_loss
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "unweighted_policy_loss": unweighted.detach().mean(),
            "kl_loss": kl_loss.detach(),
            "old_deviate": ((v_theta.detach() - v_old) ** 2).mean(),
        }
    return loss, stats
