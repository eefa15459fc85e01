"""Training checkpoints: save, rotate, roll back and resume, once per job and on every rank.

A training run writes ``OUTPUT_DIR/checkpoint-<step>`` folders. The rules, in one place:

* **Atomic.** A checkpoint is written as ``.tmp-checkpoint-<step>``, fsynced and renamed, so
  a ``checkpoint-*`` folder is complete; ``.tmp-*``/``.old-*`` leftovers of a killed save
  are removed at the next start (``remove_interrupted_writes``).
* **Rotation** (``--checkpoints_total_limit K``): after every save the newest ``K``
  checkpoints by step remain, the one just written always among them. Global rank 0 deletes,
  between barriers; never a local main process (with several machines there are several).
* **Rollback.** Resuming from ``checkpoint-N`` while newer ``checkpoint-M`` (M > N) exist
  abandons them: they are renamed ``abandoned-checkpoint-M`` (kept for a human to inspect or
  delete), so ``latest`` never resolves to them and rotation never counts them.
* **One answer for every rank.** ``latest`` is resolved on global rank 0 and broadcast, so no
  two ranks can load different steps.
* **Any world size.** A checkpoint records how many processes wrote it. Resumed with another
  number, the ranks convert each DeepSpeed engine's checkpoint once into DeepSpeed's
  universal form (``ds_to_universal``: one folder per parameter with its fp32 master weights
  and Adam moments) inside the checkpoint (``universal/``), each rank its share of the files
  (``convert_engine_to_universal``), and every rank loads its new partitions from it; the
  EMA partitions are re-cut from every rank's file, the learning-rate schedule is moved to
  the new process count, and each rank takes the RNG state of rank ``rank % saved
  processes``. The original files are never changed.
* **Shared filesystem.** A save checks first that every rank sees the temporary folder global
  rank 0 created (``collective_publish``): an ``--output_dir`` on node-local disks fails with
  one error on every rank before anything is written, and leaves no folder on any node. A
  resume checks that every rank sees the files it needs (its own partitions, RNG state, EMA
  shard, and rank 0's files): a checkpoint copied onto node-local disks fails with one clear
  error on every rank instead of a hang or a half-loaded state.
* **Write errors.** A full disk (or any failed write) on any rank while a checkpoint is written
  is held until the ranks exchange verdicts (``WriteErrors``; inside DeepSpeed's collective
  save too, ``deferred_engine_writes``), so no rank is left waiting in a collective: the
  temporary folder is removed, the previous checkpoint stays the latest, and every rank raises
  one ``CheckpointError`` naming the file and the errno's meaning.
* **Manifest.** The last file written before the rename is ``manifest.json`` (each file's size
  and CRC-32, ``state.manifest``). A resume compares the checkpoint with it first; a damaged
  file is one ``CorruptCheckpointError`` naming it, and with ``fallback`` (``--resume_fallback``)
  ``latest`` falls back to the newest intact checkpoint instead. A checkpoint without a
  manifest (an older version's) resumes with its files checked for presence only.

Checkpoints hold pickles (DeepSpeed's and accelerate's state files): resume only
checkpoints you trust. The EMA shards are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch

from ..errors import CorruptCheckpointError
from ..runtime.deepspeed_internals.checkpoint_writes import deferred_engine_writes
from ..runtime.deepspeed_internals.universal import Zero3Layout, convert_whole, load_universal
from ..runtime.distributed import (
    all_gather_object,
    barrier,
    get_rank,
    get_world_size,
    is_main_process,
    log_rank_zero,
)
from ..runtime.library_internals import prepared_models, prepared_schedulers
from .folders import CheckpointError, WriteErrors, collective_publish, fsync_dir, naming, replace_folder
from .manifest import balanced_shares as _balanced_shares
from .manifest import manifest_problems, write_manifest

CHECKPOINT_PREFIX = "checkpoint-"
ABANDONED_PREFIX = "abandoned-"
STATE_FILE = "training_state.json"
UNIVERSAL_DIR = "universal"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a ``checkpoint-<step>`` folder name, None for any other name."""
    name = Path(path).name
    rest = name[len(CHECKPOINT_PREFIX) :]
    return int(rest) if name.startswith(CHECKPOINT_PREFIX) and rest.isdigit() else None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete ``checkpoint-<step>`` folders in ``output_dir``, oldest first (by step)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if checkpoint_step(p) is not None and (p / STATE_FILE).exists()]
    return sorted(found, key=checkpoint_step)


