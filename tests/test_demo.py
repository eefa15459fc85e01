"""The embedded default's generator, through the command that `make train` runs."""

import subprocess
import sys

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit


def test_demo_cli_writes_pipeline_dataset_and_reward_model(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "diffusers_zero3.demo", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "tiny-sd" / "model_index.json").exists()
    assert len((tmp_path / "shapes" / "metadata.jsonl").read_text().splitlines()) == 64
    assert (tmp_path / "redness-reward" / "config.json").exists()

    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(tmp_path / "tiny-sd", subfolder="tokenizer")
    ids = tok("a red circle").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and len(ids) > 5
    assert tok.decode(ids, skip_special_tokens=True) == "a red circle"


def test_every_familys_default_run_flags_are_valid_for_its_pipeline():
    """`make train MODEL=<name>` passes the family's ``default_run_args`` to the training script:
    each set parses and applies to its family (a flag naming a component the family lacks, or a
    flag of the other objective, would fail the run after the pipeline was generated)."""
    from diffusers_zero3.args import component_overrides
    from diffusers_zero3.families import ALL_FAMILIES
    from diffusers_zero3.recipes.text_to_image_settings import (
        TextToImageSettings,
        validate_args,
        validate_family,
    )

    for family in ALL_FAMILIES:
        run_args = [a.format(pipeline="/tmp/tiny") for a in family.default_run_args]
        args = TextToImageSettings.parse(
            ["--pretrained_model_name_or_path", "p", "--train_data_dir", "d", *run_args]
        )
        validate_args(args)
        validate_family(args, family)
        placed = {k[: -len("_placement")] for k, v in vars(args).items() if k.endswith("_placement") and v}
        assert placed <= set(family.frozen_components), (family.name, placed)
        assert set(component_overrides(args)) <= {*family.frozen_components, *family.tokenizer_folders}


def test_the_default_run_script_refuses_an_unknown_model_in_one_line():
    from diffusers_zero3.families import FAMILY_NAMES

    res = subprocess.run(
        ["bash", "scripts/train_default.sh"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "MODEL": "kandinsky",
            "PYTHON": sys.executable,
            "OUT": "/tmp/dz3-unused",
        },
    )
    assert res.returncode == 2, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["error: MODEL must be one of " + ", ".join(FAMILY_NAMES) + ", got 'kandinsky'"], (
        res.stderr
    )
    assert not res.stdout


def _family_names() -> list[str]:
    from diffusers_zero3.families import ALL_FAMILIES

    return [f.name for f in ALL_FAMILIES]


@pytest.mark.parametrize("name", _family_names())
def test_every_family_has_a_tiny_pipeline(name):
    """The tests and `make train MODEL=<name>` build every family's tiny pipeline from
    ``demo.pipelines.TINY_PIPELINES``: a family added without one fails here, by name."""
    from diffusers_zero3.demo import TINY_PIPELINES

    assert name in TINY_PIPELINES, f"{name} has no tiny pipeline in diffusers_zero3/demo/pipelines.py"


def test_tiny_pipelines_are_only_of_known_families():
    from diffusers_zero3.demo import TINY_PIPELINES

    assert set(TINY_PIPELINES) <= set(_family_names())
