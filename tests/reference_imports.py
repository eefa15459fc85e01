"""Importing the reward models' reference packages (open_clip, timm, ImageReward's BLIP) on a
machine where torchvision cannot run.

The torchvision wheel of the registry does not import beside the CPU build of torch 2.13
(``operator torchvision::nms does not exist``), and open_clip and timm import it at module
level, for image transforms and detection ops that the reference computations never call. While
``torchvision_stub()`` is active, every ``torchvision.*`` import gets an empty stand-in module
whose attributes are inert placeholders (a class that refuses to be called), so the reference
packages' model code, which is what the tests compare against, imports and runs as published.
The preprocessing is then written from the published transforms with PIL, in the tests.

The reference packages live in ``tests/.reference_packages`` (``make reference-packages``, a
prerequisite of every test target), never in the environment: accelerate's CLI imports timm when
it is installed, and timm without torchvision fails at import. ``torchvision_stub()`` puts that
folder at the end of ``sys.path`` while it is active.

On exit the stand-ins, the folder on ``sys.path`` and the reference packages' modules are
removed again; objects already built keep working.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from pathlib import Path

# the packages whose modules are dropped again on exit (with the stand-ins)
REFERENCE_PACKAGES = {"torchvision", "open_clip", "timm", "hpsv2", "ImageReward", "fairscale"}
# where `make reference-packages` installs them (pip install --target), for the tests alone
REFERENCE_DIR = Path(__file__).resolve().parent / ".reference_packages"


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}", cls.__module__)


class _Placeholder(metaclass=_PlaceholderMeta):
    """A torchvision name that the reference code imports but the tests never use: any
    attribute of it is another placeholder; calling it raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is a torchvision stand-in in this test")


def _placeholder(name: str, module: str) -> type:
    return _PlaceholderMeta(name, (_Placeholder,), {"__module__": module})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(name, self.__name__)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: its submodules resolve through this finder too
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module):
        return None


@contextlib.contextmanager
def torchvision_stub() -> Iterator[None]:
    """Let ``import open_clip`` / ``import timm`` succeed without a working torchvision.

    Refuses to run where a real torchvision is already imported (the stand-in would be
    silently ignored), and where ``make reference-packages`` has not installed the packages.
    """
    if not (REFERENCE_DIR / ".installed").exists():
        raise RuntimeError(f"{REFERENCE_DIR} is missing: run `make reference-packages` (make test does)")
    if "torchvision" in sys.modules and not isinstance(sys.modules["torchvision"], _StubModule):
        raise RuntimeError("a real torchvision is imported: the stand-in is not needed here")
    # transformers and diffusers decide at import whether torchvision is there: let them decide
    # before the stand-in exists (open_clip imports transformers)
    import diffusers  # noqa: F401
    import transformers  # noqa: F401
    from transformers.utils import is_torchvision_available

    is_torchvision_available()
    before = set(sys.modules)
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    sys.path.append(str(REFERENCE_DIR))  # last: the environment's own packages win
    try:
        yield
    finally:
        sys.path.remove(str(REFERENCE_DIR))
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if name.partition(".")[0] in REFERENCE_PACKAGES:
                del sys.modules[name]
