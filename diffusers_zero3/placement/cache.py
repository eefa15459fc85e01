"""The "cache" placement: run the frozen text encoder / VAE once, store outputs, free the models.

``precompute_frozen_outputs`` has every rank encode its own contiguous share of the dataset
(in lockstep, so sharded frozen engines work), writes one safetensors part per rank, and
publishes the folder atomically under a key that changes whenever the models' weights, the
tokenizer, the resolution/crop settings or the data (captions, dataset fingerprint) change.
A later run with the same inputs finds the folder and encodes nothing.

What the cache freezes (it cannot redo per-step randomness):

* the crop: ``center_crop`` as asked, otherwise the random crop drawn for epoch 0;
* the caption: the first of several captions of a row (live training picks one at random);
* flips stay random: with ``random_flip`` both orientations are cached and training picks one;
* VAE sampling stays random: the latent distribution's parameters (mean and log-variance)
  are cached and training samples from them, exactly as ``latent_dist.sample()`` does live;
* each crop's original size and top-left corner are stored beside its latents (SDXL's
  ``time_ids``), for the flipped copy too;
* each text encoder's outputs are stored under its family's names (several encoders, pooled
  outputs), so any subset of a family's encoders can be cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from ..data.images import DataError, is_readable_image, pick_caption, transform_image_with_crop
from ..runtime.distributed import (
    all_gather_object,
    get_rank,
    get_world_size,
    is_main_process,
    log_rank_zero,
    logger,
)
from ..runtime.lockstep import lockstep_map
from ..runtime.zero3 import gathered_parameters
from ..state.folders import collective_publish

CACHE_FORMAT = 2
_IMAGE_TENSORS = (
    "latent_params",
    "latent_params_flipped",
    "original_size",
    "crop_top_left",
    "crop_top_left_flipped",
)


def model_fingerprint(module: Any) -> str:
    """A hash of a model's config and weights, the same whatever its placement.

    Collective when the model is ZeRO-3 partitioned (each parameter is gathered in turn):
    call on every rank.
    """
    module = getattr(module, "module", module)
    h = hashlib.sha256()
    config = getattr(module, "config", None)
    if config is not None:
        h.update(
            repr(
                sorted(dict(config).items()) if isinstance(config, dict) else config.to_json_string()
            ).encode()
        )
    for name, p in module.named_parameters():
        with gathered_parameters(p):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _dataset_fingerprint(dataset, caption_column: str) -> str:
    h = hashlib.sha256(str(getattr(dataset, "_fingerprint", len(dataset))).encode())
    for caption in dataset[caption_column]:
        h.update(repr(caption).encode())
    return h.hexdigest()[:16]


def cache_key(**inputs: Any) -> str:
    """The folder name for a cache of ``inputs`` (a stable hash of their JSON)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:20]


