"""Library messages that tell a user nothing are filtered where the package causes them
(diffusers_zero3.runtime.notices), narrowly: transformers' torchvision fallback, diffusers'
experimental-guider notice, datasets' "Downloading data" bar for a local folder. Each test
first shows the message comes without the filter (else it skips: the library changed), then
that the real call prints nothing with it."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit


def _stderr_of(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_the_torchvision_fallback_notice_is_filtered():
    # a fresh process each: transformers warns once per process and class
    load = "from transformers import CLIPImageProcessor; print(CLIPImageProcessor.__name__)"
    if "requires torchvision" not in _stderr_of(load):
        pytest.skip("transformers did not warn here (torchvision installed, or a version that does not)")
    quiet = "from diffusers_zero3.runtime.notices import quiet_library_notices; quiet_library_notices(); "
    assert "requires torchvision" not in _stderr_of(quiet + load)
    # narrowly: the same logger's other messages still print
    other = "import logging; logging.getLogger('transformers.utils.import_utils').warning('another message')"
    assert "another message" in _stderr_of(quiet + other)


def test_the_experimental_guider_notice_is_filtered():
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_zero3.runtime.notices import DropMessage, quiet_library_notices

    logger = logging.getLogger("diffusers.guiders.guider_utils")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    filters = list(logger.filters)
    logger.filters[:] = [f for f in filters if not isinstance(f, DropMessage)]  # e.g. a tiny pipeline's build
    try:
        ClassifierFreeGuidance(guidance_scale=6.0)
        if not any("experimental" in m for m in seen):
            pytest.skip("diffusers no longer logs the guider notice")
        seen.clear()
        quiet_library_notices()
        quiet_library_notices()  # idempotent: one filter
        assert sum(isinstance(f, DropMessage) for f in logger.filters) == 1
        for _ in range(3):
            ClassifierFreeGuidance(guidance_scale=6.0)
        logger.warning("another message")
        assert seen == ["another message"]
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = filters  # the rest of this process as it was


def _shapes(folder, n: int = 20):  # datasets shows no download bar for 16 files or fewer
    import json

    from PIL import Image

    folder.mkdir()
    with open(folder / "metadata.jsonl", "w") as f:
        for i in range(n):
            Image.new("RGB", (8, 8), (i * 60, 0, 0)).save(folder / f"{i}.png")
            f.write(json.dumps({"file_name": f"{i}.png", "text": f"shape {i}"}) + "\n")
    return folder


def test_a_local_folder_is_not_downloaded(tmp_path, capfd):
    import datasets

    from diffusers_zero3.data.images import load_image_caption_dataset

    if datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None or datasets.are_progress_bars_disabled():
        pytest.skip("datasets' progress bars are off here anyway")
    folder = _shapes(tmp_path / "shapes")
    datasets.load_dataset("imagefolder", data_dir=str(folder), cache_dir=str(tmp_path / "plain"))
    if "Downloading data" not in capfd.readouterr().err:
        pytest.skip("datasets shows no download bar for a local folder")
    ds = load_image_caption_dataset(train_data_dir=str(folder), cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 20
    err = capfd.readouterr().err
    assert "Downloading data" not in err and "Generating train split" not in err, err
    assert not datasets.are_progress_bars_disabled()  # restored after the load
