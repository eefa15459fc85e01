"""Write ``upstream_flags.json``: every ``--flag`` each of diffusers' example scripts that
ours stand in for defines (``add_argument("--...``), read from one commit of a diffusers clone.

    python tests/data/upstream_flags.py /path/to/diffusers [COMMIT] > tests/data/upstream_flags.json
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

SCRIPTS = (
    "examples/text_to_image/train_text_to_image.py",
    "examples/text_to_image/train_text_to_image_sdxl.py",
    "examples/text_to_image/train_text_to_image_lora.py",
    "examples/text_to_image/train_text_to_image_lora_sdxl.py",
    "examples/dreambooth/train_dreambooth.py",
    "examples/dreambooth/train_dreambooth_lora.py",
    "examples/dreambooth/train_dreambooth_lora_sdxl.py",
    "examples/controlnet/train_controlnet.py",
    "examples/controlnet/train_controlnet_sdxl.py",
)
FLAG = re.compile(r'add_argument\(\s*"--([A-Za-z0-9_\-]+)"')


def main(repo: str, commit: str = "HEAD") -> dict:
    def git(*argv: str) -> str:
        return subprocess.check_output(["git", "-C", repo, *argv], text=True)

    commit = git("rev-parse", commit).strip()
    return {
        "source": "https://github.com/huggingface/diffusers",
        "diffusers_commit": commit,
        "note": 'every --flag each script\'s argparse parser defines (add_argument("--...")), read from that commit',
        "scripts": {s: sorted(set(FLAG.findall(git("show", f"{commit}:{s}")))) for s in SCRIPTS},
    }


if __name__ == "__main__":
    json.dump(main(*sys.argv[1:]), sys.stdout, indent=1)
    sys.stdout.write("\n")
