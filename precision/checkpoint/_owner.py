"""Which run a checkpoint directory belongs to: ``<dir>/precision_run.json``.

The record names the run (a random run id) and what makes its checkpoints its own: the
recipe, the model config and the seed. The first writer creates it; a later writer whose
recipe, model config or seed differ is refused (`CheckpointOwnershipError` naming the
field), so two runs cannot take turns deleting each other's steps. A run that continues
another one's state under a new recipe or seed says so explicitly
(`Checkpointer.adopt`), which rewrites the record and keeps the previous owners in its
history.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from typing import Any, NamedTuple

from precision._recipe import Recipe
from precision.checkpoint import _files
from precision.checkpoint import _integrity
from precision.checkpoint import _tree
from precision.checkpoint._errors import CheckpointDamagedError

RECORD_FILE = "precision_run.json"
RECORD_FORMAT = 1


class RunRecord(NamedTuple):
  """The run a checkpoint directory belongs to.

  run_id: random hex id given when the directory was first written. recipe: the Recipe.
  model_config: JSON dict (or None). seed: int (or None when not given). created: ISO
  UTC time. history: earlier owners, as dicts, oldest first (explicit adoptions).
  """

  run_id: str
  recipe: Recipe
  model_config: dict | None
  seed: int | None
  created: str
  history: tuple[dict, ...] = ()

  def difference(self, recipe: Recipe, model_config: dict | None = None,
                 seed: int | None = None) -> str | None:
    """How a run with this recipe / model config / seed differs from the owner (the first
    differing field, e.g. "seed: the directory's run uses 0, this one 1"), or None."""
    return difference(self, recipe, model_config, seed)


def new_run_id() -> str:
  return uuid.uuid4().hex[:16]


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _body(r: RunRecord) -> dict[str, Any]:
  return _files.stamp({"run_id": r.run_id, "recipe": r.recipe.to_dict(),
                      "model_config": r.model_config, "seed": r.seed, "created": r.created,
                      "history": list(r.history)}, RECORD_FORMAT)


def read(directory: str) -> RunRecord | None:
  """The directory's record, None when it has none.

  Raises:
    CheckpointDamagedError when the file exists but cannot be read, is a symbolic link
    (never followed) or fails its checksum; CheckpointFormatError when a newer version
    of precision wrote it.
  """
  path = os.path.join(directory, RECORD_FILE)
  if not os.path.lexists(path):
    return None
  try:
    d, _, ok = _files.read_self_digested(path, RECORD_FORMAT, f"The run record {path}")
    if not ok:
      raise ValueError("it does not match its own checksum")
    return RunRecord(run_id=str(d["run_id"]), recipe=Recipe.from_dict(d["recipe"]),
                     model_config=d["model_config"], seed=d["seed"], created=d["created"],
                     history=tuple(d["history"]))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointDamagedError(
        f"The run record {path} is damaged ({e}); it says which run owns the directory. "
        "Restore it from a backup, or delete it if you know the directory's run") from e


def write(directory: str, record: RunRecord) -> None:
  body = _body(record)
  _integrity.write_json(os.path.join(directory, RECORD_FILE), {**body, "sha256": _files.json_digest(body)})


def create(recipe: Recipe, model_config: dict | None, seed: int | None,
           run_id: str | None = None) -> RunRecord:
  return RunRecord(run_id or new_run_id(), recipe, model_config, seed, _now(), ())


def adopted(old: RunRecord, recipe: Recipe, model_config: dict | None, seed: int | None,
            reason: str) -> RunRecord:
  """`old` rewritten for a new owner identity, the old identity kept in the history."""
  entry = {"run_id": old.run_id, "recipe": old.recipe.to_dict(),
           "model_config": old.model_config, "seed": old.seed, "created": old.created,
           "until": _now(), "host": socket.gethostname(), "reason": reason}
  return RunRecord(old.run_id, recipe, model_config, seed, old.created,
                   old.history + (entry,))


def recipe_difference(saved: Recipe, mine: Recipe) -> str | None:
  """The first differing field of two recipes ('recipe: ...'), or None when equal."""
  if saved == mine:
    return None
  a, b = saved.to_dict(), mine.to_dict()
  if a["name"] != b["name"]:
    return f"recipe: the directory's run uses {a['name']!r}, this one {b['name']!r}"
  for key in a:
    if a[key] != b.get(key):
      return (f"recipe {a['name']!r} field {key}: the directory's run has {a[key]!r}, "
              f"this one {b.get(key)!r}")
  return f"recipe: {a['name']!r} differs"


def difference(record: RunRecord, recipe: Recipe, model_config: dict | None,
               seed: int | None) -> str | None:
  """How this run's identity differs from the record's (first field), or None."""
  diff = recipe_difference(record.recipe, recipe)
  if diff:
    return diff
  diff = _tree.config_difference(record.model_config, model_config)
  if diff:
    return diff.replace("checkpoint", "the directory's run", 1).replace("target", "this one", 1)
  if record.seed is not None and seed is not None and int(record.seed) != int(seed):
    return f"seed: the directory's run uses {record.seed}, this one {seed}"
  return None