def _resolve_locally(output_dir: str | os.PathLike, value: str) -> tuple[str | None, bool, str | None]:
    """(path, whether it is a folder name inside output_dir, error) as this rank sees it."""
    if value == "latest":
        found = list_checkpoints(output_dir)
        return (found[-1].name if found else None), True, None
    if (Path(value) / STATE_FILE).exists():
        return str(Path(value).resolve()), False, None
    if (Path(output_dir) / Path(value).name / STATE_FILE).exists():
        return Path(value).name, True, None
    return None, False, f"--resume_from_checkpoint {value!r}: no complete checkpoint folder there"


def resolve_resume_checkpoint(output_dir: str | os.PathLike, value: str | None) -> Path | None:
    """The folder ``--resume_from_checkpoint`` names, decided on global rank 0 for every rank.

    Collective: call on every rank. ``value`` is ``latest`` (None when there is no
    checkpoint yet), a path, or a folder name inside ``output_dir``; a named folder that is
    missing or incomplete raises ``CheckpointError`` on every rank. Rank 0 decides which
    checkpoint (so no two ranks load different steps); each rank then finds it in its own
    ``output_dir``, so a machine that does not share the folder fails the check at load.
    """
    if value is None:
        return None
    answer = _resolve_locally(output_dir, value) if is_main_process() else None
    path, inside, error = all_gather_object(answer)[0]
    if error:
        raise CheckpointError(error)
    if path is None:
        return None
    return Path(output_dir) / path if inside else Path(path)


def abandon_newer_checkpoints(output_dir: str | os.PathLike, step: int) -> list[Path]:
    """Rename every ``checkpoint-M`` with ``M > step`` to ``abandoned-checkpoint-M``.

    Not a collective: the global main process calls it (``resume_training`` does, between
    barriers). Used when a run resumes from an older checkpoint: the newer ones belong to
    the abandoned trajectory. An existing ``abandoned-checkpoint-M`` gets a numbered suffix.
    """
    moved = []
    for path in list_checkpoints(output_dir):
        if checkpoint_step(path) > step:
            target = path.parent / f"{ABANDONED_PREFIX}{path.name}"
            n = 1
            while target.exists():
                target = path.parent / f"{ABANDONED_PREFIX}{path.name}.{n}"
                n += 1
            os.replace(path, target)
            moved.append(target)
    if moved:
        fsync_dir(output_dir)
    return moved


def prune_checkpoints(output_dir: str | os.PathLike, total_limit: int) -> list[Path]:
    """Delete the oldest checkpoints so that the newest ``total_limit`` (by step) remain.

    Not a collective: the global main process calls it right after publishing a checkpoint,
    which, being the newest, always remains. Returns the deleted folders.
    """
    if total_limit <= 0:
        raise ValueError(f"checkpoints_total_limit must be at least 1, got {total_limit}")
    found = list_checkpoints(output_dir)
    removed = found[: max(0, len(found) - total_limit)]
    for p in removed:
        shutil.rmtree(p)
    return removed


