"""Named points of a training run that an observer outside the library can hook.

The trainers call ``reached(phase)`` as a rank enters each phase that waits on a collective:
``"frozen_forward"``, ``"train_step"``, ``"checkpoint"``, ``"validation"``, ``"final_save"``.
It does nothing unless ``DIFFUSERS_ZERO3_PHASE_HOOK`` names a function as ``module:function``,
which is then called with the phase's name. The tests point it at
``diffusers_zero3.testing.fault_point`` to freeze one rank in a chosen phase (the library
itself never imports its test instruments).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

PHASE_HOOK_ENV = "DIFFUSERS_ZERO3_PHASE_HOOK"
_hooks: dict[str, Callable[[str], None]] = {}


def reached(phase: str) -> None:
    """Call the phase hook with ``phase``, where ``DIFFUSERS_ZERO3_PHASE_HOOK`` names one. Not a
    collective."""
    spec = os.environ.get(PHASE_HOOK_ENV)
    if not spec:
        return
    if spec not in _hooks:
        module, _, name = spec.partition(":")
        _hooks[spec] = getattr(importlib.import_module(module), name)
    _hooks[spec](phase)
