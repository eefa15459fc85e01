"""Every use of a DeepSpeed name that is not its documented API, in one place, with the
DeepSpeed versions each was checked on.

The package's speed-ups (the levers of ``levers.py``, ``async_reduce.py``, the fast
partitioned build of ``zero_init.py``) replace methods of DeepSpeed's objects, write their
attributes and call their underscored functions. Such names change between releases without
notice: on DeepSpeed 0.15-0.17 the replaced reduce method had another signature and read an
attribute that did not exist (an AttributeError at the first backward); on 0.18.0 the
gradient epilogue counted micro-steps itself, and the replacement's call order would have added
a micro-step's last buckets onto the previous step's partitions (silently wrong gradients).
So each lever is applied only on a DeepSpeed version it was verified on, with every name it
needs present; otherwise it is off (DeepSpeed's own behaviour), said once in one warning line,
never half-applied (``lever_in_force``, asked when an engine or a partitioned model is built).

What counts as documented, and is used elsewhere in the package: ``deepspeed.initialize``,
``deepspeed.zero.Init`` and its arguments, ``deepspeed.zero.GatheredParameters``,
``deepspeed.utils.set_z3_leaf_module(s)`` / ``z3_leaf_module``, ``deepspeed.checkpoint``'s
``ds_to_universal`` entry point, ``deepspeed.comm``, the accelerator API, and reading a ZeRO-3
parameter's ``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor``, ``ds_status`` and
``ds_persist``.

Each lever, the names it needs (``PRIVATE_NAMES``, owner and name) and the versions it was
verified on (the test suite ran on them):

| lever | what it does | private names |
|---|---|---|
| ``hooks`` | drops ZeRO-3's module hooks where nothing is gathered | ``DeepSpeedZeRoOffload.forward_hooks`` / ``backward_hooks`` (lists written), ``module._external_params`` |
| ``coalesce`` | gathers the kept-whole parameters after a step in one collective | ``DeepSpeedZeroOptimizer_Stage3.persistent_parameters``, ``param.all_gather`` (replaced), ``param.ds_status`` (written), ``param.ds_process_group`` |
| ``leaves`` | reduces the gradients of block leaf modules per parameter | ``_grad_acc_hooks``, ``_leaf_module_hooks``, ``leaf_parameters``, ``fp16_groups``, ``create_reduce_and_remove_grad_hooks``, ``param.ds_z3_leaf_module`` (deleted), ``param.all_gather`` / ``partition`` (replaced while hooks are made) |
| ``overlap`` | reduce-scatters gradient buckets while the backward goes on (CPU) | ``_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads`` and ``independent_gradient_partition_epilogue`` (replaced), ``ipg_buckets``, ``partition_grads``, ``_get_param_partition_group``, ``_gradient_averaging_world_size``, ``_assert_same_partition_group``, ``gradient_accumulation_dtype`` |
| ``nvtx`` | DeepSpeed's NVTX ranges off | ``deepspeed.utils.nvtx.enable_nvtx`` (written) |
| ``fastload`` | partitions a model built to be overwritten without broadcasting it, its parameters cast to the partitions' dtype | ``Init._zero_init_param`` (replaced), ``Init._convert_to_deepspeed_param``, ``param.partition`` |
| ``share_fp32`` | fp32 master weights shared with fp32 parameters | ``fp16_partitioned_groups_flat``, ``fp32_partitioned_groups_flat`` |
| ``memory`` (read only) | counts a ZeRO-3 optimizer's bytes (``zero3_optimizer_bytes``) | ``grad_partitions_flat_buffer``, ``fp16_partitioned_groups_flat``, ``fp32_partitioned_groups_flat``, ``ipg_buckets`` |
| ``universal`` | converts a ZeRO-3 checkpoint to the universal form with the work spread over the ranks | ``ds_to_universal``'s ``_get_optim_files``, ``_filter_zero3_optim_files``, ``_get_zero3_model_state_files``, ``_autoep_expert_param_names_by_rank``, ``_build_zero3_rank_grid``, ``_parse_model_states_stage3``, ``extract_zero_shards_stage3``, ``merge_zero3_slices``, ``_save_optimizer_state_stage3``, ``_is_expert_model_state_file`` |

Four uses are not levers but the only way to do what they do, so a missing name there is an
error naming it (``require_names``), whatever the version:

| use | what it does | private names |
|---|---|---|
| ``pause_init`` | ``zero3_init_disabled`` pauses an enclosing ``zero.Init`` | ``partition_parameters.top_level_context``, ``.patched``, ``unpatch_init_and_builtins`` / ``patch_init_and_builtins`` |
| ``universal_load`` | loads a universal checkpoint into a built engine (resume on another number of processes) | ``DeepSpeedEngine._config.load_universal_checkpoint`` (written) |
| ``held_whole`` | whether a ZeRO-3 parameter is whole on this rank (``reads.held_whole``: the partitioned load fills it whole, ``gathered_parameters`` and the EMA do not gather it) | ``partition_parameters.ZeroParamStatus.AVAILABLE`` (the value of a parameter's ``ds_status``) |
| ``loss_scale`` | the factor an engine's backward multiplies a loss by (``reads.engine_loss_scale``, for ``training.parts.loss_scale``) | ``ZeROOptimizer.scale_if_loss``, ``DeepSpeedEngine.torch_autocast_z0_gradscaler`` |

One use falls back to DeepSpeed's own behaviour without a warning when a name is missing
(``checkpoint_writes.py``):

| use | what it does | private names |
|---|---|---|
| ``deferred_writes`` | a rank's failed checkpoint write is kept, not raised mid-collective (``deferred_engine_writes``) | ``DeepSpeedEngine._save_checkpoint`` / ``_save_zero_checkpoint`` (replaced on the instance), ``.checkpoint_engine``, ``TorchCheckpointEngine.save`` (replaced on the instance), ``.zipfile_serialization`` |

One read falls back to what a missing name would mean (``reads.py``):

| use | what it does | private names |
|---|---|---|
| ``fp32_master`` | the fp32 master partition the EMA averages (``reads.local_fp32_master``; a parameter without the name is one no ZeRO-3 optimizer owns, averaged from its partition) | ``param._z3_optimizer`` (written on each parameter ``DeepSpeedZeroOptimizer_Stage3`` owns) |

(transformers' ``integrations.deepspeed._hf_deepspeed_config_weak_ref`` is read and written
here too: ``zero_init.py``.)
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("diffusers_zero3")

# The DeepSpeed releases the test suite ran on (constraints.txt pins the newest).
VERIFIED_ON: tuple[str, ...] = ("0.19.8",)

# Levers that ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS`` (a comma-separated list) turns back to
# DeepSpeed's own behaviour, to measure each: "persistence" (accelerate's 10 x hidden),
# "hooks" (ZeRO-3's hooks on every module), "nvtx" (DeepSpeed's profiler ranges around its
# hooks), "live" (10^9 elements gathered ahead and kept for reuse), "coalesce" (the kept-whole
# parameters gathered one by one after each step), "leaves" (every module its own fetch unit),
# "overlap" (each gradient bucket's reduce-scatter blocking the backward on the CPU).
LEVERS = ("persistence", "hooks", "nvtx", "live", "coalesce", "leaves", "overlap")

_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_OFFLOAD = "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload"
_INIT = "deepspeed.runtime.zero.partition_parameters:Init"
_PARTITION = "deepspeed.runtime.zero.partition_parameters"
_UNIVERSAL = "deepspeed.checkpoint.ds_to_universal"
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
# Uses that have no fallback: checked for names only (``require_names``), not for versions.
REQUIRED = ("pause_init", "universal_load", "held_whole", "loss_scale")


@dataclass(frozen=True)
class PrivateName:
    """A DeepSpeed name a lever uses: ``owner`` is ``module:Class`` or ``module``; ``on_class``
    says whether the name can be looked up on the owner itself (methods, module attributes),
    or exists only on instances (checked where the lever runs)."""

    lever: str
    owner: str
    name: str
    on_class: bool = True


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("hooks", _OFFLOAD, "forward_hooks", on_class=False),
    PrivateName("hooks", _OFFLOAD, "backward_hooks", on_class=False),
    PrivateName("coalesce", _STAGE3, "persistent_parameters", on_class=False),
    PrivateName("leaves", _STAGE3, "create_reduce_and_remove_grad_hooks"),
    PrivateName("leaves", _STAGE3, "_grad_acc_hooks", on_class=False),
    PrivateName("leaves", _STAGE3, "_leaf_module_hooks", on_class=False),
    PrivateName("leaves", _STAGE3, "leaf_parameters", on_class=False),
    PrivateName("leaves", _STAGE3, "fp16_groups", on_class=False),
    PrivateName("overlap", _STAGE3, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"),
    PrivateName("overlap", _STAGE3, "independent_gradient_partition_epilogue"),
    PrivateName("overlap", _STAGE3, "partition_grads"),
    PrivateName("overlap", _STAGE3, "_get_param_partition_group"),
    PrivateName("overlap", _STAGE3, "_gradient_averaging_world_size"),
    PrivateName("overlap", _STAGE3, "_assert_same_partition_group"),
    PrivateName("overlap", _STAGE3, "ipg_buckets", on_class=False),
    PrivateName("nvtx", "deepspeed.utils.nvtx", "enable_nvtx"),
    PrivateName("fastload", _INIT, "_zero_init_param"),
    PrivateName("fastload", _INIT, "_convert_to_deepspeed_param"),
    PrivateName("share_fp32", _STAGE3, "fp16_partitioned_groups_flat", on_class=False),
    PrivateName("share_fp32", _STAGE3, "fp32_partitioned_groups_flat", on_class=False),
    PrivateName("memory", _STAGE3, "grad_partitions_flat_buffer", on_class=False),
    PrivateName("universal", _UNIVERSAL, "_get_optim_files"),
    PrivateName("universal", _UNIVERSAL, "_filter_zero3_optim_files"),
    PrivateName("universal", _UNIVERSAL, "_get_zero3_model_state_files"),
    PrivateName("universal", _UNIVERSAL, "_autoep_expert_param_names_by_rank"),
    PrivateName("universal", _UNIVERSAL, "_build_zero3_rank_grid"),
    PrivateName("universal", _UNIVERSAL, "_parse_model_states_stage3"),
    PrivateName("universal", _UNIVERSAL, "extract_zero_shards_stage3"),
    PrivateName("universal", _UNIVERSAL, "merge_zero3_slices"),
    PrivateName("universal", _UNIVERSAL, "_save_optimizer_state_stage3"),
    PrivateName("universal", _UNIVERSAL, "_is_expert_model_state_file"),
    PrivateName("pause_init", _PARTITION, "top_level_context"),
    PrivateName("pause_init", _INIT, "unpatch_init_and_builtins"),
    PrivateName("pause_init", _INIT, "patch_init_and_builtins"),
    PrivateName("universal_load", _ENGINE, "_config", on_class=False),
    PrivateName("deferred_writes", _ENGINE, "_save_checkpoint"),
    PrivateName("deferred_writes", _ENGINE, "_save_zero_checkpoint"),
    PrivateName("deferred_writes", _ENGINE, "checkpoint_engine", on_class=False),
    PrivateName("held_whole", "deepspeed.runtime.zero.partition_parameters:ZeroParamStatus", "AVAILABLE"),
    PrivateName("loss_scale", "deepspeed.runtime.base_optimizer:ZeROOptimizer", "scale_if_loss"),
    PrivateName("loss_scale", _ENGINE, "torch_autocast_z0_gradscaler", on_class=False),
    PrivateName("fp32_master", _STAGE3, "_z3_optimizer", on_class=False),
)

_decided: dict[str, bool] = {}


def levers_turned_off() -> frozenset[str]:
    """The levers that ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS`` sets back to DeepSpeed's own
    behaviour (``LEVERS``); an unknown name is an error."""
    names = {
        n.strip() for n in os.environ.get("DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS", "").split(",") if n.strip()
    }
    unknown = names - set(LEVERS)
    if unknown:
        raise ValueError(
            f"DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS: unknown lever(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(LEVERS)})"
        )
    return frozenset(names)


def deepspeed_version() -> str:
    """The installed DeepSpeed's version (``"0.19.8"``), without a local suffix."""
    import deepspeed

    return str(deepspeed.__version__).split("+")[0]


