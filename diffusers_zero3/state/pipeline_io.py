"""Validation images and the final pipeline folder of a text-to-image run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..runtime.distributed import is_main_process
from .folders import CheckpointError, collective_publish, fsync_dir, replace_folder
from .pretrained import save_pretrained_zero3


class VideoWithSound(list):
    """A validation video's PIL frames with its sound: ``audio`` ``(channels, samples)`` float in
    [-1, 1] at ``sample_rate`` (the vocoder's), and the ``fps`` the pipeline generated at."""

    def __init__(self, frames: list, audio: torch.Tensor, pipeline, pipeline_kwargs: dict):
        super().__init__(frames)
        self.audio = torch.as_tensor(audio).float().cpu()
        vocoder = pipeline.vocoder.config
        self.sample_rate = int(vocoder.get("output_sampling_rate") or pipeline.audio_sampling_rate)
        self.fps = float(pipeline_kwargs.get("frame_rate", 24.0))  # LTX2Pipeline's default


@torch.no_grad()
def generate_validation_images(
    pipeline,
    prompts: list[str],
    *,
    size: tuple[int, int],
    num_inference_steps: int = 20,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    sources: list | None = None,
    **pipeline_kwargs,
) -> list:
    """One image per prompt from a pipeline around the current weights. Collective: call on
    every rank.

    ``pipeline`` is a family's pipeline (``family.pipeline(...)``) around the trained
    denoiser and the placed frozen models. Every rank runs the same prompts with the same
    seed, so partitioned models (the denoiser engine, sharded frozen engines) are called the
    same number of times on every rank; all ranks get the same images, and one of them writes.
    ``pipeline_kwargs`` go to the pipeline call (a family's ``validation_kwargs``, e.g.
    Flux's ``max_sequence_length`` and ``guidance_scale``). A video pipeline gives each prompt's
    frames (a list of PIL images) instead of an image, each ``size`` ``(height, width)``.
    ``sources`` (one per prompt) are an editing pipeline's source images (its ``image``
    argument).

    ``dtype`` is the training's weight dtype: bf16 or fp16 run the pipeline under
    ``torch.autocast``, as diffusers' own training scripts validate. Without it the models'
    dtypes meet in the pipeline and a convolution refuses the mix: SDXL's VAE stays fp32 while
    the bf16 denoiser hands it bf16 latents, and without DeepSpeed accelerate's autocast
    wrapper returns fp32 latents to a bf16 VAE.
    """
    denoiser = pipeline.unet if hasattr(pipeline, "unet") else pipeline.transformer
    was_training = denoiser.training
    denoiser.eval()
    pipeline.set_progress_bar_config(disable=True)
    device = next(denoiser.parameters()).device
    images = []
    lower = dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(device.type, dtype=dtype, enabled=lower) if lower else contextlib.nullcontext():
        for i, prompt in enumerate(prompts):
            generator = torch.Generator(device=device).manual_seed(seed + i)
            if sources is not None:
                pipeline_kwargs["image"] = sources[i]
            out = pipeline(
                prompt=prompt,  # by name: Flux.2's first positional argument is an image
                num_inference_steps=num_inference_steps,
                generator=generator,
                height=size[0],
                width=size[1],
                **pipeline_kwargs,
            )
            # an image, or a video pipeline's list of PIL frames (with its sound: LTX-2)
            if hasattr(out, "images"):
                images.append(out.images[0])
            elif getattr(out, "audio", None) is not None:
                images.append(VideoWithSound(out.frames[0], out.audio[0], pipeline, pipeline_kwargs))
            else:
                images.append(out.frames[0])
    denoiser.train(was_training)
    return images


def image_grid(images: list, cols: int | None = None):
    """Paste PIL images of one size into a grid (one row when ``cols`` is None)."""
    from PIL import Image

    cols = cols or len(images)
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img, ((i % cols) * w, (i // cols) * h))
    return grid


@dataclass(frozen=True)
class CurveAxes:
    """A curve's axes (``plot_curve``): the x label (its last word names the unit: the
    optimizer step, or a round), the y label, and the y range (None: the values' own)."""

    xlabel: str = "optimizer step"
    ylabel: str = "value"
    y_range: tuple[float, float] | None = None


def plot_curve(
    values: list[float],
    path: str | os.PathLike,
    title: str,
    *,
    axes: CurveAxes | None = None,
    reference: tuple[float, str] | None = None,
    smooth: int | None = None,
    size: tuple[int, int] = (640, 360),
):
    """A per-step line chart of ``values`` as a PNG at ``path`` (matplotlib); returns ``path``.

    The x axis counts from 1, labelled ``axes.xlabel``; the y axis ``axes.ylabel``, within
    ``axes.y_range`` (``CurveAxes``; None: its defaults); ``reference`` ``(value, label)`` draws
    a dashed horizontal line with that label (e.g. ``(0.5, "chance")``); ``smooth`` adds a
    moving average over that many steps. ``size`` is in pixels. Call on one process (it writes
    a file).

    Example:
        >>> plot_curve(losses, "loss.png", "loss per step", axes=CurveAxes(ylabel="loss"), smooth=10)
    """
    axes = axes or CurveAxes()
    xlabel, ylabel, y_range = axes.xlabel, axes.ylabel, axes.y_range
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dpi = 100
    fig, ax = plt.subplots(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi)
    steps = list(range(1, len(values) + 1))
    unit = xlabel.split()[-1]
    ax.plot(
        steps, values, color="tab:blue", alpha=0.45 if smooth else 1.0, linewidth=1.2, label=f"per {unit}"
    )
    if smooth and values:
        window = [values[max(0, i - smooth + 1) : i + 1] for i in range(len(values))]
        ax.plot(steps, [sum(v) / len(v) for v in window], color="tab:blue", linewidth=2.2,
                label=f"mean of the last {smooth} {unit}s")  # fmt: skip
    if reference is not None:
        ax.axhline(reference[0], color="grey", linestyle="--", linewidth=1, label=reference[1])
    if y_range is not None:
        ax.set_ylim(*y_range)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# A model card's title and tags by the family's ``task`` (the Hub's pipeline tag).
CARD_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "text-to-image": ("Text-to-image", ("text-to-image",)),
    "image-to-image": ("Instruction-editing", ("image-to-image", "image-editing", "instruction-editing")),
    "text-to-video": ("Text-to-video", ("text-to-video",)),
}


def model_card(
    base_model: str,
    dataset: str,
    args: dict,
    validation_prompts: list[str] | None,
    pipeline_class: str,
    task: str = "text-to-image",
    call: dict[str, Any] | None = None,
) -> str:
    """A README.md for an output folder of a ``pipeline_class`` pipeline that does ``task``
    (a family's ``task``: ``CARD_KINDS``' keys).

    Its title, tags and usage follow ``task``: a text-to-image card calls
    ``pipe(prompt=...).images[0]``, an instruction-editing card (``image-to-image``) edits a
    source image (``pipe(image=load_image("source.png"), prompt=...)``), a text-to-video card
    writes the frames as a GIF (``export_to_gif``: PIL alone; ``export_to_video`` needs
    imageio). ``call`` holds the call's other keyword arguments as literals (the run's
    validation settings: steps, size, the family's ``validation_kwargs``), so the snippet
    redraws what validation drew and is as cheap. The first validation prompt is the snippet's
    prompt. The snippet runs as printed once ``path/to/this/folder`` (and, for an editing
    card, ``source.png``) name real files.

    Example:
        >>> card = model_card("tiny", "pairs", {}, ["make the circle blue"], "FluxKontextPipeline",
        ...                   "image-to-image", {"height": 32})
        >>> "pipe(image=load_image(\"source.png\"), prompt=\"make the circle blue\", height=32)" in card
        True
    """
    title, task_tags = CARD_KINDS[task]
    # the Stable Diffusion tag only on Stable Diffusion's own pipelines (SD 1.x/2.x, SDXL, SD3)
    brand = ("stable-diffusion",) if pipeline_class.startswith("StableDiffusion") else ()
    tags = ", ".join((*brand, *task_tags, "diffusers", "deepspeed-zero3"))
    hyper = "\n".join(
        f"- {k}: {args[k]}" for k in sorted(args) if args[k] is not None and not k.startswith("hub_")
    )
    prompts = "\n".join(f"- {p}" for p in validation_prompts or [])
    edits, video = task == "image-to-image", task == "text-to-video"
    default_prompt = "make it blue" if edits else "a photo"
    kwargs = {"prompt": (validation_prompts or [default_prompt])[0], **(call or {})}
    if video:
        kwargs.setdefault("output_type", "pil")  # export_to_gif takes PIL frames
    # literals as Python reads them (a prompt in double quotes, json's escapes)
    arguments = ", ".join(
        f"{k}={json.dumps(v) if isinstance(v, str) else repr(v)}" for k, v in kwargs.items()
    )
    cls = pipeline_class
    if edits:
        imports = f"from diffusers import {cls}\nfrom diffusers.utils import load_image"
        use = f'image = pipe(image=load_image("source.png"), {arguments}).images[0]\nimage.save("edited.png")'
        heading = "Validation edit instructions"
    elif video:
        imports = f"from diffusers import {cls}\nfrom diffusers.utils import export_to_gif"
        use = (
            f"frames = pipe({arguments}).frames[0]\n"
            'export_to_gif(frames, "video.gif")  # or export_to_video(frames, "video.mp4") with imageio-ffmpeg'
        )
        heading = "Validation prompts"
    else:
        imports = f"from diffusers import {cls}"
        use = f'image = pipe({arguments}).images[0]\nimage.save("image.png")'
        heading = "Validation prompts"
    return f"""---
library_name: diffusers
base_model: {base_model}
pipeline_tag: {task}
tags: [{tags}]
---

# {title} fine-tune of {base_model}

Fine-tuned with `diffusers_zero3` (DeepSpeed ZeRO-3) on `{dataset}`: a `{cls}`.

```python
{imports}

pipe = {cls}.from_pretrained("path/to/this/folder")
{use}
```

## {heading}
{prompts or "- (none)"}

## Training arguments
{hyper}
"""


def pipeline_components(source_folder: str | os.PathLike) -> dict[str, list]:
    """The components a pipeline's ``model_index.json`` lists (name -> [library, class]).

    Raises ``CheckpointError`` for a missing or unreadable index, and for a component name
    that is not a plain folder name (``..``, an absolute path, a separator): such a name
    would make a save write outside the output folder.
    """
    index_file = Path(source_folder) / "model_index.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {index_file} ({type(e).__name__}: {e})") from e
    components = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list):
            continue
        if not name or name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
            raise CheckpointError(f"{index_file} names a component {name!r} that is not a plain folder name")
        components[name] = value
    return components


