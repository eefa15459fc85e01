"""diffusers', accelerate's and transformers' undocumented names live in
``runtime.library_internals`` and its table (DeepSpeed's in ``runtime.deepspeed_internals``):
every tabled name exists on the installed versions, a missing one is one error naming it, and
no other module of the package reaches a private name of these libraries itself."""

from __future__ import annotations

import ast

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit

PACKAGE = REPO_ROOT / "diffusers_zero3"
ALLOWED = (PACKAGE / "runtime" / "library_internals.py", PACKAGE / "runtime" / "deepspeed_internals")
LIBRARIES = ("diffusers", "accelerate", "transformers", "deepspeed")
# The private names the package used outside the tables (issue 52), found by attribute access
# or as a string (``getattr(model, "_cp_plan")``). Generic names of the table (``setup``) are
# left out: a name is flagged wherever it occurs.
PRIVATE_ATTRIBUTES = {
    "_cp_plan", "_parallel_config", "_attention_backend", "_supports_context_parallel",
    "_AttentionBackendRegistry", "get_active_backend", "set_active_backend",
    "_pack_latents", "_unpack_latents", "_pack_audio_latents", "_auto_resize", "VAE_IMAGE_SIZE",
    "prepare_causal_attention_mask", "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict",
    "_shared_state", "_models", "_schedulers",
    "_z3_optimizer", "scale_if_loss", "torch_autocast_z0_gradscaler",
}  # fmt: skip


def _is_private_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] in LIBRARIES and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def private_uses(source: str, where: str = "<snippet>") -> list[str]:
    """``where:line what`` for each private use of the libraries in ``source``: an import of a
    private module (``diffusers.models._modeling_parallel``), ``from <library>... import _name``,
    an access (or string) of one of ``PRIVATE_ATTRIBUTES``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno} import {a.name}" for a in node.names if _is_private_module(a.name)
            ]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if _is_private_module(module):
                found.append(f"{where}:{node.lineno} from {module} import ...")
            elif module.split(".")[0] in LIBRARIES:
                found += [
                    f"{where}:{node.lineno} from {module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append(f"{where}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:
            found.append(f"{where}:{node.lineno} {node.value!r}")
    return sorted(found, key=lambda f: int(f.split(" ", 1)[0].rsplit(":", 1)[1]))


def test_no_module_outside_the_tables_uses_a_private_library_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ALLOWED[0] or ALLOWED[1] in path.parents:
            continue
        found += private_uses(path.read_text(), str(path.relative_to(REPO_ROOT)))
    assert not found, "private library names outside runtime/library_internals.py:\n" + "\n".join(found)


def test_the_scan_flags_private_imports_and_attributes():
    snippet = """
from diffusers.models._modeling_parallel import ContextParallelConfig
import accelerate._private
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from accelerate.state import PartialState
plan = model._cp_plan
plan = getattr(model, "_cp_plan", None)
engines = accelerator._models
ok = model.config.num_attention_heads
"""
    found = private_uses(snippet)
    assert [f.split(" ", 1)[1] for f in found] == [
        "from diffusers.models._modeling_parallel import ...",
        "import accelerate._private",
        "from diffusers.models.attention_dispatch import _AttentionBackendRegistry",
        "._cp_plan",
        "'_cp_plan'",
        "._models",
    ], found


def test_every_tabled_name_exists_on_the_installed_versions():
    from diffusers_zero3.runtime.library_internals import (
        LIBRARY_NAMES,
        VERIFIED_ON,
        library_version,
        missing_library_names,
        require,
    )

    for library in {entry.library for entry in LIBRARY_NAMES}:
        assert library_version(library) in VERIFIED_ON[library], library  # constraints.txt's
    assert missing_library_names() == []
    for use in {entry.use for entry in LIBRARY_NAMES}:
        require(use)


def test_a_missing_name_is_one_error_naming_it_and_the_verified_versions(monkeypatch):
    from diffusers_zero3.runtime import library_internals as li

    made_up = li.LibraryName("ltx2_packing", li._LTX2, "_pack_latents_made_up")
    monkeypatch.setattr(li, "LIBRARY_NAMES", (*li.LIBRARY_NAMES, made_up))
    monkeypatch.setattr(li, "_checked", set())
    assert li.missing_library_names() == [
        "diffusers.pipelines.ltx2.pipeline_ltx2.LTX2Pipeline._pack_latents_made_up"
    ]
    with pytest.raises(li.LibraryInternalsError) as raised:
        li.ltx2_pipeline_method("_pack_latents_made_up")
    message = str(raised.value)
    assert "LTX2Pipeline._pack_latents_made_up" in message and "_pack_latents," not in message
    assert f"diffusers {li.library_version('diffusers')} lacks" in message
    assert "verified on diffusers 0.42.1" in message
    assert "\n" not in message
    # an instance-only name, missing on the object handed over
    with pytest.raises(li.LibraryInternalsError, match=r"accelerate\.accelerator\.Accelerator\._models"):
        li.prepared_models(object())
    # a name the table lacks is a programming error, not a lookup
    with pytest.raises(KeyError):
        li.ltx2_pipeline_method("_prepare_latents")


def test_the_accessors_read_what_the_names_hold():
    import torch
    from diffusers import FluxTransformer2DModel

    from diffusers_zero3.runtime import library_internals as li

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    assert li.cp_plan_of(model) is type(model)._cp_plan is not None
    assert li.cp_plan_of(torch.nn.Linear(2, 2)) is None
    assert li.attention_backend_of(model) == getattr(li.active_attention_backend(), "value", None)
    assert li.attention_backend_of(torch.nn.Linear(2, 2)) is None
    assert "native" in li.context_parallel_backends()
    assert li.keep_in_fp32_modules(model, fp16=False) == list(type(model)._keep_in_fp32_modules or [])
    assert li.kontext_keep_source_size() == {"_auto_resize": False}

    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    before = module.VAE_IMAGE_SIZE
    with li.qwenimage_edit_plus_source_area(64 * 48):
        assert module.VAE_IMAGE_SIZE == 64 * 48
    assert module.VAE_IMAGE_SIZE == before
