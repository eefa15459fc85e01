"""The training objectives: DDPM noise prediction (the UNets) and flow matching (the transformers).

Same maths as diffusers' ``examples/text_to_image/train_text_to_image.py`` (noise offset,
input perturbation, epsilon / v-prediction targets, Min-SNR-gamma loss weighting, DREAM) and
its SD3 / Flux scripts (timestep densities and loss weightings). Both objectives have one
signature, ``objective.loss(predict, latents)``, where ``predict(noisy, timesteps)`` is the
family's denoiser call; a family picks its objective (``Family.objective``) and the trainer
calls ``family.objective_loss(denoiser, objective, ...)`` (or ``family.loss(...)``, which builds
the objective) whatever the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..runtime.host_transfer import host_to_device, stack_to_device


def compute_snr(noise_scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio of ``timesteps`` (Min-SNR weighting, arXiv:2303.09556)."""
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alphas_cumprod / (1.0 - alphas_cumprod)


def sample_generators(seed: int, epoch: int, indices) -> list[torch.Generator]:
    """One generator per sample, seeded from ``(seed, epoch, dataset index)``: a sample's noise,
    timestep and latent draw are then the same whichever rank trains it, and however many
    processes there are (a run resumed on another number of processes continues the losses
    of the uninterrupted run, with the same global batch). CPU generators: the draws are
    small and are moved to the batch's device."""
    import hashlib

    generators = []
    for index in torch.as_tensor(indices).tolist():
        digest = hashlib.sha256(f"{seed}-{epoch}-{index}".encode()).digest()
        # CPU: per-sample draws are made there and moved (one generator per sample, any device)
        generators.append(torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1))
    return generators


def _per_sample(draw, generators: list[torch.Generator], device, dtype=None) -> torch.Tensor:
    """``draw(generator)`` for each sample's generator, stacked and moved to ``device``. On CUDA
    the draws are stacked into pinned memory and copied without blocking
    (``runtime.host_transfer.stack_to_device``): a pageable copy each step would make the host
    wait for the device's whole queue. The values are the CPU generators' either way."""
    return stack_to_device([draw(g) for g in generators], device, dtype)


def sample_noise(
    latents: torch.Tensor,
    noise_offset: float = 0.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> torch.Tensor:
    """Gaussian noise like ``latents``, plus the per-channel offset of ``--noise_offset``.
    ``generator`` may be one per sample (``sample_generators``)."""
    if isinstance(generator, list):
        shape = latents.shape[1:]
        # CPU: drawn with each sample's CPU generator, then moved (_per_sample)
        noise = _per_sample(
            lambda g: torch.randn(shape, generator=g), generator, latents.device, latents.dtype
        )
        if noise_offset:
            # CPU: as the noise
            offset = _per_sample(
                lambda g: torch.randn(shape[0], 1, 1, generator=g), generator, latents.device
            )
            noise = noise + noise_offset * offset.to(latents.dtype)
        return noise
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype, device=latents.device)
    if noise_offset:
        offset = torch.randn(
            (latents.shape[0], latents.shape[1], 1, 1), generator=generator, device=latents.device
        )
        noise = noise + noise_offset * offset.to(latents.dtype)
    return noise