class CachedOutputs:
    """A published cache folder: look rows up by their dataset index.

    ``get(indices, flip=None, generator=None)`` returns ``encoder_hidden_states`` and/or
    ``latents`` (sampled from the cached distribution, unscaled: multiply by the VAE's
    ``scaling_factor`` as usual) for those rows.
    """

    def __init__(self, folder: str | os.PathLike, reused: bool = False):
        from safetensors import safe_open

        self.folder = Path(folder)
        self.reused = reused  # True when found on disk rather than encoded by this call
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self._parts = []
        self._where: dict[int, tuple[int, int]] = {}
        for part_file in sorted(self.folder.glob("part-*.safetensors")):
            f = safe_open(str(part_file), framework="pt")
            for row, idx in enumerate(f.get_tensor("index").tolist()):
                self._where[idx] = (len(self._parts), row)
            self._parts.append(f)
        self.has_latents = "latent_params" in self.meta["tensors"]
        self.text_outputs = [n for n in self.meta["tensors"] if n not in _IMAGE_TENSORS]
        self.has_text = bool(self.text_outputs)
        self.skipped_rows: list[int] = list(self.meta.get("skipped_rows", []))
        expected = self.meta["rows"] - len(self.skipped_rows)
        if len(self._where) != expected:
            raise DataError(
                f"the frozen-model cache {self.folder} holds {len(self._where)} rows, its meta.json says "
                f"{expected}: it is damaged; delete that folder and run again"
            )

    def __len__(self) -> int:
        return len(self._where)

    def _rows(self, name: str, indices) -> torch.Tensor:
        rows = []
        for idx in indices:
            part, row = self._where[int(idx)]
            rows.append(self._parts[part].get_slice(name)[row : row + 1])
        return torch.cat(rows)

    def get(
        self,
        indices,
        flip: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        sample: bool = True,
    ) -> dict:
        """Cached outputs for dataset rows ``indices`` (``flip``: per-row bool, flipped latents;
        ``sample=False``: the latent distribution's mode instead of a sample).

        Returns each cached text encoder output under its family's name (SD:
        ``encoder_hidden_states``; SDXL: ``prompt_embeds_1``, ``prompt_embeds_2``,
        ``text_embeds``) and, for a cached VAE, ``latents`` sampled from the cached
        distribution (unscaled), with the crops' ``original_size`` and ``crop_top_left`` for
        families that condition on them (SDXL).
        """
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        out = {name: self._rows(name, indices) for name in self.text_outputs}
        if self.has_latents:
            params = self._rows("latent_params", indices)
            crops = "crop_top_left" in self.meta["tensors"]
            if crops:
                out["original_size"] = self._rows("original_size", indices)
                out["crop_top_left"] = self._rows("crop_top_left", indices)
            if flip is not None and self.meta["random_flip"]:
                flipped = self._rows("latent_params_flipped", indices)
                params = torch.where(flip.view(-1, *[1] * (params.ndim - 1)), flipped, params)
                if crops:
                    crop_flipped = self._rows("crop_top_left_flipped", indices)
                    out["crop_top_left"] = torch.where(flip.view(-1, 1), crop_flipped, out["crop_top_left"])
            distribution = DiagonalGaussianDistribution(params)
            out["latents"] = distribution.sample(generator=generator) if sample else distribution.mode()
        return out


def _tokenizer_fingerprint(tokenizer) -> str:
    return hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:16]


