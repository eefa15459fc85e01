"""The published configs as data: ``families/published/**.json`` read by ``published_config``,
each file read somewhere in the package and shipped with it (setup.cfg's package_data)."""

from __future__ import annotations

import configparser
import re
from fnmatch import fnmatch

import pytest

from diffusers_zero3.families import flux2
from diffusers_zero3.families.published import CLIP_L, CLIP_VIT_L14, published_config
from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit

PACKAGE = REPO_ROOT / "diffusers_zero3"
FOLDER = PACKAGE / "families" / "published"


def _names() -> list[str]:
    return sorted(p.relative_to(FOLDER).with_suffix("").as_posix() for p in FOLDER.rglob("*.json"))


def test_published_config_is_a_fresh_dict_each_call():
    config = published_config("flux2/transformer_dev")
    assert config == flux2.PUBLISHED_TRANSFORMER_DEV
    assert config is not flux2.PUBLISHED_TRANSFORMER_DEV
    config["num_layers"] = 0
    config["axes_dims_rope"].append(0)
    again = published_config("flux2/transformer_dev")
    assert again["num_layers"] == 8 and again["axes_dims_rope"] == [32, 32, 32, 32]
    assert CLIP_L == CLIP_VIT_L14["text_config"] == published_config("clip_vit_l14")["text_config"]


def test_a_misspelt_name_fails():
    with pytest.raises(FileNotFoundError):
        published_config("flux2/transformer_dve")


def test_every_file_is_read_by_the_package_and_shipped_with_it():
    names = _names()
    assert "flux2/transformer_dev" in names and "clip_vit_l14" in names, "the control: the files are found"
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    read = set(re.findall(r'published_config\(\s*"([^"]+)"\s*\)', source))
    assert sorted(set(names) - read) == [], "files no module reads"
    assert sorted(read - set(names)) == [], "names without a file"

    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    globs = [g.strip() for g in setup["options.package_data"]["diffusers_zero3"].split(",")]
    # setuptools' globs do not cross a "/" with "*": match part by part
    unshipped = [
        name
        for name in names
        if not any(
            len(g.split("/")) == len(f"families/published/{name}.json".split("/"))
            and all(map(fnmatch, f"families/published/{name}.json".split("/"), g.split("/")))
            for g in globs
        )
    ]
    assert unshipped == [], "not in setup.cfg's package_data: " + ", ".join(unshipped)
