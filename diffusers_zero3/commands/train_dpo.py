"""Diffusion-DPO on preference pairs against a frozen reference: ``scripts/train_dpo.py``'s flags; run as
every command (``commands``); nothing is imported before ``main`` runs (a rank puts its
host tensors on huge pages first)."""

from . import command, run_if_main

main = command(__spec__.name)
run_if_main(__name__, main)
