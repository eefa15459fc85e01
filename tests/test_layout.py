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


# Functions of the library with more than MAX_PARAMETERS named parameters (self and cls not
# counted, nor *args and **kwargs); issue 52 asks for none. A ratchet: lower it as they go.
MAX_PARAMETERS = 8
MOST_LONG_SIGNATURES = 0


def long_signatures(package=PACKAGE, limit: int = MAX_PARAMETERS) -> list[str]:
    """``path:line name (n)`` of each function under ``package`` with more than ``limit``
    named parameters, longest first."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                if names[:1] in (["self"], ["cls"]):
                    names = names[1:]
                if len(names) > limit:
                    found.append(
                        (len(names), f"{path.relative_to(package.parent)}:{node.lineno} {node.name}")
                    )
    return [f"{where} ({n})" for n, where in sorted(found, key=lambda f: (-f[0], f[1]))]


def test_long_signatures_only_go_down(tmp_path):
    control = tmp_path / "control.py"
    control.write_text(
        "def f(a, b, c, d, e, f, g, h, i): ...\nclass C:\n    def m(self, a, b, c, d, e, f, g, h): ...\n"
    )
    assert [s.split()[1] for s in long_signatures(tmp_path)] == ["f"], "the control: 9 counted, self not"
    found = long_signatures()
    assert len(found) <= MOST_LONG_SIGNATURES, (
        f"{len(found)} functions take more than {MAX_PARAMETERS} parameters (at most {MOST_LONG_SIGNATURES}): "
        "group the ones that travel together into a small dataclass\n" + "\n".join(found)
    )
