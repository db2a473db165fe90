"""The few Orbax calls precision.checkpoint makes, each synchronous and closed after use.

Every call builds its own handler or checkpointer and closes it in a ``finally``, so no
Orbax thread or event loop outlives the call, whether it returns or raises: a failed
restore leaves nothing behind to print "Event loop is closed" at exit. Read errors come
back as `OrbaxReadError` with the first line of Orbax's message (TensorStore's are
hundreds of lines of JSON spec); the original exception is its `orbax_error`.
"""

from __future__ import annotations

import os
from typing import Any

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


def is_item(path: str) -> bool:
  return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m))
                                     for m in ITEM_MARKERS)


def _first_line(e: BaseException, limit: int = 300) -> str:
  text = str(e).strip().splitlines()
  line = text[0] if text else type(e).__name__
  line = line.split(" See full TensorStore details")[0]  # then a long JSON spec
  return line if len(line) <= limit else line[:limit] + "..."


def save_item(path: str, tree: Any) -> None:
  """Writes `tree` as an Orbax StandardCheckpointHandler item at `path` (must not exist)."""
  ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  try:
    with _compat.orbax_drained_event_loops():
      ckptr.save(path, args=ocp.args.StandardSave(tree))
  finally:
    ckptr.close()


def item_tree(path: str, what: str) -> Any:
  """The saved tree of an item with ArrayMetadata leaves (shape, dtype), nothing read."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    with _compat.orbax_drained_event_loops():
      meta = handler.metadata(epath.Path(path))
  except Exception as e:  # pylint: disable=broad-except
    raise _read_error(what, "the item's metadata", e) from None
  finally:
    handler.close()
  return getattr(meta, "tree", meta)


def restore_item(path: str, abstract: Any, what: str) -> Any:
  """Restores an item into the structure, dtypes and shardings of `abstract`."""
  handler = ocp.StandardCheckpointHandler()
  try:
    with _compat.orbax_drained_event_loops():
      return handler.restore(epath.Path(path), args=ocp.args.StandardRestore(abstract))
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
    with _compat.orbax_drained_event_loops():
      return handler.restore(epath.Path(path), args=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except
    raise _read_error(what, "the arrays", e) from None
  finally:
    handler.close()
