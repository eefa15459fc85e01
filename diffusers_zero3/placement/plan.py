"""Placement planner: bytes per rank of every component of a training job, by placement, and
the fastest set of placements that fits the device memory.

    python -m diffusers_zero3.placement.plan PIPELINE [--num_processes N] [--device_memory 80GiB]
        [--mixed_precision bf16] [--use_ema] [--rank R] [--offload frozen|optimizer|all]
        [--fixed_data] [--reference] [--reward_model NAME=FOLDER ...] [--json]
        [--rl grpo|nft --reward NAME ... --group_size G --prompts_per_round P ...]

``PIPELINE`` is a local pipeline folder, a hub id (only its ``*.json`` configs are fetched), or
one of the carried configs (``known_pipelines``: SD 1.5, SDXL, SD3 medium, FLUX.1 [dev]).
Models are built on the meta device from their configs: no weight is read.

What is counted (per rank, ``N = num_processes``, ``Ψ`` parameters, ``b`` bytes per element
of the training dtype, the trained model's persistence threshold and bucket sizes as
``ds_config.zero3_bucket_sizes`` sets them):

* trained denoiser, ``shard`` (a ZeRO-3 engine): parameters ``b·Ψ/N`` (plus the whole of the
  parameters under the persistence threshold), gradient partitions ``b·Ψ/N``, optimizer
  Adam moments ``8Ψ/N`` and, under bf16/fp16, fp32 master partitions ``4Ψ/N`` (under fp32
  the parameters are the master weights: ``deepspeed_internals.levers.share_fp32_master_weights``); EMA ``4Ψ/N``;
  buffers (below). ``offload``: the same with the gradients, optimizer
  state and master weights in host memory. ``replicate`` (plain DDP, for comparison): ``4Ψ``
  parameters, ``4Ψ`` gradients, ``4Ψ`` of DDP's gradient buckets, ``8Ψ`` Adam, ``4Ψ`` EMA.
  With ``--rank R`` (LoRA) the base is frozen and partitioned, and gradients, optimizer and
  EMA are the adapters' (``R·(in + out)`` per targeted layer). Buffers are the gradient
  reduce bucket and the fp32 copy of one optimizer sub-group's gradients made at each step
  (both sized by ``ds_config.zero3_bucket_sizes``).
* frozen model: ``replicate`` ``b·Ψ``; ``shard`` DeepSpeed's partition of every parameter plus
  the whole of those under its persistence threshold (``frozen.placement_bytes_per_rank``);
  ``offload`` nothing on the device (the shard in host memory); ``cache`` nothing, and the
  bytes of its stored outputs per image (a video family: per clip of ``num_frames``) on disk.
* a reference denoiser (``--reference``: full fine-tuning with DPO or GRPO's KL; with LoRA the
  reference is the base with the adapters off and costs nothing) and reward models
  (``--reward_model NAME=FOLDER``, a folder or hub id with the model's ``config.json``): frozen
  models as above, never cached (they see fresh samples every step).
* ``--rl grpo|nft`` (``placement.rl_plan``): an online RL job: built-in rewards by name
  (``--reward pickscore --reward vlm``) at their published sizes, the round's sampled latents,
  log-probabilities, conditioning and images per rank, DiffusionNFT's old policy, and every
  placement of the reference and the rewards with whether it fits.

Activations are not counted in the recommendation: it keeps ``--margin`` (default 25 %) of the
device memory free for them. For a Wan transformer (video) the plan adds ``activations``: the
bytes a rank keeps for the backward of one clip (``placement.activations``, with
``--gradient_checkpointing`` or without) at ``--context_parallel_size K``, and with
``--device_memory`` the same for every K dividing the processes, the smallest K whose model
states plus activations fit the device memory less the margin (``context_parallel_fits``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import ArgumentError
from ..runtime.distributed import log_rank_zero
from ..runtime.ds_config import resolve_dtype
from .known_pipelines import KNOWN_PIPELINES

GIB = 2**30
MIB = 2**20
MIXED_PRECISIONS = ("no", "fp16", "bf16")
FROZEN_ORDER = ("replicate", "cache", "shard", "offload")  # fastest first (cache needs fixed data)


@dataclass
class Component:
    """One model of a pipeline: folder name, library, class and config, built on demand."""

    name: str
    library: str
    class_name: str
    config: dict
    trainable: bool = False
    # a text encoder's tokenizer_config.json model_max_length, where the pipeline has one
    tokenizer_max_length: int | None = None
    # False for a model that sees fresh inputs every step (a reward model, a reference
    # denoiser): its outputs cannot be cached
    cacheable: bool = True
    _module: torch.nn.Module | None = field(default=None, repr=False)
    # elements of its cached outputs per image or clip, by (frames, height, width, sequence
    # length): replanning at other process counts (what_would_fit) reuses them instead of
    # running the model again
    _output_elements: dict[tuple[int, int, int, int], int] = field(default_factory=dict, repr=False)

    def meta_module(self) -> torch.nn.Module:
        """The model built on the meta device from its config (no weights, exact shapes)."""
        if self._module is None:
            self._module = build_on_meta(self.library, self.class_name, self.config)
        return self._module

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.meta_module().parameters())


def build_on_meta(library: str, class_name: str, config: dict) -> torch.nn.Module:
    """``class_name`` of ``library`` (``diffusers`` or ``transformers``) built from ``config``
    on the meta device."""
    from ..runtime.zero3 import zero3_init_disabled

    cls = getattr(importlib.import_module(library), class_name)
    with zero3_init_disabled(), torch.device("meta"):
        if library == "transformers":
            config_cls = cls.config_class
            known = {k: v for k, v in config.items() if not k.startswith("_")}
            if "text_config" in known and "text_config" not in getattr(config_cls, "sub_configs", {}):
                known = known["text_config"]  # a whole CLIP config saved for a CLIP text model
            return cls(config_cls(**known))
        return cls.from_config(config)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({type(e).__name__}: {e})") from e


def pipeline_components(pipeline: str | os.PathLike) -> tuple[object, dict[str, Component]]:
    """``(family, {folder: Component})`` of a pipeline folder, a hub id (configs only) or a
    carried config; the family's denoiser is marked trainable."""
    from ..families import FAMILIES, FAMILY_NAMES, family_of_index

    key = str(pipeline)
    folder = None
    if key in KNOWN_PIPELINES and not Path(key).is_dir():
        known = KNOWN_PIPELINES[key]
        class_name = known["_class_name"]
        family = FAMILY_NAMES[known["family"]]
        components = {
            name: Component(name, lib, cls, dict(cfg))
            for name, (lib, cls, cfg) in known["components"].items()
        }
    else:
        folder = _config_folder(key)
        index = _read_json(folder / "model_index.json")
        class_name = index.get("_class_name", "?")
        family = family_of_index(index)
        components = {}
        for name, value in index.items():
            if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
                continue
            lib, cls = value
            if lib is None:
                continue  # an optional component the pipeline was saved without
            if lib not in ("diffusers", "transformers") and importlib.util.find_spec(
                f"diffusers.pipelines.{lib}"
            ):
                lib = f"diffusers.pipelines.{lib}"  # a pipeline's own module (LTX-2's connectors, vocoder)
            if (
                not lib.startswith(("diffusers", "transformers"))
                or not (folder / name / "config.json").is_file()
            ):
                continue  # tokenizers, schedulers, absent components
            components[name] = Component(name, lib, cls, _read_json(folder / name / "config.json"))
    if family is None:
        raise ValueError(f"{pipeline} is a {class_name} pipeline; supported: {', '.join(sorted(FAMILIES))}")
    trained = set(family.trained_denoisers(None))  # Wan 2.2: both experts train
    for name in list(components):
        if name not in trained and name not in family.frozen_components:
            del components[name]  # e.g. a safety checker: not part of training
    for name in trained & set(components):
        components[name].trainable = True
    for name in set(family.never_cached) & set(components):
        components[name].cacheable = False
    for spec in family.text_encoders if folder is not None else ():
        tokenizer_config = folder / spec.tokenizer / "tokenizer_config.json"
        if spec.name in components and tokenizer_config.is_file():
            length = _read_json(tokenizer_config).get("model_max_length")
            if isinstance(length, (int, float)) and length > 0:  # the training tokenizer's length
                components[spec.name].tokenizer_max_length = int(length)
    return family, components


