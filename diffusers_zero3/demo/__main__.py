"""``python -m diffusers_zero3.demo [FOLDER] --model NAME [--shell] ...``: generate a default
run's tiny pipeline and dataset (and, on request, the DPO, DreamBooth and ControlNet data),
each once, under FOLDER (``scripts/*_default.sh`` call it)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..families import family_named
from ..runtime.notices import quiet_library_notices
from . import (
    MODELS,
    prepare_default,
    write_controlnet_dataset,
    write_instance_images,
    write_preference_dataset,
)


def main(argv: list[str] | None = None) -> None:
    """``python -m diffusers_zero3.demo [FOLDER] --model NAME [...]``: write the embedded
    default's tiny pipeline and data into FOLDER (with ``--shell``, print them as shell
    assignments); an unknown model is one ``error:`` line and exit 2."""
    parser = argparse.ArgumentParser(description="Generate the embedded default's pipeline and data.")
    parser.add_argument("folder", nargs="?", default="outputs/default")
    parser.add_argument("--model", default="sd", help=f"a family's short name: {', '.join(MODELS)}")
    parser.add_argument(
        "--preferences", action="store_true", help="also a preference dataset (make train-dpo)"
    )
    parser.add_argument(
        "--instances", action="store_true", help="also DreamBooth instance images (make train-dreambooth)"
    )
    parser.add_argument(
        "--controlnet", action="store_true", help="also a ControlNet dataset of masks (make train-controlnet)"
    )
    parser.add_argument(
        "--varied",
        action="store_true",
        help="an image family's dataset of landscape and portrait images (for aspect-ratio buckets)",
    )
    parser.add_argument(
        "--shell",
        action="store_true",
        help="print PIPE, DATA and RUN_ARGS (the family's default placements) as shell assignments",
    )
    cli = parser.parse_args(argv)
    quiet_library_notices()  # building the tiny pipelines imports diffusers' pipeline modules
    if cli.model not in MODELS:
        print(f"error: MODEL must be one of {', '.join(MODELS)}, got {cli.model!r}", file=sys.stderr)
        sys.exit(2)
    p, d = prepare_default(cli.folder, model=cli.model, varied=cli.varied)
    if cli.shell:
        run_args = " ".join(
            shlex.quote(a.format(pipeline=p)) for a in family_named(cli.model).default_run_args
        )
        print(f"PIPE={shlex.quote(str(p))}; DATA={shlex.quote(str(d))}; RUN_ARGS=({run_args})")
    else:
        print(f"pipeline: {p}\ndataset: {d}")
    if cli.controlnet and not (Path(cli.folder) / "controlnet-shapes").exists():
        print(
            f"controlnet data: {write_controlnet_dataset(Path(cli.folder) / 'controlnet-shapes', num_images=64)}"
        )
    if cli.instances and not (Path(cli.folder) / "instances").exists():
        print(f"instances: {write_instance_images(d, Path(cli.folder) / 'instances')}")
    if cli.preferences and not (Path(cli.folder) / "preferences").exists():
        print(f"preferences: {write_preference_dataset(Path(cli.folder) / 'preferences')}")


if __name__ == "__main__":
    main()