def save_training_checkpoint(
    accelerator,
    output_dir: str | os.PathLike,
    global_step: int,
    training_state: dict,
    *,
    ema=None,
    total_limit: int | None = None,
    parts=(),
    averages: dict | None = None,
) -> Path:
    """Save a resumable ``checkpoint-<global_step>`` folder atomically. Collective: every rank.

    Holds accelerate's state (the trained engine's partitions and optimizer, the scheduler,
    every rank's RNG states and the sampler), one EMA partition file per rank, the other
    trained models of the job (``parts``: each own-engine ``parts.TrainedModel`` as
    ``<name>/`` in DeepSpeed's layout, its schedule and its EMA shards), and
    ``training_state.json`` (``training_state`` plus the step, the world size and the parts'
    names). ``averages`` (``{name: ShardedEMA}``, e.g. DiffusionNFT's old policy) add one
    ``average_<name>_rank<r>.pt`` per rank each. Written into ``.tmp-checkpoint-<step>-*``, fsynced and renamed by global rank 0
    (``collective_publish``), so a crash leaves no partial ``checkpoint-*``. Then, with
    ``total_limit``, the oldest checkpoints beyond the newest ``total_limit`` are deleted (the
    new one is the newest, so it always remains). ``output_dir`` must be one folder that every
    rank sees: on node-local disks each machine would write its partitions into its own disk
    and rank 0 would publish a checkpoint without them, so that is refused (``CheckpointError``
    on every rank) before anything is written. The last file written is ``manifest.json``
    (``state.manifest``). A failed write on any rank (a full disk) is held until the end of
    the block (``WriteErrors``), so that every rank goes through the same collectives; then
    the temporary folder is removed and every rank raises ``CheckpointError`` naming the file
    and the errno's meaning, the previous checkpoints untouched.
    """
    out = Path(output_dir)
    final = out / f"{CHECKPOINT_PREFIX}{global_step}"

    def commit(tmp: Path, final: Path) -> None:
        replace_folder(tmp, final)
        if total_limit is not None:
            prune_checkpoints(out, total_limit)

    own = [p for p in parts if p.own_engine]
    engines = [m for m in prepared_models(accelerator) if hasattr(m, "save_checkpoint")]
    errors = WriteErrors()
    with collective_publish(final, commit=commit, folder_flag="--output_dir") as tmp:
        with ExitStack() as stack:
            for engine in [*engines, *(p.engine for p in own)]:
                stack.enter_context(deferred_engine_writes(engine, errors.run))
            # DeepSpeed writes `latest` on rank 0 just before its closing barrier, where a
            # failure would leave the other ranks in it: written below, held like the others.
            errors.run(accelerator.save_state, str(tmp), **({"save_latest": False} if engines else {}))
            if ema is not None:
                errors.run(_save_file, ema.state_dict(), tmp / f"ema_rank{get_rank()}.pt")
            for name, average in (averages or {}).items():
                errors.run(_save_file, average.state_dict(), tmp / f"average_{name}_rank{get_rank()}.pt")
            for part in own:
                part.engine.save_checkpoint(str(tmp), tag=part.name, save_latest=False)  # collective
                if is_main_process():
                    errors.run(
                        _save_file, part.lr_scheduler.state_dict(), tmp / f"{part.name}_lr_scheduler.pt"
                    )
                if part.ema is not None:
                    errors.run(
                        _save_file, part.ema.state_dict(), tmp / f"ema_{part.name}_rank{get_rank()}.pt"
                    )
        # Every rank's files are written (or failed): skip the rest on every rank when one failed.
        if not any(all_gather_object(errors.error is not None)):
            if is_main_process():
                state = {**training_state, "global_step": global_step, "world_size": get_world_size()}
                if own:
                    state["parts"] = [p.name for p in own]
                errors.run(_write_text, tmp / STATE_FILE, json.dumps(state))
                if engines or own:  # as DeepSpeed leaves it: the tag saved last
                    last = own[-1].name if own else engine_checkpoint_names(accelerator)[-1]
                    errors.run(_write_text, tmp / "latest", last)
            errors.run(write_manifest, tmp)  # collective; the last file before the rename
        errors.raise_first()
    return final


def _save_file(obj, path: Path) -> None:
    """``torch.save`` through a Python file: a failed write is an ``OSError`` with its errno and
    path (torch's own writer, given a path, says "unexpected pos" without either)."""
    with naming(path), open(path, "wb") as f:
        torch.save(obj, f)


def _write_text(path: Path, text: str) -> None:
    with naming(path):
        path.write_text(text)


