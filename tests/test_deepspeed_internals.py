"""DeepSpeed's undocumented names live in ``runtime.deepspeed_internals`` and its table, and a
lever applies only on a DeepSpeed version it was verified on, with every name it needs."""

from __future__ import annotations

import ast
import logging

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit

PACKAGE = REPO_ROOT / "diffusers_zero3"
INTERNALS = PACKAGE / "runtime" / "deepspeed_internals"


def _uses_outside_internals(names: set[str]) -> list[str]:
    """``file:line name`` for each attribute access or string of one of ``names`` in the package
    outside ``runtime/deepspeed_internals``, and each underscored attribute read from a module
    imported from deepspeed there."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if INTERNALS in path.parents:
            continue
        tree = ast.parse(path.read_text())
        deepspeed_aliases = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            and (getattr(node, "module", None) or "").startswith("deepspeed")
            or isinstance(node, ast.Import)
            and any(a.name.startswith("deepspeed") for a in node.names)
            for alias in node.names
        }
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if name.startswith("_") and isinstance(base, ast.Name) and base.id in deepspeed_aliases:
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name} (a deepspeed private)")
                    continue
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            if name in names:
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}")
    return found


def test_every_private_deepspeed_name_is_used_in_the_internals_package_only():
    from diffusers_zero3.runtime.deepspeed_internals import PRIVATE_NAMES

    names = {entry.name for entry in PRIVATE_NAMES}
    assert not _uses_outside_internals(names), _uses_outside_internals(names)
    # the control: the scan finds the names where they are used
    assert _uses_outside_internals({"load_pretrained_zero3"}), "the scan finds nothing"


def test_every_lever_names_present_on_the_installed_deepspeed():
    from diffusers_zero3.runtime.deepspeed_internals import (
        PRIVATE_NAMES,
        VERIFIED_ON,
        deepspeed_version,
        missing_names,
    )

    assert deepspeed_version() in VERIFIED_ON  # the suite runs on a verified version (constraints.txt)
    for lever in {entry.lever for entry in PRIVATE_NAMES}:
        assert missing_names(lever) == [], lever


@pytest.fixture
def fresh_decisions(monkeypatch):
    from diffusers_zero3.runtime import deepspeed_internals

    monkeypatch.setattr(deepspeed_internals, "_decided", {})
    return deepspeed_internals


def test_a_lever_is_off_with_one_warning_line_on_an_unverified_version(fresh_decisions, monkeypatch, caplog):
    internals = fresh_decisions
    assert internals.lever_in_force("overlap")  # the control: in force on the verified version
    internals._decided.clear()
    monkeypatch.setattr(internals, "deepspeed_version", lambda: "0.18.0")
    with caplog.at_level(logging.WARNING, logger="diffusers_zero3"):
        assert not internals.lever_in_force("overlap")
        assert not internals.lever_in_force("overlap")  # decided once: said once
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "warning: diffusers_zero3's 'overlap' lever is off: it was verified on DeepSpeed 0.19.8, this is 0.18.0"
    ]


def test_a_lever_whose_names_are_missing_is_off_and_not_half_applied(fresh_decisions, monkeypatch, caplog):
    """A lever off for a missing name leaves DeepSpeed's objects untouched: the overlapped
    reduction is not installed on a ZeRO-3 optimizer (its method stays DeepSpeed's)."""
    internals = fresh_decisions
    gone = internals.PrivateName(
        "overlap", "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "_renamed"
    )
    monkeypatch.setattr(internals, "PRIVATE_NAMES", (*internals.PRIVATE_NAMES, gone))
    with caplog.at_level(logging.WARNING, logger="diffusers_zero3"):
        assert not internals.lever_in_force("overlap")
    assert "DeepSpeedZeroOptimizer_Stage3._renamed" in caplog.text

    from diffusers_zero3.runtime.deepspeed_internals.async_reduce import _REDUCE, overlap_gradient_reduction

    class Optimizer:  # what zero3_optimizer recognises, with DeepSpeed's method names
        fp32_partitioned_groups_flat = []
        ipg_buckets = {}

        def independent_gradient_partition_epilogue(self):
            return "deepspeed's"

    optimizer = Optimizer()
    setattr(optimizer, _REDUCE, "deepspeed's")
    assert not overlap_gradient_reduction(optimizer)
    assert getattr(optimizer, _REDUCE) == "deepspeed's"
    assert optimizer.independent_gradient_partition_epilogue() == "deepspeed's"
