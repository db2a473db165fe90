"""Save and restore the whole training state of a precision recipe with Orbax.

Layout of a checkpoint directory:

  <dir>/precision_run.json   the run it belongs to (run id, recipe, model config, seed)
  <dir>/precision.lock       the writer lock (flock; pid/host/run of the holder)
  <dir>/<step>/state/        Orbax item (StandardCheckpointHandler): the TrainState arrays
  <dir>/<step>/meta/metadata JSON: step, recipe.to_dict(), model config, seed, run id, the
                             data sampler's position and any extra JSON the caller adds
  <dir>/<step>/integrity.json  SHA-256 of every file and every array of the step
  <dir>/.tmp-<step>-<id>/    a save in progress (never read; removed by the next writer)

A step is written into ``.tmp-<step>-<id>`` (arrays, metadata, then the checksums) and
renamed to ``<step>`` only when complete, so a process killed in the middle of a save
leaves the previous steps intact and no half-written ``<step>`` behind. Before the rename
every file of the step is fsynced and the step is read back (manifest, metadata, Orbax's
array metadata): a save that could not be restored fails at once, and older steps are
deleted (`keep`) only after the new one is durable. Only folders named by a step number
that hold ``integrity.json`` are checkpoints (plus the complete steps of format 1, written
by earlier versions through an Orbax CheckpointManager, restored without checksums only
with ``allow_unverified=True``); an empty, partial, linked or stray numeric folder is
reported, never read. Saves are synchronous: `save` returns when the step is on disk; a
write that fails (disk full, read-only, no permission) is one `CheckpointWriteError`
naming the path and the errno.

`restore` verifies a step's files before Orbax reads them and its arrays after: a damaged
newest step is reported by name (a `CheckpointFallbackWarning`, and `Restored.skipped`)
and the newest intact older step is restored instead, or `CheckpointDamagedError` says
that none is intact. One process writes a directory at a time (`CheckpointLockedError`),
and only the run it belongs to (`CheckpointOwnershipError`). Local POSIX filesystems, one
process (all the devices of one host); a multi-process job is refused at `save`.

Size: save and restore are one protocol (temp folder, digests, read-back, rotation,
fallback, ownership); the pieces they share live in _files, _integrity, _owner and _lock.
"""

from __future__ import annotations

import errno
import json
import numbers
import os
import re
import shutil
import time
import uuid
import warnings
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from precision._plan import Plan, as_plan
from precision._recipe import Recipe
from precision._state import TrainState
from precision.checkpoint import _convert
from precision.checkpoint import _files
from precision.checkpoint import _integrity
from precision.checkpoint import _keys
from precision.checkpoint import _orbax
from precision.checkpoint import _owner
from precision.checkpoint import _tree
from precision.checkpoint._errors import CheckpointAuthenticityError
from precision.checkpoint._errors import CheckpointDamagedError
from precision.checkpoint._errors import CheckpointError
from precision.checkpoint._errors import CheckpointFallbackWarning
from precision.checkpoint._errors import CheckpointFormatError
from precision.checkpoint._errors import CheckpointOwnershipError
from precision.checkpoint._errors import CheckpointUnverifiedWarning
from precision.checkpoint._errors import CheckpointWarning
from precision.checkpoint._errors import CheckpointWriteError
from precision.checkpoint._errors import NoCheckpointError
from precision.checkpoint._lock import WriterLock

# Format of a step's meta JSON: 1 = Orbax CheckpointManager layout without checksums
# (earlier versions), 2 = this layout with integrity.json.
FORMAT_VERSION = 2
_LEGACY_FORMAT = 1
_STATE, _META = "state", os.path.join("meta", "metadata")
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")
# Rescans of a restore whose step a writer deleted (rotation) or replaced while it was read.
_RESCANS = 20
_PARTIAL = re.compile(r"\.(tmp|old|del)-([0-9]+)-[0-9a-f]+|([0-9]+)\.orbax-checkpoint-tmp.*")


class Restored(NamedTuple):
  """What `restore` returns.

  state: the TrainState. step: the checkpoint's step. recipe: the recipe `state` is in.
  saved_recipe: the recipe it was saved under. model_config / data / extra: the JSON saved
  with it (data: the sampler position as a dict). converted: human-readable notes of
  what a cross-recipe restore changed (empty when nothing was converted). seed / run_id:
  the seed and run id saved with the step (None when not recorded). skipped: one line per
  newer step passed over because it is damaged (empty when the newest step was
  restored). verified: whether the step carried checksums (False only for steps written
  by earlier versions without them). authenticated: whether its HMAC was checked against
  the key given to the restore (False without a key).
  """

  state: TrainState
  step: int
  recipe: Recipe
  saved_recipe: Recipe
  model_config: dict | None
  data: dict | None
  extra: dict | None
  converted: tuple[str, ...]
  seed: int | None = None
  run_id: str | None = None
  skipped: tuple[str, ...] = ()
  verified: bool = True
  authenticated: bool = False


def _json_data(data: Any) -> dict | None:
  """The data sampler's position as a JSON dict of integers.

  Every value must be an integer (Python, NumPy, or an integer scalar array): a float is
  refused, not truncated (a seed of 1.7 would come back as 1, another stream), and so is
  a bool (it would come back as 0 or 1).
  """
  if data is None:
    return None
  accepted = ("None, or a dict or NamedTuple of str -> integer (the data sampler's "
              "position, e.g. {'seed': 0, 'step': 12})")
  if hasattr(data, "_asdict"):
    d = data._asdict()
  elif isinstance(data, Mapping):
    d = dict(data)
  else:
    raise ValueError(f"data={data!r}; accepted: {accepted}")
  out = {}
  for k, v in d.items():
    if not isinstance(k, str):
      raise ValueError(f"data has the key {k!r} (a {type(k).__name__}); accepted: {accepted}")
    out[k] = _integer(f"data[{k!r}]", v)
  return out


