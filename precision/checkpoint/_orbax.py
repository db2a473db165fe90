"""The few Orbax calls precision.checkpoint makes, each synchronous and closed after use.

Every call builds its own handler or checkpointer and closes it in a ``finally``, so no
Orbax thread or event loop outlives the call, whether it returns or raises: a failed
restore leaves nothing behind to print "Event loop is closed" at exit. Read errors come
back as `OrbaxReadError` with the first line of Orbax's message (TensorStore's are
hundreds of lines of JSON spec); the original exception is its `orbax_error`.

Orbax reads the paths it is given as glob patterns in places (merging the per-process
OCDBT folders after a save, listing array metadata): a ``[``, ``]``, ``*`` or ``?``
anywhere in the path (``lr[3e-3]/ckpt``) makes a save write an item nothing can read. So
every path reaches Orbax through `_plain`: unchanged when it holds none of these
characters, else as ``/proc/self/fd/<fd>/...`` of the folder opened by this process (or,
without /proc, a link of a random name in a fresh private temporary folder), a name in
which no character is a pattern.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import tempfile
import threading
from typing import Any, Iterator

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from precision import _compat
from precision.checkpoint._errors import CheckpointError

# Files that mark a directory as an Orbax PyTree item (StandardCheckpointer,
# PyTreeCheckpointer, a CheckpointManager item).
ITEM_MARKERS = ("_METADATA", "manifest.ocdbt")


class OrbaxReadError(CheckpointError):
  """Orbax could not read an item; the message is the first line of its error."""

  def __init__(self, message: str, orbax_error: BaseException):
    super().__init__(message)
    self.orbax_error = orbax_error


def _read_error(what: str, part: str, e: BaseException) -> OrbaxReadError:
  return OrbaxReadError(f"{what}: Orbax cannot read {part} ({type(e).__name__}: "
                        f"{_first_line(e)})", e)


_PATTERN = re.compile(r"[][*?]")


@contextlib.contextmanager
def _plain(path: str, exists: bool) -> Iterator[str]:
  """A path naming `path` in which no character is a glob pattern (see the docstring).

  exists: `path` is an existing folder (read), else its parent is (save).
  """
  path = os.path.abspath(path)
  if not _PATTERN.search(path):
    yield path
    return
  anchor, name = (path, "") if exists else os.path.split(path)
  if _PATTERN.search(name):
    raise ValueError(f"Orbax item name {name!r} holds a glob character; accepted: names "
                     "without [, ], *, ?")
  if os.path.isdir("/proc/self/fd"):
    fd = os.open(anchor, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
      base = f"/proc/self/fd/{fd}"
      yield os.path.join(base, name) if name else base
    finally:
      os.close(fd)
    return
  alias_dir = tempfile.mkdtemp(prefix="precision-orbax-")  # mode 0700, random name
  if _PATTERN.search(alias_dir):
    os.rmdir(alias_dir)
    raise CheckpointError(f"Cannot hand {path} to Orbax: the temporary folder {alias_dir} "
                          "holds a glob character too; set TMPDIR to a plain path")
  link = os.path.join(alias_dir, "d")
  os.symlink(anchor, link)
  try:
    yield os.path.join(link, name) if name else link
  finally:
    os.unlink(link)
    os.rmdir(alias_dir)


def is_item(path: str) -> bool:
  return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m))
                                     for m in ITEM_MARKERS)


def _first_line(e: BaseException, limit: int = 300) -> str:
  text = str(e).strip().splitlines()
  line = text[0] if text else type(e).__name__
  line = line.split(" See full TensorStore details")[0]  # then a long JSON spec
  return line if len(line) <= limit else line[:limit] + "..."


def _errno_in(text: str) -> int | None:
  """The errno whose system message appears in `text` (e.g. "No space left on device")."""
  for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
               errno.EIO, errno.ENOENT):
    if os.strerror(code) in text:
      return code
  return None


class _OrbaxFailureLog(logging.Filter):
  """Drops the error records Orbax logs (with their tracebacks, through absl) from its
  worker threads when a write or read fails: the same failure reaches the calls here as
  an exception and is reported once, in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f"{os.sep}orbax{os.sep}" in (record.pathname or "")
    return not (from_orbax and record.levelno >= logging.ERROR)


def _orbax_threads() -> list[threading.Thread]:
  """Orbax's worker threads now alive (they log a failure when they end)."""
  return [t for t in threading.enumerate()
          if type(t).__module__.startswith("orbax.") and t is not threading.current_thread()]


@contextlib.contextmanager
def _orbax_failures_unlogged() -> Iterator[None]:
  log, quiet = logging.getLogger("absl"), _OrbaxFailureLog()
  before = set(_orbax_threads())
  log.addFilter(quiet)
  try:
    yield
  finally:
    # A failed write's worker threads may still be logging after the call raised: the
    # filter stays until the threads this call started have ended.
    for t in set(_orbax_threads()) - before:
      # Orbax's own thread class re-raises its target's exception from join(): that is
      # the failure the call already reports (or an OSError made of it), not a second one.
      try:
        threading.Thread.join(t, timeout=30)
      except Exception:  # pylint: disable=broad-except
        pass
    log.removeFilter(quiet)


def save_item(path: str, tree: Any) -> None:
  """Writes `tree` as an Orbax StandardCheckpointHandler item at `path` (must not exist)."""
  with _orbax_failures_unlogged():
    _save_item(path, tree)


def _save_item(path: str, tree: Any) -> None:
  ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  try:
    with _plain(path, exists=False) as plain, _compat.orbax_drained_event_loops():
      ckptr.save(plain, args=ocp.args.StandardSave(tree))
  except OSError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    # TensorStore reports a failed write (disk full, read-only) as a ValueError whose
    # text holds the system's message; it comes back as the OSError it is.
    code = _errno_in(str(e))
    if code is None:
      raise CheckpointError(f"Orbax cannot write {path} ({type(e).__name__}: "
                            f"{_first_line(e)})") from None
    raise OSError(code, os.strerror(code), path) from None
  finally:
    ckptr.close()


def item_tree(path: str, what: str) -> Any:
  """The saved tree of an item with ArrayMetadata leaves (shape, dtype), nothing read."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    with _plain(path, exists=True) as plain, _compat.orbax_drained_event_loops(), \
        _orbax_failures_unlogged():
      meta = handler.metadata(epath.Path(plain))
  except Exception as e:  # pylint: disable=broad-except
    raise _read_error(what, "the item's metadata", e) from None
  finally:
    handler.close()
  return getattr(meta, "tree", meta)


def restore_item(path: str, abstract: Any, what: str) -> Any:
  """Restores an item into the structure, dtypes and shardings of `abstract`."""
  handler = ocp.StandardCheckpointHandler()
  try:
    with _plain(path, exists=True) as plain, _compat.orbax_drained_event_loops(), \
        _orbax_failures_unlogged():
      return handler.restore(epath.Path(plain), args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # pylint: disable=broad-except
    raise _read_error(what, "the arrays", e) from None
  finally:
    handler.close()


def restore_partial(path: str, item: Any, what: str) -> Any:
  """Restores the leaves present in `item` (a nested dict/list of numpy templates
  matching the saved structure) as numpy arrays, leaving the rest of the item unread."""
  import jax  # pylint: disable=g-import-not-at-top

  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  handler = ocp.PyTreeCheckpointHandler()
  try:
    with _plain(path, exists=True) as plain, _compat.orbax_drained_event_loops(), \
        _orbax_failures_unlogged():
      return handler.restore(epath.Path(plain), args=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except
    raise _read_error(what, "the arrays", e) from None
  finally:
    handler.close()