def model_component(name: str, folder: str | os.PathLike) -> Component:
    """A frozen, uncacheable ``Component`` from a model folder (or hub id) holding its
    ``config.json``: a transformers model (class from ``architectures``) or a diffusers one
    (``_class_name``). ``ValueError`` when neither names a class."""
    config = _read_json(_config_folder(str(folder)) / "config.json")
    if config.get("_class_name"):
        return Component(name, "diffusers", config["_class_name"], config, cacheable=False)
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{folder}/config.json names no model class (no architectures, no _class_name)")
    return Component(name, "transformers", architectures[0], config, cacheable=False)


def job_components(pipeline: str | os.PathLike, options: PlanOptions) -> tuple[object, dict[str, Component]]:
    """``pipeline_components`` plus the job's other frozen models: the reference denoiser
    (``options.reference``; planned for full fine-tuning only: with LoRA the reference is the
    base with the adapters disabled) and each reward model of ``options.reward_models``."""
    family, components = pipeline_components(pipeline)
    if options.reference:
        denoiser = components[family.denoiser]
        components["reference"] = Component(
            "reference", denoiser.library, denoiser.class_name, denoiser.config, cacheable=False
        )
    for name, folder in options.reward_models.items():
        components[f"reward:{name}"] = model_component(f"reward:{name}", folder)
    return family, components


def text_sequence_length(comp: Component, spec, family, max_sequence_length: int | None = None) -> int:
    """Tokens per caption the training script feeds a text encoder (``Family.token_length``:
    a family's template tokens included):
    ``--max_sequence_length`` or the family's default for T5; otherwise the tokenizer's
    ``model_max_length`` (its ``tokenizer_config.json``), or, for a config without tokenizer
    files (carried, published), the encoder's ``max_position_embeddings`` up to 77 (CLIP's),
    never more than the encoder's ``max_position_embeddings``."""
    from types import SimpleNamespace

    positions = None
    if not spec.uses_max_sequence_length:
        positions = getattr(comp.meta_module().config, "max_position_embeddings", None)
    length = comp.tokenizer_max_length or min(positions or 77, 77)
    if positions:
        length = min(length, positions)
    return family.token_length(spec, SimpleNamespace(model_max_length=length), max_sequence_length)


