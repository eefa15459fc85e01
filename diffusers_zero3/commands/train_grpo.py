"""Online RL for flow models (Flow-GRPO, DiffusionNFT) with sharded rewards: ``scripts/train_grpo.py``'s flags.

    diffusers-zero3-train-grpo FLAGS                         # launches this host's ranks (see ``commands``)
    python -m diffusers_zero3.commands.train_grpo FLAGS
    accelerate launch --config_file CONFIG -m diffusers_zero3.commands.train_grpo FLAGS

Nothing is imported before ``main`` runs: a rank puts its host tensors on huge pages first.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from . import command_main


def main(argv: Sequence[str] | None = None) -> int:
    """``diffusers-zero3-train-grpo``: launch this host's ranks, or run as one rank under a launcher."""
    return command_main(__spec__.name, argv)


if __name__ == "__main__":
    sys.exit(main())
