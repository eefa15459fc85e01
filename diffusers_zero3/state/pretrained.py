"""Load partitioned, save consolidated: no rank ever holds the whole model.

* ``load_pretrained_zero3`` builds a diffusers ``ModelMixin`` (or a transformers
  ``PreTrainedModel``) under ``deepspeed.zero.Init`` and reads, for every parameter, only this
  rank's partition: the byte range of the flattened tensor inside the safetensors file. Peak
  host memory per rank stays near the model's bytes / N; no full tensor is ever read.
* ``save_pretrained_zero3`` streams a model (or an EMA's partitions) to safetensors shards:
  the headers are computed up front from the parameter shapes, then each tensor is gathered
  to rank 0 and written straight to its place in the file, so rank 0's extra memory is one
  tensor. The folder is written under a temporary name and renamed: complete or absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.deepspeed_internals.reads import held_whole
from ..runtime.distributed import (
    all_gather_object,
    barrier,
    comm_device,
    get_rank,
    get_world_size,
    is_main_process,
)
from ..runtime.ds_config import base_config, zero_init_config
from ..runtime.library_internals import keep_in_fp32_modules
from ..runtime.zero3 import (
    _register_zero3_engine,
    is_zero3_param,
    zero3_init_disabled,
)
from .folders import CheckpointError, describe_write_error, naming, publish_folder

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


# ----------------------------------------------------------------------------- safetensors


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where tensor data starts."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(fh.read(n))
    return header, 8 + n


def _safetensors_header_bytes(entries: list[tuple[str, list[int], torch.dtype]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = _numel(shape) * _itemsize(dtype)
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _read_flat_range(
    path: Path, data_start: int, info: dict, start: int, end: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Elements ``[start, end)`` of a stored tensor, flattened, read straight from the file.

    With ``out`` (a flat tensor of ``end - start`` elements), the values land in it: read
    into it directly when it is a CPU tensor of the stored dtype (no intermediate buffer, so
    loading a partition costs no transient copy of it), else through a buffer and a cast.
    """
    dtype = _TORCH_DTYPES[info["dtype"]]
    size = _itemsize(dtype)
    begin = data_start + info["data_offsets"][0] + start * size
    direct = out is not None and out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
    if direct:
        buf = memoryview(out.numpy() if dtype != torch.bfloat16 else out.view(torch.int16).numpy()).cast("B")
    else:
        buf = bytearray((end - start) * size)
    if len(buf):
        with open(path, "rb") as fh:
            fh.seek(begin)
            if fh.readinto(buf) != len(buf):
                raise CheckpointError(f"{path} is truncated")
    if direct:
        return out
    # CPU: file bytes, as frombuffer's; copy_ below moves them to out's device
    values = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    if out is not None:
        out.copy_(values)
        return out
    return values


# ----------------------------------------------------------------------------- load


