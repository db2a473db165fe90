"""A precision.study cell adapted for `precision.numerics.bisect`: the step, loss, batches
and original losses of a Task under a recipe, from one of the cell's checkpoints.

The study sits above numerics: `bisect` takes a step function, and a Task given to it is
asked for its replay through `Task.bisect_replay`, which builds it here from the study's
own programs (the same step as the cell's), so numerics imports nothing from the study.

A study cell's folder holds ``ckpt/`` (precision.checkpoint steps, saved with the recipe
and the seed), ``steps.jsonl`` (the loss of every step) and sits in a study folder whose
``study.json`` records a digest of the task (seed 0's initial params and first batch).
The checkpoint is refused when its recipe or seed differ from the ones asked for, or when
that digest is not this task's. The study's own overrides (study.json) stay in every
replay, the promoted scopes' rules added to them. The batches are the task's stream for
the seed advanced to the checkpoint's step, as a resumed cell reads them.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from flax import nnx

from precision import checkpoint as ckpt_lib
from precision._recipe import Recipe
from precision.study import _cells
from precision.study import _digest
from precision.study import _models
from precision.study._task import batch_stream


class Prepared(NamedTuple):
  """What `bisect` replays for a Task."""
  make_step: Callable
  state: Any
  batches: Any
  loss: Callable
  start: int
  original_losses: tuple | None


def _study_overrides(task, directory: str) -> dict:
  """The overrides the study trained every cell with ({} outside a study folder); a
  checkpoint inside a study folder (<out>/cells/<cell>/ckpt) must be of this task."""
  out = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(directory))))
  path = os.path.join(out, "study.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    identity = json.load(f).get("identity", {})
  recorded = identity.get("task_digest")
  if recorded is not None and recorded != _digest.task_digest(task):
    raise ValueError(f"checkpoint={directory!r} is from another run: the study in {out} "
                     f"trained another task (its task digest {recorded[:12]}... differs "
                     "from this task's initial params and first batch); accepted: a "
                     "checkpoint of this task")
  return {str(k): str(v) for k, v in identity.get("overrides", ())}


def _recorded_losses(directory: str, start: int, steps: int) -> tuple | None:
  path = os.path.join(os.path.dirname(os.path.abspath(directory)), "steps.jsonl")
  losses = {r["step"]: r["loss"] for r in _cells.read_jsonl(path) if "loss" in r}
  want = range(start + 1, start + steps + 1)
  if not all(s in losses for s in want):
    return None
  return tuple(float(losses[s]) for s in want)


def _loss_of(task, prog, seed: int, start: int, state) -> Callable:
  """``loss(params, batch)`` of the task's model under the restored state, for inspect."""
  if prog.kind == "nnx":
    rest = state.model_state
    return lambda params, batch: task.loss(nnx.merge(prog.graphdef, params, rest), batch)
  if prog.kind == "linen":
    module = task.init(seed)[0]
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), start)
    return lambda params, batch: task.loss(_models.LinenModel(
        module, params, state.model_state, rng, True, task.rng_streams), batch)
  return task.loss


def prepare(task, recipe: Recipe, directory: str, step: int | None, seed: int | None,
            steps: int, restore_checked: Callable) -> Prepared:
  """The replay of `task` under `recipe` from checkpoint `step` of `directory`."""
  if directory is None:
    raise ValueError("checkpoint=None with a Task; accepted: the cell's checkpoint "
                     "directory (<study out>/cells/<cell>/ckpt)")
  meta = ckpt_lib.Checkpointer(directory).metadata(step)
  saved_seed = meta.get("seed")
  if seed is None:
    if saved_seed is None:
      raise ValueError(f"checkpoint={directory!r} records no seed; accepted: seed=")
    seed = int(saved_seed)
  base = _study_overrides(task, directory)
  prog = _models.build(task, recipe, seed, (), base)
  restored = restore_checked(directory, prog.state, recipe, meta["step"], seed)
  start = restored.step

  def make_step(r: Recipe, overrides):
    # The study's own overrides stay; a promoted scope's rule is added (or replaces one
    # of the same pattern): the deepest matching scope decides.
    step_fn = _models.build(task, r, seed, (), _merged(base, overrides)).step
    t = [start]

    def step(state, batch):
      # The cell's step t gets the step number (its rng is fold_in(key(seed), t)).
      state, metrics = step_fn(state, batch, jnp.int32(t[0]))
      t[0] += 1
      return state, metrics["loss"]

    return step

  return Prepared(make_step, restored.state, batch_stream(task, seed, skip=start),
                  _loss_of(task, prog, seed, start, restored.state), start,
                  _recorded_losses(directory, start, steps))


def _merged(base: dict, overrides: dict | None) -> dict:
  """The study's overrides with bisect's promoted groups: a promoted scope's rule replaces
  the study's for the directions it names; a direction it leaves out keeps the study's
  policy for that scope (not the recipe's)."""
  out = dict(base)
  for key, value in (overrides or {}).items():
    if isinstance(value, dict) and isinstance(out.get(key), str):
      value = {d: value.get(d, out[key]) for d in ("fwd", "bwd")}
    out[key] = value
  return out