def precompute_frozen_outputs(
    dataset,
    cache_dir: str | os.PathLike,
    *,
    tokenizer=None,
    text_encoder=None,
    vae=None,
    text_encoders: dict | None = None,
    tokenizers: dict | None = None,
    family=None,
    image_column: str = "image",
    caption_column: str = "text",
    resolution: int = 512,
    center_crop: bool = False,
    random_flip: bool = False,
    seed: int = 0,
    batch_size: int = 8,
    max_sequence_length: int | None = None,
    clips=None,
) -> CachedOutputs:
    """Encode a dataset once with the frozen models and publish the outputs; call on every rank.

    Collective: every rank encodes its contiguous share of ``dataset`` (a ``datasets``
    dataset), calling sharded models in lockstep. Pass text encoders, ``vae``, or both;
    each may be a module or a ``FrozenModel``. Text encoders are given as
    ``text_encoders={"text_encoder_2": model, ...}`` with ``tokenizers`` of the same names
    and the pipeline's ``family`` (``diffusers_zero3.families``), which says what each
    encoder outputs (SDXL: penultimate hidden states and the pooled embedding); any subset
    of a family's encoders may be cached. ``text_encoder=``/``tokenizer=`` are the SD 1.x
    shorthand. With a VAE and a family that conditions on crops (SDXL's ``time_ids``), each
    image's ``original_size`` and ``crop_top_left`` (also for the flipped copy) are stored too.
    ``max_sequence_length`` is the T5 tokens per caption (default: the family's).

    ``clips`` (a ``video.VideoCaptionDataset``) gives a video family's pixels: each row's clip
    as training reads it at epoch 0 (its frames and crop; with ``random_flip`` the mirrored
    clip is cached too), ``(3, F, H, W)``; a clip that does not decode is skipped and recorded
    like a corrupt image.

    Returns the cache (reused as is when a cache with the same key exists in ``cache_dir``;
    rank 0 decides, and a published folder is checked before use). Afterwards the models can
    be released (``FrozenModel.release()`` or ``del``): training needs none of their weights.
    """
    from ..families import SD

    text_encoders = dict(text_encoders or {})
    tokenizers = dict(tokenizers or {})
    if text_encoder is not None:
        text_encoders["text_encoder"] = text_encoder
        if tokenizer is not None:
            tokenizers["text_encoder"] = tokenizer
    family = family or SD
    if not text_encoders and vae is None:
        raise ValueError("precompute_frozen_outputs needs a text encoder, a vae, or both")
    missing = [name for name in text_encoders if name not in tokenizers]
    if missing:
        raise ValueError(f"caching text embeddings needs the tokenizer of {', '.join(missing)}")
    inputs = {
        "format": CACHE_FORMAT,
        "family": family.name,
        "text_encoders": {n: model_fingerprint(m) for n, m in sorted(text_encoders.items())},
        "tokenizers": {n: _tokenizer_fingerprint(tokenizers[n]) for n in sorted(text_encoders)},
        "sequence_lengths": {
            spec.name: family.sequence_length(spec, tokenizers[spec.name], max_sequence_length)
            for spec in family.text_encoders
            if spec.name in text_encoders
        },
        "vae": model_fingerprint(vae) if vae is not None else None,
        "data": _dataset_fingerprint(dataset, caption_column),
        "columns": [image_column, caption_column],
        "resolution": resolution if vae is not None else None,
        "center_crop": center_crop if vae is not None else None,
        "random_flip": random_flip if vae is not None else None,
        "seed": seed if vae is not None and not center_crop else None,
        "clips": clips.cache_key() if clips is not None and vae is not None else None,
    }
    # Rank 0's view decides: an in-memory dataset has a random fingerprint in each process,
    # and another job may publish the same cache while this one starts.
    inputs = all_gather_object(inputs)[0]
    key = cache_key(**inputs)
    final = Path(cache_dir) / key
    reuse = all_gather_object((final / "meta.json").exists() if is_main_process() else None)[0]
    if reuse:
        log_rank_zero(f"reusing the frozen-model cache {final}")
        return CachedOutputs(final, reused=True)

    log_rank_zero(f"encoding {len(dataset)} rows with the frozen models into {final}")
    # collective_publish gives the temporary folder a name of its own: two jobs sharing
    # cache_dir never write into one.
    with collective_publish(final, commit=_publish_unless_present) as tmp:
        _encode_share(tmp, dataset, inputs, text_encoders, tokenizers, family, vae, image_column,
                      caption_column, resolution, center_crop, random_flip, seed, batch_size, max_sequence_length,
                      clips)  # fmt: skip
    return CachedOutputs(final)


def _publish_unless_present(tmp: Path, final: Path) -> None:
    if (final / "meta.json").exists():  # another job published the same key meanwhile: keep it
        return
    os.replace(tmp, final)


