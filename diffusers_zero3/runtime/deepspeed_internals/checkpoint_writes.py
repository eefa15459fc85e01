"""DeepSpeed's checkpoint writes, made to fail without leaving the other ranks waiting.

``DeepSpeedEngine.save_checkpoint`` is a collective: a barrier after the folder is made, a tag
check (an all-reduce), each rank's files, then a closing barrier. When one rank's write fails
(a full disk), DeepSpeed lets the ``OSError`` out of the middle of that sequence: the failing
rank leaves while the others wait in the closing barrier, and whatever that rank calls next
pairs with it (or the job hangs until the process-group timeout). ``deferred_engine_writes``
wraps the two methods that write (``_save_checkpoint``: the model states file,
``_save_zero_checkpoint``: the optimizer partition and, on rank 0, the recovery scripts, each
after every collective of its method) so that a write error is handed to ``run`` (which keeps
it) and the rank goes on into the same barrier as the others. It also writes each file through
a Python file object, as DeepSpeed's ``TorchCheckpointEngine.save`` does with a path but
without torch's C++ writer, whose failure says "unexpected pos" without the errno.

Private names (``PRIVATE_NAMES``, use ``deferred_writes``), checked on DeepSpeed 0.19.8:
``DeepSpeedEngine._save_checkpoint``, ``._save_zero_checkpoint``, ``.checkpoint_engine`` and
``TorchCheckpointEngine.zipfile_serialization``. Without them, DeepSpeed's own behaviour.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from . import missing_names

WRITING_METHODS = ("_save_checkpoint", "_save_zero_checkpoint")


@contextmanager
def deferred_engine_writes(engine, run: Callable) -> Iterator[None]:
    """While inside, ``engine``'s checkpoint writes go through ``run(fn, *args, **kwargs)``.

    ``run`` calls ``fn`` and keeps a write error instead of raising it (``state.folders.
    WriteErrors.run``). Not a collective; use it on every rank around a collective save. An
    engine that is not a DeepSpeed engine (DDP), or a DeepSpeed without these names, is left
    as it is. The engine's methods are restored on leaving.

    Example:
        >>> errors = WriteErrors()
        >>> with deferred_engine_writes(engine, errors.run):
        ...     engine.save_checkpoint(tmp, tag="pytorch_model")   # every rank, failed or not
        >>> errors.raise_first()
    """
    if not all(hasattr(engine, name) for name in (*WRITING_METHODS, "checkpoint_engine")) or missing_names(
        "deferred_writes"
    ):
        yield
        return
    import torch

    saver = engine.checkpoint_engine
    own_save = type(saver).__name__ == "TorchCheckpointEngine" and hasattr(saver, "zipfile_serialization")

    def save_through_python_file(state_dict, path: str) -> None:
        try:
            with open(path, "wb") as f:  # an OSError with its errno
                torch.save(state_dict, f, _use_new_zipfile_serialization=saver.zipfile_serialization)
        except OSError as e:  # and the path, which a failed write() does not give
            if e.filename is not None or e.errno is None:
                raise
            raise OSError(e.errno, e.strerror, path) from e

    def deferred(method):
        return lambda *args, **kwargs: run(method, *args, **kwargs)

    for name in WRITING_METHODS:
        setattr(engine, name, deferred(getattr(engine, name)))
    if own_save:
        saver.save = save_through_python_file
    try:
        yield
    finally:
        for name in WRITING_METHODS:
            engine.__dict__.pop(name, None)
        if own_save:
            saver.__dict__.pop("save", None)
