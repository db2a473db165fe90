"""The embedded corpus: the running interpreter's standard-library Python sources, as bytes.

Every machine that runs this code has a Python standard library, so the corpus needs no
download and no cache. What is read:

  * root: ``sysconfig.get_paths()["stdlib"]`` of the running interpreter;
  * files: every ``*.py`` file below it, in sorted order of their POSIX relative paths;
    directories named ``site-packages``, ``dist-packages`` (third-party code, differs per
    machine), ``test``, ``tests`` and ``idle_test`` (the stdlib test suites: ~150 MB of
    repetitive fixtures) are skipped;
  * cap: whole files are taken in that order while the total stays within ``max_bytes``
    (default 4 MiB), which keeps loading well under a second;
  * split by file: a file goes to validation when ``crc32(relative path) % 10 == 0``
    (about 10% of files), else to training. The split depends only on the path, so it is
    the same on every machine with the same Python version;
  * each split is its files' bytes concatenated, as uint8.

On CPython 3.11.7 (this project's machine) the uncapped selection is 734 files, 12.1 MB;
the default 4 MiB cap keeps the first 266 files in sorted order (``__future__.py`` up to
``encodings/iso8859_3.py``): 236 training files, 3.80 MB, and 30 validation files, 0.40 MB,
loaded in about 0.1 s. `Corpus.describe()` gives the exact counts and a SHA-256 of the
bytes, which the training summary records.

Batches: `sample_batch` draws B windows of T+1 bytes at uniform random offsets of the
training split; the randomness is a pure function of (seed, step), so the sampler's whole
state is `SamplerState(seed, step)`: two ints, saved in every checkpoint. Validation uses
fixed windows spread evenly over the validation split (`validation_batches`), and the
metric is bits per byte: mean cross entropy in nats / ln 2 (one token is one byte).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import sysconfig
import zlib
from typing import NamedTuple

import numpy as np

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                          "__pycache__"})
VALIDATION_MODULUS = 10  # crc32(path) % 10 == 0 -> validation


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
  """Train and validation bytes of the embedded corpus.

  Attributes:
    train, validation: uint8 arrays (the concatenated bytes of each split's files).
    train_files, validation_files: relative paths of the files in each split, in order.
    root: the stdlib directory read.
    sha256: hex digest of train bytes followed by validation bytes.
  """

  train: np.ndarray
  validation: np.ndarray
  train_files: tuple[str, ...]
  validation_files: tuple[str, ...]
  root: str
  sha256: str

  def describe(self) -> dict:
    """JSON-safe facts about the corpus (sizes in bytes, file counts, digest)."""
    return {"root": self.root, "train_bytes": int(self.train.size),
            "validation_bytes": int(self.validation.size),
            "train_files": len(self.train_files),
            "validation_files": len(self.validation_files), "sha256": self.sha256}


def stdlib_files(root: str | None = None) -> list[str]:
  """Relative POSIX paths of the corpus' candidate files, sorted (before the byte cap)."""
  root = root or sysconfig.get_paths()["stdlib"]
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
    rel_dir = os.path.relpath(dirpath, root)
    for name in filenames:
      if name.endswith(".py"):
        rel = name if rel_dir == "." else os.path.join(rel_dir, name)
        found.append(rel.replace(os.sep, "/"))
  return sorted(found)


def is_validation_file(rel_path: str) -> bool:
  """Whether a file (relative POSIX path) belongs to the validation split."""
  return zlib.crc32(rel_path.encode("utf-8")) % VALIDATION_MODULUS == 0


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> Corpus:
  """Reads the embedded corpus (cached in memory per (max_bytes, root); nothing on disk).

  Raises ValueError if max_bytes is not positive or the cap leaves a split empty.
  """
  if max_bytes <= 0:
    raise ValueError(f"max_bytes={max_bytes!r}; must be a positive number of bytes")
  root = root or sysconfig.get_paths()["stdlib"]
  train, val, train_files, val_files = [], [], [], []
  total = 0
  for rel in stdlib_files(root):
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read()
    if total + len(data) > max_bytes:
      break
    total += len(data)
    if is_validation_file(rel):
      val.append(data)
      val_files.append(rel)
    else:
      train.append(data)
      train_files.append(rel)
  if not train or not val:
    raise ValueError(f"max_bytes={max_bytes} leaves {len(train_files)} training and "
                     f"{len(val_files)} validation files under {root}; raise max_bytes")
  train_b, val_b = b"".join(train), b"".join(val)
  digest = hashlib.sha256(train_b + val_b).hexdigest()
  return Corpus(train=np.frombuffer(train_b, np.uint8), validation=np.frombuffer(val_b, np.uint8),
                train_files=tuple(train_files), validation_files=tuple(val_files),
                root=root, sha256=digest)


class SamplerState(NamedTuple):
  """Where the batch sampler is: batch number `step` of the stream seeded by `seed`."""

  seed: int
  step: int


def init_sampler(seed: int) -> SamplerState:
  return SamplerState(seed=int(seed), step=0)


def _check_window(data: np.ndarray, seq: int, what: str) -> None:
  if seq < 1 or data.size < seq + 2:
    raise ValueError(f"seq={seq}: the {what} split has {data.size} bytes; need "
                     f"1 <= seq <= {data.size - 2}")


def sample_batch(data: np.ndarray, state: SamplerState, batch: int, seq: int
                 ) -> tuple[np.ndarray, SamplerState]:
  """B random windows of seq+1 bytes: ([batch, seq + 1] int32, next state).

  The offsets are drawn by numpy's default generator (PCG64) seeded with
  (seed, step), so batch k is the same whenever and wherever it is drawn.
  """
  _check_window(data, seq, "training")
  rng = np.random.default_rng([int(state.seed), int(state.step)])
  starts = rng.integers(0, data.size - seq - 1, size=batch, endpoint=True)
  tokens = data[starts[:, None] + np.arange(seq + 1)[None, :]].astype(np.int32)
  return tokens, SamplerState(seed=state.seed, step=state.step + 1)


def validation_batches(data: np.ndarray, n_batches: int, batch: int, seq: int) -> np.ndarray:
  """Fixed windows spread evenly over the validation split: [n_batches, batch, seq+1] int32."""
  _check_window(data, seq, "validation")
  n = n_batches * batch
  starts = np.linspace(0, data.size - seq - 1, num=n).astype(np.int64)
  tokens = data[starts[:, None] + np.arange(seq + 1)[None, :]].astype(np.int32)
  return tokens.reshape(n_batches, batch, seq + 1)


def bits_per_byte(loss_nats: float) -> float:
  """Mean cross entropy per byte in nats -> bits per byte (a uniform byte model is 8.0)."""
  return float(loss_nats) / math.log(2.0)
