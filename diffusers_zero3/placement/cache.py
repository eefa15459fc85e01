"""The "cache" placement: run the frozen text encoder / VAE once, store outputs, free the models.

``precompute_frozen_outputs`` has every rank encode its own contiguous share of the dataset
(in lockstep, so sharded frozen engines work) and write it as it goes, in safetensors shards
of at most ``shard_rows`` rows (``part-{rank:05d}-{shard:05d}.safetensors``: ranks never
write the same file), so that a rank holds one shard's outputs in memory, not its share of
the dataset. The folder is published atomically under a key that changes whenever the
models' weights or the dtype they run in, the tokenizer, the resolution/crop settings or the
data (captions, dataset fingerprint, and the size and mtime of each image or clip file read
from disk) change; the number of ranks is not part of it. A later run with the same inputs,
on any number of processes, finds the folder and encodes nothing; reading maps the shards
(``safe_open``) and copies only the rows asked for.

What the cache freezes (it cannot redo per-step randomness):

* the crop: ``center_crop`` as asked, otherwise the random crop drawn for epoch 0 (drawn after
  the caption, as live training draws them, so that it is epoch 0's live crop);
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
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..data.buckets import NO_BUCKET
from ..data.images import DataError, is_readable_image, pick_caption, transform_image_with_crop
from ..data.pixels import RowsToPixels
from ..runtime.distributed import (
    all_gather_object,
    get_rank,
    get_world_size,
    is_main_process,
    log_rank_zero,
    logger,
)
from ..runtime.lockstep import lockstep_iter
from ..runtime.zero3 import gathered_parameters
from ..state.folders import collective_publish

# Not bumped for the shards: a folder of one part per rank (``part-00000.safetensors``) reads
# as a shard each, and the key's new "dtypes" field makes every older key miss anyway.
# 3: the random crop of a row with several captions is drawn after its caption, as live
# training draws it (format 2 drew it first, a crop training never takes).
CACHE_FORMAT = 3
# Rows per shard file: at most this many rows (plus one micro-batch) of outputs in memory per
# rank while encoding. SD 1.5 at 512 px with its text encoder is about 0.35 MiB a row (0.48 MiB
# with random_flip): 175-240 MiB a shard, and 10 M images make about 20 k files.
DEFAULT_SHARD_ROWS = 512
_IMAGE_TENSORS = (
    "latent_params",
    "latent_params_flipped",
    "original_size",
    "crop_top_left",
    "crop_top_left_flipped",
    "target_size",
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


def file_identity(path: str | os.PathLike) -> list:
    """What tells a file on disk from its rewrite without reading it: ``[path, size, mtime_ns]``;
    for a folder (a clip's frames) the size and mtime of each file in it, by name;
    ``[path, None]`` when it cannot be read (a missing file, a URL)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return [path, None]
    if stat.S_ISDIR(st.st_mode):
        with os.scandir(path) as entries:
            files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())
        return [path, files]
    return [path, st.st_size, st.st_mtime_ns]


def _image_files(dataset, image_column: str) -> Iterator[str | None]:
    """The file each row's image is read from, None for an image held in the dataset itself
    (its bytes: the dataset's own fingerprint covers them).

    A ``datasets.Image`` column is read as Arrow (its ``path`` and whether ``bytes`` is set),
    never decoded; a column of strings is paths as they are.
    """
    import datasets

    feature = getattr(dataset, "features", {}).get(image_column)
    is_image = isinstance(feature, datasets.Image)
    is_paths = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    if not (is_image or is_paths):
        return
    for batch in dataset.select_columns([image_column]).with_format("arrow").iter(batch_size=10_000):
        column = batch.column(image_column).combine_chunks()
        if not is_image:
            yield from column.to_pylist()
            continue
        paths, embedded = column.field("path").to_pylist(), column.field("bytes").is_valid().to_pylist()
        yield from (None if inline or path is None else path for path, inline in zip(paths, embedded))


