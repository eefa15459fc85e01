"""The frozen half of a training step: each frozen model placed on its own, live or cached.

``place_frozen_models`` loads a family's frozen components (its text encoders and the VAE)
with one placement each (``replicate``, ``shard``, ``offload`` or ``cache``), encodes the
dataset once for the cached ones and frees them. The ``FrozenInputs`` it returns turns a
batch into what the denoiser needs (scaled latents, the family's conditioning, SDXL's
``time_ids``), from the live models or the cache, and reloads cached models as replicas for
validation. A custom training script calls these two instead of copying the logic.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .cache import CachedOutputs, precompute_frozen_outputs
from .distributed import log_rank_zero
from .families import Family, time_ids
from .recipe import load_frozen_component, weight_dtype
from .testing import fault_point
from .zero3 import is_zero3_enabled


class FrozenInputs:
    """Latents and conditioning of training batches from live frozen models or a cache.

    Calling it is a collective when a live model is sharded: every rank calls it once per
    micro-batch (the training loop does).
    """

    def __init__(
        self,
        family: Family,
        models: dict[str, Any],
        cache: CachedOutputs | None,
        *,
        vae_config: dict,
        dtype: torch.dtype,
        resolution: int,
        random_flip: bool,
        sources: dict[str, tuple[Path, str]],
        variant: str | None = None,
    ):
        self.family = family
        self.models = models  # name -> FrozenModel, or None when cached
        self.cache = cache
        self.scaling_factor = vae_config["scaling_factor"]
        self.shift_factor = vae_config.get("shift_factor")
        self.dtype = dtype
        self.resolution = resolution
        self.random_flip = random_flip
        self.sources = sources  # name -> (folder, subfolder), to reload cached models
        self.variant = variant

    @torch.no_grad()
    def __call__(self, batch: dict, device: torch.device) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """``(latents, conditioning, time_ids)`` of a batch: latents scaled by the VAE's
        factors, the family's conditioning (``encoder_hidden_states``, SDXL's ``text_embeds``),
        and SDXL's ``time_ids`` (None for families without them)."""
        cached: dict[str, torch.Tensor] = {}
        if self.cache is not None:
            # CPU: the flip picks rows of the cache, which is read on the CPU
            flip = torch.rand(len(batch["index"])) < 0.5 if self.random_flip else None
            cached = self.cache.get(batch["index"].cpu(), flip=flip)
        vae = self.models["vae"]
        if vae is None:
            latents = cached["latents"].to(device)
            sizes, crops = cached.get("original_size"), cached.get("crop_top_left")
        else:
            latents = vae.encode(batch["pixel_values"].to(device, vae.dtype)).latent_dist.sample()
            sizes, crops = batch.get("original_size"), batch.get("crop_top_left")
        if self.shift_factor is not None:
            latents = latents - self.shift_factor
        latents = (latents * self.scaling_factor).to(self.dtype)
        outputs = {k: v for k, v in cached.items() if k not in ("latents", "original_size", "crop_top_left")}
        live = {spec.name: self.models[spec.name] for spec in self.family.text_encoders}
        if any(encoder is not None for encoder in live.values()):
            fault_point("frozen_forward")
            outputs.update(self.family.encode_texts(live, batch))
        cond = conditioning_on(self.family, outputs, device, self.dtype)
        ids = None
        if self.family.uses_time_ids:
            ids = time_ids(sizes.to(device), crops.to(device), self.resolution).to(self.dtype)
        return latents, cond, ids

    @contextlib.contextmanager
    def validation_modules(self, accelerator) -> Iterator[dict[str, torch.nn.Module]]:
        """Every frozen component as a module for a pipeline, for the duration of the block.

        Cached ones are reloaded for the occasion (``cache_placement()``: partitioned under
        ZeRO-3) and released on exit. Collective: every rank enters it (reloading a sharded
        model builds an engine, and sharded modules are called in lockstep).
        """
        modules, reloaded = {}, []
        for name, frozen in self.models.items():
            if frozen is None:
                folder, sub = self.sources[name]
                frozen = load_frozen_component(
                    accelerator,
                    folder,
                    sub,
                    cache_placement(),
                    self.family.component_class(name),
                    self.variant,
                    dtype=self.family.component_dtype(name, self.dtype),
                )
                reloaded.append(frozen)
            modules[name] = frozen.module
        try:
            yield modules
        finally:
            for frozen in reloaded:
                frozen.release()


