"""Every use of a diffusers, accelerate or transformers name that is not its documented API, in
one place, with the versions each was checked on (DeepSpeed's: ``runtime.deepspeed_internals``).

Underscored attributes, pipeline helpers and module constants change between releases without
notice, and a renamed one mostly fails silently: a model whose ``_cp_plan`` is gone says it has
no context-parallel plan, a pipeline constant written under an old name changes nothing. So the
package touches these names only through the functions of this module, each of which raises
one ``LibraryInternalsError`` naming what the installed library lacks and the versions the name
was verified on (``VERIFIED_ON``, the versions of constraints.txt). Where a name is legitimately
absent on some objects (an attention processor of the old kind has no ``_attention_backend``, a
UNet no ``_cp_plan``), its owner class is checked instead, once per use.

Each use, what it does and its names (``LIBRARY_NAMES``: the use, the owner, the name), and
where the package calls it:

| use | what it does | private names | where |
|---|---|---|---|
| ``context_parallel`` | splits a denoiser's sequence over a group of ranks on this package's mesh (``enable_parallelism``'s steps) | ``ModelMixin._cp_plan`` (read), ``ModelMixin._parallel_config`` and an attention processor's ``_parallel_config`` (written), ``ParallelConfig.setup`` | ``runtime/context_parallel.py`` |
| ``attention_backends`` | the backend a model's attention runs and those diffusers splits; a model's backend set without changing the process's | ``attention_dispatch._AttentionBackendRegistry``, its ``_supports_context_parallel``, ``get_active_backend``, ``set_active_backend``; an attention processor's ``_attention_backend`` | ``runtime/context_parallel.py`` |
| ``ltx2_packing`` | LTX-2's video and audio latents as the transformer's tokens and back | ``LTX2Pipeline._pack_latents``, ``._unpack_latents``, ``._pack_audio_latents`` | ``families/ltx2.py`` |
| ``kontext_source_size`` | a Kontext validation call that keeps the source's size | ``FluxKontextPipeline.__call__``'s argument ``_auto_resize`` | ``families/kontext.py`` |
| ``qwenimage_edit_source_area`` | a Qwen-Image-Edit-Plus call that encodes its sources at the requested area | ``pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE`` (written for the call) | ``families/qwenimage_edit.py`` |
| ``hunyuanvideo15_vae_mask`` | HunyuanVideo 1.5's VAE attention on batches of clips | ``autoencoder_kl_hunyuanvideo15.HunyuanVideo15AttnBlock.prepare_causal_attention_mask`` (replaced while open) | ``families/hunyuanvideo15.py`` |
| ``fp32_modules`` | the modules ``from_pretrained`` keeps in fp32, for the partitioned load | ``ModelMixin._keep_in_fp32_modules``; transformers' ``PreTrainedModel._keep_in_fp32_modules`` and ``_keep_in_fp32_modules_strict`` | ``state/pretrained.py`` |
| ``accelerate_state`` | whether accelerate's DeepSpeed plugin is ZeRO-3, without creating accelerate's state | ``AcceleratorState._shared_state`` (and its ``deepspeed_plugins`` key) | ``runtime/zero3.py`` |
| ``prepared_objects`` | the engines and schedules ``accelerator.prepare`` made, for checkpoints and resume on another number of processes | ``Accelerator._models``, ``Accelerator._schedulers`` | ``state/resume.py`` |

Not tabled (documented): ``diffusers.ContextParallelConfig``, ``diffusers.ParallelConfig`` (the
package used to import them from ``models._modeling_parallel``), ``diffusers.hooks.
apply_context_parallel``, ``ModelMixin.set_attention_backend``. The family modules that
re-implement a pipeline's private method (``Flux2Pipeline._patchify_latents``, ...) cite it
and call nothing of it. Also outside this table: the message of diffusers' sequence sharder
that ``context_parallel.SPLIT_FAILURE`` matches, and torch's and datasets' private names.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The releases the test suite ran on (constraints.txt pins them).
VERIFIED_ON: dict[str, tuple[str, ...]] = {
    "diffusers": ("0.42.1",),
    "accelerate": ("1.15.0",),
    "transformers": ("5.24.0",),
}

_MODEL = "diffusers.models.modeling_utils:ModelMixin"
# the attention processors of diffusers' attention dispatch each carry the two names; Flux.1's
# stands for them
_PROCESSOR = "diffusers.models.transformers.transformer_flux:FluxAttnProcessor"
_REGISTRY = "diffusers.models.attention_dispatch:_AttentionBackendRegistry"
_LTX2 = "diffusers.pipelines.ltx2.pipeline_ltx2:LTX2Pipeline"
_QWEN_EDIT_PLUS = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"
_HUNYUAN_ATTN = "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15:HunyuanVideo15AttnBlock"
_ACCELERATOR = "accelerate.accelerator:Accelerator"


class LibraryInternalsError(RuntimeError):
    """The installed diffusers, accelerate or transformers lacks a name the package uses."""


@dataclass(frozen=True)
class LibraryName:
    """A name of another library that is not its documented API. ``owner`` is ``module:Class``
    or ``module``; ``on_class``: the name can be looked up on the owner itself (class
    attributes, methods, module attributes), else it exists on instances only (checked where
    it is used, on the instance); ``parameter_of``: the name is a parameter of that method of
    the owner."""

    use: str
    owner: str
    name: str
    on_class: bool = True
    parameter_of: str | None = None

    @property
    def library(self) -> str:
        return self.owner.split(".")[0].split(":")[0]

    @property
    def qualified(self) -> str:
        owner = self.owner.replace(":", ".")
        if self.parameter_of:
            return f"{owner}.{self.parameter_of}({self.name}=...)"
        return f"{owner}.{self.name}"


LIBRARY_NAMES: tuple[LibraryName, ...] = (
    LibraryName("context_parallel", _MODEL, "_cp_plan"),
    LibraryName("context_parallel", _MODEL, "_parallel_config"),
    LibraryName("context_parallel", _PROCESSOR, "_parallel_config"),
    LibraryName("context_parallel", "diffusers:ParallelConfig", "setup"),
    LibraryName("attention_backends", "diffusers.models.attention_dispatch", "_AttentionBackendRegistry"),
    LibraryName("attention_backends", _REGISTRY, "_supports_context_parallel"),
    LibraryName("attention_backends", _REGISTRY, "get_active_backend"),
    LibraryName("attention_backends", _REGISTRY, "set_active_backend"),
    LibraryName("attention_backends", _PROCESSOR, "_attention_backend"),
    LibraryName("ltx2_packing", _LTX2, "_pack_latents"),
    LibraryName("ltx2_packing", _LTX2, "_unpack_latents"),
    LibraryName("ltx2_packing", _LTX2, "_pack_audio_latents"),
    LibraryName(
        "kontext_source_size", "diffusers:FluxKontextPipeline", "_auto_resize", parameter_of="__call__"
    ),
    LibraryName("qwenimage_edit_source_area", _QWEN_EDIT_PLUS, "VAE_IMAGE_SIZE"),
    LibraryName("hunyuanvideo15_vae_mask", _HUNYUAN_ATTN, "prepare_causal_attention_mask"),
    LibraryName("fp32_modules", _MODEL, "_keep_in_fp32_modules"),
    LibraryName("fp32_modules", "transformers.modeling_utils:PreTrainedModel", "_keep_in_fp32_modules"),
    LibraryName(
        "fp32_modules", "transformers.modeling_utils:PreTrainedModel", "_keep_in_fp32_modules_strict"
    ),
    LibraryName("accelerate_state", "accelerate.state:AcceleratorState", "_shared_state"),
    LibraryName("prepared_objects", _ACCELERATOR, "_models", on_class=False),
    LibraryName("prepared_objects", _ACCELERATOR, "_schedulers", on_class=False),
)

_checked: set[str] = set()


def library_version(library: str) -> str:
    """The installed version of ``library`` (``"0.42.1"``), without a local suffix; ``"absent"``
    when it is not installed."""
    try:
        return importlib.metadata.version(library).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _owner(owner: str) -> Any:
    module_name, _, class_name = owner.partition(":")
    obj = importlib.import_module(module_name)
    return getattr(obj, class_name) if class_name else obj


def _present(entry: LibraryName) -> bool:
    try:
        owner = _owner(entry.owner)
    except (ImportError, AttributeError):
        return False
    if entry.parameter_of is not None:
        method = getattr(owner, entry.parameter_of, None)
        return method is not None and entry.name in inspect.signature(method).parameters
    if entry.on_class:
        return hasattr(owner, entry.name)
    # on instances only: the owner's source assigns it (``self.<name> =``)
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return False
    return f"self.{entry.name} =" in source or f"self.{entry.name}: " in source


def missing_library_names(use: str | None = None) -> list[str]:
    """The names of ``LIBRARY_NAMES`` (those of ``use``, or all) that the installed libraries
    lack, qualified (``diffusers.pipelines.ltx2.pipeline_ltx2.LTX2Pipeline._pack_latents``).
    Names on instances only are looked for in their owner's source."""
    return [e.qualified for e in LIBRARY_NAMES if (use is None or e.use == use) and not _present(e)]