def _encode_share(
    tmp: Path, dataset, inputs: dict, text_encoders: dict, tokenizers: dict, family, vae,
    image_column: str, caption_column: str, resolution: int, center_crop: bool, random_flip: bool,
    seed: int, batch_size: int, max_sequence_length: int | None, clips=None,
) -> None:  # fmt: skip
    """This rank's share of the cache, written into ``tmp`` (in lockstep with the others)."""
    rank, world = get_rank(), get_world_size()
    per_rank = -(-len(dataset) // world)
    mine = list(range(rank * per_rank, min(len(dataset), (rank + 1) * per_rank)))
    skipped, clip_pixels = [], {}
    if vae is not None and clips is not None:  # clips that do not decode are skipped and recorded
        for i in mine:
            pixels = clips.clip_pixels(i)
            if pixels is None:
                logger.warning("skipping row %d: the clip does not decode or is too short", i)
                skipped.append(i)
            else:
                clip_pixels[i] = pixels
        mine = [i for i in mine if i not in set(skipped)]
    elif vae is not None:  # corrupt images are skipped, as in live training; the rows are recorded
        for i in mine:
            if not is_readable_image(dataset, i, image_column):
                logger.warning("skipping row %d: unreadable image", i)
                skipped.append(i)
        mine = [i for i in mine if i not in set(skipped)]
    chunks = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]

    def encode(indices: list[int]) -> dict[str, torch.Tensor]:
        rows = [dataset[i] for i in indices]
        out = {}
        with torch.no_grad():
            if text_encoders:
                captions = [pick_caption(r[caption_column], None) for r in rows]
                outputs = family.encode_texts(
                    text_encoders, family.tokenize(tokenizers, captions, max_sequence_length)
                )
                out.update({k: v.cpu() for k, v in outputs.items()})
            if vae is not None:
                if clips is not None:  # clips as training reads them at epoch 0 (no flip: both are cached)
                    crops = []
                    pixels = torch.stack([clip_pixels[i] for i in indices]).to(vae.device, vae.dtype)
                else:
                    crops = [
                        transform_image_with_crop(
                            r[image_column], resolution, center_crop, False, random.Random(f"{seed}-0-{i}")
                        )
                        for i, r in zip(indices, rows)
                    ]
                    pixels = torch.stack([p for p, _ in crops]).to(vae.device, vae.dtype)
                out["latent_params"] = family.latent_distribution(vae, pixels).parameters.cpu()
                if family.uses_time_ids:
                    # CPU: written to the cache file beside the other outputs, all moved to the CPU
                    out["original_size"] = torch.tensor([c.original_size for _, c in crops])
                    # CPU: as original_size
                    out["crop_top_left"] = torch.tensor([c.crop_top_left for _, c in crops])
                if random_flip:
                    flipped = family.latent_distribution(vae, pixels.flip(-1)).parameters
                    out["latent_params_flipped"] = flipped.cpu()
                if random_flip and family.uses_time_ids:
                    # the same crop seen in the flipped image, as live training records it
                    # CPU: written to the cache file, as original_size
                    out["crop_top_left_flipped"] = torch.tensor(
                        [c.mirrored(resolution).crop_top_left for _, c in crops]
                    )
        return out

    results = lockstep_map(encode, chunks, name="frozen models (cache)")
    tensors = {"index": torch.tensor(mine, dtype=torch.long)}  # CPU: safetensors saves CPU tensors
    for name in results[0] if results else []:
        tensors[name] = torch.cat([r[name] for r in results]).contiguous()
    from safetensors.torch import save_file

    save_file(tensors, str(tmp / f"part-{rank:05d}.safetensors"))
    if mine:  # what a cached row costs on disk (the README's bytes per image or clip)
        per_row = sum(t.numel() * t.element_size() for n, t in tensors.items() if n != "index") / len(mine)
        names = ", ".join(n for n in sorted(tensors) if n != "index")
        log_rank_zero(f"frozen-model cache: {per_row / 2**20:.3f} MiB per row ({names})")
    reports = all_gather_object((sorted(tensors), skipped))
    names = sorted(set().union(*(t for t, _ in reports)) - {"index"})
    all_skipped = sorted(i for _, s in reports for i in s)
    if all_skipped:
        log_rank_zero(
            f"skipped {len(all_skipped)} unreadable image row(s) while caching", level=logging.WARNING
        )
    if is_main_process():
        meta = {**inputs, "tensors": names, "rows": len(dataset), "skipped_rows": all_skipped}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
