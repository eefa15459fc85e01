"""Library messages that tell a user of this package nothing, each filtered narrowly where the
package causes it: one logger, one message; every other message of that logger still prints.

Checked on transformers 5.24, diffusers 0.42.1 and datasets 5.2. Nothing here runs at import
(``import diffusers_zero3`` changes nothing in the process): a trainer calls
``quiet_library_notices()`` at its start, and the data loaders read a local folder under
``local_dataset_progress_off()``.

* transformers: importing a diffusers pipeline module (``from transformers import
  CLIPImageProcessor``) without torchvision logs "`CLIPImageProcessor` requires torchvision
  (not installed); falling back to `CLIPImageProcessorPil` ..." once per class and process: 2 to
  4 lines per run. The package reads images with PIL and numpy on purpose (no torchvision);
  the PIL processor is the one it wants, and the advice to install torchvision is wrong here.
* diffusers: every guider built (HunyuanVideo 1.5's pipeline holds a ``ClassifierFreeGuidance``,
  built again at each load of the pipeline) logs "Guiders are currently an experimental
  feature ...", on every rank: a notice about a component of the published pipeline that the
  user did not choose and cannot act on.
* datasets: loading a local folder shows "Downloading data" and "Generating train split" bars;
  nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

# (logger, the message it drops): the exact logger the library logs it on
TORCHVISION_FALLBACK = (
    "transformers.utils.import_utils",
    re.compile(r"^`\w+` requires torchvision \(not installed\); falling back to `\w+Pil`"),
)
EXPERIMENTAL_GUIDERS = (
    "diffusers.guiders.guider_utils",
    re.compile(r"^Guiders are currently an experimental feature"),
)
NOTICES = (TORCHVISION_FALLBACK, EXPERIMENTAL_GUIDERS)


class DropMessage(logging.Filter):
    """A logging filter that drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_library_notices() -> None:
    """Drop the messages in ``NOTICES`` from here on, in this process: a filter on each one's
    own logger (a filter on a logger sees only the records logged on it, so the library's
    other messages, and its child loggers', are untouched). Idempotent.

    Example:
        >>> quiet_library_notices()  # first thing in a trainer's setup()
        >>> logging.getLogger("diffusers.guiders.guider_utils").warning("Guiders are currently an experimental feature.")
        >>> # (nothing printed)
    """
    for name, pattern in NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) and f.pattern is pattern for f in logger.filters):
            logger.addFilter(DropMessage(pattern))


@contextlib.contextmanager
def local_dataset_progress_off() -> Iterator[None]:
    """``datasets``' progress bars off inside the block (a local folder is read, not
    downloaded), restored after it, exceptions included. ``HF_DATASETS_DISABLE_PROGRESS_BARS``,
    when set, is left to decide.

    Example:
        >>> with local_dataset_progress_off():
        ...     ds = datasets.load_dataset("imagefolder", data_dir="outputs/default/shapes")
    """
    import datasets
    from datasets import config

    if config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None or datasets.are_progress_bars_disabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


__all__ = [
    "EXPERIMENTAL_GUIDERS",
    "NOTICES",
    "TORCHVISION_FALLBACK",
    "DropMessage",
    "local_dataset_progress_off",
    "quiet_library_notices",
]