def _error(names: list[str], use: str) -> LibraryInternalsError:
    libraries = sorted({n.split(".")[0] for n in names})
    installed = ", ".join(f"{lib} {library_version(lib)}" for lib in libraries)
    verified = "; ".join(f"{lib} {', '.join(VERIFIED_ON.get(lib, ('?',)))}" for lib in libraries)
    return LibraryInternalsError(
        f"{installed} lacks {', '.join(names)}, which diffusers_zero3 needs for {use.replace('_', ' ')}"
        f" (verified on {verified})"
    )


def require(use: str) -> None:
    """Raise ``LibraryInternalsError`` naming each name of ``use`` the installed libraries lack
    (those on a class or module; not those on instances only). Checked once per use and
    process. Not a collective."""
    if use in _checked:
        return
    if not any(e.use == use for e in LIBRARY_NAMES):
        raise KeyError(f"no use {use!r} in LIBRARY_NAMES")
    missing = [e.qualified for e in LIBRARY_NAMES if e.use == use and e.on_class and not _present(e)]
    if missing:
        raise _error(missing, use)
    _checked.add(use)


def _entry(owner: str, name: str) -> LibraryName:
    for entry in LIBRARY_NAMES:
        if entry.owner == owner and entry.name == name:
            return entry
    raise KeyError(f"{owner}.{name} is not in LIBRARY_NAMES")