def sample_latent_distribution(
    distribution, generators: torch.Generator | list[torch.Generator] | None = None
) -> torch.Tensor:
    """A sample of a VAE's latent distribution (diffusers' ``DiagonalGaussianDistribution``:
    ``mean + std * noise``), the values of its own ``sample(generator=generators)``.

    With one CPU generator per sample, diffusers draws each sample's noise on the host and
    copies it from pageable memory (``randn_tensor``), which blocks the host until the device's
    queue has run; here the draws (the same ones, in the distribution's dtype) are stacked into
    pinned memory and copied without blocking (``_per_sample``). Any other distribution or
    generator: its own ``sample``.

    Example:
        >>> from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        >>> dist = DiagonalGaussianDistribution(torch.zeros(2, 8, 4, 4))
        >>> ours = sample_latent_distribution(dist, sample_generators(0, 0, [3, 4]))
        >>> torch.equal(ours, dist.sample(generator=sample_generators(0, 0, [3, 4])))
        True
    """
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    if (
        type(distribution) is not DiagonalGaussianDistribution
        or not isinstance(generators, list)
        or generators[0].device.type != "cpu"
    ):
        return distribution.sample(generator=generators)
    shape, dtype = distribution.mean.shape[1:], distribution.parameters.dtype
    # CPU: each sample's own CPU generator draws (the same values on any device), then staged and moved
    noise = _per_sample(lambda g: torch.randn(shape, generator=g, dtype=dtype), generators,
                        distribution.parameters.device)  # fmt: skip
    return distribution.mean + distribution.std * noise


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
    batch_size: int,
    num_timesteps: int,
    device,
    weights: torch.Tensor | None = None,
    generators: list[torch.Generator] | None = None,
) -> torch.Tensor:
    """Training timesteps: uniform, or drawn from ``timestep_bias_weights``; one draw per
    sample's generator when ``generators`` are given."""
    if generators is not None:
        if weights is None:
            # CPU: drawn with each sample's CPU generator, then moved (_per_sample)
            return _per_sample(
                lambda g: torch.randint(0, num_timesteps, (), generator=g), generators, device
            ).long()
        return _per_sample(lambda g: torch.multinomial(weights, 1, generator=g)[0], generators, device).long()
    if weights is None:
        return torch.randint(0, num_timesteps, (batch_size,), device=device).long()
    return host_to_device(torch.multinomial(weights, batch_size, replacement=True).long(), device)


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


