"""The text-to-image training objectives: DDPM noise prediction (UNets) and flow matching (SD3, Flux).

Same maths as diffusers' ``examples/text_to_image/train_text_to_image.py``: noise offset,
input perturbation, epsilon / v-prediction targets, and Min-SNR-gamma loss weighting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_snr(noise_scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio of ``timesteps`` (Min-SNR weighting, arXiv:2303.09556)."""
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alphas_cumprod / (1.0 - alphas_cumprod)


def sample_noise(
    latents: torch.Tensor, noise_offset: float = 0.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Gaussian noise like ``latents``, plus the per-channel offset of ``--noise_offset``."""
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype, device=latents.device)
    if noise_offset:
        offset = torch.randn(
            (latents.shape[0], latents.shape[1], 1, 1), generator=generator, device=latents.device
        )
        noise = noise + noise_offset * offset.to(latents.dtype)
    return noise


TIMESTEP_BIAS_STRATEGIES = ("none", "earlier", "later", "range")


def timestep_bias_weights(
    num_timesteps: int,
    strategy: str = "none",
    multiplier: float = 1.0,
    begin: int = 0,
    end: int = 1000,
    portion: float = 0.25,
) -> torch.Tensor | None:
    """Sampling weights over timesteps for ``--timestep_bias_strategy`` (diffusers' SDXL flags).

    ``earlier``/``later`` multiply the weight of the first/last ``portion`` of the timesteps by
    ``multiplier``; ``range`` multiplies ``[begin, end)``. Returns normalised weights, or None
    for ``none`` (uniform sampling, as without the flag).
    """
    if strategy == "none":
        return None
    if strategy not in TIMESTEP_BIAS_STRATEGIES:
        raise ValueError(
            f"timestep bias strategy must be one of {TIMESTEP_BIAS_STRATEGIES}, got {strategy!r}"
        )
    if multiplier <= 0:
        raise ValueError(f"the timestep bias multiplier must be positive, got {multiplier}")
    # CPU: sample_timesteps draws from these weights here and moves the draws to the batch's device
    weights = torch.ones(num_timesteps)
    count = int(portion * num_timesteps)
    if strategy == "earlier":
        selected = slice(0, count)
    elif strategy == "later":
        selected = slice(num_timesteps - count, num_timesteps)
    else:
        if not 0 <= begin < end <= num_timesteps:
            raise ValueError(f"the timestep bias range [{begin}, {end}) must lie within [0, {num_timesteps}]")
        selected = slice(begin, end)
    weights[selected] *= multiplier
    return weights / weights.sum()


def sample_timesteps(
    batch_size: int, num_timesteps: int, device, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Training timesteps: uniform, or drawn from ``timestep_bias_weights``."""
    if weights is None:
        return torch.randint(0, num_timesteps, (batch_size,), device=device).long()
    return torch.multinomial(weights, batch_size, replacement=True).long().to(device)


def diffusion_target(
    noise_scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """What the UNet learns to predict: the noise (``epsilon``) or the velocity
    (``v_prediction``), by the scheduler's ``prediction_type``."""
    if noise_scheduler.config.prediction_type == "epsilon":
        return noise
    if noise_scheduler.config.prediction_type == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unknown prediction type {noise_scheduler.config.prediction_type!r}")


def diffusion_loss(
    unet,
    noise_scheduler,
    latents: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    prediction_type: str | None = None,
    snr_gamma: float | None = None,
    input_perturbation: float = 0.0,
    perturbation: torch.Tensor | None = None,
    dream_detail_preservation: float | None = None,
    denoiser_kwargs: dict | None = None,
) -> torch.Tensor:
    """The denoising loss of one batch (mean over the batch).

    ``latents`` are already scaled by the VAE's ``scaling_factor``. ``perturbation`` is the
    extra noise of ``--input_perturbation`` (drawn by the caller, so that runs are
    reproducible). ``dream_detail_preservation`` turns on DREAM (arXiv:2312.00210): one
    extra no-grad UNet forward (every rank makes it, so ZeRO-3 stays in lockstep).
    ``denoiser_kwargs`` go to the UNet call (a family's extra conditioning, e.g. SDXL's
    ``added_cond_kwargs``).
    """
    if prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=prediction_type)
    noisy_input = noise
    if input_perturbation and perturbation is not None:
        noisy_input = noise + input_perturbation * perturbation
    noisy_latents = noise_scheduler.add_noise(latents, noisy_input, timesteps)
    target = diffusion_target(noise_scheduler, latents, noise, timesteps)
    if dream_detail_preservation is not None:
        from diffusers.training_utils import compute_dream_and_update_latents

        noisy_latents, target = compute_dream_and_update_latents(
            unet,
            noise_scheduler,
            timesteps,
            noise,
            noisy_latents,
            target,
            encoder_hidden_states,
            dream_detail_preservation,
        )
    model_pred = unet(
        noisy_latents, timesteps, encoder_hidden_states, return_dict=False, **(denoiser_kwargs or {})
    )[0]
    if snr_gamma is None:
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    snr = compute_snr(noise_scheduler, timesteps)
    weights = torch.stack([snr, snr_gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    weights = weights / snr if noise_scheduler.config.prediction_type == "epsilon" else weights / (snr + 1)
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    return (loss.mean(dim=list(range(1, loss.ndim))) * weights).mean()


WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none")


def flow_matching_loss(
    predict,
    noise_scheduler,
    latents: torch.Tensor,
    noise: torch.Tensor,
    *,
    weighting_scheme: str = "none",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> torch.Tensor:
    """The rectified-flow loss of diffusers' SD3 and Flux training scripts (mean over the batch).

    Timesteps are drawn with ``compute_density_for_timestep_sampling`` (``logit_normal``,
    ``mode``, else uniform) as indices into the ``FlowMatchEulerDiscreteScheduler``'s
    ``timesteps`` and ``sigmas`` (a scheduler that ``set_timesteps`` never touched); the input
    is ``(1 - sigma) * latents + sigma * noise``, the target ``noise - latents``, and each
    sample's squared error is weighted by ``compute_loss_weighting_for_sd3`` (``sigma_sqrt``,
    ``cosmap``, else 1). ``predict(noisy_latents, timesteps)`` calls the denoiser (a family's
    ``predict``) and returns a prediction in the latents' shape.
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    if weighting_scheme not in WEIGHTING_SCHEMES:
        raise ValueError(f"weighting scheme must be one of {WEIGHTING_SCHEMES}, got {weighting_scheme!r}")
    n = latents.shape[0]
    u = compute_density_for_timestep_sampling(
        weighting_scheme=weighting_scheme,
        batch_size=n,
        logit_mean=logit_mean,
        logit_std=logit_std,
        mode_scale=mode_scale,
    )
    num_steps = noise_scheduler.config.num_train_timesteps
    indices = (u * num_steps).long().clamp(max=num_steps - 1)
    timesteps = noise_scheduler.timesteps[indices].to(latents.device)
    sigmas = noise_scheduler.sigmas[indices].to(latents.device, latents.dtype)
    sigmas = sigmas.view(n, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    model_pred = predict(noisy, timesteps)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - latents
    error = (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(n, -1)
    return error.mean(dim=1).mean()