def _files_fingerprint(dataset, image_column: str, clips=None) -> str:
    """A hash of the identity (``file_identity``) of every file the VAE's pixels are read from:
    each row's clip (``clips``), or each image referred to by path. Images are usually files
    beside the dataset (an imagefolder, a parquet column of paths), and rewriting one under its
    name changes neither the captions nor the dataset's own fingerprint."""
    h = hashlib.sha256()
    paths = clips.clip_paths() if clips is not None else _image_files(dataset, image_column)
    for path in paths:
        h.update(json.dumps(file_identity(path) if path is not None else None).encode())
    return h.hexdigest()[:16]


def compute_dtype(module: Any) -> str:
    """The dtype ``module`` encodes in: its weights' (``module.dtype``, a ``FrozenModel``'s
    module's), or the autocast dtype when autocast is on for its device (torch >= 2.4)."""
    dtype = getattr(module, "dtype", None)
    if dtype is None:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    device = getattr(module, "device", None)
    device_type = torch.device(device).type if device is not None else "cpu"
    if hasattr(torch, "get_autocast_dtype") and torch.is_autocast_enabled(device_type):
        return f"autocast {torch.get_autocast_dtype(device_type)} (weights {dtype})"
    return str(dtype)


def cache_key(**inputs: Any) -> str:
    """The folder name for a cache of ``inputs`` (a stable hash of their JSON)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:20]


class CachedOutputs:
    """A published cache folder: look rows up by their dataset index.

    ``get(indices, flip=None, generator=None)`` returns ``encoder_hidden_states`` and/or
    ``latents`` (sampled from the cached distribution, unscaled: multiply by the VAE's
    ``scaling_factor`` as usual) for those rows. The folder may hold any number of part files
    (``part-*.safetensors``, whatever number of ranks wrote them and however they were split);
    each is memory-mapped and a lookup copies only its rows.
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
                if "target_size" in self.meta["tensors"]:  # each crop's shape (aspect-ratio buckets)
                    out["target_size"] = self._rows("target_size", indices)
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


@dataclass(frozen=True)
class FrozenEncoders:
    """The frozen models a cache runs: text encoders (``{"text_encoder_2": model, ...}``, each
    a module or a ``FrozenModel``) with ``tokenizers`` of the same names, the ``vae``, or
    both; the pipeline's ``family`` (``diffusers_zero3.families``; None: SD 1.x), which says
    what each encoder outputs (SDXL: penultimate hidden states and the pooled embedding); and
    ``max_sequence_length``, the T5 tokens per caption (None: the family's).

    Example:
        >>> FrozenEncoders({"text_encoder": te}, {"text_encoder": tokenizer}, vae=vae)  # SD 1.x
    """

    text_encoders: dict[str, Any] = field(default_factory=dict)
    tokenizers: dict[str, Any] = field(default_factory=dict)
    vae: Any = None
    family: Any = None
    max_sequence_length: int | None = None