def _engine_files(model_dir: Path, rank: int) -> list[tuple[Path, ...]]:
    optim = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return [
        (model_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",),
        # under bf16 DeepSpeed prefixes the optimizer states' name (_get_zero_ckpt_prefix)
        (model_dir / optim, model_dir / f"bf16_{optim}"),
    ]


def _files_needed(
    path: Path, ranks: list[int], ema: bool, parts: list[tuple[str, bool]] = (), averages=()
) -> list[tuple[Path, ...]]:
    """The files of the saved ``ranks`` this rank needs to resume from ``path`` (its own when
    the world size is unchanged, every saved rank's otherwise), each as the names it may have;
    ``parts`` are the other trained models' ``(name, with EMA)``, ``averages`` the names of
    the other averages."""
    need = [(path / STATE_FILE,)]
    model_dir = path / "pytorch_model"
    engine = model_dir.is_dir() or (path / "latest").exists()  # a DeepSpeed engine's checkpoint
    for name, _ in parts:
        need.append((path / f"{name}_lr_scheduler.pt",))
    for rank in ranks:
        need.append((path / f"random_states_{rank}.pkl",))
        need.extend((path / f"average_{name}_rank{rank}.pt",) for name in averages)
        if ema:
            need.append((path / f"ema_rank{rank}.pt",))
        if engine:
            need += _engine_files(model_dir, rank)
        for name, part_ema in parts:
            need += _engine_files(path / name, rank)
            if part_ema:
                need.append((path / f"ema_{name}_rank{rank}.pt",))
    return need


def check_resumable(path: str | os.PathLike, *, ema: bool = False, parts=(), averages=()) -> dict:
    """Check on every rank that ``path`` can be resumed here; return its training state.

    Collective: call on every rank. Raises ``CheckpointError`` on every rank when a rank
    does not see the files it needs (its own, or every saved rank's when the number of
    processes changed; node-local disks: checkpoints need a filesystem that every machine
    shares), or when ``ema`` is asked for and it has no EMA state, or when the job's other
    trained models (``parts``) are not the checkpoint's, or one of ``averages`` (names) is
    missing. The state's ``world_size`` is the number of processes that wrote it.

    Then (the files each rank needs being there) the checkpoint is compared with its manifest (``state.manifest.manifest_problems``:
    every file's size on every rank, the checksums shared out between the ranks): a damaged
    file raises ``CorruptCheckpointError`` (a ``CheckpointError``) naming it and what differs,
    on every rank. A checkpoint without a manifest (an older version's) is said so in the log,
    and checked for its files' presence only.
    """
    path = Path(path)
    rank, world = get_rank(), get_world_size()
    state, missing = None, []
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        missing = [f"{STATE_FILE} ({type(e).__name__})"]
    own = [(p.name, p.ema is not None) for p in parts if p.own_engine]
    if state is not None:
        if state.get("world_size") is None:  # written before the world size was recorded
            state["world_size"] = len(list(path.glob("random_states_*.pkl")))
        if sorted(state.get("parts", [])) != sorted(n for n, _ in own):
            raise CheckpointError(
                f"{path} holds the trained models {', '.join(['denoiser', *state.get('parts', [])])}; this run trains "
                f"{', '.join(['denoiser', *(n for n, _ in own)])} (e.g. --train_text_encoder given in one run only)"
            )
        saved = int(state["world_size"])
        ranks = [rank] if saved == world else list(range(saved))
        missing = [
            str(names[0].relative_to(path))
            for names in _files_needed(path, ranks, ema, own, averages)
            if not any(p.exists() for p in names)
        ]
    reports = all_gather_object((missing, state, manifest_problems(path)))
    # a file a rank needs and does not see first: that says node-local disks, where the manifest
    # (listed on rank 0) would only call the other machine's files missing
    problems = [(r, m) for r, (m, _, _) in enumerate(reports) if m]
    if problems:
        r, m = problems[0]
        if ema and all(f.startswith("ema_rank") for f in m):
            raise CheckpointError(f"{path} has no EMA state for rank {r} (saved without --use_ema?)")
        raise CheckpointError(
            f"checkpoint {path} is incomplete as seen from rank {r} (missing {', '.join(m[:3])}); "
            "checkpoints must be on a filesystem that every machine shares"
        )
    damaged = [(r, d) for r, (_, _, d) in enumerate(reports) if d]
    if damaged:
        r, found = damaged[0]
        more = sum(len(d) for _, d in damaged) - 1
        raise CorruptCheckpointError(
            f"checkpoint {path} is damaged: {found[0]}" + (f" (and {more} more)" if more else "")
            + f" (checked against its manifest.json on rank {r})"
        )  # fmt: skip
    if reports[0][2] is None and reports[0][1] is not None:
        log_rank_zero(
            f"{path} has no manifest (written by an older version): its files are checked for presence only"
        )
    return reports[0][1]


def load_ema_shard(path: str | os.PathLike) -> dict:
    """Read one rank's EMA state file with ``torch.load(weights_only=True)``, onto the host.

    It holds only tensors, numbers and names, so nothing in it needs unpickling code; a file
    that would run code is refused with ``CheckpointError``. Its tensors come to the CPU
    whatever device saved them (``map_location="cpu"``): a shard saved from ``cuda:7`` is read
    by every rank of a resume on another number of processes, where that device may be another
    rank's or absent, and ``load_resharded`` joins shards of several ranks; the EMA copies them
    onto its own device.
    """
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} is not a plain tensor file; refusing to unpickle it ({e})") from e


