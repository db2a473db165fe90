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
hashing runs at about 1-2 GB/s, small next to the write. The digests guard against
accidental damage (a bad disk, a cut copy, a stray edit), not against someone who can
write the directory: whoever changes a file can rewrite the manifest to match. With a
secret key (``save(..., key=)``) each step also gets ``integrity.hmac``, the
HMAC-SHA256 of the manifest's bytes, and ``restore(..., key=)`` accepts only steps whose
manifest carries a matching HMAC: a change by someone without the key is detected.

The manifest's file names are confined to the step folder (`_files.confined`): a name
with ``..``, an absolute name, or a symbolic link anywhere in the step (the step folder
included) is damage, never followed; so is a file the manifest does not list.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

import jax
import numpy as np

from precision.checkpoint import _files
from precision.checkpoint import _keys
from precision.checkpoint import _tree
from precision.checkpoint._errors import CheckpointAuthenticityError
from precision.checkpoint._errors import CheckpointDamagedError

MANIFEST = "integrity.json"
MANIFEST_FORMAT = 1
SIGNATURE = "integrity.hmac"  # written only with a key: HMAC-SHA256 of the manifest's bytes
SIGNATURE_FORMAT = 1
_CHUNK = 1 << 20


def file_digest(path: str) -> str:
  h = hashlib.sha256()
  with _files.open_regular_binary(path) as f:  # never through a symbolic link
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


def _walk(step_dir: str) -> tuple[list[str], list[str]]:
  """(files, links): relative POSIX paths of the regular files under step_dir but the
  manifest, and of every symbolic link (to a file or a folder, never followed), sorted."""
  found, links = [], []
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    for name in dirs + files:
      full = os.path.join(root, name)
      rel = os.path.relpath(full, step_dir).replace(os.sep, "/")
      if os.path.islink(full):
        links.append(rel)
      elif name in files and rel not in (MANIFEST, SIGNATURE):
        found.append(rel)
  return sorted(found), sorted(links)


write_json = _files.write_json
fsync_dir = _files.fsync_dir


def write_manifest(step_dir: str, step: int, arrays: dict[str, dict]) -> None:
  """Hashes every file now under step_dir and writes the manifest next to them."""
  found, links = _walk(step_dir)
  if links:
    raise ValueError(f"{step_dir} holds a symbolic link ({links[0]}); a step holds files")
  files = {rel: {"bytes": os.path.getsize(os.path.join(step_dir, rel)),
                 "sha256": file_digest(os.path.join(step_dir, rel))}
           for rel in found}
  body = _files.stamp({"step": int(step), "files": files, "arrays": arrays},
                      MANIFEST_FORMAT)
  write_json(os.path.join(step_dir, MANIFEST), {**body, "sha256": _files.json_digest(body)})


def check_key(key: Any) -> bytes | None:
  """The HMAC key as bytes (a str is UTF-8 encoded); None stays None.

  Raises:
    ValueError for anything else, or a key shorter than 16 bytes.
  """
  if key is None:
    return None
  if isinstance(key, str):
    key = key.encode()
  if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
    raise ValueError(f"key of type {type(key).__name__}"
                     + (f" and {len(key)} bytes" if isinstance(key, (bytes, bytearray)) else "")
                     + "; accepted: None, or bytes / str of at least 16 bytes (a secret)")
  return bytes(key)


def _key_id(key: bytes) -> str:
  """A public name of the key (not the key): the first 16 hex digits of its SHA-256."""
  return hashlib.sha256(b"precision.checkpoint key id:" + key).hexdigest()[:16]


def sign(step_dir: str, key: bytes) -> None:
  """Writes SIGNATURE: the HMAC-SHA256 with `key` of the manifest's exact bytes."""
  mac = hmac.new(key, _files.read_bytes(os.path.join(step_dir, MANIFEST)), hashlib.sha256)
  write_json(os.path.join(step_dir, SIGNATURE), _files.stamp(
      {"alg": "HMAC-SHA256", "key_id": _key_id(key), "hmac": mac.hexdigest()},
      SIGNATURE_FORMAT))


