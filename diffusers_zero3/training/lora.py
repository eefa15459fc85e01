"""LoRA under ZeRO-3: peft adapters on a partitioned frozen denoiser, saved in diffusers' format.

The base denoiser is loaded straight into ZeRO-3 partitions (``load_pretrained_zero3``), then
``add_lora_adapters`` injects peft LoRA layers and freezes everything else. The model is
prepared as one ZeRO-3 engine whose optimizer holds the adapters alone: the frozen base stays
partitioned (gathered layer by layer in forward and backward, never given gradients or
optimizer state), and the adapters are partitioned like any trained parameter.

``save_lora_zero3`` gathers the adapters (a collective) and rank 0 writes
``pytorch_lora_weights.safetensors`` with the family's pipeline class's
``save_lora_weights``, after checking that every tensor has its adapter's full shape (an
ungathered ZeRO-3 parameter reads as shape [0]: the empty LoRA files reported upstream in
peft#2500, accelerate#3508, trl#4416). The file is written aside and moved into place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import ArgumentError
from ..runtime.distributed import barrier, is_main_process
from ..runtime.zero3 import gathered_parameters, is_zero3_param
from ..state.folders import fsync_tree

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
DORA_MAGNITUDE_SUFFIX = "lora_magnitude_vector.weight"  # a DoRA layer's magnitudes (--use_dora)


class LoraError(RuntimeError):
    """A gathered adapter tensor that does not have its adapter's shape (never written)."""