def load_training_checkpoint(
    accelerator, path: str | os.PathLike, *, ema=None, check=None, parts=(), averages: dict | None = None,
    state: dict | None = None,
) -> dict:  # fmt: skip
    """Restore what ``save_training_checkpoint`` wrote; return its training state.

    Collective: call on every rank. Checks the checkpoint first (``check_resumable``, then
    ``check(state)`` if given, which may raise before anything is loaded or written). With
    the number of processes that wrote it, accelerate's ``load_state`` restores everything
    as it was; with another number, ``load_resharded`` does. The other trained models
    (``parts``) and the other averages (``averages``, ``{name: ShardedEMA}``) are restored
    either way. ``state``: what ``check_resumable`` returned for ``path`` with these
    arguments, which is then not checked again.
    """
    path = Path(path)
    averages = averages or {}
    if state is None:
        state = check_resumable(path, ema=ema is not None, parts=parts, averages=list(averages))
    if check is not None:
        check(state)
    own = [p for p in parts if p.own_engine]
    saved_world = int(state["world_size"])
    _load_averages(averages, path, saved_world)
    if saved_world != get_world_size():
        load_resharded(accelerator, path, saved_world, ema=ema, parts=own)
        return state
    accelerator.load_state(str(path))
    if ema is not None:
        ema.load_state_dict(load_ema_shard(path / f"ema_rank{get_rank()}.pt"))
    for part in own:
        part.engine.load_checkpoint(str(path), tag=part.name)
        _load_part_state(part, path, saved_world)
    return state


def _load_averages(averages: dict, path: Path, saved_world: int) -> None:
    """Each ``{name: ShardedEMA}`` from its ``average_<name>_rank<r>.pt`` files: this rank's, or
    re-cut from every saved rank's. Not a collective."""
    for name, average in averages.items():
        if saved_world == get_world_size():
            average.load_state_dict(load_ema_shard(path / f"average_{name}_rank{get_rank()}.pt"))
        else:
            average.load_resharded(
                [load_ema_shard(path / f"average_{name}_rank{r}.pt") for r in range(saved_world)]
            )


def _load_part_state(part, path: Path, saved_world: int) -> None:
    """A part's schedule (stepped once per update by its engine: the same at any number of
    processes) and EMA (its own shard, or re-cut from every saved rank's)."""
    part.lr_scheduler.load_state_dict(torch.load(path / f"{part.name}_lr_scheduler.pt", weights_only=False))
    if part.ema is None:
        return
    if saved_world == get_world_size():
        part.ema.load_state_dict(load_ema_shard(path / f"ema_{part.name}_rank{get_rank()}.pt"))
    else:
        part.ema.load_resharded(
            [load_ema_shard(path / f"ema_{part.name}_rank{r}.pt") for r in range(saved_world)]
        )


def engine_checkpoint_names(accelerator) -> list[str]:
    """The folder names accelerate gives each prepared model's DeepSpeed checkpoint, in
    order: ``pytorch_model``, ``pytorch_model_1``, ..."""
    return [
        "pytorch_model" if i == 0 else f"pytorch_model_{i}" for i in range(len(prepared_models(accelerator)))
    ]


def convert_to_universal(path: str | os.PathLike, names: list[str]) -> Path:
    """Convert the DeepSpeed checkpoints ``path/<name>`` into DeepSpeed's universal form in
    ``path/universal/<name>``, once; return ``path/universal``. Collective: call on every rank.

    Every rank converts its share of each engine (``convert_engine_to_universal``) into a
    temporary folder that global rank 0 renames when all are done (``collective_publish``). A
    folder converted before (as global rank 0 sees it) is reused. The saved files are only
    read.
    """
    path = Path(path)
    final = path / UNIVERSAL_DIR
    done = all((final / name).is_dir() for name in names) if is_main_process() else None
    if all_gather_object(done)[0]:
        return final
    with collective_publish(final) as tmp:
        for name in names:
            convert_engine_to_universal(path / name, tmp / name)
    return final