def check_signature(step_dir: str, key: bytes, what: str) -> None:
  """Checks that the step's manifest was signed with `key` (and not changed since).

  Raises:
    CheckpointAuthenticityError when the step is unsigned, signed with another key, or its
    manifest differs from what was signed.
  """
  path = os.path.join(step_dir, SIGNATURE)
  if not os.path.lexists(path):
    raise CheckpointAuthenticityError(
        f"{what} is not signed (no {SIGNATURE}): it was saved without a key, and a restore "
        "with key= accepts signed steps only")
  try:
    sig = _files.read_json(path)
    if not isinstance(sig, dict):
      raise ValueError("it is not a JSON object")
    _files.check_format(sig, SIGNATURE_FORMAT, f"{what}: its {SIGNATURE}")
    manifest = _files.read_bytes(os.path.join(step_dir, MANIFEST))
  except (OSError, ValueError) as e:
    raise CheckpointAuthenticityError(f"{what}: its {SIGNATURE} or {MANIFEST} cannot be "
                                      f"read ({e})") from None
  if sig.get("key_id") != _key_id(key):
    raise CheckpointAuthenticityError(
        f"{what} was signed with another key (key id {sig.get('key_id')!r}; the key given "
        f"has id {_key_id(key)!r})")
  good = hmac.new(key, manifest, hashlib.sha256).hexdigest()
  if not isinstance(sig.get("hmac"), str) or not hmac.compare_digest(sig["hmac"], good):
    raise CheckpointAuthenticityError(
        f"{what} fails its HMAC: its {MANIFEST} was changed by someone without the key")


def has_manifest(step_dir: str) -> bool:
  """Whether the step folder has a manifest (a link named so counts: it is refused as
  damage when read, rather than making the step look like an unverified one)."""
  path = os.path.join(step_dir, MANIFEST)
  return os.path.isfile(path) or os.path.islink(path)


def _entry_ok(entry: Any) -> bool:
  return (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
          and isinstance(entry.get("bytes"), int) and not isinstance(entry["bytes"], bool))


def read_manifest(step_dir: str, what: str) -> dict:
  """The manifest of a step, checked against its own digest. `what` names the step in errors.

  Raises:
    CheckpointFormatError for a manifest of a newer format; CheckpointDamagedError for
    one that cannot be read, does not match its digest, or names a file outside the step.
  """
  path = os.path.join(step_dir, MANIFEST)
  try:
    if os.path.islink(step_dir):
      raise ValueError("the step folder is a symbolic link")
    manifest, body, ok = _files.read_self_digested(path, MANIFEST_FORMAT,
                                                   f"{what}: its {MANIFEST}")
    ok = ok and isinstance(body.get("files"), dict) and isinstance(body.get("arrays", {}),
                                                                  dict)
    if ok:
      _files.check_format(manifest, MANIFEST_FORMAT, f"{what}: its {MANIFEST}")
  except (OSError, ValueError, AttributeError) as e:
    raise CheckpointDamagedError(f"{what} is damaged: its {MANIFEST} cannot be read ({e})") from e
  if not ok:
    raise CheckpointDamagedError(f"{what} is damaged: its {MANIFEST} does not match its own "
                                 "checksum")
  for rel, entry in manifest["files"].items():
    try:
      _files.confined(step_dir, rel)
    except _files.UnsafeName as e:
      raise CheckpointDamagedError(f"{what} is damaged: its {MANIFEST} lists a file "
                                   f"outside the step ({e}); nothing of it was read") from None
    if not _entry_ok(entry):
      raise CheckpointDamagedError(f"{what} is damaged: its {MANIFEST} entry for {rel} is "
                                   f"{entry!r}, not {{'bytes': int, 'sha256': str}}")
  return manifest


def verify_files(step_dir: str, what: str, only: tuple[str, ...] | None = None) -> dict:
  """Checks every file listed in the manifest (or only those in `only`); returns it.

  Raises:
    CheckpointDamagedError naming the first missing, resized or changed file, a symbolic
    link anywhere in the step, or (checking every file) a file the manifest does not list.
  """
  manifest = read_manifest(step_dir, what)
  found, links = _walk(step_dir)
  if links:
    raise CheckpointDamagedError(f"{what} is damaged: {links[0]} is a symbolic link (a "
                                 "step holds files only; links are never followed)")
  if only is None:
    unlisted = sorted(set(found) - set(manifest["files"]))
    if unlisted:
      raise CheckpointDamagedError(f"{what} is damaged: file {unlisted[0]} is not in its "
                                   f"{MANIFEST} (added after the save)")
  for rel, expect in sorted(manifest["files"].items()):
    if only is not None and rel not in only:
      continue
    path = _files.confined(step_dir, rel)
    if not os.path.isfile(path):
      raise CheckpointDamagedError(f"{what} is damaged: file {rel} is missing")
    size = os.path.getsize(path)
    if size != expect["bytes"]:
      raise CheckpointDamagedError(
          f"{what} is damaged: file {rel} has {size} bytes, {expect['bytes']} were written")
    try:
      digest = file_digest(path)
    except OSError as e:
      raise CheckpointDamagedError(f"{what}: file {rel} cannot be read ({e})") from None
    if digest != expect["sha256"]:
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