def resolve_model_folder(
    pretrained_model_name_or_path: str | os.PathLike,
    subfolder: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> Path:
    """A local folder for a model: the path itself, or a hub snapshot (only that subfolder)."""
    path = Path(pretrained_model_name_or_path)
    if not path.is_dir():
        if path.is_absolute() or str(pretrained_model_name_or_path).startswith((".", "~")):
            raise CheckpointError(f"model folder {str(pretrained_model_name_or_path)!r} does not exist")
        try:
            from huggingface_hub import snapshot_download

            patterns = [f"{subfolder}/*"] if subfolder else None
            path = Path(
                snapshot_download(
                    str(pretrained_model_name_or_path),
                    revision=revision,
                    cache_dir=cache_dir,
                    allow_patterns=patterns,
                )
            )
        except Exception as e:
            raise CheckpointError(
                f"model {str(pretrained_model_name_or_path)!r} is neither a local folder nor reachable on the hub"
                f" ({type(e).__name__})"
            ) from e
    folder = path / subfolder if subfolder else path
    if not folder.is_dir():
        raise CheckpointError(f"model folder {str(folder)!r} does not exist")
    return folder


def weight_files(folder: Path, variant: str | None = None) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it (sharded or not)."""
    for stem in ("diffusion_pytorch_model", "model"):
        name = f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors"
        index = folder / f"{name}.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {k: folder / v for k, v in weight_map.items()}
        single = folder / name
        if single.exists():
            header, _ = read_safetensors_header(single)
            return {k: single for k in header if k != "__metadata__"}
    raise CheckpointError(
        f"no safetensors weights in {folder} (expected diffusion_pytorch_model or model .safetensors)"
    )


# torch.nn.init's in-place initialisers: modules call them as ``init.<name>`` at construction.
_TORCH_INITIALISERS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


@contextlib.contextmanager
def skip_torch_init() -> Iterator[None]:
    """Within it, ``torch.nn.init``'s in-place initialisers leave their tensor as it is.

    For a model built only to be overwritten by a checkpoint: under ``zero.Init`` each module
    is built whole and initialised before it is partitioned, and the random initialisation
    was most of the time of a partitioned load (docs/benchmarks.md). Every parameter is then
    read from the checkpoint
    (``_load_partitions`` refuses a missing one). Not thread-safe: it patches the module.
    """
    import torch.nn.init as init

    originals = {name: getattr(init, name) for name in _TORCH_INITIALISERS if hasattr(init, name)}

    def keep(tensor, *args, **kwargs):
        return tensor

    try:
        for name in originals:
            setattr(init, name, keep)
        yield
    finally:
        for name, fn in originals.items():
            setattr(init, name, fn)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Within it, torch's default floating dtype is ``dtype`` (restored on exit): the dtype
    diffusers' and transformers' ``from_pretrained(torch_dtype=...)`` build a model in."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_partitioned(
    build: Callable[[], torch.nn.Module], cfg: dict, *, broadcast: bool = True
) -> torch.nn.Module:
    """``build()`` under ``deepspeed.zero.Init(cfg)``, each module partitioned as it is built,
    with every tensor it computes in ``__init__`` equal to ``from_pretrained``'s. Collective:
    call on every rank.

    ``zero.Init`` by default wraps torch's tensor factories (``torch.arange``, ``zeros``,
    ``empty``, ...) and casts their floating results to the partitions' dtype. A module that
    computes a table in ``__init__`` (rotary frequencies from ``arange``, position tables)
    then builds it from bf16-rounded values, even where the table itself is fp32, and no
    checkpoint overwrites a non-persistent buffer or a plain tensor attribute (Wan's rotary
    table at head dim 128 and 1024 positions: off by up to 2.0). Here the factories are left
    alone (``tensor_overrides=[]``) and the model is built under the partitions' dtype as the
    default dtype, which is how ``from_pretrained(torch_dtype=...)`` builds it: each tensor is
    computed as it would be there, and only parameters are cast to the partitions' dtype, as
    they are partitioned. Buffers are then moved to the accelerator (the factories no longer
    put them there); plain tensor attributes stay where ``from_pretrained`` leaves them.

    ``broadcast=False`` partitions each new parameter without broadcasting it from rank 0
    first: for a model whose every parameter is read from a checkpoint next (there is no
    random initialisation to agree on), which then builds under ``skip_torch_init`` too. Both
    the cast and the skipped broadcast are the ``fastload`` lever
    (``runtime.deepspeed_internals``); where it is off, DeepSpeed partitions as it does.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ..runtime.deepspeed_internals.zero_init import partition_new_parameters

    bf16, fp16 = (cfg.get(k, {}).get("enabled", False) for k in ("bf16", "fp16"))
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32  # as zero.Init reads cfg
    init = deepspeed.zero.Init(config_dict_or_path=cfg, tensor_overrides=[])
    partition_new_parameters(init, dtype, broadcast)
    with default_dtype(dtype), init:
        model = build()
    buffers_to(model, torch.device(get_accelerator().current_device_name()))
    return model


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move ``model``'s buffers (not its parameters) to ``device``: a partitioned model's
    buffers, which DeepSpeed's engine does not move. Not a collective."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def keeps_fp32(model: torch.nn.Module, name: str, dtype: torch.dtype) -> bool:
    """Whether ``from_pretrained(torch_dtype=dtype)`` keeps the tensor ``name`` of ``model`` in
    fp32: a module the class names in ``_keep_in_fp32_modules`` (diffusers: always; transformers:
    under fp16 only) or ``_keep_in_fp32_modules_strict`` (transformers), matched by name part
    (``runtime.library_internals.keep_in_fp32_modules``)."""
    if dtype == torch.float32:
        return True
    keep = keep_in_fp32_modules(model, fp16=dtype == torch.float16)
    parts = name.split(".")
    return any(k in parts for k in keep)


