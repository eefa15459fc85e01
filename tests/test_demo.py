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
