"""The errors and the warning of precision.checkpoint.

Each says what happened to which directory and step and what to do about it. The classes
also derive from the builtin a caller would catch without knowing them: a missing
checkpoint is a FileNotFoundError, a mismatched target or a foreign run a ValueError.
"""

from __future__ import annotations


class CheckpointError(Exception):
  """Base class of the checkpoint errors below."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
  """The directory holds no complete checkpoint (missing, empty, or only unfinished saves)."""


class CheckpointDamagedError(CheckpointError):
  """A checkpoint's files or arrays differ from the checksums written with them, or its
  files cannot be read: it was damaged after it was written."""


class CheckpointAuthenticityError(CheckpointDamagedError):
  """A restore with a key met a step that is unsigned, signed with another key, or whose
  manifest differs from what was signed (passed over like a damaged step)."""


class CheckpointMismatchError(CheckpointError, ValueError):
  """The restore target does not have the checkpoint's structure, shapes or dtypes."""


class CheckpointLockedError(CheckpointError):
  """Another live process holds the directory's writer lock."""


class CheckpointOwnershipError(CheckpointError, ValueError):
  """The directory belongs to another run (recipe, model config or seed differ)."""


class CheckpointFormatError(CheckpointError):
  """A file of the checkpoint has a format this version of precision does not read
  (written by a newer version), or holds a field it does not know."""


class CheckpointWriteError(CheckpointError, OSError):
  """A save could not write (ENOSPC, EACCES, EROFS, ...): one line naming the path and
  the errno; `errno`, `strerror` and `filename` are those of the failed call. The last
  good step is never deleted by a save that failed."""

  def __init__(self, message: str, cause: OSError | None = None, filename: str | None = None):
    super().__init__(message)
    if cause is not None:
      self.errno, self.strerror = cause.errno, cause.strerror
    self.filename = filename

  def __str__(self) -> str:
    return str(self.args[0])


class CheckpointWarning(UserWarning):
  """Something about a checkpoint directory a user should know, that stopped nothing."""


class CheckpointFallbackWarning(CheckpointWarning):
  """`restore` passed over a damaged newer step and restored an older intact one."""


class CheckpointUnverifiedWarning(CheckpointWarning):
  """`restore(..., allow_unverified=True)` restored a step that carries no checksums."""