def cast_persistent_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating persistent buffers to ``dtype`` as ``from_pretrained`` does
    with the checkpoint's values (not those it keeps in fp32: ``keeps_fp32``). Non-persistent
    buffers keep the dtype they were computed in. Not a collective."""
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            name = f"{prefix}.{key}" if prefix else key
            if (
                buffer is not None
                and buffer.is_floating_point()
                and buffer.dtype != dtype
                and key not in module._non_persistent_buffers_set
                and not keeps_fp32(model, name, dtype)
            ):
                module._buffers[key] = buffer.to(dtype)


def _build_model(model_cls, folder: Path):
    if hasattr(model_cls, "load_config") and hasattr(model_cls, "from_config"):  # diffusers ModelMixin
        config = model_cls.load_config(folder)

        def build_diffusers():
            with skip_torch_init():
                return model_cls.from_config(config)

        return build_diffusers
    config_class = getattr(model_cls, "config_class", None)
    if config_class is None:
        raise TypeError(
            f"{model_cls.__name__} is neither a diffusers ModelMixin nor a transformers PreTrainedModel"
        )
    with zero3_init_disabled():
        config = config_class.from_pretrained(folder)

    def build():
        # Every weight is read from the checkpoint next, so transformers' own initialisation is
        # skipped: it runs once the top module is built, when zero.Init has already partitioned
        # the submodules, and writes into them (an embedding's padding row raises IndexError on
        # an empty partition: any config with a pad_token_id, e.g. Mistral's).
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = model_cls(config)
        model.tie_weights()  # init_weights ties them, and no_init_weights skips it (T5's shared embedding)
        return model

    return build


def load_pretrained_zero3(
    model_cls,
    pretrained_model_name_or_path: str | os.PathLike,
    subfolder: str | None = None,
    *,
    ds_config: dict | None = None,
    accelerator=None,
    torch_dtype: torch.dtype | None = None,
    variant: str | None = None,
    offload_param: bool | None = None,
):
    """Load a pretrained model straight into ZeRO-3 partitions; call on every rank.

    Collective (``deepspeed.zero.Init``): call on every rank. The model is built under
    ``zero.Init`` (so each module is partitioned as soon as it is constructed) and each rank
    reads only its own partition of every parameter from the safetensors files (sharded or
    not), so no rank ever holds a full copy. The result is what ``from_pretrained``
    followed by ZeRO-3 partitioning gives, ready for ``deepspeed.initialize`` /
    ``accelerator.prepare``. Without ZeRO-3 (no stage-3 config) it is ``from_pretrained``.

    Args:
        model_cls: a diffusers ``ModelMixin`` or transformers ``PreTrainedModel`` class.
        pretrained_model_name_or_path: a local folder or a hub id (its snapshot, only
            ``subfolder``; for a revision or a cache folder of your own, pass the folder that
            ``resolve_model_folder(id, subfolder, revision, cache_dir)`` returns, without a
            ``subfolder``).
        subfolder: e.g. ``"unet"`` inside a pipeline folder.
        ds_config: the DeepSpeed config (default: the accelerator's active plugin's).
        torch_dtype: dtype of the partitions (default fp32, or the config's bf16/fp16).
        offload_param: partitions in host memory (True) or accelerator memory (False),
            whatever the config's ``offload_param`` says; None follows the config.

    Raises:
        CheckpointError: a missing folder or weights file, a missing tensor, or a shape that
            does not fit the model (the message names the tensor).

    Example:
        >>> unet = load_pretrained_zero3(UNet2DConditionModel, "path/to/sd", "unet", accelerator=accelerator)
        >>> unet, optimizer = accelerator.prepare(unet, torch.optim.AdamW(unet.parameters()))
    """
    folder = resolve_model_folder(pretrained_model_name_or_path, subfolder)
    if base_config(ds_config, accelerator).get("zero_optimization", {}).get("stage") != 3:
        with zero3_init_disabled():
            return model_cls.from_pretrained(folder, torch_dtype=torch_dtype, variant=variant)

    from ..runtime.distributed import init_distributed_if_needed

    # this rank's GPU first, then the process group: zero_init_config reads the world size
    # (a custom script may call this before anything else has started it)
    init_distributed_if_needed()
    cfg = zero_init_config(ds_config, accelerator, offload=offload_param, dtype=torch_dtype)
    files = weight_files(folder, variant)
    build = _build_model(model_cls, folder)
    model = build_partitioned(build, cfg, broadcast=False)  # the dtype is the config's (zero_init_config)
    cast_persistent_buffers(model, next(model.parameters()).dtype)
    _register_zero3_engine()
    _load_partitions(model, checkpoint_names(model, files))
    read_generation_config(model, folder)
    return model


def read_generation_config(model: torch.nn.Module, folder: str | os.PathLike) -> None:
    """Give a transformers model that generates its folder's generation settings, as
    ``from_pretrained`` does (``adjust_generation_fn``: ``generation_config.json``, else the ones
    ``config.json`` holds): a model built from its config has only the config's defaults, and a
    judge that answers by generating would sample other answers (its ``top_k``, its
    ``max_new_tokens`` lost). Nothing for a model that does not generate. Not a collective."""
    can_generate = getattr(model, "can_generate", None)
    if can_generate is None or not can_generate():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: what config.json holds, as transformers does
        model.generation_config = GenerationConfig.from_pretrained(
            folder, config_file_name="config.json", _from_model_config=True
        )


def checkpoint_names(model: torch.nn.Module, files: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """``{model tensor name: (file, checkpoint tensor name)}`` of a weights map.

    transformers 5 saves some models under older names than their modules have (a VLM's
    ``model.language_model.*`` is written as ``model.*``, its ``model.visual.*`` as
    ``visual.*``) and renames them as it loads; this applies the same renamings, from
    transformers' own conversion mapping of the model. A checkpoint that needs more than a
    renaming (tensors fused or split) raises ``CheckpointError``.
    """
    names = {name: (path, name) for name, path in files.items()}
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return names
    if not isinstance(model, PreTrainedModel):
        return names
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return names
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict(keep_vars=True)
    renamed = {}
    for name, path in files.items():
        target, converted = rename_source_key(name, renamings, converters, model.base_model_prefix, expected)
        if converted is not None:
            raise CheckpointError(
                f"tensor {name!r} of {type(model).__name__} needs transformers' conversion {converted!r}, "
                "which a partitioned load does not do"
            )
        renamed[target] = (path, name)
    return renamed


def load_partitions_from(
    model: torch.nn.Module, folder: str | os.PathLike, prefixes: tuple[str, ...]
) -> list[str]:
    """Fill the tensors of ``model`` whose names start with one of ``prefixes`` from the
    safetensors weights of another model's ``folder`` (the same names there), each rank reading
    only its partitions under ZeRO-3 (whole tensors otherwise); returns the names read.
    Collective under ZeRO-3 only in that the model is partitioned; no communication.

    A ControlNet starts from its UNet's ``conv_in``, time embeddings, down blocks and middle
    block (``ControlNetModel.from_unet``) without a whole UNet on any rank.
    """
    files = {name: (path, name) for name, path in weight_files(Path(folder)).items()}
    names = [n for n in model.state_dict(keep_vars=True) if n.startswith(prefixes)]
    _load_partitions(model, files, only=set(names))
    return names


def _load_partitions(
    model: torch.nn.Module, files: dict[str, tuple[Path, str]], only: set[str] | None = None
) -> None:
    headers: dict[Path, tuple[dict, int]] = {}

    def info_of(name: str, expected_shape) -> tuple[Path, dict, int]:
        if name not in files:
            raise CheckpointError(f"tensor {name!r} of {type(model).__name__} is missing from the checkpoint")
        path, stored = files[name]
        if path not in headers:
            headers[path] = read_safetensors_header(path)
        header, start = headers[path]
        info = header[stored]
        if list(info["shape"]) != list(expected_shape):
            raise CheckpointError(
                f"tensor {name!r}: checkpoint shape {tuple(info['shape'])} does not fit the model's {tuple(expected_shape)}"
            )
        return path, info, start

    rank = get_rank()
    # Tied weights (T5's shared embedding and encoder.embed_tokens) are one tensor under
    # several names, of which the checkpoint holds one: read each tensor once, by a name the
    # checkpoint has.
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    for key, names in names_of.items():
        if only is not None and not any(n in only for n in names):
            continue
        tensor = tensors[key]
        name = next((n for n in names if n in files), names[0])
        if is_zero3_param(tensor):
            path, info, start = info_of(name, tensor.ds_shape)
            part = tensor.ds_tensor
            lo = min(rank * part.numel(), tensor.ds_numel)
            hi = min(lo + part.numel(), tensor.ds_numel)
            with torch.no_grad():
                _read_flat_range(path, start, info, lo, hi, out=part.data.view(-1)[: hi - lo])
                if held_whole(tensor):  # kept whole (persistence): fill it too
                    full = _read_flat_range(path, start, info, 0, tensor.ds_numel)
                    tensor.data.copy_(full.view(tensor.ds_shape))
        else:
            path, info, start = info_of(name, tensor.shape)
            with torch.no_grad():
                tensor.data.copy_(_read_flat_range(path, start, info, 0, tensor.numel()).view(tensor.shape))


# ----------------------------------------------------------------------------- save


def _gather_full(tensor: torch.Tensor, partition: torch.Tensor) -> torch.Tensor | None:
    """A ZeRO-3 parameter's full value from every rank's flat ``partition``, on rank 0 (None
    elsewhere). Collective."""
    flat = partition.detach().reshape(-1).to(comm_device())
    if get_world_size() == 1:
        full = flat
    else:
        parts = [torch.empty_like(flat) for _ in range(get_world_size())] if is_main_process() else None
        dist.gather(flat, parts, dst=0)
        full = torch.cat(parts) if parts is not None else None
    if full is None:
        return None
    return full[: tensor.ds_numel].view(tensor.ds_shape)


def _write_tensor(fh, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Append ``tensor``'s bytes (as ``dtype``, on CPU) at the current position of ``fh``."""
    data = tensor.to(device="cpu", dtype=dtype).contiguous()
    fh.write(data.view(-1).view(torch.uint8).numpy().tobytes())


def _plan_shards(entries, max_shard_bytes: int) -> list[list[int]]:
    shards, current, size = [], [], 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = _numel(shape) * _itemsize(dtype)
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"10KB"`` or an int (decimal units, as huggingface_hub)."""
    if isinstance(size, int):
        return size
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    s = size.strip().upper()
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    raise ValueError(f"cannot read size {size!r}; use e.g. '5GB'")


def save_pretrained_zero3(
    model_or_engine,
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    partitions: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None,
) -> None:
    """Write a model folder (config + safetensors) from ZeRO-3 partitions; call on every rank.

    Collective: call on every rank. Each tensor is gathered to rank 0 and streamed into its
    shard file, whose header was written from the known shapes, so rank 0's extra memory is
    one tensor and the other ranks' is nothing. Shards and the index file are named as
    ``save_pretrained`` names them (``diffusion_pytorch_model`` for diffusers models,
    ``model`` for transformers ones), so the class's ``from_pretrained`` loads the folder.
    The folder is complete or absent: it is written under a temporary name and renamed, and
    an error on rank 0 is raised on every rank.

    Args:
        model_or_engine: a module (partitioned or not) or a DeepSpeed engine.
        max_shard_size: largest shard, as ``"5GB"`` or bytes.
        dtype: cast floating tensors to this dtype (default: as they are held).
        partitions: for each parameter, the local flat partition to write instead of the
            parameter's own (``ShardedEMA`` writes its averages this way), or a full tensor
            for a non-ZeRO parameter; None keeps the parameter.

    Example:
        >>> save_pretrained_zero3(unet_engine, "out/unet", max_shard_size="2GB")
        >>> UNet2DConditionModel.from_pretrained("out/unet")
    """
    module = getattr(model_or_engine, "module", model_or_engine)
    state = module.state_dict(keep_vars=True)
    seen: set[int] = set()
    names, tensors = [], []
    for name, t in state.items():
        if id(t) in seen:  # tied weights are stored once, as save_pretrained does
            continue
        seen.add(id(t))
        names.append(name)
        tensors.append(t)
    entries = []
    for name, t in zip(names, tensors):
        shape = list(t.ds_shape) if is_zero3_param(t) else list(t.shape)
        t_dtype = dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype
        entries.append((name, shape, t_dtype))
    stem = "diffusion_pytorch_model" if hasattr(module, "save_config") else "model"
    shards = _plan_shards(entries, parse_size(max_shard_size))

    error: str | None = None
    completed = False
    files: list[Any] = []
    tmp_ctx = None
    tmp: Path | None = None
    if is_main_process():
        try:
            tmp_ctx = publish_folder(save_directory)
            tmp = tmp_ctx.__enter__()
            if hasattr(module, "save_config"):
                module.save_config(tmp)
            elif hasattr(module, "config"):
                module.config.save_pretrained(tmp)
            total = len(shards)
            for k, idx in enumerate(shards):
                fname = (
                    f"{stem}.safetensors" if total == 1 else f"{stem}-{k + 1:05d}-of-{total:05d}.safetensors"
                )
                with naming(tmp / fname):
                    fh = open(tmp / fname, "wb")
                    files.append((fname, fh))
                    fh.write(_safetensors_header_bytes([entries[i] for i in idx]))
        except Exception as e:
            error = describe_write_error(e)
    try:
        for k, idx in enumerate(shards):
            for i in idx:
                t = tensors[i]
                given = partitions(t) if partitions is not None else None
                if is_zero3_param(t):
                    full = _gather_full(t, given if given is not None else t.ds_tensor)
                else:  # whole on every rank: rank 0 writes it (or the whole tensor given)
                    full = (given if given is not None else t).detach() if is_main_process() else None
                if full is not None and error is None:
                    try:
                        _write_tensor(files[k][1], full, entries[i][2])
                    except Exception as e:
                        where = files[k][0] if isinstance(e, OSError) and e.filename is None else None
                        error = (
                            f"{where + ': ' if where else ''}{describe_write_error(e)} (writing {names[i]})"
                        )
        if is_main_process() and error is None:
            try:  # closing flushes the last bytes: a full disk may show only here
                for fname, fh in files:
                    with naming(tmp / fname):
                        fh.close()
                if len(shards) > 1:
                    weight_map = {entries[i][0]: files[k][0] for k, idx in enumerate(shards) for i in idx}
                    total_size = sum(_numel(s) * _itemsize(d) for _, s, d in entries)
                    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
                    with naming(tmp / f"{stem}.safetensors.index.json"):
                        (tmp / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
            except OSError as e:  # reported to every rank below, not raised past their exchange
                error = describe_write_error(e)
        completed = True
    finally:
        for _, fh in files:
            fh.close()
        if tmp_ctx is not None:
            if completed and error is None:
                tmp_ctx.__exit__(None, None, None)  # publish
            else:  # an error or an interruption: remove the temporary folder
                exc = CheckpointError(error or "interrupted")
                tmp_ctx.__exit__(CheckpointError, exc, None)
    errors = [e for e in all_gather_object(error) if e]
    if errors:
        raise CheckpointError(f"saving {save_directory} failed on rank 0: {errors[0]}")
    barrier()
