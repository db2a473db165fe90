"""The file operations of precision.checkpoint that must not be redirected.

A checkpoint directory may hold names planted by someone else: a symbolic link where the
lock, the run record or a step's file should be, a manifest that names ``../../x``. Every
file the library opens goes through here:

  * `read_json` opens with ``O_NOFOLLOW`` (a link is refused, never followed) and only
    regular files;
  * `write_json` writes a temporary file of a random name opened with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted name or link makes it fail, it never
    writes through one), fsyncs it and renames it over the target (a link at the target
    is replaced, its target untouched);
  * `confined` turns a relative name from a manifest into a path inside a folder after
    realpath, refusing absolute names, ``..``, and links anywhere on the way;
  * `check_format` refuses a file written in a newer format than this version reads.

Every JSON file the library writes carries ``format`` (its own number) and
``precision_version`` (the version that wrote it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import uuid
from typing import Any

from precision.checkpoint._errors import CheckpointFormatError
from precision import _version

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def version() -> str:
  """This version of precision ("0.1.0")."""
  return _version.__version__


def stamp(body: dict, fmt: int) -> dict:
  """`body` with its format number and the writing version of precision."""
  return {"format": int(fmt), "precision_version": version(), **body}


def check_format(d: dict, newest: int, what: str, strict: bool = True) -> Any:
  """The format number of `d` (a JSON object the library wrote), checked.

  Raises:
    CheckpointFormatError when it is newer than `newest`, naming the version that wrote
    it; ValueError (when `strict`) when it is missing or not an integer >= 1 (the
    caller reports damage).
  """
  fmt = d.get("format")
  if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
    if strict:
      raise ValueError(f"its format is {fmt!r}, not an integer >= 1")
    return fmt
  if fmt > newest:
    raise CheckpointFormatError(
        f"{what} has format {fmt}, written by a newer version of precision "
        f"({d.get('precision_version', 'unknown')}); this one ({version()}) reads formats "
        f"<= {newest}. Upgrade precision to read it")
  return fmt


def json_digest(body: dict) -> str:
  """SHA-256 of a JSON object's canonical text (sorted keys): what a file that carries
  its own checksum (the manifest, the run record) stores under "sha256"."""
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_self_digested(path: str, newest: int, what: str) -> tuple[dict, dict, bool]:
  """(document, body, digest matches) of a JSON object carrying its own "sha256".

  A newer format is refused before the digest is checked (a newer version may digest
  otherwise).

  Raises:
    CheckpointFormatError for a newer format; OSError / ValueError for a file that is a
    link, not a regular file, not JSON or not a JSON object (the caller reports damage).
  """
  if os.path.islink(path):
    raise ValueError("it is a symbolic link, never followed")
  doc = read_json(path)
  if not isinstance(doc, dict):
    raise ValueError("it is not a JSON object")
  check_format(doc, newest, what, strict=False)
  body = {k: v for k, v in doc.items() if k != "sha256"}
  return doc, body, doc.get("sha256") == json_digest(body)


def _open_regular(path: str, flags: int) -> int:
  """An fd of the regular file at `path`, never through a symbolic link."""
  fd = os.open(path, flags | _NOFOLLOW)
  try:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      raise OSError(errno.EINVAL, "not a regular file", path)
  except BaseException:
    os.close(fd)
    raise
  return fd


def read_bytes(path: str, limit: int = 1 << 30) -> bytes:
  """The bytes of the regular file at `path` (a symbolic link raises OSError ELOOP)."""
  fd = _open_regular(path, os.O_RDONLY)
  with os.fdopen(fd, "rb") as f:
    return f.read(limit)


def read_json(path: str) -> Any:
  """The JSON of the regular file at `path`; OSError for a link, ValueError for bad JSON."""
  return json.loads(read_bytes(path).decode())


def open_regular_binary(path: str):
  """A binary reader of the regular file at `path`, never through a link."""
  return os.fdopen(_open_regular(path, os.O_RDONLY), "rb")


def write_json(path: str, obj: Any) -> None:
  """Writes JSON to `path` durably: a fresh temporary file of a random name (O_EXCL,
  O_NOFOLLOW), fsync, atomic rename over `path`."""
  folder, name = os.path.split(path)
  tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
  data = json.dumps(obj, sort_keys=True, allow_nan=False).encode()
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_tree(path: str) -> None:
  """fsyncs every regular file and folder under `path` (the folder included): the step's
  bytes are on disk before the step is renamed into place and older steps deleted."""
  for root, dirs, files in os.walk(path):
    for name in files:
      p = os.path.join(root, name)
      if os.path.islink(p):
        continue
      fd = os.open(p, os.O_RDONLY | _NOFOLLOW)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fsync_dir(root)


class UnsafeName(ValueError):
  """A name from a manifest that is not a plain relative name inside its folder."""


def confined(folder: str, rel: Any) -> str:
  """The path of the relative POSIX name `rel` inside `folder`, after realpath.

  Raises:
    UnsafeName when `rel` is not a string, is empty or absolute, has an empty, '.' or
    '..' component or a backslash / NUL, or when `folder` or any component below it is a
    symbolic link (the realpath would leave the folder, or could).
  """
  if (not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel
      or "\0" in rel or any(part in ("", ".", "..") for part in rel.split("/"))):
    raise UnsafeName(f"{rel!r} is not a plain relative name inside the step folder "
                     "(accepted: names like 'state/_METADATA', without '..' or a leading "
                     "'/')")
  if os.path.islink(folder):
    raise UnsafeName(f"the folder {folder} is a symbolic link")
  root = os.path.realpath(folder)
  path = os.path.join(root, *rel.split("/"))
  if os.path.realpath(path) != path:
    raise UnsafeName(f"{rel!r} is, or lies under, a symbolic link")
  return path