def latent_loss_weights(mask: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """A per-pixel loss mask (``--mask_column``: 1 trains, 0 is ignored) averaged down to the
    latents' grid: ``(n, 1, H, W)`` to ``(n, 1, h, w)``, or ``(n, 1, 1, h, w)`` for 5-D latents of
    one frame; each latent pixel weighs the mean of the image pixels it encodes. A clip's mask
    ``(n, 1, F, H, W)`` goes to ``(n, 1, f, h, w)`` the way a causal video VAE (Wan's) compresses
    time: the first frame alone, then each group of ``(F - 1) / (f - 1)`` frames."""
    mask = mask.to(latents.device, torch.float32)
    if mask.ndim == 4:
        weights = F.interpolate(mask, size=latents.shape[-2:], mode="area")
        return weights.unsqueeze(2) if latents.ndim == 5 else weights
    n, _, frames, height, width = mask.shape
    f = latents.shape[2]
    if f > 1:
        if (frames - 1) % (f - 1):
            raise ValueError(f"a mask of {frames} frames does not map onto {f} latent frames")
        group = (frames - 1) // (f - 1)
        rest = mask[:, :, 1:].reshape(n, 1, f - 1, group, height, width).mean(dim=3)
        mask = torch.cat([mask[:, :, :1], rest], dim=2)
    else:
        mask = mask.mean(dim=2, keepdim=True)
    weights = F.interpolate(
        mask.transpose(1, 2).reshape(n * f, 1, height, width), size=latents.shape[-2:], mode="area"
    )
    return weights.reshape(n, f, 1, *latents.shape[-2:]).transpose(1, 2)


def weighted_sample_means(error: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Each sample's mean of ``error`` ``(n, ...)``, weighted by ``weights`` (broadcast to it;
    None: the plain mean): ``sum(w * e) / sum(w)``, the mean error over the weighted region,
    so that a mask of ones gives the unmasked loss; a sample whose weights are all zero gives 0."""
    dims = list(range(1, error.ndim))
    if weights is None:
        return error.mean(dim=dims)
    weights = weights.float().expand_as(error)
    return (error * weights).sum(dim=dims) / weights.sum(dim=dims).clamp_min(1e-8)


@dataclass(frozen=True)
class DDPMDraw:
    """The random draws of one DDPM training step, made by the caller so that runs are
    reproducible (``DDPMObjective.loss`` draws them from this rank's RNG or each sample's
    generator): the noise, each sample's timestep, and the extra noise of
    ``--input_perturbation`` (None: no perturbation)."""

    noise: torch.Tensor
    timesteps: torch.Tensor
    perturbation: torch.Tensor | None = None


def diffusion_loss(
    predict,
    noise_scheduler,
    latents: torch.Tensor,
    draw: DDPMDraw,
    *,
    settings: ObjectiveSettings | None = None,
    prediction_type: str | None = None,
    reduction: str = "mean",
    loss_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The denoising loss of one batch (mean over the batch; ``reduction="none"``: one value
    per sample, e.g. for DreamBooth's prior-preservation halves). ``loss_weights`` (broadcast
    to the latents: ``latent_loss_weights``) weigh each element's squared error
    (``weighted_sample_means``: masked training).

    ``predict(noisy_latents, timesteps)`` calls the denoiser (a family's ``predict``) and
    returns its prediction in the latents' shape. ``latents`` are already normalised (the
    VAE's ``scaling_factor``). ``draw`` holds the noise, the timesteps and the perturbation
    (``DDPMDraw``). Of ``settings`` (``ObjectiveSettings``; None: its defaults) this reads
    ``snr_gamma`` (Min-SNR weighting), ``input_perturbation`` (the perturbation's factor) and
    ``dream_detail_preservation``, which turns on DREAM (arXiv:2312.00210) through diffusers'
    own helper: one extra no-grad denoiser forward (every rank makes it, so ZeRO-3 stays in
    lockstep). ``prediction_type`` (None: the scheduler's) is registered on the scheduler.

    Example:
        >>> t = sample_timesteps(latents.shape[0], 1000, latents.device)
        >>> loss = diffusion_loss(predict, scheduler, latents, DDPMDraw(torch.randn_like(latents), t),
        ...                       settings=ObjectiveSettings(snr_gamma=5.0))
    """
    s = settings or ObjectiveSettings()
    snr_gamma, dream_detail_preservation = s.snr_gamma, s.dream_detail_preservation
    noise, timesteps = draw.noise, draw.timesteps
    if prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=prediction_type)
    noisy_input = noise
    if s.input_perturbation and draw.perturbation is not None:
        noisy_input = noise + s.input_perturbation * draw.perturbation
    noisy_latents = noise_scheduler.add_noise(latents, noisy_input, timesteps)
    target = diffusion_target(noise_scheduler, latents, noise, timesteps)
    if dream_detail_preservation is not None:
        from diffusers.training_utils import compute_dream_and_update_latents

        # diffusers' helper calls ``unet(noisy, timesteps, states).sample``: the family's call
        # stands in for it, with its own conditioning already bound.
        def unet(noisy, t, _states):
            return SimpleNamespace(sample=predict(noisy, t))

        noisy_latents, target = compute_dream_and_update_latents(
            unet, noise_scheduler, timesteps, noise, noisy_latents, target, None, dream_detail_preservation
        )
    model_pred = predict(noisy_latents, timesteps)
    if snr_gamma is None and reduction == "mean" and loss_weights is None:
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    per_sample = weighted_sample_means(loss, loss_weights)
    if snr_gamma is not None:
        snr = compute_snr(noise_scheduler, timesteps)
        weights = torch.stack([snr, snr_gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
        weights = (
            weights / snr if noise_scheduler.config.prediction_type == "epsilon" else weights / (snr + 1)
        )
        per_sample = per_sample * weights
    return per_sample if reduction == "none" else per_sample.mean()


WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none")


def flow_matching_loss(
    predict,
    noise_scheduler,
    latents: torch.Tensor,
    noise: torch.Tensor,
    *,
    settings: ObjectiveSettings | None = None,
    generators: list[torch.Generator] | None = None,
    reduction: str = "mean",
    loss_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rectified-flow loss of diffusers' SD3 and Flux training scripts (mean over the batch;
    ``reduction="none"``: one value per sample; ``loss_weights`` as in ``diffusion_loss``).

    Timesteps are drawn with ``compute_density_for_timestep_sampling`` (``settings``'
    ``weighting_scheme``: ``logit_normal`` with ``logit_mean`` and ``logit_std``, ``mode`` with
    ``mode_scale``, else uniform; ``ObjectiveSettings``, None: its defaults) as indices into
    the ``FlowMatchEulerDiscreteScheduler``'s ``timesteps`` and ``sigmas`` (a scheduler that
    ``set_timesteps`` never touched); the input
    is ``(1 - sigma) * latents + sigma * noise``, the target ``noise - latents``, and each
    sample's squared error is weighted by ``compute_loss_weighting_for_sd3`` (``sigma_sqrt``,
    ``cosmap``, else 1). ``predict(noisy_latents, timesteps)`` calls the denoiser (a family's
    ``predict``) and returns a prediction in the latents' shape. ``generators`` (one per sample)
    draw each sample's timestep from its own generator, after its noise.
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    s = settings or ObjectiveSettings()
    if s.weighting_scheme not in WEIGHTING_SCHEMES:
        raise ValueError(f"weighting scheme must be one of {WEIGHTING_SCHEMES}, got {s.weighting_scheme!r}")
    density = s.density()
    if generators is not None:
        u = _per_sample(lambda g: compute_density_for_timestep_sampling(batch_size=1, generator=g, **density)[0],
                        generators, "cpu")  # fmt: skip
    else:
        u = compute_density_for_timestep_sampling(batch_size=latents.shape[0], **density)
    timesteps, sigmas = table_points(noise_scheduler, u, latents)
    return rectified_flow_loss(
        predict, latents, noise, timesteps, sigmas,
        weighting_scheme=s.weighting_scheme, reduction=reduction, loss_weights=loss_weights,
    )  # fmt: skip