def check_output_dir(output_dir: str | os.PathLike, source_folder: str | os.PathLike) -> None:
    """Refuse an ``--output_dir`` that is the source pipeline folder or inside it.

    Saving there would replace the source's components (and delete its
    ``model_index.json``) before anything could fail. Call before anything is written.
    """
    out, src = Path(output_dir).resolve(), Path(source_folder).resolve()
    if out == src or src in out.parents:
        raise CheckpointError(
            f"--output_dir {str(output_dir)!r} is the source pipeline folder {str(source_folder)!r} or inside it; "
            "choose another folder (saving there would overwrite the source model)"
        )


def save_final_pipeline(
    source_folder: str | os.PathLike,
    output_dir: str | os.PathLike,
    denoiser,
    *,
    ema=None,
    readme: str = "",
    denoiser_name: str = "unet",
    given: GivenComponents | None = None,
    trained: dict[str, tuple] | None = None,
) -> None:
    """Write the trained pipeline into ``output_dir``. Collective: call on every rank.

    The denoiser (``unet``; the EMA average when ``ema`` is given) is streamed from its
    partitions by ``save_pretrained_zero3``: no rank builds the whole model. Every other
    component of the source pipeline (text encoders, VAE, tokenizers, scheduler, ...) is
    unchanged and copied from ``source_folder``, or from the folder ``given`` names for it
    (``--component NAME=PATH``, ``GivenComponents``), whose ``model_index.json`` entries it sets
    where the source's index leaves them empty (HiDream's separately supplied Llama encoder and
    tokenizer), so that the output loads with ``from_pretrained`` alone. ``trained`` maps the other components the job
    trained (DreamBooth's text encoders) to ``(model or engine, ema or None)``: they are
    streamed from their partitions too (their EMA average when given), not copied.

    Everything is first written into a staging folder ``output_dir/.tmp-pipeline-*``; a
    failure there (on any rank) leaves a previous output in ``output_dir`` exactly as it was
    and raises ``CheckpointError`` on every rank. Then global rank 0 swaps the components in
    and writes ``model_index.json`` last, so a folder that has one is complete. The other
    contents of ``output_dir`` (checkpoints, logs, validation images) are not touched.
    """
    out = Path(output_dir)
    source = Path(source_folder)
    check_output_dir(out, source)
    components = pipeline_components(source)
    index = json.loads((source / "model_index.json").read_text())
    given = given or GivenComponents()
    for name, entry in given.index_entries.items():
        components[name] = index[name] = list(entry)
    sources = {name: source / name for name in components}
    sources.update({k: Path(v) for k, v in given.folders.items()})
    # Staged in OUTPUT_DIR/.tmp-pipeline-*, then swapped into OUTPUT_DIR by rank 0.
    with collective_publish(out / "pipeline", commit=lambda staging, _: _swap_into(staging, out)) as staging:
        for name, (model, model_ema) in {denoiser_name: (denoiser, ema), **(trained or {})}.items():
            if model_ema is not None:
                model_ema.save_pretrained(staging / name)
            else:
                save_pretrained_zero3(model, staging / name)
        if is_main_process():
            for name, value in components.items():
                if (
                    name != denoiser_name
                    and name not in (trained or {})
                    and value[0] is not None
                    and sources[name].is_dir()
                ):
                    shutil.copytree(sources[name], staging / name)
            if readme:
                (staging / "README.md").write_text(readme)
            text = (source / "model_index.json").read_text()  # as it was, unless entries were set
            if given.index_entries:
                text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            (staging / "model_index.json").write_text(text)