def missing_names(lever: str) -> list[str]:
    """The names of ``PRIVATE_NAMES`` that ``lever`` needs and the installed DeepSpeed lacks
    (those that can be looked up without an instance)."""
    missing = []
    for entry in PRIVATE_NAMES:
        if entry.lever != lever or not entry.on_class:
            continue
        module_name, _, class_name = entry.owner.partition(":")
        try:
            owner = importlib.import_module(module_name)
            if class_name:
                owner = getattr(owner, class_name)
        except (ImportError, AttributeError):
            missing.append(entry.owner)
            continue
        if not hasattr(owner, entry.name):
            missing.append(f"{entry.owner.replace(':', '.')}.{entry.name}")
    return missing


def lever_in_force(lever: str) -> bool:
    """Whether ``lever`` applies in this process: not turned off by
    ``DIFFUSERS_ZERO3_DEEPSPEED_DEFAULTS``, the installed DeepSpeed among ``VERIFIED_ON``, and
    every name it needs present. Decided once per lever; a lever off for its version or its
    names says so in one warning line. Not a collective (every rank decides alike)."""
    if lever in LEVERS and lever in levers_turned_off():
        return False
    if lever not in _decided:
        version = deepspeed_version()
        missing = missing_names(lever)
        if version not in VERIFIED_ON:
            logger.warning(
                "warning: diffusers_zero3's %r lever is off: it was verified on DeepSpeed %s, this is %s",
                lever,
                ", ".join(VERIFIED_ON),
                version,
            )
        elif missing:
            logger.warning(
                "warning: diffusers_zero3's %r lever is off: DeepSpeed %s lacks %s",
                lever,
                version,
                ", ".join(missing),
            )
        _decided[lever] = version in VERIFIED_ON and not missing
    return _decided[lever]


def require_names(use: str, engine: object | None = None) -> None:
    """Raise ``RuntimeError`` naming what the installed DeepSpeed lacks for ``use`` (one of
    ``REQUIRED``: there is no DeepSpeed behaviour to fall back on); ``engine`` checks the
    instance attributes too. Not a collective."""
    missing = missing_names(use)
    if engine is not None:
        missing += [
            f"{e.owner.replace(':', '.')}.{e.name}"
            for e in PRIVATE_NAMES
            if e.lever == use and not e.on_class and not hasattr(engine, e.name)
        ]
    if missing:
        raise RuntimeError(
            f"DeepSpeed {deepspeed_version()} lacks {', '.join(missing)}, which diffusers_zero3 needs to {use.replace('_', ' ')}"
            f" (verified on {', '.join(VERIFIED_ON)})"
        )