def table_indices(u: torch.Tensor, num_steps: int) -> torch.Tensor:
    """The entries of a training scheduler's table of ``num_steps`` that density draws ``u`` in
    [0, 1) pick: ``u * num_steps``, rounded down, at most the last."""
    return (u * num_steps).long().clamp(max=num_steps - 1)


def table_points(
    noise_scheduler, u: torch.Tensor, latents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timesteps, sigmas)`` of the ``FlowMatchEulerDiscreteScheduler``'s table at the density
    draws ``u`` (``table_indices``), on the latents' device: ``[n]`` timesteps, and sigmas in
    the latents' dtype shaped ``[n, 1, ..., 1]`` to broadcast on them."""
    indices = table_indices(u, noise_scheduler.config.num_train_timesteps)
    # the scheduler's tables are on the host: pinned, non-blocking copies on CUDA
    timesteps = host_to_device(noise_scheduler.timesteps[indices], latents.device)
    sigmas = host_to_device(noise_scheduler.sigmas[indices], latents.device, latents.dtype)
    return timesteps, sigmas.view(latents.shape[0], *([1] * (latents.ndim - 1)))


def rectified_flow_loss(
    predict,
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    weighting_scheme: str,
    reduction: str = "mean",
    loss_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rectified-flow loss at given noise levels (``flow_matching_loss`` once it has drawn
    them): the input ``(1 - sigmas) * latents + sigmas * noise``, ``predict(noisy, timesteps)``
    against the target ``noise - latents``, each element's squared error weighted by
    ``compute_loss_weighting_for_sd3(weighting_scheme)`` and each sample's mean by
    ``loss_weights`` (``weighted_sample_means``); the mean over the batch, or one value per
    sample with ``reduction="none"``. ``sigmas`` broadcast on the latents."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    noisy = (1.0 - sigmas) * latents + sigmas * noise
    model_pred = predict(noisy, timesteps)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - latents
    error = weighting.float() * (model_pred.float() - target.float()) ** 2
    per_sample = weighted_sample_means(error, loss_weights)
    return per_sample if reduction == "none" else per_sample.mean()


@dataclass(frozen=True)
class ObjectiveSettings:
    """The objective's flags (diffusers' names): the DDPM ones apply to the UNet families, the
    flow-matching ones to the transformers; ``guidance_scale`` is the guidance input of a
    guidance-distilled transformer."""

    snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    dream_detail_preservation: float | None = None  # None: no DREAM
    timestep_weights: torch.Tensor | None = None  # --timestep_bias_*: timestep_bias_weights
    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    guidance_scale: float | None = None

    def density(self, logit_mean: float | None = None) -> dict:
        """The keywords of diffusers' ``compute_density_for_timestep_sampling`` (the timestep
        density) of these settings; ``logit_mean`` replaces theirs (Ideogram 4's is
        resolution-aware)."""
        return dict(
            weighting_scheme=self.weighting_scheme,
            logit_mean=self.logit_mean if logit_mean is None else logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
        )


def objective_settings(args, family, noise_scheduler) -> ObjectiveSettings:
    """The ``ObjectiveSettings`` of a text-to-image settings object (diffusers' flag names) for
    ``family``: its default weighting scheme unless ``--weighting_scheme``, ``--timestep_bias_*``
    weights for a DDPM family, DREAM's detail preservation under ``--dream_training`` (epsilon
    prediction only: ``ArgumentError``). Registers ``--prediction_type`` on ``noise_scheduler``."""
    from ..errors import ArgumentError

    if args.prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    if args.dream_training and noise_scheduler.config.prediction_type != "epsilon":
        raise ArgumentError(
            "--dream_training supports epsilon prediction only (diffusers has no v-prediction DREAM)"
        )
    weights = None
    if not family.flow_matching:
        weights = timestep_bias_weights(
            noise_scheduler.config.num_train_timesteps, args.timestep_bias_strategy, args.timestep_bias_multiplier,
            args.timestep_bias_begin, args.timestep_bias_end, args.timestep_bias_portion,
        )  # fmt: skip
    return ObjectiveSettings(
        snr_gamma=args.snr_gamma,
        noise_offset=args.noise_offset,
        input_perturbation=args.input_perturbation,
        dream_detail_preservation=args.dream_detail_preservation if args.dream_training else None,
        timestep_weights=weights,
        weighting_scheme=args.weighting_scheme or family.default_weighting_scheme,
        logit_mean=args.logit_mean,
        logit_std=args.logit_std,
        mode_scale=args.mode_scale,
        guidance_scale=args.guidance_scale,
    )


class Objective:
    """A training objective: ``loss(predict, latents, generators=None, reduction="mean",
    loss_weights=None)`` over the training ``noise_scheduler`` with ``settings``
    (``ObjectiveSettings``); a family picks one (``Family.objective``)."""

    def __init__(self, noise_scheduler, settings: ObjectiveSettings):
        self.noise_scheduler = noise_scheduler
        self.settings = settings

    def loss(
        self,
        predict,
        latents: torch.Tensor,
        generators: list[torch.Generator] | None = None,
        reduction: str = "mean",
        loss_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of one batch of ``latents`` (normalised): ``predict(noisy, timesteps)`` calls
        the denoiser; noise and timesteps come from this rank's RNG, or from each sample's own
        ``generators`` (``sample_generators``); the mean over the batch, or one value per sample
        with ``reduction="none"``; ``loss_weights`` weigh each element (``latent_loss_weights``)."""
        raise NotImplementedError


class DDPMObjective(Objective):
    """Noise (or velocity) prediction at uniform (or biased) DDPM timesteps."""

    def loss(self, predict, latents, generators=None, reduction="mean", loss_weights=None) -> torch.Tensor:
        """Draw noise, its perturbation and timesteps (this rank's RNG, or each sample's own
        ``generators``), then ``diffusion_loss``."""
        s = self.settings
        noise = sample_noise(latents, s.noise_offset, generators)
        perturbation = None
        if s.input_perturbation:
            perturbation = sample_noise(latents, 0.0, generators) if generators else torch.randn_like(noise)
        n_steps = self.noise_scheduler.config.num_train_timesteps
        timesteps = sample_timesteps(
            latents.shape[0], n_steps, latents.device, s.timestep_weights, generators
        )
        return diffusion_loss(
            predict,
            self.noise_scheduler,
            latents,
            DDPMDraw(noise, timesteps, perturbation),
            settings=s,
            reduction=reduction,
            loss_weights=loss_weights,
        )


class FlowMatchingObjective(Objective):
    """Rectified flow at the scheduler's sigmas (``flow_matching_loss``)."""

    def loss(self, predict, latents, generators=None, reduction="mean", loss_weights=None) -> torch.Tensor:
        """Draw noise, then timesteps (this rank's RNG, or each sample's own ``generators``)."""
        s = self.settings
        return flow_matching_loss(
            predict,
            self.noise_scheduler,
            latents,
            sample_noise(latents, 0.0, generators) if generators else torch.randn_like(latents),
            settings=s,
            generators=generators,
            reduction=reduction,
            loss_weights=loss_weights,
        )