def _instance_attribute(obj: Any, owner: str, name: str) -> Any:
    """``obj.<name>`` for an instance-only name of the table; its absence is the error."""
    entry = _entry(owner, name)
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error([entry.qualified], entry.use) from None


# ----------------------------------------------------------------------------- diffusers


def cp_plan_of(model: Any) -> Any | None:
    """``model``'s context-parallel plan (``_cp_plan``: which inputs are split at which module
    and where the output is gathered), None for a model without one. Not a collective."""
    require("context_parallel")
    return getattr(model, "_cp_plan", None)


def attach_parallel_config(
    model: Any, config: Any, rank: int, world_size: int, device: Any, mesh: Any
) -> None:
    """``config`` (a ``ParallelConfig``) set up for this rank on ``mesh`` and recorded on
    ``model`` and on each of its attention processors that reads one, as diffusers'
    ``enable_parallelism`` records its own. Not a collective."""
    require("context_parallel")
    config.setup(rank, world_size, device, mesh=mesh)
    model._parallel_config = config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config


def _backend_registry() -> Any:
    require("attention_backends")
    return _owner(_REGISTRY)


def context_parallel_backends() -> list[str]:
    """The attention backends diffusers splits for context parallelism (its registry's list,
    read at the call). Not a collective."""
    return sorted(_backend_registry()._supports_context_parallel)


def active_attention_backend() -> Any:
    """The process's active attention backend (diffusers' registry)."""
    backend, _ = _backend_registry().get_active_backend()
    return backend


def set_active_attention_backend(backend: Any) -> None:
    """Make ``backend`` the process's active attention backend again (diffusers' registry)."""
    _backend_registry().set_active_backend(backend)


def attention_backend_of(model: Any) -> str | None:
    """The attention backend of ``model``'s first attention processor of diffusers' dispatch
    (the process's active one where the processor has none set); None for a model without such
    a processor. Not a collective."""
    require("attention_backends")
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            backend = processor._attention_backend
            if backend is None:
                backend = active_attention_backend()
            return getattr(backend, "value", backend)
    return None