def _swap_into(staging: Path, out: Path) -> None:
    """Move every entry of ``staging`` into ``out``, ``model_index.json`` last."""
    (out / "model_index.json").unlink(missing_ok=True)  # from here on ``out`` reads as incomplete
    fsync_dir(out)
    for entry in sorted(staging.iterdir()):
        if entry.name == "model_index.json":
            continue
        if entry.is_dir():
            replace_folder(entry, out / entry.name)
        else:
            os.replace(entry, out / entry.name)
    os.replace(staging / "model_index.json", out / "model_index.json")
    fsync_dir(out)


@dataclass(frozen=True)
class GivenComponents:
    """Components of a trained pipeline taken from elsewhere than its source folder:
    ``folders`` (``--component NAME=PATH``: the folder that holds each) and the
    ``model_index.json`` entries (``[library, class]``) of those the source's index leaves empty
    (``[null, null]``), so that the output loads on its own (``given_components``)."""

    folders: dict[str, Path] = field(default_factory=dict)
    index_entries: dict[str, list] = field(default_factory=dict)


def given_components(
    source: str | os.PathLike, component_sources: dict, family, tokenizers: dict
) -> GivenComponents:
    """The ``--component`` folders of a job (``component_sources``) with the index entries of
    those the source's index leaves empty: a tokenizer's from its loaded class, a model's
    from the family (``Family.component_library``)."""
    index = pipeline_components(source)
    entries = {}
    tokenizer_of = {spec.tokenizer: spec.name for spec in family.text_encoders}
    for name in component_sources:
        if index.get(name, [None])[0] is not None:
            continue
        if name in tokenizer_of:
            tokenizer = tokenizers[tokenizer_of[name]]
            entries[name] = [type(tokenizer).__module__.split(".")[0], type(tokenizer).__name__]
        else:
            entries[name] = list(family.component_library(name))
    return GivenComponents({k: Path(v) for k, v in component_sources.items()}, entries)