def precompute_frozen_outputs(
    dataset,
    cache_dir: str | os.PathLike,
    models: FrozenEncoders,
    pixels: RowsToPixels | None = None,
    *,
    batch_size: int = 8,
    clips=None,
    shard_rows: int | None = DEFAULT_SHARD_ROWS,
) -> CachedOutputs:
    """Encode a dataset once with the frozen models and publish the outputs; call on every rank.

    Collective: every rank encodes its contiguous share of ``dataset`` (a ``datasets``
    dataset), calling sharded models in lockstep, ``batch_size`` rows a call. ``models``
    (``FrozenEncoders``) holds text encoders, a VAE, or both; any subset of a family's
    encoders may be cached. ``pixels`` (``data.pixels.RowsToPixels``; None: its defaults) says how a
    row becomes the VAE's pixels, exactly as training reads it: the columns, the resolution, the crop,
    the flip, the seed of the random crop, the resize filter (``interpolation``). With a VAE
    and a family that conditions on crops (SDXL's ``time_ids``), each image's
    ``original_size`` and ``crop_top_left`` (also for the flipped copy) are stored too.

    With aspect-ratio buckets (``pixels.buckets``, and each row's index into them:
    ``pixels.row_buckets``, ``data.buckets.NO_BUCKET`` for an unreadable image) each image is
    cropped to its bucket instead of ``resolution`` squared, a rank encodes its rows bucket by
    bucket (a shard holds one shape), and each crop's ``target_size`` is stored for SDXL's
    ``time_ids``.

    ``shard_rows``: each rank writes its share as it encodes, in files of at most this many
    rows (a shard also ends where an output's shape changes), so that it holds one shard's
    outputs in memory rather than its whole share; ``None`` writes one file per rank at the
    end (the share in memory: the old behaviour, kept for ``benchmarks/bench_cache.py``). It
    does not change the cache's contents or key: any layout is read, and reused, alike.

    The key records each model's fingerprint and the dtype it runs in (``compute_dtype``:
    outputs computed in bf16 and in fp32 differ), the data, tokenizers, resolution, crop,
    flip and seed settings, and each image or clip file's size and mtime (``file_identity``:
    a file rewritten under its name is encoded again; files are not read for the key); not the
    number of ranks.

    ``clips`` (a ``video.VideoCaptionDataset``) gives a video family's pixels: each row's clip
    as training reads it at epoch 0 (its frames and crop; with ``pixels.random_flip`` the
    mirrored clip is cached too), ``(3, F, H, W)``; a clip that does not decode is skipped and
    recorded like a corrupt image.

    Returns the cache (reused as is when a cache with the same key exists in ``cache_dir``;
    rank 0 decides, and a published folder is checked before use). Afterwards the models can
    be released (``FrozenModel.release()`` or ``del``): training needs none of their weights.

    Example:
        >>> pixels = RowsToPixels(resolution=512, center_crop=True)
        >>> cache = precompute_frozen_outputs(ds, "cache", FrozenEncoders(vae=vae, family=SDXL), pixels)
        >>> cache.get(torch.tensor([0, 1]))["latents"].shape                    # every rank
    """
    from ..families import SD

    family = models.family or SD
    models, pixels = replace(models, family=family), pixels or RowsToPixels()
    text_encoders, tokenizers, vae = models.text_encoders, models.tokenizers, models.vae
    if not text_encoders and vae is None:
        raise ValueError("precompute_frozen_outputs needs a text encoder, a vae, or both")
    # every text encoder needs its tokenizer (a model after them, LTX-2's connectors, has none)
    missing = [e.name for e in family.text_encoders if e.name in text_encoders and e.name not in tokenizers]
    if missing:
        raise ValueError(f"caching text embeddings needs the tokenizer of {', '.join(missing)}")
    if shard_rows is not None and shard_rows < 1:
        raise ValueError(f"shard_rows must be a positive number of rows or None, not {shard_rows}")
    # The data is read on rank 0 alone (its inputs decide below): every caption, and a stat of
    # every image or clip file, which on a shared file system should not be N-fold.
    main = is_main_process()
    inputs = {
        "format": CACHE_FORMAT,
        "family": family.name,
        "text_encoders": {n: model_fingerprint(m) for n, m in sorted(text_encoders.items())},
        "tokenizers": {
            n: _tokenizer_fingerprint(tokenizers[n]) for n in sorted(text_encoders) if n in tokenizers
        },
        "sequence_lengths": {
            spec.name: family.sequence_length(spec, tokenizers[spec.name], models.max_sequence_length)
            for spec in family.text_encoders
            if spec.name in text_encoders
        },
        "vae": model_fingerprint(vae) if vae is not None else None,
        "dtypes": {
            n: compute_dtype(m)
            for n, m in sorted({**text_encoders, **({"vae": vae} if vae is not None else {})}.items())
        },
        "data": _dataset_fingerprint(dataset, pixels.caption_column) if main else None,
        "files": _files_fingerprint(dataset, pixels.image_column, clips)
        if main and vae is not None
        else None,
        "columns": [pixels.image_column, pixels.caption_column],
        "resolution": pixels.resolution if vae is not None else None,
        "center_crop": pixels.center_crop if vae is not None else None,
        "random_flip": pixels.random_flip if vae is not None else None,
        # Kept with center_crop too, where an image's crop draws nothing: at worst an encoding
        # more, and each setting stays a field of its own.
        "seed": pixels.seed if vae is not None else None,
        "clips": clips.cache_key() if clips is not None and vae is not None else None,
        "buckets": [list(b) for b in pixels.buckets]
        if pixels.buckets is not None and vae is not None
        else None,
        "interpolation": pixels.interpolation if vae is not None and clips is None else None,
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
        _encode_share(tmp, dataset, inputs, models, pixels, batch_size, clips, shard_rows)
    return CachedOutputs(final)


def _publish_unless_present(tmp: Path, final: Path) -> None:
    if (final / "meta.json").exists():  # another job published the same key meanwhile: keep it
        return
    os.replace(tmp, final)


def _encode_share(
    tmp: Path,
    dataset,
    inputs: dict,
    models: FrozenEncoders,
    pixels: RowsToPixels,
    batch_size: int,
    clips=None,
    shard_rows: int | None = None,
) -> None:
    """This rank's share of the cache, written into ``tmp`` shard by shard as it is encoded (in
    lockstep with the others)."""
    text_encoders, tokenizers = models.text_encoders, models.tokenizers
    family, vae = models.family, models.vae
    image_column, caption_column, row_buckets = pixels.image_column, pixels.caption_column, pixels.row_buckets
    rank, world = get_rank(), get_world_size()
    per_rank = -(-len(dataset) // world)
    mine = list(range(rank * per_rank, min(len(dataset), (rank + 1) * per_rank)))
    skipped, clip_pixels = [], {}
    if vae is not None and clips is not None:  # clips that do not decode are skipped and recorded
        for i in mine:
            clip = clips.clip_pixels(i)
            if clip is None:
                logger.warning("skipping row %d: the clip does not decode or is too short", i)
                skipped.append(i)
            else:
                clip_pixels[i] = clip
        mine = [i for i in mine if i not in set(skipped)]
    elif vae is not None:  # corrupt images are skipped, as in live training; the rows are recorded
        for i in mine:
            if (row_buckets is not None and row_buckets[i] == NO_BUCKET) or not is_readable_image(
                dataset, i, image_column
            ):
                logger.warning("skipping row %d: unreadable image", i)
                skipped.append(i)
        mine = [i for i in mine if i not in set(skipped)]
    if vae is not None and row_buckets is not None:  # bucket by bucket: a chunk (and a shard) has one shape
        groups = [[i for i in mine if row_buckets[i] == b] for b in sorted({row_buckets[i] for i in mine})]
    else:
        groups = [mine]
    chunks = [g[i : i + batch_size] for g in groups for i in range(0, len(g), batch_size)]

    def crop_rng(i: int, row: dict) -> random.Random:
        """Row ``i``'s generator at epoch 0 as live training crops with it
        (``ImageCaptionDataset.example``: ``SeededRows._rng``, the caption of several drawn
        first); the caption drawn is not used (the cache holds the first)."""
        rng = random.Random(f"{pixels.seed}-0-{i}")
        pick_caption(row[caption_column], rng)
        return rng

    def encode(indices: list[int]) -> dict[str, torch.Tensor]:
        rows = [dataset[i] for i in indices]
        out = {"index": torch.tensor(indices, dtype=torch.long)}  # CPU: safetensors saves CPU tensors
        with torch.no_grad():
            if text_encoders:
                captions = [pick_caption(r[caption_column], None) for r in rows]
                outputs = family.encode_texts(
                    text_encoders, family.tokenize(tokenizers, captions, models.max_sequence_length)
                )
                out.update({k: v.cpu() for k, v in outputs.items()})
            if vae is not None:
                if clips is not None:  # clips as training reads them at epoch 0 (no flip: both are cached)
                    crops = []
                    images = torch.stack([clip_pixels[i] for i in indices]).to(vae.device, vae.dtype)
                else:
                    crops = [
                        transform_image_with_crop(
                            r[image_column],
                            pixels.crop_size(i),
                            pixels.center_crop,
                            False,
                            crop_rng(i, r),
                            pixels.interpolation,
                        )
                        for i, r in zip(indices, rows)
                    ]
                    images = torch.stack([p for p, _ in crops]).to(vae.device, vae.dtype)
                out["latent_params"] = family.latent_distribution(vae, images).parameters.cpu()
                if family.uses_time_ids:
                    # CPU: written to the cache file beside the other outputs, all moved to the CPU
                    out["original_size"] = torch.tensor([c.original_size for _, c in crops])
                    # CPU: as original_size
                    out["crop_top_left"] = torch.tensor([c.crop_top_left for _, c in crops])
                    out["target_size"] = torch.tensor(
                        [c.target_size for _, c in crops]
                    )  # CPU: as original_size
                if pixels.random_flip:
                    flipped = family.latent_distribution(vae, images.flip(-1)).parameters
                    out["latent_params_flipped"] = flipped.cpu()
                if pixels.random_flip and family.uses_time_ids:
                    # the same crop seen in the flipped image, as live training records it
                    # CPU: written to the cache file, as original_size
                    out["crop_top_left_flipped"] = torch.tensor(
                        [c.mirrored().crop_top_left for _, c in crops]
                    )
        return out

    from safetensors.torch import save_file

    # Each shard is written as soon as it fills, while the other ranks go on encoding: the
    # writes are local, so lockstep holds (every rank still makes the same calls).
    outputs = lockstep_iter(encode, chunks, name="frozen models (cache)")
    names, row_bytes = set(), 0
    for n, shard in enumerate(group_into_shards(outputs, shard_rows)):
        save_file(shard, str(tmp / f"part-{rank:05d}-{n:05d}.safetensors"))
        names |= set(shard)
        row_bytes += sum(t.numel() * t.element_size() for name, t in shard.items() if name != "index")
        del shard  # freed before the next one fills
    if mine:  # what a cached row costs on disk (the README's bytes per image or clip)
        listed = ", ".join(sorted(names - {"index"}))
        log_rank_zero(f"frozen-model cache: {row_bytes / len(mine) / 2**20:.3f} MiB per row ({listed})")
    reports = all_gather_object((sorted(names), skipped))
    names = sorted(set().union(*(t for t, _ in reports)) - {"index"})
    all_skipped = sorted(i for _, s in reports for i in s)
    if all_skipped:
        log_rank_zero(
            f"skipped {len(all_skipped)} unreadable image row(s) while caching", level=logging.WARNING
        )
    if is_main_process():
        meta = {**inputs, "tensors": names, "rows": len(dataset), "skipped_rows": all_skipped}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _layout(chunk: dict[str, torch.Tensor]) -> tuple:
    return tuple((name, tuple(t.shape[1:]), t.dtype) for name, t in sorted(chunk.items()))


def _concat(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(chunks) == 1:
        return chunks[0]
    return {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}


def group_into_shards(
    chunks: Iterable[dict[str, torch.Tensor]], shard_rows: int | None
) -> Iterator[dict[str, torch.Tensor]]:
    """Regroup encoded chunks into shards to write, as they come.

    Each chunk is a dict of tensors with the same number of rows (their first dimension). A
    shard holds at most ``shard_rows`` rows (a chunk is split where a shard fills), and one
    shape and dtype per tensor name: a chunk whose shapes or names differ from the pending
    rows' ends the shard before it. ``None``: no row limit (one shard per layout, at the end).
    Holds at most one shard plus one chunk.

    Example:
        >>> sizes = [len(s["index"]) for s in group_into_shards(({"index": torch.arange(3)}
        ...          for _ in range(3)), 4)]
        >>> sizes
        [4, 4, 1]
    """
    pending, rows, layout = [], 0, None
    for chunk in chunks:
        if pending and _layout(chunk) != layout:
            yield _concat(pending)
            pending, rows = [], 0
        layout = _layout(chunk)
        # contiguous (a VAE's outputs may be channels-last), so that the concatenations and
        # their row slices are too, as safetensors saves them
        pending.append({name: t.contiguous() for name, t in chunk.items()})
        rows += len(next(iter(chunk.values())))
        while shard_rows is not None and rows >= shard_rows:
            merged = _concat(pending)
            rows -= shard_rows
            # the rest cloned (a view would keep the merged buffer alive), then nothing but the
            # shard itself held while the caller writes it
            pending = [{n: t[shard_rows:].clone() for n, t in merged.items()}] if rows else []
            shard = {n: t[:shard_rows] for n, t in merged.items()}
            del merged
            yield shard
            del shard
    if pending:
        yield _concat(pending)