def ltx2_pipeline_method(name: str) -> Callable:
    """``LTX2Pipeline``'s static latent packing method ``name`` (one of the table's)."""
    _entry(_LTX2, name)
    require("ltx2_packing")
    return getattr(_owner(_LTX2), name)


def ltx2_pack_latents(*args: Any) -> Any:
    """``LTX2Pipeline._pack_latents(latents, patch_size, patch_size_t)``: ``(N, C, F, H, W)``
    video latents as ``(N, tokens, C p_t p p)`` tokens."""
    return ltx2_pipeline_method("_pack_latents")(*args)


def ltx2_unpack_latents(*args: Any) -> Any:
    """``LTX2Pipeline._unpack_latents(tokens, frames, height, width, patch_size,
    patch_size_t)``, the inverse of ``ltx2_pack_latents`` (frames, height, width in patches)."""
    return ltx2_pipeline_method("_unpack_latents")(*args)


def ltx2_pack_audio_latents(latents: Any) -> Any:
    """``LTX2Pipeline._pack_audio_latents``: audio latents ``(N, C, L, M)`` as ``(N, L, C x M)``
    tokens."""
    return ltx2_pipeline_method("_pack_audio_latents")(latents)


def kontext_keep_source_size() -> dict[str, Any]:
    """The keyword arguments of a ``FluxKontextPipeline`` call that leave a source image at its
    own size (floored to the pipeline's multiple) instead of resizing it to a preferred Kontext
    resolution."""
    require("kontext_source_size")
    return {"_auto_resize": False}


@contextlib.contextmanager
def qwenimage_edit_plus_source_area(area: int) -> Iterator[None]:
    """While open, ``QwenImageEditPlusPipeline`` encodes its sources' latents at ``area``
    pixels (its module's ``VAE_IMAGE_SIZE``, 1024^2 by default; restored on exit). Not
    thread-safe: it writes the module's constant."""
    require("qwenimage_edit_source_area")
    module = _owner(_QWEN_EDIT_PLUS)
    saved = module.VAE_IMAGE_SIZE
    module.VAE_IMAGE_SIZE = area
    try:
        yield
    finally:
        module.VAE_IMAGE_SIZE = saved


@contextlib.contextmanager
def hunyuanvideo15_causal_mask(mask: Callable) -> Iterator[None]:
    """While open, ``HunyuanVideo15AttnBlock.prepare_causal_attention_mask`` is ``mask`` (a
    static method; the original restored on exit). Not thread-safe: it patches the class."""
    require("hunyuanvideo15_vae_mask")
    block = _owner(_HUNYUAN_ATTN)
    original = block.__dict__["prepare_causal_attention_mask"]
    block.prepare_causal_attention_mask = staticmethod(mask)
    try:
        yield
    finally:
        block.prepare_causal_attention_mask = original


def keep_in_fp32_modules(model: Any, *, fp16: bool) -> list[str]:
    """The module names ``from_pretrained`` keeps in fp32 for ``model``: a diffusers model's
    ``_keep_in_fp32_modules`` (always); a transformers model's ``_keep_in_fp32_modules_strict``
    (always) and ``_keep_in_fp32_modules`` (under ``fp16`` only). Not a collective."""
    require("fp32_modules")
    diffusers_model = hasattr(model, "save_config")  # a diffusers ModelMixin
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if fp16 or diffusers_model:
        keep += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return keep


# ----------------------------------------------------------------------------- accelerate


def accelerate_shared_state() -> dict | None:
    """accelerate's shared state (``AcceleratorState._shared_state``; empty before any
    ``Accelerator``), or None when ``accelerate.state`` was never imported: read without
    creating the state. Not a collective."""
    module = sys.modules.get("accelerate.state")
    if module is None:
        return None
    require("accelerate_state")
    return module.AcceleratorState._shared_state


def prepared_models(accelerator: Any) -> list:
    """The models ``accelerator.prepare`` returned, in order (DeepSpeed engines under
    DeepSpeed): ``Accelerator._models``."""
    return list(_instance_attribute(accelerator, _ACCELERATOR, "_models"))


def prepared_schedulers(accelerator: Any) -> list:
    """The learning-rate schedules ``accelerator.prepare`` wrapped, in order:
    ``Accelerator._schedulers``."""
    return list(_instance_attribute(accelerator, _ACCELERATOR, "_schedulers"))