def _integer(what: str, v: Any) -> int:
  if isinstance(v, (jax.Array, np.ndarray)) and v.shape == () and (
      np.issubdtype(v.dtype, np.integer)):
    return int(v)
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
    raise ValueError(f"{what}={v!r}; accepted: an integer (Python, NumPy or an integer "
                     "scalar array); floats and bools are refused, not converted")
  return int(v)


def check_directory(directory: Any, name: str = "directory") -> str:
  """The absolute path of a checkpoint directory argument (`name`), or ValueError."""
  accepted = "a non-empty path (str or os.PathLike of str) without NUL characters"
  if not isinstance(directory, (str, os.PathLike)):
    raise ValueError(f"{name}={directory!r} (a {type(directory).__name__}); "
                     f"accepted: {accepted}")
  path = os.fspath(directory)
  # "" would be the current directory (abspath("") == os.getcwd()): never what is meant.
  if not isinstance(path, str) or not path or "\0" in path:
    raise ValueError(f"{name}={directory!r}; accepted: {accepted}")
  return os.path.abspath(path)


def _check_json(what: str, value: Any) -> None:
  accepted = ("accepted: dicts (with str keys) and lists of str, finite numbers, bools and "
              "None")
  try:
    json.dumps(value, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what}={value!r} cannot be saved as strict JSON ({e}); "
                     f"{accepted}") from None
  # json.dumps writes the key 1 as "1": the dict read back would not be the one saved.
  stack = [value]
  while stack:
    v = stack.pop()
    if isinstance(v, dict):
      keys = [k for k in v if not isinstance(k, str)]
      if keys:
        raise ValueError(f"{what}={value!r} has the key {keys[0]!r} (a "
                         f"{type(keys[0]).__name__}), which JSON would read back as "
                         f"{json.dumps(str(keys[0]))}; {accepted}")
      stack.extend(v.values())
    elif isinstance(v, (list, tuple)):
      stack.extend(v)


def _check_state(what: str, state: Any) -> None:
  """A TrainState in full shapes whose leaves are arrays or ShapeDtypeStructs, or
  ValueError saying what to pass instead."""
  if not isinstance(state, TrainState):
    raise ValueError(f"{what} must be a precision.TrainState, got {type(state).__name__}")
  # What the checksums and Orbax handle: leaves with a shape and a dtype (arrays,
  # ShapeDtypeStructs); a str or a Python number in the tree would fail inside them.
  is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
  for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_array)[0]:
    if not is_array(leaf):
      raise ValueError(
          f"{what}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; accepted: a "
          "TrainState whose leaves are arrays (jax or numpy) or jax.ShapeDtypeStructs")
  if state.layout is not None:
    # A DataParallel state holds shards laid out for one device count; a checkpoint holds
    # full shapes, so that any device count (or one device) can resume from it.
    raise ValueError(
        f"{what} is a DataParallel state (params and optimizer state sharded over "
        f"{getattr(state.layout, 'devices', '?')} devices, layout set); accepted: a state in "
        "full shapes: pass dp.state_for_checkpoint(state), and hand a restored state back "
        "with dp.state_from_checkpoint(restored.state)")


def _check_step(step: Any) -> int:
  if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
    raise ValueError(f"step={step!r}; accepted: an integer >= 0")
  return int(step)


class _Scan(NamedTuple):
  steps: dict[int, bool]          # step -> carries checksums (False: format 1)
  not_checkpoints: list[tuple[str, str]]  # (name, why) of step-like non-checkpoints
  partial: list[str]              # unfinished saves and moved-aside steps (names)


def _read_meta(step_dir: str) -> dict:
  """The step's metadata JSON, read inside the step folder only (no link followed).

  Raises:
    CheckpointFormatError for metadata of a newer format; OSError / ValueError when it
    cannot be read.
  """
  meta = _files.read_json(_files.confined(step_dir, _META.replace(os.sep, "/")))
  if not isinstance(meta, dict):
    raise ValueError("the metadata is not a JSON object")
  _files.check_format(meta, FORMAT_VERSION, f"Checkpoint step folder {step_dir}: its metadata")
  return meta


def _plan_of(recipe: Any, what: str) -> Plan:
  """`recipe` (a Recipe, a preset name or a Plan) as a Plan, bound once; one line naming
  the value otherwise."""
  if not isinstance(recipe, (Plan, Recipe, str)):
    raise ValueError(f"{what}={recipe!r} (a {type(recipe).__name__}); accepted: a "
                     "precision.Recipe, a preset name or a Plan (precision.bind)")
  return as_plan(recipe)


def _bound_difference(saved: Any, plan: Plan | None) -> str | None:
  """The first difference between what `bind` added to the recipe of a step (its
  overrides and fp32 ops, `Plan.bound_dict`) and the Plan it is restored into, or None.
  Nothing is compared without a Plan, or with a step written before the record existed."""
  if plan is None or saved is None:
    return None
  given = plan.bound_dict()
  for field in ("overrides", "fp32_ops"):
    if not isinstance(saved, dict) or saved.get(field) != given[field]:
      was = saved.get(field) if isinstance(saved, dict) else saved
      return (f"plan {field}: checkpoint {was!r}, target {given[field]!r} (restore with "
              "the plan's recipe alone, plan.recipe, to take the state into other "
              "overrides)")
  return None


def _saved_recipe(d: Any, what: str) -> Recipe:
  """The Recipe of a saved recipe dict; one line naming the problem otherwise."""
  try:
    return Recipe.from_dict(d)
  except (ValueError, TypeError, KeyError, AttributeError) as e:
    raise CheckpointFormatError(
        f"{what}: the saved recipe is not one this version of precision ({_files.version()}) "
        f"reads ({type(e).__name__}: {' '.join(str(e).split())}); it was written by a "
        "newer version, or edited") from None


