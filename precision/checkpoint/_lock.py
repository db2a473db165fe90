"""One writer per checkpoint directory: an advisory lock on ``<dir>/precision.lock``.

The lock is `fcntl.flock` on the file, held for as long as the writer's Checkpointer is
open. The kernel releases it when the holding process ends in any way (exit, exception,
SIGKILL), so a lock left by a killed run never blocks the next one: the next writer takes
it and reports the dead owner it replaced. While held, the file records the holder (pid,
host, run id, since when) so a refused writer is told who holds it. flock needs a local
(or NFSv4) POSIX filesystem; where it is unsupported the writer is refused with an error
saying so, rather than writing without a lock.

The file is opened with ``O_NOFOLLOW`` and must be a regular file with one link: a
symbolic or hard link planted under its name (to make the writer truncate another file)
is refused, never written through.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import stat
from typing import Any

from precision.checkpoint import _files

from precision.checkpoint._errors import CheckpointLockedError

LOCK_FILE = "precision.lock"

try:
  import fcntl  # POSIX only
except ImportError:  # pragma: no cover (not POSIX)
  fcntl = None


def _describe(holder: dict[str, Any]) -> str:
  if not holder:
    return "a process that has not written its name yet"
  parts = [f"pid {holder.get('pid')} on host {holder.get('host')}"]
  if holder.get("run_id"):
    parts.append(f"run {holder['run_id']}")
  if holder.get("since"):
    parts.append(f"since {holder['since']}")
  return ", ".join(parts)


class WriterLock:
  """The exclusive writer lock of one checkpoint directory (which must exist)."""

  def __init__(self, directory: str):
    self.path = os.path.join(directory, LOCK_FILE)
    self._fd: int | None = None
    self.replaced: str | None = None  # the dead holder this lock was taken over from

  @property
  def held(self) -> bool:
    return self._fd is not None

  def _read(self, fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
      holder = json.loads(raw.decode()) if raw.strip() else {}
    except ValueError:
      holder = {}
    return holder if isinstance(holder, dict) else {}

  def acquire(self, run_id: str | None = None) -> None:
    """Takes the lock or raises CheckpointLockedError naming the holder."""
    if self._fd is not None:
      return
    if fcntl is None:  # pragma: no cover
      raise CheckpointLockedError(
          f"Cannot lock {self.path}: this platform has no fcntl.flock; checkpoints are "
          "written only under a writer lock")
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                   | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as e:
      why = ("it is a symbolic link" if os.path.islink(self.path) else
             f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})")
      raise CheckpointLockedError(f"Cannot take the writer lock {self.path}: {why}; "
                                  "remove it (the lock is a plain file precision "
                                  "creates)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
      os.close(fd)
      raise CheckpointLockedError(
          f"Cannot take the writer lock {self.path}: it is "
          + ("not a regular file" if not stat.S_ISREG(st.st_mode) else
             f"a file with {st.st_nlink} hard links (another file's name)")
          + "; remove it (the lock is a plain file precision creates)")
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = self._read(fd)
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise CheckpointLockedError(
            f"Checkpoint directory {os.path.dirname(self.path)} is being written by "
            f"another process ({_describe(holder)}); two runs must not write one "
            "directory. Wait for it to finish, stop it, or use another directory (a lock "
            "left by a killed process is released by the system).") from None
      raise CheckpointLockedError(
          f"Cannot lock {self.path} ({e.strerror}): the filesystem does not support "
          "flock; write checkpoints to a local or NFSv4 directory") from e
    # A holder that released cleanly emptied the file; a name still there belongs to a
    # process that ended without releasing (killed): the system freed its lock.
    try:
      old = self._read(fd)
      if old:
        self.replaced = _describe(old)
      me = _files.stamp(
          {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id,
           "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
          1)
      os.ftruncate(fd, 0)
      os.lseek(fd, 0, os.SEEK_SET)
      os.write(fd, json.dumps(me).encode())
      os.fsync(fd)
    except BaseException:
      try:
        os.ftruncate(fd, 0)  # not held: no holder recorded
      except OSError:
        pass
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
      raise
    self._fd = fd

  def still_there(self) -> bool:
    """Whether the held lock file is still the one at its path (not deleted or moved)."""
    if self._fd is None:
      return False
    try:
      st = os.lstat(self.path)
    except OSError:
      return False
    mine = os.fstat(self._fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

  def release(self) -> None:
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)  # no holder recorded while nobody holds it
      fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
      os.close(fd)