def convert_engine_to_universal(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Write DeepSpeed's universal form of the ZeRO-3 checkpoint ``src`` into ``dst``, the work
    spread over the ranks. Collective: call on every rank.

    Why: one process converting everything (``ds_to_universal.main``) writes every parameter's
    fp32 weights and both Adam moments twice (per-rank fragments, then merged files: about
    24 bytes per parameter) while the other ranks wait in a collective that fails after the
    process-group timeout (30 minutes by default). Here DeepSpeed's own per-item functions do
    the work (``deepspeed_internals.universal.Zero3Layout``), split as DeepSpeed splits it
    between its worker processes: first each rank extracts the fragments of some saved ranks'
    optimizer files (saved rank ``i`` on rank ``i % world``), then, once every fragment exists,
    each rank merges the fragments of its share of the parameters (shares balanced by element
    count, largest first; DeepSpeed's ``optimizer_state.pt``, a copy of saved rank 0's
    optimizer file, counted as one more item). So each rank writes about 1/world of the bytes,
    and waits in a collective only for as long as the slowest share takes beyond its own. The
    result is DeepSpeed's own, file for file and tensor for tensor. An extracting rank holds
    one saved rank's optimizer file at a time, as the single process did.

    Tensor- or expert-parallel checkpoints, ZeRO stages 1-2, and any checkpoint where the
    ``universal`` lever is off go to ``ds_to_universal.main`` on global rank 0 alone.
    """
    src, dst = Path(src), Path(dst)
    rank, world = get_rank(), get_world_size()
    layout = Zero3Layout.of(src)
    if layout is None:  # DeepSpeed's converter, in one process
        _each_rank_then_sync("convert", lambda: is_main_process() and convert_whole(src, dst))
        return
    temp, zero = dst / "tmp", dst / "zero"

    def extract() -> None:  # 1. each saved rank's optimizer file cut into per-parameter fragments
        for i in range(rank, layout.dp_degree, world):
            layout.extract(temp, i)

    _each_rank_then_sync("extract", extract)
    sizes = {name: math.prod(shape) for group in layout.shapes for name, shape in group.items()}
    items = {("param", name): 3 * numel for name, numel in sizes.items()}
    items[("optimizer_state", "")] = 3 * sum(-(-numel // layout.dp_degree) for numel in sizes.values())
    mine = _balanced_shares(items, world)[rank]

    def merge() -> None:  # 2. every fragment exists now: whole parameters, and the rest
        for kind, name in mine:
            if kind == "param":
                layout.merge(zero, temp, name)
            else:
                layout.save_optimizer_state(dst)
        if is_main_process():
            layout.copy_model_states(src, dst)

    _each_rank_then_sync("merge", merge)
    if is_main_process():
        shutil.rmtree(temp, ignore_errors=True)
        (dst.parent / "latest_universal").write_text(dst.name)  # as ds_to_universal.main writes it


def _each_rank_then_sync(phase: str, work) -> None:
    """Run ``work()`` on this rank, then exchange outcomes. Collective: call on every rank.

    A rank whose work raised re-raises it; the others raise ``CheckpointError`` naming it, so
    no rank is left waiting in a collective that a failed rank skipped."""
    error = None
    try:
        work()
    except Exception as e:  # reported to every rank
        error = e
    reports = all_gather_object(f"{type(error).__name__}: {error}" if error is not None else None)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(reports) if m]
    if failed:
        raise CheckpointError(f"universal conversion ({phase}) failed on rank {failed[0][0]}: {failed[0][1]}")


def load_resharded(accelerator, path: str | os.PathLike, saved_world: int, *, ema=None, parts=()) -> None:
    """Load a checkpoint written by ``saved_world`` processes into this run's (another number).
    Collective: call on every rank, after ``accelerator.prepare``.

    * DeepSpeed engines: from the universal form (``convert_to_universal``), each rank takes
      the partitions of its new rank: fp32 master weights, Adam moments and step.
    * The learning-rate schedulers: their saved state, with the step count moved to this
      world size (accelerate steps a scheduler once per process at every optimizer step).
    * The EMA: its partitions re-cut from every saved rank's file (``ShardedEMA.load_resharded``).
    * RNG: rank ``r`` takes the states of saved rank ``r % saved_world``.
    * The other trained models (``parts``, own engines): from the universal form too.
    """
    import warnings

    path = Path(path)
    world = get_world_size()
    names = engine_checkpoint_names(accelerator)
    engines = [m for m in prepared_models(accelerator) if hasattr(m, "load_checkpoint")]
    if engines or parts:
        universal = convert_to_universal(path, [*names, *(p.name for p in parts)])
    for part in parts:
        load_universal(part.engine, str(universal), part.name)
        _load_part_state(part, path, saved_world)
    if engines:
        for name, engine in zip(names, engines):
            load_universal(engine, str(universal), name)
        for i, scheduler in enumerate(prepared_schedulers(accelerator)):
            saved = torch.load(
                path / ("scheduler.bin" if i == 0 else f"scheduler_{i}.bin"), weights_only=False
            )
            getattr(scheduler, "scheduler", scheduler).load_state_dict(saved)
    else:  # whole models (DDP): only the schedule and the RNG depend on the number of processes
        accelerator.load_state(str(path))
    for scheduler in prepared_schedulers(accelerator):
        inner = getattr(scheduler, "scheduler", scheduler)
        # accelerate steps the wrapped scheduler num_processes times per optimizer step
        inner.last_epoch = inner.last_epoch // saved_world * world
        inner._step_count = inner.last_epoch + 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lrs = inner.get_lr()
        for group, lr in zip(inner.optimizer.param_groups, lrs):
            group["lr"] = lr
        inner._last_lr = list(lrs)
    _load_rng_states(accelerator, path / f"random_states_{get_rank() % saved_world}.pkl")
    if ema is not None:
        ema.load_resharded([load_ema_shard(path / f"ema_rank{r}.pt") for r in range(saved_world)])


def _load_rng_states(accelerator, file: Path) -> None:
    """The RNG states accelerate's ``save_state`` wrote to ``file`` (Python, NumPy, torch, CUDA)."""
    import random

    import numpy as np

    states = torch.load(file, weights_only=False)  # accelerate's own pickle, as its load_state reads it
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    if "step" in states:
        accelerator.step = states["step"]


def resume_training(
    accelerator, output_dir: str | os.PathLike, value: str | None, *, ema=None, check=None, parts=(),
    averages: dict | None = None, fallback: bool = False,
):  # fmt: skip
    """Resume as ``--resume_from_checkpoint value`` asks; return ``(path, state)`` or None.

    Collective: call on every rank, after ``accelerator.prepare`` (and the other trained
    models, ``parts``). ``latest`` with no checkpoint yet returns None (a new run). Newer
    checkpoints than the one resumed from are abandoned (renamed ``abandoned-checkpoint-<step>``)
    by global rank 0. A damaged checkpoint (``CorruptCheckpointError``) is an error, unless
    ``value`` is ``latest`` and ``fallback`` (``--resume_fallback``) is set: then the newest
    intact checkpoint is resumed (said in the log), and the damaged newer ones are abandoned.
    """
    path = resolve_resume_checkpoint(output_dir, value)
    if path is None:
        return None
    averages = averages or {}
    check_args = {"ema": ema is not None, "parts": parts, "averages": list(averages)}
    if fallback and value == "latest":
        path, state = _newest_intact(output_dir, path, check_args)
    else:
        state = check_resumable(path, **check_args)
    state = load_training_checkpoint(
        accelerator, path, ema=ema, check=check, parts=parts, averages=averages, state=state
    )
    if is_main_process():
        abandon_newer_checkpoints(output_dir, int(state["global_step"]))
    barrier()
    return path, state


def _newest_intact(output_dir: str | os.PathLike, latest: Path, check_args: dict) -> tuple[Path, dict]:
    """The newest checkpoint from ``latest`` down that ``check_resumable`` finds undamaged, and
    its state. Collective: call on every rank (rank 0's listing decides the order). Raises the
    newest one's ``CorruptCheckpointError`` when every checkpoint is damaged."""
    names = all_gather_object([p.name for p in list_checkpoints(output_dir)] if is_main_process() else None)[
        0
    ]
    older = [Path(output_dir) / n for n in reversed(names) if checkpoint_step(n) < checkpoint_step(latest)]
    first = None
    for path in [latest, *older]:
        try:
            return path, check_resumable(path, **check_args)
        except CorruptCheckpointError as e:
            first = first or e
            log_rank_zero(f"--resume_fallback: not resuming {path.name}: {e}", level=30)
    raise CorruptCheckpointError(
        f"{first}; no older intact checkpoint in {output_dir} to fall back to"
    ) from first