def _config_folder(pipeline: str) -> Path:
    path = Path(pipeline)
    if path.is_dir():
        return path
    if path.is_absolute() or pipeline.startswith((".", "~")):
        raise ValueError(f"pipeline folder {pipeline!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(pipeline, allow_patterns=["*.json"]))
    except Exception as e:  # offline, unknown id, gated repository
        known = ", ".join(KNOWN_PIPELINES)
        raise ValueError(
            f"{pipeline!r} is neither a local folder nor reachable on the hub ({type(e).__name__}); "
            f"configs carried offline: {known}"
        ) from e


# ---------------------------------------------------------------------------- bytes


def _bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


def lora_parameters(module: torch.nn.Module, rank: int, target_modules: tuple[str, ...] | list[str]) -> int:
    """Parameters of rank-``rank`` LoRA adapters on ``module``'s layers named by
    ``target_modules`` (peft's rule: the module's name is a target or ends in ``.target``):
    ``rank·(in + out)`` per Linear, ``rank·(in·k·k + out)`` per Conv2d."""
    total = 0
    for name, sub in module.named_modules():
        if not any(name == t or name.endswith("." + t) for t in target_modules):
            continue
        if isinstance(sub, torch.nn.Linear):
            total += rank * (sub.in_features + sub.out_features)
        elif isinstance(sub, torch.nn.Conv2d):
            k = sub.kernel_size[0] * sub.kernel_size[1]
            total += rank * (sub.in_channels // sub.groups * k + sub.out_channels)
    return total


def denoiser_placements(
    module: torch.nn.Module,
    world_size: int,
    mixed_precision: str,
    use_ema: bool,
    lora: tuple[int, tuple[str, ...]] | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes per rank of the trained denoiser by placement (see the module doc)."""
    from ..runtime.ds_config import DEEPSPEED_LIVE_DEFAULT, typical_hidden_size, zero3_bucket_sizes
    from .frozen import sharded_elements

    b = _bytes(resolve_dtype(mixed_precision, {}, None))
    numels = [p.numel() for p in module.parameters()]
    psi = sum(numels)
    sizes = zero3_bucket_sizes(module)
    threshold = sizes["stage3_param_persistence_threshold"]
    trainable = psi if lora is None else lora_parameters(module, *lora)
    # the reduce bucket and optimizer sub-groups: sized by the largest trainable parameter
    # (ds_config.zero3_bucket_sizes), under LoRA an adapter, smaller than hidden^2
    reduced = sizes["reduce_bucket_size"] if lora is None else typical_hidden_size(module) ** 2
    # LoRA adapters are partitioned like the rest; their shapes are small and many stay whole
    base = sharded_elements(numels, world_size, threshold) * b
    own = math.ceil(trainable / world_size)
    # the parameters gathered at once beyond the running module (ds_config.live_parameters)
    window = min(psi, sizes.get("stage3_max_live_parameters", DEEPSPEED_LIVE_DEFAULT))
    master = 4 * own if b != 4 else 0
    zero = {
        "parameters": base + (own * b if lora is not None else 0),
        "gradients": own * b,
        "optimizer": 8 * own + master,
        "ema": 4 * own if use_ema else 0,
        # the gradient reduce bucket, the fp32 copy of one optimizer sub-group's gradients
        # that DeepSpeed makes at each step, and the gathered window
        "buffers": (reduced + window) * b + 4 * min(reduced, own),
    }
    out = {
        "shard": {**zero, "host_bytes_per_rank": 0},
        "offload": {
            **zero,
            "gradients": 0,
            "optimizer": 0,
            "host_bytes_per_rank": 4 * own + zero["optimizer"] + (4 * own if b == 4 else 0),
        },
    }
    if lora is None:  # DDP for comparison: fp32 weights (autocast), gradients, buckets, Adam
        out["replicate"] = {
            "parameters": 4 * psi,
            "gradients": 4 * psi,
            "optimizer": 8 * psi,
            "ema": 4 * psi if use_ema else 0,
            "buffers": 4 * psi,
            "host_bytes_per_rank": 0,
        }
    for p in out.values():
        p["bytes_per_rank"] = sum(v for k, v in p.items() if k != "host_bytes_per_rank")
    return out


def cache_bytes_per_image(
    comp: Component,
    family,
    dtype_bytes: int,
    resolution: int | tuple[int, int],
    sequence_length: int,
    num_frames: int = 1,
) -> int:
    """Bytes a cached model's outputs take per image (or per clip of ``num_frames`` frames, for
    a video family), in the dtype it runs in: the outputs the family stores for a text encoder
    (``encode_text`` run on the meta device), or the VAE's latent distribution (mean and
    log-variance) at ``resolution`` (square, or ``(height, width)``)."""
    height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
    key = (num_frames, height, width, sequence_length)
    if key not in comp._output_elements:
        module = comp.meta_module()
        with torch.no_grad():
            if comp.name == "vae":
                shape = (1, 3, num_frames, height, width) if family.video else (1, 3, height, width)
                pixels = torch.zeros(*shape, device="meta")
                outputs = {"latent_params": family.latent_distribution(module, pixels).parameters}
            else:
                ids = torch.zeros(1, sequence_length, dtype=torch.long, device="meta")
                outputs = family.encode_text(comp.name, module, ids)
        comp._output_elements[key] = sum(t.numel() for t in outputs.values())
    return comp._output_elements[key] * dtype_bytes


def frozen_placements(
    comp: Component,
    family,
    world_size: int,
    mixed_precision: str,
    resolution: int | tuple[int, int],
    sequence_length: int,
    num_frames: int = 1,
) -> dict[str, dict[str, int]]:
    """Bytes per rank of a frozen model by placement (see the module doc); the cache's bytes
    per image (or clip of ``num_frames``) at ``resolution``."""
    from .frozen import placement_bytes_per_rank

    module = comp.meta_module()
    dtype = family.component_dtype(comp.name, resolve_dtype(mixed_precision, {}, None))
    shard = placement_bytes_per_rank(module, "shard", world_size, dtype)
    replicate = placement_bytes_per_rank(module, "replicate", world_size, dtype)
    rows = {
        "replicate": {"bytes_per_rank": replicate, "parameters": replicate},
        "shard": {"bytes_per_rank": shard, "parameters": shard},
        "offload": {"bytes_per_rank": 0, "parameters": 0, "host_bytes_per_rank": shard},
    }
    if not comp.cacheable:
        return rows
    return {
        **rows,
        "cache": {
            "bytes_per_rank": 0,
            "parameters": 0,
            "cache_bytes_per_image": cache_bytes_per_image(
                comp, family, _bytes(dtype), resolution, sequence_length, num_frames
            ),
        },
    }


# ---------------------------------------------------------------------------- plan


@dataclass
class PlanOptions:
    """What the job looks like (the planner's flags)."""

    num_processes: int = 1
    num_machines: int = 1
    device_memory: int | None = None  # bytes per rank; None: no limit (everything fits)
    mixed_precision: str = "no"
    use_ema: bool = False
    rank: int | None = None
    offload: str = "none"  # which offloads may be recommended: none, frozen, optimizer, all
    fixed_data: bool = False  # the same images and captions every epoch: frozen outputs can be cached
    resolution: int = 512
    height: int | None = None  # with width: the cache's image or clip size instead of resolution
    width: int | None = None
    num_frames: int = 1  # a video family's frames per clip (the cache's bytes per clip)
    max_sequence_length: int | None = None
    margin: float = 0.25
    zero3: bool = True  # False: a DDP launch, where nothing can be sharded or offloaded
    fixed_placements: dict[str, str] = field(default_factory=dict)  # components the user placed
    reference: bool = False  # a frozen copy of the denoiser (full fine-tuning with DPO or GRPO's KL)
    reward_models: dict[str, str] = field(default_factory=dict)  # {name: folder with its config.json}
    context_parallel_size: int = 1  # K: ranks splitting one sample's tokens (the activations' count)
    gradient_checkpointing: bool = False  # the activations' count: each block recomputed in the backward


def make_plan(pipeline: str | os.PathLike, options: PlanOptions) -> dict:
    """The plan as a JSON-ready dict: ``num_processes``, ``components`` (class, exact
    parameter count, trainable, bytes per placement), ``recommended`` placements,
    ``total_bytes_per_rank`` of the recommended set, ``fits`` and ``advice``."""

    if options.mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"--mixed_precision must be no, fp16 or bf16, got {options.mixed_precision!r}")
    if options.num_processes < 1 or options.num_machines < 1 or options.num_processes % options.num_machines:
        raise ValueError(
            f"--num_processes ({options.num_processes}) must be a positive multiple of --num_machines "
            f"({options.num_machines})"
        )
    k = options.context_parallel_size
    if k < 1 or options.num_processes % k:
        raise ValueError(
            f"--context_parallel_size ({k}) must be a positive divisor of --num_processes ({options.num_processes})"
        )
    family, components = job_components(pipeline, options)
    plan = {
        "pipeline": str(pipeline),
        "pipeline_class": family.pipeline_class,
        **_plan(components, family, options),
        "notes": plan_notes(str(pipeline), components, family),
    }
    if not plan["fits"]:
        plan["advice"] = what_would_fit(components, family, options)
    activations = plan_activations(components, family, options, plan["components"])
    if activations is not None:
        plan.update(activations)
        plan["notes"] = [n for n in plan["notes"] if "frames x height x width" not in n]
    return plan


def plan_activations(
    components: dict[str, Component], family, options: PlanOptions, planned: dict
) -> dict | None:
    """``{"activations": ..., "context_parallel_fits": ...}`` for a Wan transformer given a clip
    (``num_frames`` above 1, or a ``context_parallel_size``; None otherwise and for any other
    denoiser): the activation bytes per rank of one micro-batch (batch 1) at the
    clip of ``options`` and ``options.context_parallel_size``; with a device memory, one row per
    K dividing the processes (and the heads, for Ulysses): the model states per rank of the
    placements ``recommend`` picks for ``planned`` (the plan's components) in what the
    activations leave of the device memory less the margin, whether both fit, its placements,
    and the smallest K that fits (None when none does)."""
    from dataclasses import replace

    from ..families.wan import vae_compression
    from .activations import activation_bytes, latent_tokens, wan_shape

    denoiser = components.get(family.denoiser)
    if denoiser is None or denoiser.class_name != "WanTransformer3DModel" or "vae" not in components:
        return None
    if options.num_frames == 1 and options.context_parallel_size == 1:
        return None  # no clip given: the note says what grows with it
    shape = wan_shape(denoiser.config, family.expand_timesteps)
    vae_config = components["vae"].config
    spatial = vae_compression(vae_config)[1]
    height, width = options.height or options.resolution, options.width or options.resolution
    frames = family.latent_frames(options.num_frames, vae_config)
    tokens = latent_tokens(frames, height // spatial, width // spatial, shape.patch)
    spec = next((e for e in family.text_encoders if e.name in components), None)
    text = (
        512
        if spec is None
        else text_sequence_length(components[spec.name], spec, family, options.max_sequence_length)
    )
    b = _bytes(resolve_dtype(options.mixed_precision, {}, None))

    def at(k: int) -> dict:
        return activation_bytes(
            shape,
            tokens,
            text,
            b,
            context_parallel_size=k,
            gradient_checkpointing=options.gradient_checkpointing,
        )

    out: dict = {
        "activations": {
            "tokens": tokens,
            "latent_grid": [frames, height // spatial // shape.patch[1], width // spatial // shape.patch[2]],
            "text_length": text,
            "context_parallel_size": options.context_parallel_size,
            "gradient_checkpointing": options.gradient_checkpointing,
            **at(options.context_parallel_size),
        }
    }
    if options.device_memory is None:
        return out
    budget = int(options.device_memory * (1 - options.margin))
    rows = []
    for k in range(1, options.num_processes + 1):
        if options.num_processes % k or shape.heads % k:
            continue
        act = at(k)
        left = max(0, budget - act["bytes"]) / (1 - options.margin)  # the device memory the states may use
        states = recommend(planned, replace(options, device_memory=int(left)))
        rows.append(
            {
                "context_parallel_size": k,
                "tokens_per_rank": act["tokens_per_rank"],
                "activation_bytes": act["bytes"],
                "state_bytes": states["total_bytes_per_rank"],
                "fits": states["total_bytes_per_rank"] + act["bytes"] <= budget,
                "recommended": states["recommended"],
            }
        )
    smallest = next((r["context_parallel_size"] for r in rows if r["fits"]), None)
    out["context_parallel_fits"] = {"budget_bytes_per_rank": budget, "rows": rows, "smallest": smallest}
    return out


VISION_PARTS = ("visual.", "vision_tower.", "multi_modal_projector.")


def plan_notes(pipeline: str, components: dict[str, Component], family=None) -> list[str]:
    """What the counts include that a reader would not expect: a carried config's note, each
    vision-language text encoder's vision tower (loaded and counted, never run), and that a
    video family's activations grow with the clip."""
    notes = []
    if family is not None and family.video:
        notes.append(
            "activations are not counted, and a video's grow with frames x height x width (the latent "
            "tokens: (frames - 1) / 4 + 1 latent frames of (height / 16) x (width / 16) for Wan 2.1): "
            "the --margin kept for them must hold a clip of the size trained, or the clips must be shorter"
        )
    known = KNOWN_PIPELINES.get(pipeline)
    if known and known.get("note") and not Path(pipeline).is_dir():
        notes.append(known["note"])
    for name, comp in components.items():
        if (
            comp.trainable
            or name.startswith("reward:")
            or not hasattr(comp.meta_module().config, "vision_config")
            or (family is not None and family.encodes_source_images)  # its vision tower runs
        ):
            # (a reward judge runs its vision tower)
            continue
        vision = sum(
            p.numel()
            for n, p in comp.meta_module().named_parameters()
            if any(part in n for part in VISION_PARTS)
        )
        notes.append(
            f"{name} ({comp.class_name}) is counted whole as it loads: {vision:,} of its {comp.parameters:,} "
            "parameters are its vision tower, which never runs (only the text path encodes prompts)"
        )
    return notes


def _plan(components: dict[str, Component], family, options: PlanOptions) -> dict:
    n = options.num_processes
    out: dict = {"num_processes": n, "components": {}}
    for name, comp in components.items():
        if name == "reference" and options.rank:
            continue  # LoRA: the reference is the base with the adapters disabled
        if comp.trainable:
            lora = (options.rank, tuple(family.lora_target_modules)) if options.rank else None
            placements = denoiser_placements(
                comp.meta_module(), n, options.mixed_precision, options.use_ema, lora
            )
        else:
            spec = next((e for e in family.text_encoders if e.name == name), None)
            seq = 0  # the VAE takes no tokens
            if spec is not None:
                seq = text_sequence_length(comp, spec, family, options.max_sequence_length)
            size = (options.height or options.resolution, options.width or options.resolution)
            placements = frozen_placements(
                comp, family, n, options.mixed_precision, size, seq, options.num_frames if family.video else 1
            )
        out["components"][name] = {
            "class": comp.class_name,
            "parameters": comp.parameters,
            "trainable": comp.trainable,
            "placements": placements,
        }
        if not comp.cacheable:
            out["components"][name]["cacheable"] = False
    out.update(recommend(out["components"], options))
    return out


def _choices(name: str, component: dict, options: PlanOptions) -> list[str]:
    """The placements the planner may pick for a component, fastest first."""
    if name in options.fixed_placements:
        return [options.fixed_placements[name]]
    if not options.zero3:
        return (
            ["replicate"]
            if component["trainable"]
            else [
                p
                for p in ("replicate", "cache")
                if p in component["placements"] and (p != "cache" or options.fixed_data)
            ]
        )
    if component["trainable"]:
        allowed = ["shard"]
        if options.offload in ("optimizer", "all"):
            allowed.append("offload")
        return allowed
    allowed = [
        p for p in FROZEN_ORDER if p in component["placements"] and (p != "cache" or options.fixed_data)
    ]
    if options.offload not in ("frozen", "all"):
        allowed.remove("offload")
    return allowed


def _total(components: dict, chosen: dict[str, str]) -> int:
    return sum(components[name]["placements"][p]["bytes_per_rank"] for name, p in chosen.items())


def recommend(components: dict, options: PlanOptions) -> dict:
    """The fastest placements that fit ``options.device_memory`` less the margin: each
    component starts at its fastest choice, and the largest ones move to their next choice
    until the total fits (replicate where it fits, cache where the data is fixed and it does
    not, shard where it must, offload where allowed). Says what would fit when nothing does."""
    choices = {name: _choices(name, c, options) for name, c in components.items()}
    chosen = {name: cs[0] for name, cs in choices.items()}
    budget = None if options.device_memory is None else int(options.device_memory * (1 - options.margin))

    def bytes_of(name: str) -> int:
        return components[name]["placements"][chosen[name]]["bytes_per_rank"]

    while budget is not None and _total(components, chosen) > budget:
        movable = [n for n in chosen if choices[n].index(chosen[n]) + 1 < len(choices[n]) and bytes_of(n) > 0]
        if not movable:
            break
        frozen = [n for n in movable if not components[n]["trainable"]]
        name = max(frozen or movable, key=bytes_of)  # frozen models move before the trained one
        chosen[name] = choices[name][choices[name].index(chosen[name]) + 1]
    total = _total(components, chosen)
    fits = budget is None or total <= budget
    result = {"recommended": chosen, "total_bytes_per_rank": total, "fits": fits}
    if budget is not None:
        result["budget_bytes_per_rank"] = budget
    return result


def what_would_fit(components: dict[str, Component], family, options: PlanOptions) -> list[str]:
    """Sentences naming changes that would make the job fit, each checked by planning again:
    more processes, offloading, LoRA, caching the frozen models' outputs."""
    from dataclasses import replace

    advice = []
    n = options.num_processes
    while n < 4096:
        n *= 2
        if _plan(components, family, replace(options, num_processes=n))["fits"]:
            advice.append(f"it would fit on {n} processes (--num_processes {n})")
            break
    else:
        advice.append("it does not fit on up to 4096 processes")
    variants = [
        (
            "offload=all",
            "with --offload all (frozen shards and the optimizer in host memory)",
            {"offload": "all"},
        ),
        ("fixed_data", "with --fixed_data (the frozen models' outputs cached)", {"fixed_data": True}),
        ("rank", "with LoRA (--rank 16)", {"rank": 16}),
    ]
    for key, text, change in variants:
        if key == "offload=all" and options.offload == "all" or key == "fixed_data" and options.fixed_data:
            continue
        if key == "rank" and options.rank:
            continue
        if _plan(components, family, replace(options, **change))["fits"]:
            advice.append(f"it would fit at --num_processes {options.num_processes} {text}")
    return advice


def device_memory_per_rank(accelerator) -> int:
    """Memory one rank may use: its GPU's total memory, else the host's memory divided by
    the processes on this machine."""
    if accelerator.device.type == "cuda":
        return torch.cuda.get_device_properties(accelerator.device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, accelerator.state.num_processes // max(1, _num_machines()))


def _num_machines() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return max(1, world // local) if local else 1


def resolve_auto_placements(
    placements: dict[str, str], source: str | os.PathLike, accelerator, job: PlanOptions
) -> tuple[dict[str, str], dict | None]:
    """``(placements, plan)``: ``placements`` (``{component: placement}``) with every ``auto``
    replaced by the planner's choice for this job, and the plan (None when nothing is
    ``auto``). ``job`` says what the job trains (``PlanOptions``: ``fixed_data``, ``use_ema``,
    LoRA ``rank``, the image or clip size, ``max_sequence_length``); the machine's fields
    (processes, machines, device memory, mixed precision, which offloads, ZeRO-3) come from
    ``accelerator`` and the placements given stay as given. Logs the table and the choice;
    raises ``ValueError`` for an ``auto`` the planner has no component for.

    Example:
        >>> job = PlanOptions(fixed_data=True, use_ema=True, resolution=1024)
        >>> placements, plan = resolve_auto_placements({"vae": "auto", "text_encoder": "shard"}, source, acc, job)

    Collective: every rank calls it; rank 0 plans and broadcasts, so all ranks place alike.
    """
    from ..runtime.distributed import all_gather_object, get_rank

    auto = [name for name, value in placements.items() if value == "auto"]
    if not auto:
        return dict(placements), None
    plan = None
    if get_rank() == 0:
        options = replace(
            job,
            num_processes=accelerator.num_processes,
            num_machines=_num_machines(),
            device_memory=device_memory_per_rank(accelerator),
            mixed_precision=accelerator.mixed_precision
            if accelerator.mixed_precision in MIXED_PRECISIONS
            else "no",
            rank=job.rank or None,
            offload="frozen" if accelerator.device.type == "cuda" else "none",
            zero3=accelerator.state.deepspeed_plugin is not None,
            fixed_placements={k: v for k, v in placements.items() if v not in ("auto",) and k != "reference"},
        )
        plan = make_plan(source, options)
    plan = all_gather_object(plan)[0]
    log_rank_zero("placement plan (--*_placement auto):\n" + format_table(plan))
    resolved = dict(placements)
    for name in auto:
        if name not in plan["recommended"]:
            raise ValueError(f"--{name}_placement auto: the planner has no {name} for this pipeline")
        resolved[name] = plan["recommended"][name]
    log_rank_zero("auto placements: " + ", ".join(f"{n}={resolved[n]}" for n in auto))
    return resolved, plan


def format_table(plan: dict) -> str:
    """The plan as a text table: one row per component and placement (MiB per rank), the
    recommended rows marked, then the totals."""
    head = (
        f"{'component':<16} {'class':<36} {'params':>14} {'placement':<10} {'params MiB':>11} "
        f"{'grads MiB':>10} {'optim MiB':>10} {'EMA MiB':>9} {'buffers':>9} {'total MiB':>11} "
        f"{'host MiB':>10} {'cache/img':>10}"
    )
    lines = [
        f"{plan['pipeline_class']} {plan['pipeline']}: bytes per rank at N={plan['num_processes']}",
        head,
        "-" * len(head),
    ]
    for name, comp in plan["components"].items():
        for placement, row in comp["placements"].items():
            mark = "*" if plan["recommended"].get(name) == placement else " "
            cache = row.get("cache_bytes_per_image")
            lines.append(
                f"{name:<16} {comp['class']:<36} {comp['parameters']:>14,} {mark}{placement:<9} "
                f"{row.get('parameters', 0) / MIB:>11.1f} {row.get('gradients', 0) / MIB:>10.1f} "
                f"{row.get('optimizer', 0) / MIB:>10.1f} {row.get('ema', 0) / MIB:>9.1f} "
                f"{row.get('buffers', 0) / MIB:>9.1f} {row['bytes_per_rank'] / MIB:>11.1f} "
                f"{row.get('host_bytes_per_rank', 0) / MIB:>10.1f} "
                f"{'' if cache is None else f'{cache / MIB:.2f} MiB':>10}"
            )
    chosen = ", ".join(f"{k}={v}" for k, v in plan["recommended"].items())
    lines.append(f"recommended (*): {chosen}")
    total = f"total per rank: {plan['total_bytes_per_rank'] / GIB:.2f} GiB"
    if "budget_bytes_per_rank" in plan:
        total += f" of {plan['budget_bytes_per_rank'] / GIB:.2f} GiB usable"
        total += " (fits)" if plan["fits"] else " (does NOT fit)"
    lines.append(total + "; activations not included")
    lines.extend(_activation_lines(plan))
    lines.extend(f"note: {n}" for n in plan.get("notes", []))
    lines.extend(plan.get("advice", []))
    return "\n".join(lines)


def _activation_lines(plan: dict) -> list[str]:
    """The table's lines for a plan's ``activations`` and ``context_parallel_fits`` (none
    without them)."""
    act = plan.get("activations")
    if act is None:
        return []
    f, h, w = act["latent_grid"]
    ckpt = "with" if act["gradient_checkpointing"] else "without"
    lines = [
        f"activations per rank (one clip of {f} x {h} x {w} = {act['tokens']:,} tokens, {act['text_length']} text "
        f"tokens, {ckpt} gradient checkpointing): K={act['context_parallel_size']}: "
        f"{act['tokens_per_rank']:,} tokens per rank, {act['bytes'] / GIB:.2f} GiB"
    ]
    fits = plan.get("context_parallel_fits")
    if fits is None:
        return lines
    lines.append(
        f"{'K':>3} {'tokens/rank':>12} {'activ. GiB':>11} {'states GiB':>11} {'total GiB':>10}  fits  placements"
    )
    for r in fits["rows"]:
        total = r["activation_bytes"] + r["state_bytes"]
        lines.append(
            f"{r['context_parallel_size']:>3} {r['tokens_per_rank']:>12,} {r['activation_bytes'] / GIB:>11.2f} "
            f"{r['state_bytes'] / GIB:>11.2f} {total / GIB:>10.2f}  {'yes' if r['fits'] else 'no ':<4}"
            + ", ".join(f"{n}={p}" for n, p in r["recommended"].items())
        )
    usable = f"{fits['budget_bytes_per_rank'] / GIB:.2f} GiB usable"
    if fits["smallest"] is None:
        lines.append(f"no --context_parallel_size up to {plan['num_processes']} fits the {usable}")
    else:
        lines.append(f"smallest --context_parallel_size that fits the {usable}: {fits['smallest']}")
    return lines


_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80GB"`` (read as GiB), ``"512MiB"`` or a number of bytes -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 80GiB, 24GB, 512MiB)")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m diffusers_zero3.placement.plan``."""
    p = argparse.ArgumentParser(
        prog="python -m diffusers_zero3.placement.plan", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("pipeline", help="pipeline folder, hub id, or one of: " + ", ".join(KNOWN_PIPELINES))
    p.add_argument("--num_processes", type=int, default=1, help="ranks in all (all machines)")
    p.add_argument("--num_machines", type=int, default=1)
    p.add_argument("--device_memory", type=parse_bytes, default=None, help="per rank, e.g. 80GiB")
    p.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--use_ema", action="store_true")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (the denoiser frozen, adapters trained)")
    p.add_argument(
        "--offload",
        default="none",
        choices=["none", "frozen", "optimizer", "all"],
        help="offloads the recommendation may use: frozen models' shards and/or the optimizer to host memory",
    )
    p.add_argument("--fixed_data", action="store_true", help="the frozen models' outputs may be cached")
    p.add_argument("--resolution", type=int, default=None, help="for the cache's bytes per image")
    p.add_argument("--height", type=int, default=None, help="with --width: a non-square image or clip")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num_frames", type=int, default=1, help="a video family's frames per clip (the cache)")
    p.add_argument("--max_sequence_length", type=int, default=None)
    p.add_argument(
        "--reference",
        action="store_true",
        help="count a frozen copy of the denoiser (full fine-tuning with DPO, or GRPO's KL); none with --rank",
    )
    p.add_argument(
        "--reward_model",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="count a reward model from the folder (or hub id) of its config.json; repeatable",
    )
    p.add_argument(
        "--context_parallel_size",
        type=int,
        default=1,
        help="K ranks split each clip's tokens (the activations' count, Wan); must divide --num_processes",
    )
    p.add_argument(
        "--gradient_checkpointing", action="store_true", help="count activations with each block recomputed"
    )
    p.add_argument("--margin", type=float, default=0.25, help="share of the device memory kept free")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from .rl_plan import add_rl_arguments  # the RL mode (--rl): its own module, which imports this one

    add_rl_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the plan (a table, or JSON with ``--json``); a bad input is one ``error:`` line
    on stderr and exit code 2."""
    from .rl_plan import format_rl_table, make_rl_plan, rl_options_from_args

    args = parser().parse_args(argv)
    try:
        options = options_from_args(args)
        rl = rl_options_from_args(args)
        plan = make_plan(args.pipeline, options) if rl is None else make_rl_plan(args.pipeline, options, rl)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = format_table if rl is None else format_rl_table
    print(json.dumps(plan, indent=1) if args.json else table(plan))
    return 0


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    """``PlanOptions`` from the parsed command line; ``ValueError`` for a value out of range."""
    if args.rank is not None and args.rank < 1:
        raise ValueError(f"--rank must be at least 1, got {args.rank}")
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin must be in [0, 1), got {args.margin}")
    if args.num_frames < 1:
        raise ValueError(f"--num_frames must be at least 1, got {args.num_frames}")
    reward_models: dict[str, str] = {}
    for pair in args.reward_model:
        name, sep, folder = pair.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--reward_model takes NAME=FOLDER, got {pair!r}")
        if name in reward_models:
            raise ValueError(f"--reward_model {name} is given twice")
        reward_models[name] = folder
    return PlanOptions(
        reference=args.reference,
        reward_models=reward_models,
        num_processes=args.num_processes,
        num_machines=args.num_machines,
        device_memory=args.device_memory,
        mixed_precision=args.mixed_precision,
        use_ema=args.use_ema,
        rank=args.rank,
        offload=args.offload,
        fixed_data=args.fixed_data,
        resolution=args.resolution or 512,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        max_sequence_length=args.max_sequence_length,
        margin=args.margin,
        context_parallel_size=args.context_parallel_size,
        gradient_checkpointing=args.gradient_checkpointing,
    )


if __name__ == "__main__":
    sys.exit(main())


# -------------------------------------------------------------------------------- settling a job's placements


def live_text_for_caption_dropout(
    placements: dict[str, str],
    requested: dict[str, str],
    family,
    empty_prompt_probability: float,
    live: str = "shard",
) -> dict[str, str]:
    """The placements with every text encoder live when captions are emptied at random
    (``--proportion_empty_prompts`` / ``--caption_dropout``): a cache holds each row's own
    caption's embedding, so the emptied captions would be ignored without a word. A cache that
    ``auto`` chose becomes ``live`` (``shard`` under DeepSpeed, else ``replicate``; logged); one
    the user asked for is one error line."""
    if not empty_prompt_probability:
        return placements
    placements = dict(placements)
    for spec in family.text_encoders:
        if placements.get(spec.name) != "cache":
            continue
        if requested.get(spec.name, "auto") != "auto":
            raise ArgumentError(
                f"--{spec.name}_placement cache holds each row's caption embedding, so --proportion_empty_prompts "
                "/ --caption_dropout would be ignored: give replicate, shard or offload, or no caption dropout"
            )
        placements[spec.name] = live
        log_rank_zero(f"{spec.name}: {live}, not the cache 'auto' chose (caption dropout needs it live)")
    return placements


def check_pair_placements(
    placements: dict[str, str], family, reads_pairs: bool, mask_column: str | None
) -> None:
    """One error line for a cache placement that would hold what changes every step: the
    VAE's latents under ``--mask_column`` (each step's crop of the mask) or editing pairs (each
    step's sources), a text encoder that reads the sources (Qwen-Image-Edit's VL)."""
    if mask_column is not None and placements.get("vae") == "cache":
        raise ArgumentError(
            "--mask_column needs each step's crop and flip of the mask: give --vae_placement replicate or shard, "
            "not cache"
        )
    if reads_pairs and placements.get("vae") == "cache":
        raise ArgumentError(
            "editing pairs encode each step's source images with the live VAE: give --vae_placement replicate, "
            "shard or offload (not cache / --cache_latents)"
        )
    if reads_pairs and family.encodes_source_images:
        for spec in family.text_encoders:
            if placements.get(spec.name) == "cache":
                raise ArgumentError(
                    f"{family.title}'s {spec.name} reads each step's source images: give "
                    f"--{spec.name}_placement replicate, shard or offload (not cache)"
                )
