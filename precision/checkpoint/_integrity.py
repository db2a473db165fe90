"""Checksums written with every checkpoint step, and their verification.

Orbax 0.12 checks no array bytes on restore: its zarr/OCDBT files carry a crc32c of the
chunk index only, so one flipped byte in a data file restores wrong values without a word.
Each step therefore gets ``integrity.json``:

  * ``files``: the size and SHA-256 of every file of the step (the Orbax item, the JSON
    metadata), verified before Orbax reads anything: a flipped byte, a truncated, deleted
    or emptied file is reported by name, and never reaches Orbax (whose errors on damaged
    input are long TensorStore dumps);
  * ``arrays``: dtype, shape and SHA-256 of the bytes of every saved array, by leaf path,
    verified on the arrays Orbax returns: what is restored is what was saved;
  * ``sha256``: the digest of the two above, so a damaged manifest is told apart from a
    damaged file.

SHA-256 (not a CRC) because the digest also serves as the identity of what was saved;
hashing runs at about 1-2 GB/s, small next to the write.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

from precision.checkpoint import _keys
from precision.checkpoint import _tree
from precision.checkpoint._errors import CheckpointDamagedError

MANIFEST = "integrity.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20


def file_digest(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def array_digest(x: Any) -> str:
  """SHA-256 of an array's dtype, shape and C-order little-endian bytes (host copy).

  A typed PRNG key: of its key dtype name ("key<fry>"), its shape and the bytes of its
  uint32 key data (what the checkpoint holds, see `_keys`).
  """
  head = None
  if _keys.is_key(x):
    head = f"{x.dtype.name}:{tuple(x.shape)}:"
    x = jax.random.key_data(x[...])  # [...]: the array of an nnx Variable leaf too
  a = np.ascontiguousarray(np.asarray(jax.device_get(x)))
  if a.dtype.byteorder == ">":
    a = a.astype(a.dtype.newbyteorder("<"))
  h = hashlib.sha256((head or f"{a.dtype.name}:{a.shape}:").encode())
  h.update(a.tobytes())
  return h.hexdigest()


def array_digests(tree: Any) -> dict[str, dict]:
  """{leaf path: {"dtype", "shape", "sha256"}} for every array leaf of `tree`; a typed
  PRNG key leaf also has "key_impl" (its impl's name, e.g. "threefry2x32")."""
  out = {}
  for name, leaf in _tree.array_leaves(tree):
    if name in out:
      raise ValueError(f"Two leaves of the state share the path '{name}'; checkpoint leaf "
                       "paths must be unique")
    key = _keys.is_key(leaf)
    out[name] = {"dtype": leaf.dtype.name if key else np.dtype(leaf.dtype).name,
                 "shape": list(np.shape(leaf)), "sha256": array_digest(leaf)}
    if key:
      out[name]["key_impl"] = _keys.impl_name(leaf.dtype)
  return out


def _files(step_dir: str) -> list[str]:
  """Relative POSIX paths of every regular file under step_dir but the manifest, sorted."""
  found = []
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
      if rel != MANIFEST:
        found.append(rel)
  return sorted(found)


def _body_digest(body: dict) -> str:
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_json(path: str, obj: Any) -> None:
  """Writes JSON to `path` durably: a temporary file, fsync, atomic rename."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, sort_keys=True, allow_nan=False)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_manifest(step_dir: str, step: int, arrays: dict[str, dict]) -> None:
  """Hashes every file now under step_dir and writes the manifest next to them."""
  files = {rel: {"bytes": os.path.getsize(os.path.join(step_dir, rel)),
                 "sha256": file_digest(os.path.join(step_dir, rel))}
           for rel in _files(step_dir)}
  body = {"format": MANIFEST_FORMAT, "step": int(step), "files": files, "arrays": arrays}
  write_json(os.path.join(step_dir, MANIFEST), {**body, "sha256": _body_digest(body)})


def has_manifest(step_dir: str) -> bool:
  return os.path.isfile(os.path.join(step_dir, MANIFEST))


def read_manifest(step_dir: str, what: str) -> dict:
  """The manifest of a step, checked against its own digest. `what` names the step in errors."""
  path = os.path.join(step_dir, MANIFEST)
  try:
    with open(path) as f:
      manifest = json.load(f)
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    ok = manifest.get("sha256") == _body_digest(body) and isinstance(body.get("files"), dict)
  except (OSError, ValueError, AttributeError) as e:
    raise CheckpointDamagedError(f"{what} is damaged: its {MANIFEST} cannot be read ({e})") from e
  if not ok:
    raise CheckpointDamagedError(f"{what} is damaged: its {MANIFEST} does not match its own "
                                 "checksum")
  return manifest


def verify_files(step_dir: str, what: str, only: tuple[str, ...] | None = None) -> dict:
  """Checks every file listed in the manifest (or only those in `only`); returns it.

  Raises:
    CheckpointDamagedError naming the first missing, resized or changed file.
  """
  manifest = read_manifest(step_dir, what)
  for rel, expect in sorted(manifest["files"].items()):
    if only is not None and rel not in only:
      continue
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
      raise CheckpointDamagedError(f"{what} is damaged: file {rel} is missing")
    size = os.path.getsize(path)
    if size != expect["bytes"]:
      raise CheckpointDamagedError(
          f"{what} is damaged: file {rel} has {size} bytes, {expect['bytes']} were written")
    if file_digest(path) != expect["sha256"]:
      raise CheckpointDamagedError(
          f"{what} is damaged: file {rel} has changed (its SHA-256 differs from the one "
          "written with it)")
  return manifest


def verify_arrays(manifest: dict, tree: Any, what: str) -> None:
  """Checks the restored arrays against the digests written with them.

  Raises:
    CheckpointDamagedError naming the first leaf whose bytes, dtype or shape differ, or a
    leaf restored that was not saved (or the reverse).
  """
  expect = manifest.get("arrays", {})
  got = array_digests(tree)
  for name, e in expect.items():
    if name not in got:
      raise CheckpointDamagedError(f"{what}: saved array '{name}' was not restored")
    g = got[name]
    if (g["dtype"], g["shape"]) != (e["dtype"], e["shape"]):
      raise CheckpointDamagedError(
          f"{what} is damaged: array '{name}' restored as {g['dtype']}{g['shape']}, saved "
          f"as {e['dtype']}{e['shape']}")
    if g["sha256"] != e["sha256"]:
      raise CheckpointDamagedError(
          f"{what} is damaged: array '{name}' restored with other bytes than were saved "
          "(SHA-256 differs)")
  extra = sorted(set(got) - set(expect))
  if extra:
    raise CheckpointDamagedError(f"{what}: restored array '{extra[0]}' has no checksum")
