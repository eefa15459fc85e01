"""The package's import graph: each sub-package imports only those below it (no upward import,
no circle between sub-packages, also inside functions), and no module imports itself back
through its module-level imports."""

from __future__ import annotations

import ast
from collections import defaultdict

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit

PACKAGE = REPO_ROOT / "diffusers_zero3"
# lowest first; a sub-package may import the ones before it (the root re-exports lazily)
LAYERS = ("errors", "runtime", "state", "data", "families", "placement", "rewards", "training", "rl", "args", "recipes",
          "commands", "demo", "testing", "plan", "(root)")  # fmt: skip


def _module(path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(module_level_only: bool) -> dict[str, set[str]]:
    """``{module: modules of this package it imports}``."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        name = _module(path)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        nodes = tree.body if module_level_only else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").startswith("diffusers_zero3"):
                    target = node.module
                else:
                    continue
                graph[name].add(target)
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def test_each_sub_package_imports_only_those_below_it():
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in _imports(module_level_only=False).items()
        for b in targets
        if LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))
    )
    assert not upward, "imports against the layers " + " < ".join(LAYERS) + ":\n" + "\n".join(upward)
    assert {_layer(m) for m in _imports(False)} <= set(LAYERS), "a new sub-package: give it its layer"


def cycles_of(graph: dict[str, set[str]]) -> list[str]:
    """The import circles of ``graph``, as ``a -> b -> a``."""
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif len(path) < 12:
                visit(nxt, [*path, nxt])

    for module in sorted(graph):
        visit(module, [module])
    return sorted(set(cycles))


def test_no_module_imports_itself_back_at_import_time():
    assert cycles_of({"a": {"b"}, "b": {"c"}, "c": {"a"}}), "the control: a circle is found"
    cycles = cycles_of(_imports(module_level_only=True))
    assert not cycles, "\n".join(cycles)