def conditioning_on(
    family: Family, outputs: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``family.conditioning(outputs)`` on ``device`` in ``dtype``.

    Cached outputs come from safetensors on the CPU while live encoders' outputs are on their
    device (the GPU), and a family concatenates them (SDXL's two encoders, SD3's CLIPs and
    T5): every output is moved to ``device`` before they meet.
    """
    moved = {k: v.to(device) for k, v in outputs.items()}
    return {k: v.to(device, dtype) for k, v in family.conditioning(moved).items()}


def cache_placement() -> str:
    """How a ``cache`` model runs while it encodes (and for validation images): ``shard``
    under ZeRO-3, so that it is loaded partitioned and no rank ever holds it whole, else
    ``replicate``."""
    return "shard" if is_zero3_enabled() else "replicate"


def place_frozen_models(
    accelerator,
    family: Family,
    source: str | os.PathLike,
    placements: dict[str, str],
    *,
    dataset=None,
    tokenizers: dict | None = None,
    cache_dir: str | os.PathLike | None = None,
    image_column: str = "image",
    caption_column: str = "text",
    resolution: int = 512,
    center_crop: bool = False,
    random_flip: bool = False,
    seed: int = 0,
    batch_size: int = 8,
    variant: str | None = None,
    vae_source: str | os.PathLike | None = None,
    max_sequence_length: int | None = None,
) -> FrozenInputs:
    """Load and place a family's frozen models, one placement each. Collective: every rank.

    ``placements`` maps each of ``family.frozen_components`` to ``replicate``, ``shard``,
    ``offload`` or ``cache`` (missing ones are replicated). Sharded models are read straight
    into partitions. The ``cache`` ones encode ``dataset`` once (``precompute_frozen_outputs``,
    with ``tokenizers`` and ``max_sequence_length`` T5 tokens, into ``cache_dir``) and are then
    freed; under ZeRO-3 they are loaded partitioned and run sharded for this (a T5-XXL is never
    whole on every rank), otherwise as replicas. The VAE runs in fp32 where the family says
    so; ``vae_source`` is a VAE folder to use instead of ``source/vae``.

    Example:
        >>> family = detect_family(source)
        >>> inputs = place_frozen_models(accelerator, family, source, {"text_encoder_2": "shard", "vae": "cache"},
        ...                              dataset=ds, tokenizers=family.load_tokenizers(source), cache_dir="cache")
        >>> latents, cond, time_ids = inputs(batch, accelerator.device)     # every rank, every micro-batch
    """
    source = Path(source)
    dtype = weight_dtype(accelerator)
    sources = {name: (source, name) for name in family.frozen_components}
    if vae_source is not None:
        vae_folder = Path(vae_source)
        sources["vae"] = (vae_folder.parent, vae_folder.name)
    live = {}
    for name in family.frozen_components:
        placement = placements.get(name) or "replicate"
        folder, sub = sources[name]
        live[name] = load_frozen_component(
            accelerator,
            folder,
            sub,
            cache_placement() if placement == "cache" else placement,
            family.component_class(name),
            variant,
            dtype=family.component_dtype(name, dtype),
        )
        note = f" (to encode the cache as {live[name].placement})" if placement == "cache" else ""
        log_rank_zero(live[name].describe() + note)
    cached = [n for n in family.frozen_components if placements.get(n) == "cache"]
    cache = None
    if cached:
        encoders = {n: live[n] for n in cached if n != "vae"}
        cache = precompute_frozen_outputs(
            dataset,
            cache_dir,
            text_encoders=encoders,
            tokenizers={n: tokenizers[n] for n in encoders},
            family=family,
            vae=live["vae"] if "vae" in cached else None,
            image_column=image_column,
            caption_column=caption_column,
            resolution=resolution,
            center_crop=center_crop,
            random_flip=random_flip,
            seed=seed,
            batch_size=batch_size,
            max_sequence_length=max_sequence_length,
        )
        for name in cached:  # training holds none of their weights
            live[name].release()
            live[name] = None
    from diffusers import AutoencoderKL

    vae_folder, vae_sub = sources["vae"]
    return FrozenInputs(
        family,
        live,
        cache,
        vae_config=AutoencoderKL.load_config(vae_folder / vae_sub),
        dtype=dtype,
        resolution=resolution,
        random_flip=random_flip,
        sources=sources,
        variant=variant,
    )