def _is_legacy(step_dir: str) -> bool:
  """A complete step of format 1 (Orbax CheckpointManager, no checksums)."""
  if not (os.path.isfile(os.path.join(step_dir, "_CHECKPOINT_METADATA"))
          and _orbax.is_item(os.path.join(step_dir, _STATE))):
    return False
  try:
    return _read_meta(step_dir).get("format") == _LEGACY_FORMAT
  except (OSError, ValueError, CheckpointFormatError):
    return False


class Checkpointer:
  """Saves TrainStates under `directory/<step>`, keeping the last `keep` steps.

  With a secret `key` (bytes or str, at least 16 bytes) every step saved is signed
  (HMAC-SHA256 of its manifest, in ``integrity.hmac``) and a restore accepts only steps
  signed with that key (`CheckpointAuthenticityError`, passed over like damage):
  authenticity, which the SHA-256 digests alone do not give.

  Creating a Checkpointer touches nothing on disk. The first `save` (or `acquire`)
  creates the directory, takes its writer lock (held until `close`) and records the run
  the directory belongs to. Use it as a context manager, or call `close`.

  Examples:
    >>> with Checkpointer("/tmp/run1", keep=3) as ckpt:
    ...   ckpt.save(100, TrainState(params, opt_state, {}, key_data), recipe=recipe,
    ...             model_config=cfg.to_dict(), seed=0, data=sampler_state)
    ...   r = ckpt.restore(TrainState(params, opt_state, {}, key_data))
    >>> r.step, r.skipped
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3,
               key: bytes | str | None = None):
    if isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or keep < 1:
      raise ValueError(f"keep={keep!r}; accepted: an integer >= 1 (number of checkpoints "
                       "kept)")
    self._key = _integrity.check_key(key)
    self.directory = check_directory(directory)
    self.keep = int(keep)
    self._lock: WriterLock | None = None
    self._record: _owner.RunRecord | None = None
    self._identity: tuple[int, int] | None = None
    self.cleaned: list[str] = []  # unfinished saves `acquire` removed

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------ reading

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _what(self, step: int) -> str:
    return f"Checkpoint {self.directory} step {step}"

  def _scan(self) -> _Scan:
    steps, bad, partial = {}, [], []
    try:
      names = sorted(os.listdir(self.directory))
    except FileNotFoundError:
      return _Scan({}, [], [])
    except NotADirectoryError:
      raise NoCheckpointError(f"No complete checkpoint in {self.directory}: it is a file, "
                              "not a directory") from None
    except OSError as e:
      raise CheckpointError(f"Checkpoint directory {self.directory} cannot be read: "
                            f"{_oserror(e)}") from None
    for name in names:
      try:
        self._scan_one(name, steps, bad, partial)
      except OSError as e:
        # An unreadable step folder (no permission, an I/O error) is damage: named,
        # passed over, and the newest readable step restored.
        bad.append((name, f"cannot be read: {_oserror(e)}"))
    return _Scan(steps, bad, partial)

  def _scan_one(self, name: str, steps: dict, bad: list, partial: list) -> None:
    """Sorts the directory entry `name` into `steps`, `bad` or `partial` (`_scan`)."""
    path = os.path.join(self.directory, name)
    if _PARTIAL.fullmatch(name):
      partial.append(name)
      return
    if not name.isascii() or not name.isdigit():
      return  # not step-like: the run record, the lock, the user's own files
    if not _STEP_NAME.fullmatch(name):
      bad.append((name, "not a step name precision writes"))
    elif os.path.islink(path):
      bad.append((name, "a symbolic link; step folders are never links, and never "
                        "followed"))
    elif not os.path.isdir(path):
      if os.path.lexists(path):  # else deleted by a writer's rotation since listdir
        bad.append((name, "a file, not a step folder"))
    elif _integrity.has_manifest(path):
      steps[int(name)] = True
    elif _is_legacy(path):
      steps[int(name)] = False
    else:
      try:
        entries = os.listdir(path)
      except FileNotFoundError:
        return  # deleted by a writer's rotation while this scan ran
      if _integrity.MANIFEST in entries:
        # Listed but not found: the folder may be listed, not entered (mode r--); the
        # stat's PermissionError says so (an unreadable step, passed over as damage).
        os.lstat(os.path.join(path, _integrity.MANIFEST))
      empty = not entries
      bad.append((name, "empty") if empty else
                 (name, f"no {_integrity.MANIFEST}: deleted, or not written by "
                        "precision.checkpoint"))

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, ascending (their data not yet verified:
    `verify` or `restore` does that)."""
    return sorted(self._scan().steps)

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def problems(self) -> list[str]:
    """Step-like folders that are not checkpoints, and why ("'7' (empty)")."""
    return [f"'{name}' ({why})" for name, why in self._scan().not_checkpoints]

  def run_record(self) -> _owner.RunRecord | None:
    """The run this directory belongs to (None before the first save)."""
    return _owner.read(self.directory)

  def verify(self, step: int | None = None) -> None:
    """Checks the files of checkpoint `step` (latest when None) against their checksums.

    Raises:
      CheckpointDamagedError naming the first damaged file; NoCheckpointError /
      ValueError when there is no such step.
    """
    step = self._resolve(step)[0]
    if self._scan().steps[step]:
      if self._key is not None:
        _integrity.check_signature(self._step_dir(step), self._key, self._what(step))
      _integrity.verify_files(self._step_dir(step), self._what(step))

  def _resolve(self, step: int | None) -> list[int]:
    """Candidate steps, newest first: [step] when given, else every complete step."""
    scan = self._scan()
    if step is not None:
      step = _check_step(step)
      if step not in scan.steps:
        why = [f"'{n}' ({w})" for n, w in scan.not_checkpoints if n == str(step)]
        raise ValueError(f"step={step!r} has no checkpoint in {self.directory}"
                         f"{': folder ' + why[0] if why else ''}; saved: {sorted(scan.steps)}")
      return [step]
    if not scan.steps:
      where = ("the directory does not exist" if not os.path.exists(self.directory) else
               "no step folder holds a complete save")
      found = ([f"'{n}' ({w})" for n, w in scan.not_checkpoints]
               + [f"'{p}' (an unfinished save)" for p in scan.partial])
      raise NoCheckpointError(f"No complete checkpoint in {self.directory}: {where}"
                              + (f"; found {', '.join(found)}" if found else ""))
    return sorted(scan.steps, reverse=True)

  def metadata(self, step: int | None = None) -> dict:
    """The JSON saved with checkpoint `step` (latest when None), checked against its
    checksum."""
    step = self._resolve(step)[0]
    step_dir = self._step_dir(step)
    if _integrity.has_manifest(step_dir):
      _integrity.verify_files(step_dir, self._what(step), only=(_META.replace(os.sep, "/"),))
    try:
      return _read_meta(step_dir)
    except (OSError, ValueError) as e:
      raise CheckpointDamagedError(f"{self._what(step)} is damaged: its metadata cannot be "
                                   f"read ({e})") from None

  def restore(self, target: TrainState, *, step: int | None = None,
              recipe: Recipe | str | Plan | None = None, model_config: dict | None = None,
              optimizer_for: Callable[[Recipe], Any] | None = None,
              mesh: jax.sharding.Mesh | None = None,
              allow_unverified: bool = False) -> Restored:
    """Restores checkpoint `step` (the newest intact one when None) into `target`.

    The step's files are checked against the checksums written with them before Orbax
    reads them, and the restored arrays after. When `step` is None and the newest step
    is damaged, it is reported (a `CheckpointFallbackWarning` per damaged step, and
    `Restored.skipped`) and the next older step is tried, down to the oldest. A step a
    writer deletes (its `keep` rotation) or replaces while it is being read is no damage:
    the directory is scanned again and the newest complete step read instead (a reader
    beside a trainer gets the newest complete step, or NoCheckpointError before the
    first save).

    Args:
      target: a TrainState (arrays or ShapeDtypeStructs, possibly sharded) built for
        `recipe`, or for the saved recipe when `recipe` is None.
      step: restore exactly this step (a damaged one raises instead of falling back).
      recipe: restore into this recipe (a Recipe, a preset name or a Plan). When it
        differs from the saved one the state is converted (see `_convert`), which needs
        `optimizer_for`. A Plan's overrides and fp32 ops are compared with those the step
        was saved with (`Plan.bound_dict`; steps written before they were recorded are
        not compared): a difference raises CheckpointMismatchError.
      model_config: if given, compared with the saved model config.
      optimizer_for: recipe -> the optax transformation built for it (same inner
        optimizer as the run used); needed for a cross-recipe restore.
      mesh: leaves of `target` without a sharding are restored replicated on `mesh`.
      allow_unverified: restore a step without checksums (format 1, written by earlier
        versions; or one whose integrity.json was deleted), with a
        `CheckpointUnverifiedWarning`. Without it such a step counts as damaged: passed
        over (fallback) or, when it is the only one or `step`, refused.

    Raises:
      NoCheckpointError (a FileNotFoundError) when the directory holds no complete step
      (it is not created); CheckpointDamagedError when no candidate step is intact;
      CheckpointMismatchError (a ValueError) naming the first differing leaf (and model
      config field) when the target does not fit the checkpoint; CheckpointFormatError
      for a step written by a newer version of precision; ValueError for an explicit
      `step` deleted or replaced while it was read; CheckpointError when a writer rotated
      each newest step away before it could be read, 20 times in a row.
    """
    _check_state("target", target)
    if recipe is not None and not isinstance(recipe, (Recipe, Plan, str)):
      raise ValueError(f"recipe={recipe!r}; accepted: None (the saved recipe), a "
                       "precision.Recipe, a preset name or a Plan (precision.bind)")
    # A Plan is compared with the overrides the step was saved with; a Recipe or a preset
    # name carries none, so only its recipe is compared.
    plan = None if recipe is None else _plan_of(recipe, "recipe")
    given_plan = recipe if isinstance(recipe, Plan) else None
    if optimizer_for is not None and not callable(optimizer_for):
      raise ValueError(f"optimizer_for={optimizer_for!r}; accepted: None or a callable "
                       "recipe -> optax transformation")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
      raise ValueError(f"mesh={mesh!r}; accepted: None or a jax.sharding.Mesh")
    if not isinstance(allow_unverified, bool):
      raise ValueError(f"allow_unverified={allow_unverified!r}; accepted: True or False")
    if model_config is not None:
      _check_json("model_config", model_config)
    for _ in range(_RESCANS):
      candidates = self._resolve_settled(step)
      skipped: list[str] = []
      for s in candidates:
        ident = _identity(self._step_dir(s))
        try:
          r = self._restore_step(s, target, plan, given_plan, model_config,
                                 optimizer_for, mesh, allow_unverified)
        except Exception as e:  # pylint: disable=broad-except  (re-raised unless vanished)
          if self._vanished(s, ident):
            break  # deleted or replaced by a writer while read: scan again
          if step is not None or not isinstance(e, CheckpointDamagedError):
            raise
          skipped.append(str(e))
          older = [c for c in candidates if c < s]
          warnings.warn(f"{e}; {'trying step ' + str(older[0]) if older else 'no older step'}",
                        CheckpointFallbackWarning, stacklevel=2)
          continue
        return self._reported(r, s, step, skipped)
      else:
        raise CheckpointDamagedError(
            f"No intact checkpoint in {self.directory}: " + " | ".join(skipped))
      if step is not None:
        raise ValueError(f"step={step!r} of {self.directory} was deleted or replaced while "
                         "it was being read (a writer's rotation: keep more steps, or "
                         "restore the newest one)")
    raise CheckpointError(
        f"Checkpoint {self.directory}: each step was deleted by a writer's rotation before "
        f"it could be read, {_RESCANS} times in a row; the writer saves faster than one "
        "restore reads (keep=1?): keep more steps (Checkpointer(keep=2)) or read less often")

  def _vanished(self, step: int, ident: tuple[int, int] | None) -> bool:
    """Whether step folder `step` is gone or is another folder than when its read began
    (`ident`): rotated away or replaced by a writer, which is no damage."""
    return ident is None or _identity(self._step_dir(step)) != ident

  def _resolve_settled(self, step: int | None) -> list[int]:
    """`_resolve`, waiting out a writer that is replacing the only step: between moving it
    aside (``.old-<step>-...``) and renaming its new version in, no step is complete."""
    for _ in range(_RESCANS):
      try:
        return self._resolve(step)
      except NoCheckpointError:
        if step is not None or not any(p.startswith(".old-") for p in self._scan().partial):
          raise
      time.sleep(0.01)
    return self._resolve(step)

  def _reported(self, r: Restored, s: int, step: int | None,
                skipped: list[str]) -> Restored:
    """`r` with `skipped`; when restoring the newest step, newer step-like folders that
    are no checkpoint (a deleted manifest, a stray folder) are reported too: the newest
    folder is not what was restored."""
    if step is None:
      for name, why in self._scan().not_checkpoints:
        if int(name) > s:
          note = f"Checkpoint {self.directory} folder '{name}' is not a checkpoint ({why})"
          skipped.append(note)
          warnings.warn(f"{note}; restored step {s}", CheckpointFallbackWarning,
                        stacklevel=3)
    return r._replace(skipped=tuple(skipped))

  def _restore_step(self, step, target, plan, given_plan, model_config, optimizer_for,
                    mesh, allow_unverified=False) -> Restored:
    what = self._what(step)
    step_dir = self._step_dir(step)
    verified = _integrity.has_manifest(step_dir)
    if self._key is not None:
      if not verified:
        raise CheckpointAuthenticityError(
            f"{what} carries no checksums, so no signature; a restore with key= accepts "
            "signed steps only")
      _integrity.check_signature(step_dir, self._key, what)
    if not verified and not allow_unverified:
      raise CheckpointDamagedError(
          f"{what} carries no checksums (no {_integrity.MANIFEST}: written by a precision "
          f"without them, format {_LEGACY_FORMAT}, or its {_integrity.MANIFEST} was "
          "deleted); pass allow_unverified=True to restore it unverified")
    manifest = _integrity.verify_files(step_dir, what) if verified else None
    try:
      meta = _read_meta(step_dir)
      saved_recipe_dict = meta["recipe"]
    except (OSError, ValueError, KeyError) as e:
      raise CheckpointDamagedError(f"{what} is damaged: its metadata cannot be read "
                                   f"({type(e).__name__}: {e})") from None
    try:
      saved_recipe = _saved_recipe(saved_recipe_dict, what)
    except CheckpointFormatError as e:
      if not verified:
        raise CheckpointDamagedError(f"{what} is damaged: its recipe is invalid ({e})") from None
      raise
    if not verified:
      warnings.warn(f"{what} carries no checksums: restored unverified "
                    "(allow_unverified=True)", CheckpointUnverifiedWarning, stacklevel=3)
    state_dir = os.path.join(step_dir, _STATE)

    def read(fn, *args):
      try:
        return fn(*args)
      except _orbax.OrbaxReadError as e:
        if verified:  # intact files Orbax cannot read: not damage, so no fallback
          raise CheckpointError(f"{e} although the files match their checksums") from None
        raise CheckpointDamagedError(f"{e}: damaged or unreadable") from None

    saved_tree = read(_orbax.item_tree, state_dir, what)
    # Typed PRNG keys are held as uint32 key data; compared as the keys they were saved as.
    saved = _keys.typed_shapes(_tree.shapes_by_path(saved_tree), manifest, what)
    recipe = saved_recipe if plan is None else plan.recipe
    abstract = _tree.to_abstract(target)
    if mesh is not None:
      replicated = NamedSharding(mesh, PartitionSpec())
      abstract = jax.tree.map(
          lambda x: x if getattr(x, "sharding", None) is not None else
          jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), abstract)
    config_diff = _tree.config_difference(meta.get("model_config"), model_config)
    bound_diff = _bound_difference(meta.get("plan"), given_plan)
    if bound_diff is not None:
      config_diff = bound_diff if config_diff is None else f"{config_diff}; {bound_diff}"
    converting = recipe != saved_recipe

    def mismatch(diff: str) -> _tree.CheckpointMismatchError:
      head = f"Checkpoint {self.directory} step {step} does not fit the restore target: "
      tail = f"; {config_diff}" if config_diff else ""
      return _tree.CheckpointMismatchError(head + diff + tail)

    def restore_arrays(abstract: TrainState) -> TrainState:
      # Key leaves read as their uint32 data, wrapped back into keys, then verified.
      data = read(_orbax.restore_item, state_dir, _keys.to_data(abstract), what)
      state = _keys.from_data(data, abstract)
      if manifest is not None:
        _integrity.verify_arrays(manifest, state, what)
      return state

    def finish(state: TrainState, notes: tuple[str, ...]) -> Restored:
      return Restored(state, step, recipe, saved_recipe, meta.get("model_config"),
                      meta.get("data"), meta.get("extra"), notes, meta.get("seed"),
                      meta.get("run_id"), (), verified, self._key is not None)

    if not converting:
      diff = _tree.first_difference(saved, _tree.shapes_by_path(abstract))
      if diff is not None or config_diff is not None:
        raise mismatch(diff or "arrays match")
      return finish(restore_arrays(abstract), ())

    if optimizer_for is None:
      raise ValueError(f"Restoring a {saved_recipe.name} checkpoint into recipe "
                       f"{recipe.name} converts the optimizer state; pass optimizer_for="
                       "(recipe -> optax transformation)")
    # Params as saved: the target's structure with the checkpoint's dtypes.
    target_param_shapes = _tree.shapes_by_path({"params": abstract.params})
    diff = _tree.first_difference(
        {k: v for k, v in saved.items() if k.startswith("params/")}, target_param_shapes,
        compare_dtype=False)
    if diff is not None or config_diff is not None:
      raise mismatch(diff or "arrays match")
    saved_params = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, saved["params/" + _tree.leaf_path(p)][1],
                                          sharding=getattr(x, "sharding", None)),
        abstract.params)
    saved_opt = jax.eval_shape(optimizer_for(saved_recipe).init, saved_params)
    model_fits = _tree.first_difference(
        {k: v for k, v in saved.items() if k.startswith("model_state/")},
        _tree.shapes_by_path({"model_state": abstract.model_state})) is None
    saved_model = abstract.model_state if model_fits else _raw_subtree(saved_tree, saved,
                                                                       "model_state")
    saved_abstract = TrainState(saved_params, saved_opt, saved_model, abstract.rng)
    diff = _tree.first_difference(saved, _tree.shapes_by_path(saved_abstract))
    if diff is not None:
      raise mismatch(f"{diff} (the state saved under {saved_recipe.name} is rebuilt with "
                     "optimizer_for; was the run's inner optimizer the same?)")
    got = restore_arrays(saved_abstract)
    params, opt, notes = _convert.convert(got.params, got.opt_state, as_plan(saved_recipe),
                                          abstract.params, abstract.opt_state, plan,
                                          optimizer_for(recipe))
    if model_fits:
      model_state = got.model_state
    else:
      model_state = target.model_state
      notes.append("model state (fp8 scaling) of the target kept: the checkpoint's does not fit")
    return finish(TrainState(params, opt, model_state, got.rng), tuple(notes))

  # ------------------------------------------------------------------ writing

  def acquire(self) -> None:
    """Creates the directory if needed and takes its writer lock (until `close`).

    Leftovers of saves that a killed process never finished are removed (they never
    were checkpoints); a step moved aside to be replaced is put back if its replacement
    never arrived.

    Raises:
      CheckpointLockedError naming the holder when another live process writes here;
      CheckpointWriteError (an OSError) naming the path and errno when the directory or
      its lock cannot be created or written; CheckpointError when the directory this
      writer locked has vanished since.
    """
    if self._lock is not None and self._lock.held:
      self._check_still_there()
      return
    try:
      os.makedirs(self.directory, exist_ok=True)
    except FileExistsError:
      raise NotADirectoryError(f"Checkpoint directory {self.directory} is a file") from None
    except OSError as e:
      raise CheckpointWriteError(f"Checkpoint directory {self.directory} cannot be created: "
                                 f"{_oserror(e)} at {e.filename or self.directory}", e,
                                 e.filename or self.directory) from None
    lock = WriterLock(self.directory)
    try:
      record = _owner.read(self.directory)
    except CheckpointDamagedError:
      record = None  # reported by claim, under the lock
    try:
      lock.acquire(record.run_id if record else None)
    except CheckpointError:
      raise
    except OSError as e:
      raise CheckpointWriteError(f"Checkpoint directory {self.directory}: the writer lock "
                                 f"cannot be written: {_oserror(e)} at {lock.path}", e,
                                 lock.path) from None
    self._lock = lock
    self._identity = _identity(self.directory)
    if lock.replaced:
      warnings.warn(f"Checkpoint directory {self.directory}: took over the writer lock of "
                    f"{lock.replaced}, which ended without releasing it",
                    CheckpointWarning, stacklevel=2)
    self._clean_partial()

  def _write_record(self, record: _owner.RunRecord) -> None:
    path = os.path.join(self.directory, _owner.RECORD_FILE)
    try:
      _owner.write(self.directory, record)
    except OSError as e:
      raise CheckpointWriteError(f"Checkpoint directory {self.directory}: the run record "
                                 f"cannot be written: {_oserror(e)} at {path}", e, path) from None

  def _check_still_there(self) -> None:
    """Raises CheckpointError when the directory this writer locked was deleted, moved
    or replaced since: the writer stops instead of recreating it (its steps are gone)."""
    now = _identity(self.directory)
    if now != self._identity or not self._lock.still_there():
      what = "vanished" if now is None else "was replaced by another folder"
      raise CheckpointError(
          f"Checkpoint directory {self.directory} {what} while this writer held its lock "
          "(deleted or moved by someone else); the writer stopped rather than recreate it "
          "and write steps without their predecessors. Restore the directory, or start "
          "the run again in a new one")

  def _clean_partial(self) -> None:
    names = os.listdir(self.directory)
    for name in sorted(names):
      if name.startswith(f".{_owner.RECORD_FILE}.tmp-"):
        # A run record a killed writer never renamed in (or a name planted to catch one):
        # removed, never opened (the name only, a link is not followed).
        try:
          os.unlink(os.path.join(self.directory, name))
        except OSError:
          pass  # a folder of that name is not ours to remove
        continue
      m = _PARTIAL.fullmatch(name)
      if not m:
        continue
      path = os.path.join(self.directory, name)
      if os.path.islink(path):
        os.unlink(path)  # never a save of ours; never followed into
        continue
      final = self._step_dir(int(m.group(2))) if m.group(1) == "old" else None
      if final is not None and not os.path.lexists(final):
        os.rename(path, final)  # the replacement never arrived: keep the step it replaced
      else:
        shutil.rmtree(path, ignore_errors=True)
        if m.group(1) != "del":
          self.cleaned.append(name)

  def claim(self, *, recipe: Recipe | str | Plan, model_config: dict | None = None,
            seed: int | None = None) -> _owner.RunRecord:
    """Takes the lock and checks that the directory belongs to this run (recipe, model
    config, seed), recording it when the directory has no owner yet.

    A directory without a record but with checkpoints (written by an earlier version) is
    claimed only when its newest step's recipe and model config are this run's.

    Raises:
      CheckpointOwnershipError naming the first differing field; CheckpointLockedError.
    """
    recipe = _plan_of(recipe, "recipe").recipe  # the run is owned by its recipe
    if seed is not None and (isinstance(seed, (bool, np.bool_))
                             or not isinstance(seed, numbers.Integral)):
      raise ValueError(f"seed={seed!r}; accepted: an integer or None")
    seed = None if seed is None else int(seed)  # a NumPy int is written as JSON too
    if model_config is not None and not isinstance(model_config, dict):
      raise ValueError(f"model_config={model_config!r} (a {type(model_config).__name__}); "
                       "accepted: None or a JSON dict")
    _check_json("model_config", model_config)
    self.acquire()
    record = self._record or _owner.read(self.directory)
    if record is None:
      record = self._record_from_steps(recipe, model_config, seed)
      self._write_record(record)
    diff = _owner.difference(record, recipe, model_config, seed)
    if diff is not None:
      raise CheckpointOwnershipError(
          f"Checkpoint directory {self.directory} belongs to run {record.run_id} "
          f"(recipe {record.recipe.name}, seed {record.seed}), not to this one: {diff}. "
          "Use another directory, or continue that run's state explicitly "
          "(Checkpointer.adopt after a converting restore).")
    self._record = record
    return record

  def _record_from_steps(self, recipe, model_config, seed) -> _owner.RunRecord:
    steps = self.steps()
    if steps:
      try:
        meta = _read_meta(self._step_dir(steps[-1]))
        saved = _saved_recipe(meta["recipe"], self._what(steps[-1]))
        legacy = _owner.create(saved, meta.get("model_config"), meta.get("seed"))
      except (OSError, ValueError, KeyError):
        legacy = None
      if legacy is not None:
        diff = _owner.difference(legacy, recipe, model_config, seed)
        if diff is not None:
          raise CheckpointOwnershipError(
              f"Checkpoint directory {self.directory} holds the checkpoints of another run "
              f"(newest: step {steps[-1]}): {diff}. Use another directory.")
    return _owner.create(recipe, model_config, seed)

  def adopt(self, *, recipe: Recipe | str | Plan, model_config: dict | None = None,
            seed: int | None = None, reason: str) -> _owner.RunRecord:
    """Makes this run the directory's owner, explicitly: after a restore that converted
    another run's state (other recipe or seed) on purpose. The previous owner is kept in
    the record's history with `reason`.
    """
    if not isinstance(reason, str) or not reason.strip():
      raise ValueError(f"reason={reason!r}; accepted: a non-empty string saying why")
    recipe = _plan_of(recipe, "recipe").recipe
    self.acquire()
    old = _owner.read(self.directory)
    record = (_owner.create(recipe, model_config, seed) if old is None else
              _owner.adopted(old, recipe, model_config, seed, reason))
    self._write_record(record)
    self._record = record
    return self.claim(recipe=recipe, model_config=model_config, seed=seed)

  def save(self, step: int, state: TrainState, *, recipe: Recipe | str | Plan,
           model_config: dict | None = None, seed: int | None = None, data: Any = None,
           extra: dict | None = None) -> None:
    """Writes `state` and its metadata as checkpoint `step` (blocks until on disk).

    `recipe` is a Recipe, a preset name or a Plan (`precision.bind`): the metadata holds
    the recipe's dict and what the plan adds to it (overrides, fp32 ops: a Recipe's plan
    has no overrides), which `restore` with a Plan compares.

    `data` (the data sampler's position) is None or a dict / NamedTuple of str ->
    integer: floats and bools are refused, not converted. `model_config` and `extra` are
    JSON dicts with str keys (a key 1 would read back as "1").

    The first save takes the writer lock and checks or records the directory's run
    (`claim`). The step is complete on disk, checksums included, before it replaces an
    existing folder of the same step; then the oldest steps beyond `keep`, and any step
    newer than `step` (the abandoned future of a run resumed from an older step), are
    deleted.
    """
    step = _check_step(step)
    _check_state("state", state)
    if jax.process_count() > 1:
      raise ValueError(
          f"precision.checkpoint writes from one process; this job has "
          f"{jax.process_count()} (checksums and the atomic rename need every array on "
          "this host); accepted: a single-process job")
    _check_json("extra", extra)
    data = _json_data(data)  # checked before claim writes anything
    plan = _plan_of(recipe, "recipe")
    record = self.claim(recipe=plan, model_config=model_config, seed=seed)
    # The recipe and what bind added to it (overrides, fp32 ops): restore compares them.
    meta = _files.stamp({"step": step, "recipe": plan.recipe.to_dict(),
                         "plan": plan.bound_dict(),
                         "model_config": model_config,
                         "seed": None if seed is None else int(seed),
                         "run_id": record.run_id, "data": data, "extra": extra},
                        FORMAT_VERSION)
    _check_json("meta", meta)
    tmp = os.path.join(self.directory, f".tmp-{step}-{uuid.uuid4().hex[:8]}")
    final = self._step_dir(step)
    try:
      os.mkdir(tmp)  # not makedirs: a vanished directory is never recreated here
    except OSError as e:
      raise self._disk_error(step, e, tmp) from None
    old = None
    try:
      arrays = _integrity.array_digests(state)
      _orbax.save_item(os.path.join(tmp, _STATE), _keys.to_data(state))  # keys as uint32 data
      os.mkdir(os.path.join(tmp, "meta"))
      _integrity.write_json(os.path.join(tmp, _META), meta)
      _integrity.write_manifest(tmp, step, arrays)
      if self._key is not None:
        _integrity.sign(tmp, self._key)
      # Durable before anything older is touched: every file and folder fsynced, then
      # the manifest and array metadata read back through Orbax as a restore would.
      _files.fsync_tree(tmp)
      self._read_back(tmp, step, arrays)
      if os.path.lexists(final):
        old = os.path.join(self.directory, f".old-{step}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
      os.rename(tmp, final)
      _integrity.fsync_dir(self.directory)
    except BaseException as e:
      shutil.rmtree(tmp, ignore_errors=True)
      if old is not None and not os.path.lexists(final):
        try:
          os.rename(old, final)  # the step it was to replace stays
        except OSError:
          pass  # put back by the next writer's acquire (it is named .old-<step>-...)
      if isinstance(e, OSError):
        raise self._disk_error(step, e, tmp) from None
      raise
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    self._retain(step)

  def _disk_error(self, step: int, e: OSError, where: str) -> CheckpointWriteError:
    """One line naming the path and the errno of a failed write; the last good step kept."""
    path = e.filename or where
    try:
      kept = [s for s in self.steps() if s != step]
    except CheckpointError:
      kept = []
    return CheckpointWriteError(
        f"{self._what(step)}: the save failed: {_oserror(e)} at {path}; "
        + (f"the last good step {kept[-1]} is intact" if kept else "no earlier step exists")
        + " and nothing was deleted", e, path)

  def _read_back(self, tmp: str, step: int, arrays: dict) -> None:
    """Reads a just-written step back (manifest, metadata, Orbax's array metadata) and
    checks it lists what was saved, or raises CheckpointError: a save that cannot be
    restored fails now, not at the restore."""
    what = f"{self._what(step)} (just written)"
    try:
      manifest = _integrity.read_manifest(tmp, what)
      _read_meta(tmp)
      tree = _orbax.item_tree(os.path.join(tmp, _STATE), what)
      got = _keys.typed_shapes(_tree.shapes_by_path(tree), manifest, what)
    except (CheckpointError, ValueError) as e:
      raise CheckpointError(f"{what}: the save cannot be read back ({e}); the earlier "
                            "steps are kept") from None
    name = lambda d: getattr(d, "name", str(d))
    got = {k: (list(shape), name(dtype)) for k, (shape, dtype) in got.items()}
    expect = {k: (list(e["shape"]), e["dtype"]) for k, e in manifest["arrays"].items()}
    if manifest["arrays"] != arrays:
      detail = "its manifest does not list the arrays saved"
    elif set(got) != set(expect):
      odd = sorted(set(got) ^ set(expect))[0]
      detail = f"array '{odd}' is not in both its manifest and its item"
    else:
      k = next((k for k in expect if got[k] != expect[k]), None)
      detail = None if k is None else f"array '{k}' reads back as {got[k]}, saved as {expect[k]}"
    if detail is not None:
      raise CheckpointError(f"{what}: the save cannot be read back ({detail}); the earlier "
                            "steps are kept")

  def _retain(self, step: int) -> None:
    steps = self.steps()
    kept = [s for s in steps if s <= step][-self.keep:]
    for s in steps:
      if s not in kept:
        doomed = os.path.join(self.directory, f".del-{s}-{uuid.uuid4().hex[:8]}")
        try:
          os.rename(self._step_dir(s), doomed)  # never a half-deleted step folder
        except OSError as e:
          path = self._step_dir(s)
          raise CheckpointWriteError(
              f"{self._what(step)} is saved, but removing old step {s} failed: "
              f"{_oserror(e)} at {path}", e, path) from None
        shutil.rmtree(doomed, ignore_errors=True)

  def close(self) -> None:
    """Releases the writer lock (if held). Reading needs no close."""
    if self._lock is not None:
      self._lock.release()
      self._lock = None
    self._record = None


def _oserror(e: OSError) -> str:
  """'No space left on device (ENOSPC)' for an OSError."""
  code = errno.errorcode.get(e.errno) if e.errno else None
  return f"{e.strerror or e} ({code or type(e).__name__})"


def _identity(path: str) -> tuple[int, int] | None:
  """(device, inode) of the folder at `path`, None when there is none."""
  try:
    st = os.stat(path)
  except OSError:
    return None
  return (st.st_dev, st.st_ino)


def _raw_subtree(tree: Any, saved: dict, key: str) -> Any:
  """ShapeDtypeStructs of the saved subtree `key`, with the shapes and dtypes of `saved`
  (`_keys.typed_shapes`: key data as the typed keys it was saved from)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, m: jax.ShapeDtypeStruct(*saved[f"{key}/{_tree.leaf_path(p)}"]), tree[key],
      is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def save(directory: str | os.PathLike, step: int, state: TrainState, *, recipe: Recipe | str | Plan,
         model_config: dict | None = None, seed: int | None = None, data: Any = None,
         extra: dict | None = None, keep: int = 3, key: bytes | str | None = None) -> None:
  """One-shot `Checkpointer(directory, keep=keep, key=key).save(...)` (lock released
  after)."""
  with Checkpointer(directory, keep=keep, key=key) as ckpt:
    ckpt.save(step, state, recipe=recipe, model_config=model_config, seed=seed, data=data,
              extra=extra)


def restore(directory: str | os.PathLike, target: TrainState, *, step: int | None = None,
            recipe: Recipe | str | Plan | None = None, model_config: dict | None = None,
            optimizer_for: Callable[[Recipe], Any] | None = None,
            mesh: jax.sharding.Mesh | None = None,
            allow_unverified: bool = False, key: bytes | str | None = None) -> Restored:
  """One-shot `Checkpointer(directory, key=key).restore(...)`; see `Checkpointer.restore`.
  Creates nothing: a missing directory raises NoCheckpointError."""
  return Checkpointer(directory, key=key).restore(target, step=step, recipe=recipe,
                                         model_config=model_config,
                                         optimizer_for=optimizer_for, mesh=mesh,
                                         allow_unverified=allow_unverified)
