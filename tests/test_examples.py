"""The custom-script examples: docs/custom_scripts.md holds each example file verbatim, and each
runs on 2 ZeRO-3 ranks (the training loop on SD and on SDXL), so the examples cannot rot."""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed_harness import REPO_ROOT, accelerate_launch, run_launcher

EXAMPLES = [
    "examples/custom_training_loop.py",
    "examples/custom_reward_loop.py",
    "examples/custom_two_model_loop.py",
]


@pytest.mark.unit
@pytest.mark.parametrize("path", EXAMPLES)
def test_the_docs_hold_the_example_verbatim(path):
    page = (REPO_ROOT / "docs" / "custom_scripts.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert (REPO_ROOT / path).read_text() in blocks, (
        f"docs/custom_scripts.md does not include {path} as it is"
    )


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_custom_training_loop_runs_on_two_ranks(default_data, tiny_sdxl, tmp_path, family):
    pipe, data = (default_data[0], default_data[1]) if family == "sd" else tiny_sdxl
    out = tmp_path / "out"
    _, log = run_launcher([*accelerate_launch(EXAMPLES[0]), pipe, data, str(out)], timeout=400)
    assert re.findall(r"step (\d) loss", log) == ["1", "2", "3", "4"], log[-3000:]
    assert (out / "model_index.json").exists() and (out / "sample.png").exists()


@pytest.mark.e2e
def test_custom_reward_loop_runs_with_uneven_and_zero_samples(default_data):
    pipe, _, reward = default_data
    _, log = run_launcher([*accelerate_launch(EXAMPLES[1]), pipe, reward], timeout=400)
    # rank 0 has no sample at step 1 (its reward is nan), rank 1 none at step 3
    assert re.findall(r"step (\d) reward on rank 0: (nan|[0-9.-]+)", log)[0] == ("1", "nan"), log[-3000:]
    assert len(re.findall(r"step \d reward on rank 0", log)) == 3, log[-3000:]


@pytest.mark.e2e
def test_custom_two_model_loop_trains_both_models(default_data, tmp_path):
    from safetensors.torch import load_file

    pipe, data, _ = default_data
    out = tmp_path / "out"
    _, log = run_launcher([*accelerate_launch(EXAMPLES[2]), pipe, data, str(out)], timeout=400)
    assert re.findall(r"step (\d) loss", log) == ["1", "2", "3", "4"], log[-3000:]
    for component, weights in (("unet", "diffusion_pytorch_model"), ("text_encoder", "model")):
        before = load_file(f"{pipe}/{component}/{weights}.safetensors")
        after = load_file(f"{out}/{component}/{weights}.safetensors")
        assert before.keys() == after.keys()
        assert any(not torch.equal(before[k], after[k]) for k in before), component  # both trained
