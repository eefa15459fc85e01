"""Folders that are complete or absent: temporary names, fsync, rename, and cleanup.

* ``publish_folder``: one process writes a folder under a temporary name; it is fsynced and
  renamed into place when the block succeeds (used for each saved model).
* ``collective_publish``: every rank writes into one temporary folder (a training
  checkpoint, the frozen-model cache, the final pipeline's staging folder); when every rank
  succeeded, global rank 0 fsyncs it and commits it (a rename, or a swap into an existing
  folder); when any rank failed, it is removed and every rank raises. Before anything is
  written, every rank checks that it sees the folder global rank 0 created (node-local
  disks fail there, with nothing left behind on any node).
* ``remove_interrupted_writes``: the ``.tmp-*`` / ``.old-*`` leftovers of a killed save.
* ``WriteErrors``: a rank's write error (a full disk, an I/O error, a quota) held until the
  next exchange of verdicts, so that the rank goes on through the same collectives as the
  others instead of leaving them waiting in one it skipped.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError
from ..runtime.distributed import all_gather_object, barrier, is_main_process

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
# Written by global rank 0 into a new temporary folder and read back by every rank: a rank
# that cannot read it writes somewhere else (another machine's own disk). Removed at once.
SHARED_TOKEN = ".shared-token"


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


def is_write_error(error: BaseException) -> bool:
    """Whether ``error`` is a failed write (ENOSPC, EIO, EDQUOT, ...) rather than a bug.

    An ``OSError``, or the ``RuntimeError`` that ``torch.save`` raises when it writes to a
    path itself and the write fails (its C++ stream writer reports no errno, only "unexpected
    pos" or "file write failed").
    """
    if isinstance(error, OSError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container" in text)


def describe_write_error(error: BaseException) -> str:
    """One phrase for a write error: the path and the errno's meaning, e.g.
    ``/out/.tmp-checkpoint-8-1a2b/ema_rank1.pt: no space left on device (ENOSPC)``."""
    if isinstance(error, OSError) and error.errno is not None:
        meaning = (error.strerror or os.strerror(error.errno)).lower()
        what = f"{meaning} ({errno.errorcode.get(error.errno, error.errno)})"
        return f"{error.filename}: {what}" if error.filename else what
    if not isinstance(error, OSError) and is_write_error(error):
        return f"a write failed ({type(error).__name__}: {str(error).splitlines()[0]})"
    return f"{type(error).__name__}: {error}"


@contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Give an ``OSError`` raised inside the path it was writing when it names none (a failed
    ``write()`` reports only its errno), so that the error line says which file.

    Example:
        >>> with naming(tmp / "ema_rank1.pt"), open(tmp / "ema_rank1.pt", "wb") as f:
        ...     torch.save(state, f)
    """
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e


class WriteErrors:
    """Hold this rank's first write error until the ranks exchange verdicts.

    A rank whose write fails must not leave a collective sequence that the other ranks are
    still in (the next barrier or gather would pair with another one, or wait until the
    process-group timeout). So a write that may fail runs through ``run``: a write error is
    kept and the call returns None, the rank goes on with the same collectives, and ``raise_first`` raises it where every rank exchanges its outcome
    (inside a ``collective_publish`` block, which then removes the temporary folder); files
    written after a failure go into that folder too, and with it. Errors
    that are not write errors (bugs) propagate at once.

    Example:
        >>> errors = WriteErrors()
        >>> with collective_publish(final) as tmp:                      # every rank
        ...     errors.run(torch.save, state, tmp / f"ema_rank{rank}.pt")
        ...     barrier()                                              # reached by every rank
        ...     errors.raise_first()
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def record(self, error: BaseException) -> None:
        """Keep ``error`` (a write error) unless one is kept already."""
        if self.error is None:
            self.error = error

    def run(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``; a write error is kept and None returned. Runs even after an
        earlier failure: ``fn`` may hold collectives (DeepSpeed's save) that every rank enters."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not is_write_error(e):
                raise
            self.record(e)
            return None

    def raise_first(self) -> None:
        """Raise the kept write error, if any."""
        if self.error is not None:
            raise self.error


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
    final: str | os.PathLike,
    *,
    commit: Callable[[Path, Path], None] | None = None,
    folder_flag: str | None = None,
) -> Iterator[Path]:
    """Write a folder on every rank under one temporary name; publish it once all succeeded.

    Collective: every rank enters and leaves the block. Global rank 0 creates
    ``.tmp-<name>-<random>`` beside ``final`` (a name of its own, so two jobs never share
    one); each rank gets that name in its own view of ``final``'s parent, which is the same
    folder when the storage is shared.

    Before the block, every rank checks that it sees the folder: rank 0 writes a random token
    into it and every rank reads it back; the verdicts are exchanged, so that on node-local
    disks (where another machine's ranks would write their files into their own disk and
    rank 0 would publish a folder without them) every rank raises the same
    ``CheckpointError`` together, before anything is written, and rank 0 removes its
    temporary folder (the others never had one). ``folder_flag`` names the option that chose
    the folder in that message (e.g. ``--output_dir``).

    On leaving, the ranks exchange whether their block raised. If none did, rank 0 fsyncs the
    folder and calls ``commit(tmp, final)`` (default: ``replace_folder``, a rename over any
    previous ``final``). If any rank raised, or the commit fails, the temporary folder is
    removed, ``final`` is left as it was, and every rank raises ``CheckpointError`` naming the
    rank and the error: for a write error, the file and the errno's meaning
    (``describe_write_error``). A failing rank whose error is not a write error re-raises it
    as is, with its traceback. A write that may fail while the other ranks go on into a
    collective inside the block must be held until the block's end (``WriteErrors``).

    Example:
        >>> with collective_publish(out / "checkpoint-8") as tmp:    # every rank
        ...     accelerator.save_state(str(tmp))
    """
    final = Path(final)
    tmp = _shared_temporary_folder(final, folder_flag)
    failure: BaseException | None = None
    try:
        yield tmp
    except Exception as e:  # reported to every rank below
        failure = e
    reports = all_gather_object(_describe(failure) if failure is not None else None)
    failed = [(rank, msg) for rank, msg in enumerate(reports) if msg]
    commit_error = None
    if is_main_process():
        try:
            if not failed:
                fsync_tree(tmp)
                (commit or replace_folder)(tmp, final)
        except OSError as e:
            commit_error = describe_write_error(e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was renamed
    if failure is not None and not (is_write_error(failure) or isinstance(failure, CheckpointError)):
        raise failure  # a bug, not a write error: keep its traceback
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"writing {final} failed on rank {rank}: {msg}") from failure
    commit_error = all_gather_object(commit_error)[0]
    if commit_error:
        raise CheckpointError(f"publishing {final} failed on rank 0: {commit_error}")


def _describe(failure: BaseException) -> str:
    if isinstance(failure, CheckpointError):
        return str(failure)
    return describe_write_error(failure)


def _shared_temporary_folder(final: Path, folder_flag: str | None) -> Path:
    """Create ``final``'s temporary folder on global rank 0 and check that every rank sees it.

    Collective: call on every rank. Returns the folder in this rank's view; raises
    ``CheckpointError`` on every rank (and leaves no folder) when rank 0 could not create it
    or some rank does not see the token rank 0 wrote into it. Costs one small file, a
    barrier and two exchanges of a few bytes.
    """
    name, token = all_gather_object((f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex))[0]
    tmp = final.parent / name
    created = None
    if is_main_process():
        try:
            tmp.mkdir(parents=True)
            (tmp / SHARED_TOKEN).write_text(token)
        except OSError as e:
            created = f"{type(e).__name__}: {e}"
    barrier()
    verdicts = all_gather_object(created or _sees_token(tmp / SHARED_TOKEN, token))
    if is_main_process():
        if all(v is True for v in verdicts):
            (tmp / SHARED_TOKEN).unlink(missing_ok=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if verdicts[0] is not True:
        raise CheckpointError(f"cannot create a folder beside {final} on rank 0: {verdicts[0]}")
    blind = [rank for rank, v in enumerate(verdicts) if v is not True]
    if blind:
        where = f"{folder_flag} {final.parent}" if folder_flag else str(final.parent)
        raise CheckpointError(
            f"{where} is not one folder shared by every node: rank {blind[0]} does not see the folder "
            f"{name} that global rank 0 created there ({len(blind)} of {len(verdicts)} ranks do not); "
            f"{folder_flag or 'it'} must be on storage that every node sees (a shared filesystem, at the "
            "same path on every machine)"
        )
    return tmp


def _sees_token(path: Path, token: str, tries: int = 3, wait_s: float = 0.5) -> bool:
    """Whether ``path`` holds ``token`` as this rank sees it. Read again after a short wait
    when it does not: a network filesystem may show a new file to other clients a moment
    later (close-to-open consistency is the common case, a lag the rare one)."""
    for attempt in range(tries):
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if attempt + 1 < tries:
            time.sleep(wait_s)
    return False