def add_lora_adapters(
    denoiser: torch.nn.Module,
    *,
    rank: int,
    target_modules: list[str] | tuple[str, ...],
    alpha: float | None = None,
    dropout: float = 0.0,
    use_dora: bool = False,
    seed: int | None = None,
) -> list[torch.nn.Parameter]:
    """Inject peft LoRA adapters (``rank``, ``alpha`` default ``rank``, ``dropout``, gaussian
    init as diffusers' LoRA scripts; ``use_dora``: DoRA, a learnt magnitude per output beside
    the low-rank direction, ``--use_dora``) into ``target_modules`` of ``denoiser`` (a diffusers
    model, or a transformers text encoder) and freeze the rest.

    Works on a whole or a ZeRO-3-partitioned denoiser (call before ``accelerator.prepare``, on
    every rank; under ZeRO-3 the engine broadcasts rank 0's initial values). With ``seed`` the
    initial values are drawn from that seed alone (the global RNG restored after): the same
    whatever drew from the RNG before (loading, a partitioned or a whole model, data); without
    it, from the global RNG as it stands. Returns the trainable adapter parameters, the only ones
    to give the optimizer. Raises ``ArgumentError`` when no module matches the targets.
    """
    from peft import LoraConfig

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=list(target_modules),
        use_dora=use_dora,
    )
    denoiser.requires_grad_(False)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with (
            torch.random.fork_rng(devices=devices, enabled=seed is not None),
            _dora_init_gathers_zero3_weights(use_dora),
        ):
            if seed is not None:
                torch.manual_seed(seed)
            if _is_transformers_model(denoiser):
                # transformers 5's own add_adapter asks for peft >= 0.22; peft's injection is what it does
                from peft import inject_adapter_in_model

                inject_adapter_in_model(config, denoiser)
            else:
                denoiser.add_adapter(config)
    except ValueError as e:  # peft: "Target modules ... not found in the base model"
        raise ArgumentError(
            f"--lora_layers {','.join(target_modules)}: no such module in {type(denoiser).__name__}"
        ) from e
    params = [p for n, p in denoiser.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    if not params:
        raise LoraError(
            f"no module of {type(denoiser).__name__} matches the LoRA targets {', '.join(target_modules)}"
        )
    if use_dora:
        _register_dora_weights(denoiser)
    return params


@contextlib.contextmanager
def _dora_init_gathers_zero3_weights(use_dora: bool) -> Iterator[None]:
    """For the block: peft's DoRA initialisation (each layer's magnitudes, the row norms of its
    base weight) gathers the base weight with this package's ``gathered_parameters``, one
    layer at a time, in the same order on every rank. peft gathers with ``gather_params_ctx``,
    which asks transformers whether ZeRO-3 is on, and that is False here: this package never
    registers an ``HfDeepSpeedConfig`` (it would change every ``from_pretrained``), so a
    partitioned weight would read as shape [0]. Restores peft's function in ``finally``."""
    if not use_dora:
        yield
        return
    from peft.tuners.lora import dora

    original = dora.gather_params_ctx

    def gather(params, modifier_rank=None, fwd_module=None):  # a read: nothing is written back
        return gathered_parameters([params] if isinstance(params, torch.Tensor) else list(params))

    dora.gather_params_ctx = gather
    try:
        yield
    finally:
        dora.gather_params_ctx = original


def _register_dora_weights(model: torch.nn.Module) -> int:
    """Under ZeRO-3, make each DoRA layer gather what its magnitude layer reads directly (the
    base weight and the ``lora_A``/``lora_B`` weights, for the weight norm), outside those
    modules' own forwards: registered as external parameters of the peft LoRA layer, they are
    gathered for its whole forward (the base layer's release then leaves them). Inside a block
    made a ZeRO-3 leaf they are gathered anyway. This is DeepSpeed's stated contract for a
    parameter read outside its module's forward; DeepSpeed 0.19.8 happened to leave these
    weights gathered there without it too (tests/test_lora.py's DoRA test passes either way,
    also with the leaves lever off), so it guards against a release this version does not do.
    Returns the layers registered (0 for a model that is not partitioned)."""
    layers = [m for m in model.modules() if getattr(m, "lora_magnitude_vector", None)]
    if not layers or not is_zero3_param(layers[0].get_base_layer().weight):
        return 0
    from deepspeed.runtime.zero import register_external_parameter

    for layer in layers:
        base = layer.get_base_layer()
        for name in layer.lora_magnitude_vector:
            for param in (base.weight, layer.lora_A[name].weight, layer.lora_B[name].weight):
                register_external_parameter(layer, param)
    return len(layers)


def _is_transformers_model(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel)


def adapter_shapes(denoiser: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{peft state-dict key: full shape}`` of every adapter tensor (partitioned or not)."""
    module = getattr(denoiser, "module", denoiser)
    shapes = {}
    for name, p in module.named_parameters():
        if "lora_" in name:
            shape = tuple(p.ds_shape) if is_zero3_param(p) else tuple(p.shape)
            key = name.replace(".default", "")
            if key.endswith(DORA_MAGNITUDE_SUFFIX):  # peft keeps DoRA's magnitudes under the layer's name
                key = key[: -len(".weight")]
            shapes[key] = shape
    return shapes


def gathered_lora_state_dict(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors in peft's state-dict form (CPU copies), checked against their
    shapes. Collective under ZeRO-3 (every rank gathers; every rank gets the dict)."""
    from peft.utils import get_peft_model_state_dict

    module = getattr(denoiser, "module", denoiser)
    params = [p for n, p in module.named_parameters() if "lora_" in n]
    expected = adapter_shapes(module)
    with gathered_parameters(params):
        state = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(module).items()}
    if set(state) != set(expected):
        raise LoraError(
            f"the LoRA state dict has {len(state)} tensors, the model {len(expected)} adapters: "
            f"{sorted(set(state) ^ set(expected))[:4]}"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != expected[key] or tensor.numel() == 0:
            raise LoraError(f"LoRA tensor {key} has shape {tuple(tensor.shape)}, its adapter {expected[key]}")
    return state


def _write_lora_file(path: Path, layers: dict[str, dict[str, torch.Tensor]]) -> None:
    """``layers`` (``{"<component>_lora_layers": state dict}``) as diffusers' ``save_lora_weights``
    writes them: every key prefixed with its component's name, safetensors with format ``pt``."""
    from safetensors.torch import save_file

    state = {
        f"{name.removesuffix('_lora_layers')}.{key}": tensor.contiguous()
        for name, sd in layers.items()
        for key, tensor in sd.items()
    }
    save_file(state, str(path), metadata={"format": "pt"})


def load_lora_into(pipeline, family, folder: str | os.PathLike) -> None:
    """Load ``save_lora_zero3``'s file from ``folder`` into ``pipeline``: its
    ``load_lora_weights``, or, for a pipeline class without one (NucleusMoE-Image), the
    denoiser's own ``load_lora_adapter`` with the file's prefix. Not a collective."""
    if hasattr(pipeline, "load_lora_weights"):
        pipeline.load_lora_weights(folder)
    else:
        getattr(pipeline, family.denoiser).load_lora_adapter(
            str(folder), prefix=family.denoiser, weight_name=LORA_WEIGHT_NAME
        )


def save_lora_zero3(denoiser, family, output_dir: str | os.PathLike, others: dict | None = None) -> Path:
    """Write ``output_dir/pytorch_lora_weights.safetensors`` in diffusers' LoRA format for the
    family's pipeline class, gathered from the partitions. Collective: call on every rank.
    ``others`` maps other trained components with adapters (DreamBooth's ``text_encoder``,
    ``text_encoder_2``) to their models or engines: saved in the same file, under the
    pipeline's own names (``text_encoder_lora_layers``, ...).

    ``denoiser`` is the trained model or its engine; wrap the call in
    ``ema.averaged_weights()`` to save the EMA adapters. Every tensor's shape is checked against
    its adapter (never an empty or shape-[0] tensor); the file is written by the global main
    process into a staging folder and moved into place, so an existing file is replaced whole
    or not at all. The result loads with ``pipeline.load_lora_weights(output_dir)`` (with
    ``load_lora_into`` for a pipeline class that has no LoRA loader: NucleusMoE-Image).
    """
    import diffusers
    from diffusers.utils import convert_state_dict_to_diffusers

    state = gathered_lora_state_dict(denoiser)
    other_states = {name: gathered_lora_state_dict(model) for name, model in (others or {}).items()}
    final = Path(output_dir) / LORA_WEIGHT_NAME
    if is_main_process():
        staging = Path(output_dir) / f".tmp-lora-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            pipeline_class = getattr(diffusers, family.pipeline_class)
            # diffusers' UNet LoRA scripts convert peft's keys to its own format; its transformer
            # scripts save peft's keys as they are, and their pipelines load only those: a
            # converted SD3 or Flux.2 file loaded without its attention adapters, silently.
            convert = convert_state_dict_to_diffusers if family.denoiser == "unet" else (lambda sd: sd)
            layers = {
                f"{name}_lora_layers": convert(sd)
                for name, sd in {family.denoiser: state, **other_states}.items()
            }
            if hasattr(pipeline_class, "save_lora_weights"):
                pipeline_class.save_lora_weights(staging, **layers, weight_name=LORA_WEIGHT_NAME)
            else:  # no LoRA loader in the pipeline (NucleusMoE-Image): the same file, by hand
                _write_lora_file(staging / LORA_WEIGHT_NAME, layers)
            fsync_tree(staging)
            os.replace(staging / LORA_WEIGHT_NAME, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    barrier()
    return final


def lora_loader_hint(family) -> str:
    """How a user loads the saved LoRA weights of ``family``'s denoiser: the pipeline's
    ``load_lora_weights``, or the denoiser's ``load_lora_adapter`` where the pipeline has no
    LoRA loader (NucleusMoE-Image's)."""
    import diffusers

    if hasattr(getattr(diffusers, family.pipeline_class), "load_lora_weights"):
        return f"{family.pipeline_class}.load_lora_weights"
    return f"{family.denoiser}.load_lora_adapter, prefix {family.denoiser!r}"
