"""The errors a user can fix: each is one ``error: <what is wrong>`` line from a script
(``recipe.run_script``), raised by the library and by the command line alike."""

from __future__ import annotations


class UserError(ValueError):
    """Something the user gave cannot work as given; the message names it."""


class ArgumentError(UserError):
    """A command-line value that cannot work; the message names the flag."""


class DataError(UserError):
    """The dataset cannot be used as asked (missing column, no images, nothing readable)."""


class CheckpointError(UserError):
    """A model folder or checkpoint is missing, incomplete or does not fit the model."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files differ from its manifest (a truncated, changed or missing file)."""


class RewardError(UserError):
    """A reward gave scores that cannot be used (wrong count, NaN, inf) or raised; the message
    names the reward spec and what is wrong."""
