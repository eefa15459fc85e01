"""Model families: everything that differs between kinds of pipeline, one module per family.

A ``Family`` (``base.py``) answers, for one kind of pipeline: its components (the trained
denoiser, the frozen text encoders with their tokenizers, the VAE, by class), how a caption
becomes token ids and attention masks (templates included) and each encoder's named outputs,
how they combine into the denoiser's conditioning, how images become normalised latents, the
objective (DDPM noise prediction or flow matching) behind one ``loss`` signature, the
denoiser call (packing, position ids, guidance), what its modules need under ZeRO-3 (leaf
modules), its pipeline class, and its published configs for the planner. Everything else
in the package (placements, the cache, EMA, checkpoints, load/save, lockstep, the loop) is
written once and asks the family. A family's tiny pipeline is a fixture, built in
``diffusers_zero3.demo``.

One module per family: ``sd`` (SD 1.x/2.x), ``sdxl``, ``sd3``, ``flux`` (Flux.1),
``qwenimage`` (Qwen-Image), ``zimage`` (Z-Image), ``hidream`` (HiDream-I1), ``flux2`` (Flux.2
[dev] and [klein]), ``wan`` (Wan 2.1, Wan 2.2 A14B and TI2V-5B: one pipeline class, told apart
by ``Family.matches``), ``krea2`` (Krea 2), ``kontext`` (Flux.1 Kontext: instruction editing),
``nucleusmoe`` (NucleusMoE-Image), ``ideogram4`` (Ideogram 4), ``hunyuanvideo15``
(HunyuanVideo 1.5), ``qwenimage_edit`` (Qwen-Image-Edit-Plus: instruction editing), ``ltx2`` (LTX-2: video
with its sound).

``detect_family(folder)`` picks the family from the pipeline's ``model_index.json``
(``_class_name``), with the values the pipeline registers there (``Family.configured``: Krea 2's
text encoder taps, for one); an unsupported pipeline gets one ``CheckpointError`` listing the supported
ones. ``family_named("sdxl")`` gives one by its short name (``make train MODEL=...``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..state.pretrained import CheckpointError
from .base import Family, PublishedConfig, TextEncoderSpec
from .flux import FLUX, latent_image_ids, pack_latents, unpack_latents
from .flux2 import FLUX2, FLUX2_KLEIN
from .hidream import HIDREAM
from .hunyuanvideo15 import HUNYUANVIDEO15
from .ideogram4 import IDEOGRAM4
from .kontext import KONTEXT
from .krea2 import KREA2
from .ltx2 import LTX2
from .nucleusmoe import NUCLEUSMOE
from .qwenimage import QWENIMAGE
from .qwenimage_edit import QWENIMAGE_EDIT
from .sd import SD
from .sd3 import SD3
from .sdxl import SDXL, time_ids
from .wan import WAN, WAN22, WAN22_5B
from .zimage import ZIMAGE

ALL_FAMILIES: tuple[Family, ...] = (
    SD,
    SDXL,
    SD3,
    FLUX,
    QWENIMAGE,
    ZIMAGE,
    HIDREAM,
    FLUX2,
    FLUX2_KLEIN,
    WAN,
    WAN22,
    WAN22_5B,
    KREA2,
    KONTEXT,
    NUCLEUSMOE,
    IDEOGRAM4,
    HUNYUANVIDEO15,
    QWENIMAGE_EDIT,
    LTX2,
)
# by pipeline class (the first family of a class: WanPipeline's three are told apart by family_of_index)
FAMILIES: dict[str, Family] = {}
for _family in ALL_FAMILIES:
    FAMILIES.setdefault(_family.pipeline_class, _family)
FAMILY_NAMES: dict[str, Family] = {f.name: f for f in ALL_FAMILIES}
# Every frozen model folder of any family: each gets its --<name>_placement flag.
FROZEN_COMPONENTS: tuple[str, ...] = tuple(
    dict.fromkeys(name for f in ALL_FAMILIES for name in f.frozen_components if name != "vae")
) + ("vae",)


def family_named(name: str) -> Family:
    """The family of a short name (``sd``, ``sdxl``, ``sd3``, ``flux``, ...)."""
    if name not in FAMILY_NAMES:
        raise ValueError(f"model must be one of {', '.join(FAMILY_NAMES)}, got {name!r}")
    return FAMILY_NAMES[name]


def detect_family(source: str | os.PathLike) -> Family:
    """The family of the pipeline folder ``source``, from ``model_index.json``'s ``_class_name``.

    Raises ``CheckpointError`` naming the class and the supported pipelines when it is not
    one of them.
    """
    index_file = Path(source) / "model_index.json"
    try:
        index = json.loads(index_file.read_text())
        class_name = index.get("_class_name")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {index_file} ({type(e).__name__}: {e})") from e
    family = family_of_index(index)
    if family is None:
        raise CheckpointError(
            f"{source} is a {class_name} pipeline; supported pipelines: {', '.join(sorted(FAMILIES))}"
        )
    return family


def family_of_index(model_index: dict) -> Family | None:
    """The family whose ``matches`` takes a ``model_index.json``'s contents, None when none does,
    with the values its pipeline registers in that config (``Family.configured``: the published
    values are only the pipeline's defaults)."""
    family = next((f for f in ALL_FAMILIES if f.matches(model_index)), None)
    return None if family is None else family.configured(model_index)


__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "FAMILY_NAMES",
    "FLUX",
    "FLUX2",
    "FLUX2_KLEIN",
    "FROZEN_COMPONENTS",
    "Family",
    "HIDREAM",
    "HUNYUANVIDEO15",
    "IDEOGRAM4",
    "KONTEXT",
    "KREA2",
    "LTX2",
    "NUCLEUSMOE",
    "PublishedConfig",
    "QWENIMAGE",
    "QWENIMAGE_EDIT",
    "SD",
    "SD3",
    "SDXL",
    "TextEncoderSpec",
    "WAN",
    "WAN22",
    "WAN22_5B",
    "ZIMAGE",
    "detect_family",
    "family_of_index",
    "family_named",
    "latent_image_ids",
    "pack_latents",
    "time_ids",
    "unpack_latents",
]
