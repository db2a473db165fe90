"""What stops a study without being its result: the environment failing under it.

A full disk, an I/O error, a folder this process may not read or write, the host or the
device out of memory: none of these says anything about a recipe, so none of them may
finish a cell. They stop the run with one `StudyEnvironmentError` naming the cell, the
path and the cause, and leave the cell unfinished: once the cause is gone, the same
command continues it from its last checkpoint, bit-exactly.

How a fault is told from the model's failure:

  * every file operation of the study itself (checkpoint save and restore, steps.jsonl,
    telemetry.jsonl, attempts.jsonl, error.txt, done.json) runs under `library_io`, so
    any exception it raises is the environment's, whatever its type;
  * an exception from the user's code (init, loss, batches, evaluate) is the model's
    failure, except the ones no recipe can cause: `MemoryError`, a device
    out-of-memory (XLA's RESOURCE_EXHAUSTED), and an `OSError` of a full, broken or
    read-only filesystem (ENOSPC, EDQUOT, EIO, EROFS) hit while reading the user's data.
    Other OSErrors of the user's code (a missing file, a permission) stay its failure.
"""

from __future__ import annotations

import contextlib
import errno as errno_lib
import os
from typing import Iterator

# Errnos that describe the filesystem, never the program that met them.
_FILESYSTEM = (errno_lib.ENOSPC, errno_lib.EDQUOT, errno_lib.EIO, errno_lib.EROFS)

_ADVICE = {
    errno_lib.ENOSPC: "free space on that filesystem",
    errno_lib.EDQUOT: "raise the quota or free space",
    errno_lib.EIO: "check the disk (dmesg) or move --out to a sound one",
    errno_lib.EROFS: "make that filesystem writable, or use another --out",
    errno_lib.EACCES: "give this user read and write permission there",
    errno_lib.EPERM: "give this user read and write permission there",
}


class StudyEnvironmentError(RuntimeError):
  """The study stopped because its environment failed (disk, permissions, memory), not
  its model. The cell `cell` is left unfinished; rerunning the same command continues it.

  Attributes: cell (its name, None outside a cell), path (the file or folder, None when
  none is involved), errno (None when the cause is no OSError), cause (the exception).
  """

  def __init__(self, message: str, *, cell: str | None, path: str | None,
               errno: int | None, cause: BaseException):
    super().__init__(message)
    self.cell, self.path, self.errno, self.cause = cell, path, errno, cause


def _first_line(e: BaseException, limit: int = 300) -> str:
  lines = str(e).strip().splitlines()
  line = lines[0] if lines else ""
  return line if len(line) <= limit else line[:limit] + "..."


# An error a storage library (Orbax, TensorStore) re-raised without an errno still says
# what the system call said: its text is read for these.
_ERRNO_TEXT = ((errno_lib.ENOSPC, ("No space left on device", "ENOSPC")),
               (errno_lib.EDQUOT, ("Disk quota exceeded", "EDQUOT")),
               (errno_lib.EROFS, ("Read-only file system", "EROFS")))


def _errno_of(e: BaseException) -> int | None:
  """The errno of `e`, or of the first exception of its chain (``raise ... from``, or
  raised while handling) that has one; else one its message names."""
  seen, chain = set(), []
  while e is not None and id(e) not in seen and len(chain) < 16:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  for x in chain:
    code = getattr(x, "errno", None)
    if isinstance(code, int) and code:
      return code
  for x in chain:
    text = str(x)
    for code, words in _ERRNO_TEXT:
      if any(w in text for w in words):
        return code
  return None


def _cause_words(e: BaseException) -> str:
  """'No space left on device (ENOSPC)', 'out of host memory (MemoryError)', or the
  exception's first line."""
  code = _errno_of(e)
  if code is not None:
    return f"{os.strerror(code)} ({errno_lib.errorcode.get(code, code)})"
  if isinstance(e, MemoryError):
    return "out of host memory (MemoryError)"
  if is_device_oom(e):
    return f"out of device memory ({_first_line(e, 160)})"
  return f"{type(e).__name__}: {_first_line(e)}"


def _advice(e: BaseException) -> str:
  """What to do, and that the same command then continues."""
  code = _errno_of(e)
  if code in _ADVICE:
    what = _ADVICE[code]
  elif isinstance(e, MemoryError):
    what = "free host memory (fewer processes on this machine, or a smaller task)"
  elif is_device_oom(e):
    what = "free device memory (one study per device, or a smaller batch or model)"
  else:
    what = "fix the cause"
  return f"{what}, then rerun the same command to continue"


def is_device_oom(e: BaseException) -> bool:
  """Whether `e` is XLA's out-of-memory error (RESOURCE_EXHAUSTED from a device)."""
  import jax  # pylint: disable=g-import-not-at-top
  return (isinstance(e, jax.errors.JaxRuntimeError)
          and str(e).lstrip().startswith("RESOURCE_EXHAUSTED"))


def is_environment(e: BaseException) -> bool:
  """Whether an exception of the user's code is the environment's (see the docstring)."""
  if isinstance(e, (MemoryError, StudyEnvironmentError)) or is_device_oom(e):
    return True
  return isinstance(e, OSError) and _errno_of(e) in _FILESYSTEM


def fault(cell: str | None, what: str, path: str | None,
          e: BaseException) -> StudyEnvironmentError:
  """The one-line StudyEnvironmentError of `e`, met while `what` (for `path`) ran."""
  path = getattr(e, "filename", None) or path
  where = f"cell {cell}: " if cell else ""
  at = f" at {path}" if path else ""
  kept = ("the cell is left unfinished (nothing recorded as the model's result)" if cell
          else "every finished cell is kept")
  return StudyEnvironmentError(
      f"study stopped, {where}{what} failed{at}: {_cause_words(e)}; {kept}; {_advice(e)}",
      cell=cell, path=path, errno=_errno_of(e), cause=e)


@contextlib.contextmanager
def library_io(cell: str | None, what: str, path: str | None) -> Iterator[None]:
  """Runs the study's own file operation `what` (on `path`, in cell `cell`): any
  exception it raises becomes a StudyEnvironmentError (KeyboardInterrupt and SystemExit
  pass unchanged)."""
  try:
    yield
  except StudyEnvironmentError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (classified by where, not type)
    raise fault(cell, what, path, e) from e
