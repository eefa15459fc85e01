"""DeepSpeed's universal checkpoints: converting a ZeRO-3 checkpoint with
``deepspeed.checkpoint.ds_to_universal``'s per-item functions (the ``universal`` lever: the
work spread over the ranks) and loading one into a built engine. The table of names is in this
package's ``__init__``."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import lever_in_force, require_names


def convert_whole(src: Path, dst: Path) -> None:
    """DeepSpeed's own converter (``ds_to_universal.main``) on ``src`` into ``dst``, in this
    process (no worker processes: a fork of a rank that holds a GPU is unsafe)."""
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(
        argparse.Namespace(
            input_folder=str(src),
            output_folder=str(dst),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
    )


class Zero3Layout:
    """What the per-item conversion needs of a plain ZeRO-3 checkpoint (one tensor-parallel
    rank, no AutoEP experts): the optimizer files by ``[tp][dp]``, the parameter shapes by
    sub-group and the number of saved ranks. ``of`` reads the small model-state files and one
    optimizer file's header; None for any other checkpoint or where the ``universal`` lever
    is off."""

    def __init__(self, optim_grid: Any, shapes: list[dict], dp_degree: int):
        # shapes: {parameter name: shape} per optimizer sub-group
        self.optim_grid, self.shapes, self.dp_degree = optim_grid, shapes, dp_degree

    @classmethod
    def of(cls, src: Path) -> Zero3Layout | None:
        if not lever_in_force("universal"):
            return None
        import deepspeed.checkpoint.ds_to_universal as dsu

        zero3_files = dsu._filter_zero3_optim_files(dsu._get_optim_files(str(src)))
        if not zero3_files:
            return None
        header = _load_mapped(zero3_files[0])  # only the header is read, not the whole partition
        stage = header[dsu.OPTIMIZER_STATE_DICT].get(dsu.ZERO_STAGE, 1)
        del header
        if stage <= 2:
            return None
        model_files = dsu._get_zero3_model_state_files(str(src))
        _, autoep = dsu._autoep_expert_param_names_by_rank(model_files)
        model_grid, tp_degree, dp_degree = dsu._build_zero3_rank_grid(model_files)
        optim_grid, tp_optim, dp_optim = dsu._build_zero3_rank_grid(zero3_files)
        if any(m is not None for m in autoep.values()) or (tp_degree, tp_optim, dp_optim) != (
            1,
            1,
            dp_degree,
        ):
            return None
        return cls(optim_grid, dsu._parse_model_states_stage3([model_grid[0][0]]), dp_degree)

    def extract(self, temp: Path, saved_rank: int) -> None:
        """Cut saved rank ``saved_rank``'s optimizer file into per-parameter fragments (an
        optimizer that never stepped given zero moments first: ``with_zero_moments``)."""
        import deepspeed.checkpoint.ds_to_universal as dsu

        grid = [list(row) for row in self.optim_grid]
        with with_zero_moments(Path(grid[0][saved_rank]), temp.parent) as optim_file:
            grid[0][saved_rank] = str(optim_file)
            dsu.extract_zero_shards_stage3(
                grid, [self.shapes], self.dp_degree, str(temp), (0, saved_rank), exclude_param_names=set()
            )

    def merge(self, zero: Path, temp: Path, name: str) -> None:
        """Merge the fragments of parameter ``name`` into its universal folder."""
        import deepspeed.checkpoint.ds_to_universal as dsu

        dsu.merge_zero3_slices(self.dp_degree, str(zero), str(temp), name)

    def save_optimizer_state(self, dst: Path) -> None:
        """DeepSpeed's ``optimizer_state.pt`` (a copy of saved rank 0's optimizer file; zero
        moments where it never stepped: DeepSpeed's universal load reads its ``step``)."""
        import deepspeed.checkpoint.ds_to_universal as dsu

        files = list(self.optim_grid[0])
        with with_zero_moments(Path(files[0]), dst) as optim_file:
            files[0] = str(optim_file)
            dsu._save_optimizer_state_stage3(argparse.Namespace(output_folder=str(dst)), files)

    @staticmethod
    def copy_model_states(src: Path, dst: Path) -> None:
        """The (non-expert) model-state files, copied as ``ds_to_universal.main`` copies them."""
        import deepspeed.checkpoint.ds_to_universal as dsu

        for f in sorted(src.glob("*model_states.pt")):
            if not dsu._is_expert_model_state_file(str(f)):
                shutil.copy2(f, dst)


def _load_mapped(path: str | Path) -> Any:
    """``torch.load`` of a checkpoint file, memory-mapped where its format allows (torch.save's
    zip format): only what is read is paged in."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # not torch.save's zip format, which mmap needs
        return torch.load(path, map_location="cpu", weights_only=False)


@contextlib.contextmanager
def with_zero_moments(optim_file: Path, scratch: Path) -> Iterator[Path]:
    """The ZeRO-3 optimizer file to read in place of ``optim_file``: itself, or, where a
    sub-group has no Adam state (an optimizer that has not stepped yet, e.g. the Wan 2.2 expert
    no step has drawn), a copy with zero moments there (what Adam's first step starts from), in a
    folder of its own under ``scratch`` that is removed on exit. DeepSpeed's universal extract
    (``extract_zero_shards_stage3``) and load read ``exp_avg`` and ``step`` of every sub-group
    and fail on a missing one (a ``KeyError``)."""
    import deepspeed.checkpoint.ds_to_universal as dsu

    saved = _load_mapped(optim_file)
    optim = saved[dsu.OPTIMIZER_STATE_DICT]
    state = optim["optimizer_state_dict"]["state"]
    missing = [i for i in range(len(optim["fp32_flat_groups"])) if "exp_avg" not in state.get(i, {})]
    if not missing:
        yield optim_file
        return
    for i in missing:
        flat = optim["fp32_flat_groups"][i]
        state[i] = {"step": torch.zeros((), dtype=torch.float32, device=flat.device), "exp_avg": torch.zeros_like(flat),
                    "exp_avg_sq": torch.zeros_like(flat)}  # fmt: skip
    scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".zero-moments-", dir=scratch))
    try:
        torch.save(saved, folder / optim_file.name)
        yield folder / optim_file.name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_universal(engine: Any, folder: str, tag: str) -> None:
    """Load the universal checkpoint ``folder/tag`` into the built ZeRO-3 ``engine`` (its
    parameters, fp32 master weights and optimizer state; not its schedule). Collective: call
    on every rank.

    DeepSpeed reads the choice from its config at ``load_checkpoint``; the engine's config is
    set for the call and put back. Then each optimizer sub-group gets a step counter of its
    own: DeepSpeed 0.19.8's universal load (``stage3.py``,
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) assigns one ``step`` tensor to
    every sub-group's state, which torch's Adam increments in place once per sub-group at each
    step, so the bias correction, and every update after a resume, went wrong."""
    require_names("universal_load", engine=engine)
    engine._config.load_universal_checkpoint = True
    try:
        engine.load_checkpoint(folder, tag=tag, load_lr_scheduler_states=False)
    finally:
        engine._config.load_universal_checkpoint = False
    unshare_optimizer_steps(engine)


def unshare_optimizer_steps(engine: Any) -> int:
    """Give each optimizer sub-group of ``engine`` its own ``step`` tensor; returns how many
    were shared (``load_universal``). Not a collective."""
    optimizer = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    if optimizer is None:
        return 0
    seen, shared = set(), 0
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
                shared += 1
            seen.add(id(step))
    return shared
