"""Folders that are complete or absent: temporary names, fsync, rename, and cleanup.

* ``publish_folder``: one process writes a folder under a temporary name; it is fsynced and
  renamed into place when the block succeeds (used for each saved model).
* ``collective_publish``: every rank writes into one temporary folder (a training
  checkpoint, the frozen-model cache, the final pipeline's staging folder); when every rank
  succeeded, global rank 0 fsyncs it and commits it (a rename, or a swap into an existing
  folder); when any rank failed, it is removed and every rank raises.
* ``remove_interrupted_writes``: the ``.tmp-*`` / ``.old-*`` leftovers of a killed save.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError
from ..runtime.distributed import all_gather_object, barrier, is_main_process

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flush every file under ``folder``, then the folders themselves, to stable storage.

    Called before the rename that publishes a folder, so that a power loss right after the
    rename cannot leave a published folder whose files are empty or short.
    """
    folder = Path(folder)
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for root, dirs, _files in os.walk(folder, topdown=False):
        for d in [*dirs, ""]:
            fsync_dir(os.path.join(root, d))


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename inside it) to stable storage; best effort."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


@contextmanager
def publish_folder(final: str | os.PathLike) -> Iterator[Path]:
    """Write a folder under a temporary name and rename it into place when the block succeeds.

    Yields the temporary path (``.tmp-<name>-<random>`` beside ``final``). On success its
    files are fsynced and it replaces the previous ``final`` (if any); on an exception the
    temporary folder is removed and ``final`` is left as it was. Not a collective: one
    process (rank 0) uses it.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_folder(tmp, final)


def replace_folder(src: Path, final: Path) -> None:
    """Rename ``src`` to ``final``, moving an existing ``final`` aside first (``.old-*``) and
    deleting it afterwards. A crash in between leaves ``.old-*`` beside ``final``, which
    ``remove_interrupted_writes`` cleans at the next start."""
    old = None
    if final.exists():
        old = final.parent / f"{OLD_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(src, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_interrupted_writes(folder: str | os.PathLike) -> list[Path]:
    """Delete the ``.tmp-*`` and ``.old-*`` entries that a killed save left in ``folder``.

    Not a collective: call on the global main process only, before any rank writes into
    ``folder`` (a barrier after it), since another rank's live temporary folder would go too.
    Returns what was removed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in folder.iterdir():
        if p.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextmanager
def collective_publish(
    final: str | os.PathLike, *, commit: Callable[[Path, Path], None] | None = None
) -> Iterator[Path]:
    """Write a folder on every rank under one temporary name; publish it once all succeeded.

    Collective: every rank enters and leaves the block. Global rank 0 creates
    ``.tmp-<name>-<random>`` beside ``final`` (a name of its own, so two jobs never share
    one) and every rank gets its path. On leaving, the ranks exchange whether their block
    raised. If none did, rank 0 fsyncs the folder and calls ``commit(tmp, final)`` (default:
    ``replace_folder``, a rename over any previous ``final``). If any rank raised, or the
    commit fails, the temporary folder is removed, ``final`` is left as it was, and every rank
    raises ``CheckpointError`` naming the rank and the error (a failing rank whose error is
    not an ``OSError`` re-raises it as is, with its traceback).

    Example:
        >>> with collective_publish(out / "checkpoint-8") as tmp:    # every rank
        ...     accelerator.save_state(str(tmp))
    """
    final = Path(final)
    tmp = Path(all_gather_object(str(final.parent / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"))[0])
    if is_main_process():
        tmp.mkdir(parents=True)
    barrier()
    failure: BaseException | None = None
    try:
        yield tmp
    except Exception as e:  # reported to every rank below
        failure = e
    reports = all_gather_object(f"{type(failure).__name__}: {failure}" if failure is not None else None)
    failed = [(rank, msg) for rank, msg in enumerate(reports) if msg]
    commit_error = None
    if is_main_process():
        try:
            if not failed:
                fsync_tree(tmp)
                (commit or replace_folder)(tmp, final)
        except OSError as e:
            commit_error = f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was renamed
    if failure is not None and not isinstance(failure, (OSError, CheckpointError)):
        raise failure  # a bug, not a write error: keep its traceback
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"writing {final} failed on rank {rank}: {msg}") from failure
    commit_error = all_gather_object(commit_error)[0]
    if commit_error:
        raise CheckpointError(f"publishing {final} failed on rank 0: {commit_error}")
