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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.pixels import RowsToPixels
from ..families import Family
from ..families.sdxl import time_ids
from ..placement.frozen import load_frozen_component
from ..runtime.distributed import log_rank_zero
from ..runtime.ds_config import weight_dtype
from ..runtime.host_transfer import host_to_device
from ..runtime.phases import reached
from ..state.pretrained import CheckpointError
from .cache import CachedOutputs, FrozenEncoders, precompute_frozen_outputs


@dataclass(frozen=True)
class ComponentFolders:
    """Where each frozen component of a family loads from: ``folders`` maps a component to
    ``(folder, subfolder)`` (``source/<name>``, or a folder given with ``--component
    NAME=PATH``), in the weights' ``variant`` (``fp16``; None: the default files)."""

    folders: dict[str, tuple[Path, str]] = field(default_factory=dict)
    variant: str | None = None

    def load(self, accelerator, family: Family, name: str, placement: str, dtype: torch.dtype):
        """Component ``name`` loaded with ``placement`` (``frozen.load_frozen_component``), in
        the dtype the family runs it in for a training dtype ``dtype``. Collective when
        sharded."""
        folder, sub = self.folders[name]
        return load_frozen_component(
            accelerator,
            folder,
            sub,
            placement,
            family.component_class(name),
            self.variant,
            dtype=family.component_dtype(name, dtype),
            label=name,
        )


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
        normalize_latents,
        dtype: torch.dtype,
        pixels: RowsToPixels,
        sources: ComponentFolders,
        trained: frozenset[str] = frozenset(),
    ):
        self.family = family
        self.trained = trained  # text encoders the job trains: neither placed nor cached here
        self.models = models  # name -> FrozenModel, or None when cached
        self.cache = cache
        self.normalize_latents = normalize_latents  # the family's, built from the VAE
        self.dtype = dtype
        self.pixels = pixels  # the cache's flips; the size of a crop that does not say its own
        self.sources = sources  # where cached models reload from

    @torch.no_grad()
    def __call__(
        self,
        batch: dict,
        device: torch.device,
        generators: list[torch.Generator] | None = None,
        trained_outputs: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """``(latents, conditioning, time_ids)`` of a batch: latents normalised as the family
        says (scale and shift, per-channel statistics), the family's conditioning
        (``encoder_hidden_states``, pooled embeddings, masks; SDXL's ``time_ids`` too), and
        SDXL's ``time_ids`` alone (None for families without them). The cache's flips and the
        latents' samples come from this rank's RNG, or from each sample's ``generators``
        (``objectives.sample_generators``), which the objective then goes on drawing from.
        ``trained_outputs`` are the outputs of text encoders trained in the job (placement
        ``trained``), with their graph, joined to the frozen ones' for the conditioning."""
        cached: dict[str, torch.Tensor] = {}
        if self.cache is not None:
            flip = None
            if self.pixels.random_flip and generators is not None:
                # CPU: each sample's generator is a CPU one, and the cache is read there
                flip = torch.stack([torch.rand((), generator=g) for g in generators]) < 0.5
            elif self.pixels.random_flip:
                # CPU: the flip picks rows of the cache, which is read on the CPU
                flip = torch.rand(len(batch["index"])) < 0.5
            cached = self.cache.get(
                batch["index"].cpu(), flip=flip, generator=generators, sample=self.family.sample_latents
            )
        vae = self.models["vae"]
        if vae is None:
            latents = host_to_device(cached["latents"], device)  # pinned, non-blocking on CUDA
            sizes, crops = cached.get("original_size"), cached.get("crop_top_left")
            targets = cached.get("target_size")
        else:
            pixels = batch["pixel_values"].to(device, vae.dtype)
            latents = self.family.latents_of(self.family.latent_distribution(vae, pixels), generators)
            sizes, crops = batch.get("original_size"), batch.get("crop_top_left")
            targets = batch.get("target_size")
        latents = self.normalize_latents(latents).to(self.dtype)
        outputs = {
            k: v
            for k, v in cached.items()
            if k not in ("latents", "original_size", "crop_top_left", "target_size")
        }
        live = {name: self.models.get(name) for name in self.family.text_stage}
        if any(encoder is not None for encoder in live.values()):
            reached("frozen_forward")
            outputs.update(self.family.encode_texts(live, batch))
        if trained_outputs:
            with torch.enable_grad():  # the trained encoders' graph goes on into the conditioning
                both = {**outputs, **trained_outputs}
                cond = conditioning_on(self.family, both, device, self.dtype)
        else:
            cond = None
        if cond is None:
            cond = conditioning_on(self.family, outputs, device, self.dtype)
        if "source_pixel_values" in batch:  # an editing family's source image(s) of each sample
            cond["source_latents"] = self.source_latents(batch["source_pixel_values"], device)
        cond.update(self.family.other_latents(self.models, batch, device, self.dtype))
        ids = None
        if self.family.uses_time_ids:
            target = targets if targets is not None else self.pixels.resolution  # buckets: each crop's shape
            ids = time_ids(sizes.to(device), crops.to(device), target).to(self.dtype)
            cond["time_ids"] = ids
        return latents, cond, ids

    @torch.no_grad()
    def source_latents(self, pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
        """An editing family's source latents ``(N, K, C, h, w)`` of source images ``(N, K, 3, H,
        W)`` in [-1, 1]: the live VAE's mode (``FluxKontextPipeline`` encodes its image with
        ``sample_mode="argmax"``), normalised as the target's, in the training dtype. Collective
        when the VAE is sharded (every rank encodes its batch's K sources in one call)."""
        vae = self.models["vae"]
        if vae is None:
            raise ValueError("source images need the VAE live: it is cached here")
        n, k = pixels.shape[:2]
        flat = pixels.reshape(n * k, *pixels.shape[2:]).to(device, vae.dtype)
        latents = self.normalize_latents(self.family.latent_distribution(vae, flat).mode())
        return latents.to(self.dtype).reshape(n, k, *latents.shape[1:])

    @contextlib.contextmanager
    def validation_modules(self, accelerator) -> Iterator[dict[str, torch.nn.Module]]:
        """Every frozen component as a module for a pipeline, for the duration of the block.

        Cached ones are reloaded for the occasion (``frozen.loaded_as("cache")``: partitioned
        under ZeRO-3) and released on exit. Collective: every rank enters it (reloading a sharded
        model builds an engine, and sharded modules are called in lockstep).
        """
        modules, reloaded = {}, []
        for name, frozen in self.models.items():
            if name in self.trained:
                continue  # the trainer gives the pipeline the trained module
            if frozen is None:
                frozen = self.sources.load(accelerator, self.family, name, "cache", self.dtype)
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
    T5): every output is moved to ``device`` before they meet (from the host through pinned
    memory on CUDA: ``runtime.host_transfer.host_to_device``).
    """
    moved = {k: host_to_device(v, device) for k, v in outputs.items()}
    # Masks and ids keep their integer dtypes; embeddings take the training dtype.
    return {
        k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
        for k, v in family.conditioning(moved).items()
    }


@dataclass(frozen=True)
class CacheRequest:
    """What ``place_frozen_models``' ``cache`` placements encode, and where: the rows of
    ``dataset`` (a ``datasets`` dataset; a video family's clips read through ``clips``, the
    training's ``video.VideoCaptionDataset``), ``batch_size`` rows a call, into ``folder``, the
    captions tokenized with ``tokenizers`` (``family.load_tokenizers``) at
    ``max_sequence_length`` T5 tokens (None: the family's)."""

    dataset: Any
    folder: str | os.PathLike
    tokenizers: dict = field(default_factory=dict)
    max_sequence_length: int | None = None
    batch_size: int = 8
    clips: Any = None


def place_frozen_models(
    accelerator,
    family: Family,
    source: str | os.PathLike,
    placements: dict[str, str],
    *,
    pixels: RowsToPixels | None = None,
    cache: CacheRequest | None = None,
    variant: str | None = None,
    component_sources: dict[str, str | os.PathLike] | None = None,
) -> FrozenInputs:
    """Load and place a family's frozen models, one placement each. Collective: every rank.

    ``placements`` maps each of ``family.frozen_components`` to ``replicate``, ``shard``,
    ``offload`` or ``cache`` (missing ones are replicated), or ``trained`` for a text encoder
    the job trains (not loaded here: ``FrozenInputs`` takes its outputs). Sharded models are
    read straight into partitions. The ``cache`` ones encode ``cache.dataset`` once
    (``precompute_frozen_outputs``, into ``cache.folder``: a ``CacheRequest``) and are then
    freed; under ZeRO-3 they are loaded partitioned and run sharded for this (a T5-XXL is
    never whole on every rank), otherwise as replicas. The VAE runs in fp32 where the family
    says so. ``pixels`` (``data.pixels.RowsToPixels``, the training's; None: its defaults)
    says how a row becomes the cached VAE's pixels (its crop, flip, resize filter; with
    aspect-ratio buckets each image cached at its bucket's shape) and which flips and sizes
    the cached latents take. ``variant`` is the weights' variant (``fp16``);
    ``component_sources`` maps a component to a folder that holds it instead of
    ``source/<name>`` (``--component NAME=PATH``, e.g. a separately supplied text encoder).

    Example:
        >>> family = detect_family(source)
        >>> cache = CacheRequest(ds, "cache", family.load_tokenizers(source))
        >>> inputs = place_frozen_models(accelerator, family, source, {"text_encoder_2": "shard", "vae": "cache"},
        ...                              pixels=RowsToPixels(resolution=1024), cache=cache)
        >>> latents, cond, time_ids = inputs(batch, accelerator.device)     # every rank, every micro-batch
    """
    cached = [n for n in family.frozen_components if placements.get(n) == "cache"]
    if cached and cache is None:
        raise ValueError(
            f"the cache placement of {', '.join(cached)} needs cache=CacheRequest(dataset, folder, ...)"
        )
    pixels = pixels or RowsToPixels()
    source = Path(source)
    dtype = weight_dtype(accelerator)
    folders = {name: (source, name) for name in family.frozen_components}
    for name, folder in (component_sources or {}).items():
        if name in folders:
            folders[name] = (Path(folder).parent, Path(folder).name)
    sources = ComponentFolders(folders, variant)
    live = {}
    for name in family.frozen_components:
        placement = placements.get(name) or "replicate"
        if placement == "trained":  # trained in the job (a part of its own), not placed here
            live[name] = None
            continue
        live[name] = sources.load(accelerator, family, name, placement, dtype)
        note = f" (to encode the cache as {live[name].placement})" if placement == "cache" else ""
        log_rank_zero(live[name].describe() + note)
    vae_folder, vae_sub = sources.folders["vae"]
    normalize_latents = family.latent_normalizer(
        family.component_class("vae").load_config(vae_folder / vae_sub), vae_folder / vae_sub
    )
    outputs = None
    if cached:
        encoders = {n: live[n] for n in cached if n != "vae"}
        models = FrozenEncoders(
            encoders,
            {n: cache.tokenizers[n] for n in encoders if n in cache.tokenizers},  # not LTX-2's connectors
            vae=live["vae"] if "vae" in cached else None,
            family=family,
            max_sequence_length=cache.max_sequence_length,
        )
        outputs = precompute_frozen_outputs(
            cache.dataset, cache.folder, models, pixels, batch_size=cache.batch_size, clips=cache.clips
        )
        for name in cached:  # training holds none of their weights
            live[name].release()
            live[name] = None
    return FrozenInputs(
        family,
        live,
        outputs,
        normalize_latents=normalize_latents,
        trained=frozenset(n for n in family.frozen_components if placements.get(n) == "trained"),
        dtype=dtype,
        pixels=pixels,
        sources=sources,
    )


def component_folder(source: str | os.PathLike, component_sources: dict, name: str) -> Path:
    """The folder that holds component ``name``: the one ``--component NAME=PATH`` gave
    (``component_sources``, from ``resolve_component_sources``), else ``source/name``. Its
    ``parent`` and ``name`` are a ``from_pretrained``'s folder and ``subfolder``."""
    return Path(component_sources.get(name, Path(source) / name))


def resolve_component_sources(
    family: Family,
    source: str | os.PathLike,
    overrides: dict[str, str],
    revision: str | None = None,
    cache_dir: str | None = None,
) -> dict[str, Path]:
    """The local folder of every overridden component (``--component NAME=PATH``: a folder or
    hub id that holds that component itself), checked so that each component the family needs
    is found before anything loads.

    A text encoder given from elsewhere brings its tokenizer along when the pipeline folder
    has none (HiDream's Llama: one folder holds both). Raises ``CheckpointError`` naming a
    component that is in neither place.
    """
    from ..state.pretrained import resolve_model_folder

    sources = {
        name: resolve_model_folder(path, None, revision, cache_dir) for name, path in overrides.items()
    }
    source = Path(source)
    for spec in family.text_encoders:
        if spec.name in sources and spec.tokenizer not in sources and not (source / spec.tokenizer).is_dir():
            if (sources[spec.name] / "tokenizer_config.json").is_file():
                sources[spec.tokenizer] = sources[spec.name]
    for name in (family.denoiser, *family.frozen_components, *family.tokenizer_folders):
        if name not in sources and not (source / name).is_dir():
            raise CheckpointError(
                f"{source} has no {name} folder: give it with --component {name}=PATH (a folder or hub id)"
            )
    return sources
