"""The digest a study records of its task: seed 0's initial params and first batch.

A changed task (other initial weights, another data stream) is another study: the digest
goes into the study's identity (study.json), and `bisect` of a cell refuses a checkpoint
whose study recorded another task's digest. One function computes it for both.
"""

from __future__ import annotations

import hashlib
from typing import Any

from flax import nnx

from precision.study import _cells
from precision.study import _models


def digest_of(model: Any, batch: Any) -> str:
  """SHA-256 over the trainable params of `model` (an NNX module's nnx.Param state, a
  Linen pair's params, or a params pytree) and then `batch` (each array with its path,
  dtype and shape)."""
  kind = _models.model_kind(model)
  h = hashlib.sha256()
  if kind == "nnx":
    _cells.update_digest(h, nnx.state(model, nnx.Param))
  elif kind == "linen":
    _cells.update_digest(h, model[1])
  else:
    _cells.update_digest(h, model)
  _cells.update_digest(h, batch)
  return h.hexdigest()


def task_digest(task) -> str:
  """The digest of `task` (a precision.study.Task): `digest_of` its seed-0 model and the
  first batch of its seed-0 stream."""
  return digest_of(task.init(0), next(iter(task.batches(0))))
