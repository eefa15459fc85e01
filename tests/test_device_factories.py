"""Every tensor the package builds says where it goes (issue 21).

A tensor built without ``device=`` lands on the CPU. On a CPU-only test machine everything is
on the CPU, so nothing fails; on a GPU the first op that mixes it with model data raises
("Expected all tensors to be on the same device"). This check reads the package's source
with ``ast`` and fails on every call to a tensor factory (``torch.zeros``, ``torch.tensor``,
``torch.Generator``, ...) without a ``device=`` keyword, unless a comment says why the CPU
is meant: on the call's first or last line, or alone on the line above the call or above the
statement that holds it (a formatter may spread a call's arguments over several lines)::

    flip = torch.rand(n) < 0.5  # CPU: data-loader side; accelerate moves the batch
    # CPU: gloo collectives take CPU tensors
    t = torch.tensor(values)

``*_like`` factories inherit their argument's device and are not checked.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "diffusers_zero3"

# torch callables that build a new tensor (or a generator) on the CPU unless told otherwise.
FACTORIES = frozenset(
    {
        "tensor",
        "zeros",
        "ones",
        "arange",
        "full",
        "randn",
        "rand",
        "empty",
        "linspace",
        "randint",
        "randperm",
        "eye",
        "logspace",
        "empty_strided",
        "scalar_tensor",
        "Generator",
    }
)
# "# CPU: <why>": a reason must follow the marker.
_CPU_COMMENT = re.compile(r"CPU:\s*\S")


def _torch_names(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to the torch module (``import torch [as th]``) and to its factories
    (``from torch import zeros [as z]``) anywhere in a module."""
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch":
                    modules.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            for alias in node.names:
                if alias.name in FACTORIES:
                    functions[alias.asname or alias.name] = alias.name
    return modules, functions


def _cpu_comment_lines(source: str) -> tuple[set[int], set[int]]:
    """Lines that carry a ``# CPU: <why>`` comment, and the lines that follow one standing
    alone on its line."""
    on, below = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and _CPU_COMMENT.search(tok.string):
            row, col = tok.start
            on.add(row)
            if not tok.line[:col].strip():
                below.add(row + 1)
    return on, below


def find_factories_without_device(source: str, filename: str = "<string>") -> list[str]:
    """``"file:line: <call>"`` for each tensor-factory call of ``source`` with neither a
    ``device=`` keyword nor a ``# CPU: <why>`` comment (on the call's first or last line, or
    alone on the line above the call or above its statement)."""
    tree = ast.parse(source, filename)
    modules, functions = _torch_names(tree)
    on, below = _cpu_comment_lines(source)
    statement_line = {}  # id(node) -> first line of the innermost statement holding it
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.stmt):
            for child in ast.walk(stmt):
                statement_line[id(child)] = stmt.lineno  # inner statements are visited later
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        is_factory = (
            isinstance(func, ast.Attribute)
            and func.attr in FACTORIES
            and isinstance(func.value, ast.Name)
            and func.value.id in modules
        ) or (isinstance(func, ast.Name) and func.id in functions)
        if not is_factory or any(k.arg == "device" for k in node.keywords):
            continue
        if {node.lineno, node.end_lineno} & on or {node.lineno, statement_line[id(node)]} & below:
            continue
        call = " ".join((ast.get_source_segment(source, node) or "").split())
        found.append(f"{filename}:{node.lineno}: {call[:150]}")
    return sorted(found, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def test_the_check_finds_a_factory_without_device():
    """The positive control: one offender among compliant calls is found, and only it."""
    source = (
        "import torch\n"
        "import torch as th\n"
        "from torch import zeros as z\n"
        "def f(x):\n"
        "    a = torch.zeros(3, device=x.device)\n"
        "    b = torch.arange(4)  # CPU: a shape probe, never on a device\n"
        "    # CPU: gloo collectives take CPU tensors\n"
        "    c = torch.tensor([1, 2])\n"
        "    d = torch.ones_like(x)\n"
        "    e = torch.randn(2, 2)\n"
        "    g = th.rand(\n"
        "        5,\n"
        "    )  # CPU: data-loader side; accelerate moves the batch\n"
        "    h = torch.ones(2)  # cpu bookkeeping, no reason marker\n"
        "    k = z(3)\n"
        "    m = torch.Generator()\n"
        "    n = torch.full((2,), 1.0)  # CPU:\n"
        "    # CPU: three numbers for a gloo all-reduce\n"
        "    p = torch.stack(\n"
        "        [torch.tensor(1.0), x.sum().cpu()]\n"
        "    )\n"
        "    return a, b, c, d, e, g, h, k, m, n, p\n"
    )
    assert find_factories_without_device(source, "m.py") == [
        "m.py:10: torch.randn(2, 2)",
        "m.py:14: torch.ones(2)",
        "m.py:15: z(3)",
        "m.py:16: torch.Generator()",
        "m.py:17: torch.full((2,), 1.0)",
    ]


def test_a_cpu_comment_on_the_previous_statement_excuses_nothing():
    source = "import torch\na = torch.zeros(1)  # CPU: bookkeeping\nb = torch.zeros(2)\n"
    assert find_factories_without_device(source, "m.py") == ["m.py:3: torch.zeros(2)"]


def test_every_package_tensor_factory_names_its_device():
    """The package, and the scripts and examples that users run or copy."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10, f"no package source found under {PACKAGE}"
    files += sorted((PACKAGE.parent / "scripts").glob("*.py")) + sorted(
        (PACKAGE.parent / "examples").glob("*.py")
    )
    offenders = []
    for path in files:
        rel = path.relative_to(PACKAGE.parent).as_posix()
        offenders += find_factories_without_device(path.read_text(encoding="utf-8"), rel)
    assert not offenders, (
        f"{len(offenders)} tensor factory call(s) without device=: on a GPU these tensors stay on "
        "the CPU and the first op mixing them with model data raises. Pass device= (the device "
        "of the tensors it meets, or the model's), or, where the CPU is meant, add a "
        "'# CPU: <why>' comment on the call's line or alone on the line above:\n  " + "\n  ".join(offenders)
    )
