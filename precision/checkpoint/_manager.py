"""Save and restore the whole training state of a precision recipe with Orbax.

One checkpoint (an Orbax `CheckpointManager` step directory) holds two items:
  * ``state``: the `TrainState` arrays: params, the whole optimizer state (master copy,
    moments, loss-scale state, skip counters, rounding counters), the model's non-param
    variables (fp8 scaling state) and the RNG key data;
  * ``meta`` (JSON): step, ``recipe.to_dict()``, the model config, the data sampler's
    position and any extra JSON the caller adds.
Orbax writes a step into a temporary directory and renames it when complete, so a process
killed in the middle of a save leaves the previous steps intact; the manager ignores the
unfinished directory. Saves are synchronous: `save` returns when the step is on disk.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from precision._recipe import Recipe
from precision.checkpoint import _convert
from precision.checkpoint import _tree

FORMAT_VERSION = 1


class TrainState(NamedTuple):
  """Everything of a training run that lives in arrays.

  params: the trainable params (e.g. ``nnx.state(model, nnx.Param)``), in the recipe's
    param dtype. opt_state: the optimizer state of `precision.optim.build_optimizer`.
    model_state: the model's other variables (fp8 scaling state), any pytree ({} if none).
    rng: uint32 PRNG key data (``jax.random.key_data(key)``), not a typed key.
  """

  params: Any
  opt_state: Any
  model_state: Any
  rng: Any


class Restored(NamedTuple):
  """What `restore` returns.

  state: the TrainState. step: the checkpoint's step. recipe: the recipe `state` is in.
  saved_recipe: the recipe it was saved under. model_config / data / extra: the JSON saved
  with it (data: the sampler position as a dict). converted: human-readable notes of
  what a cross-recipe restore changed (empty when nothing was converted).
  """

  state: TrainState
  step: int
  recipe: Recipe
  saved_recipe: Recipe
  model_config: dict | None
  data: dict | None
  extra: dict | None
  converted: tuple[str, ...]


def _json_data(data: Any) -> dict | None:
  if data is None:
    return None
  d = data._asdict() if hasattr(data, "_asdict") else dict(data)
  return {k: int(v) for k, v in d.items()}


class Checkpointer:
  """Saves TrainStates under `directory/<step>`, keeping the last `keep` steps.

  Examples:
    >>> ckpt = Checkpointer("/tmp/run1", keep=3)
    >>> ckpt.save(100, TrainState(params, opt_state, {}, key_data), recipe=recipe,
    ...           model_config=cfg.to_dict(), data=sampler_state)
    >>> r = ckpt.restore(TrainState(params, opt_state, {}, key_data))
    >>> r.step, r.state.params
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3):
    if keep < 1:
      raise ValueError(f"keep={keep!r}; must be >= 1 (number of checkpoints kept)")
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    # Handlers named up front, so a fresh manager (a new process) can read item metadata.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=handlers)

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, ascending."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: TrainState, *, recipe: Recipe,
           model_config: dict | None = None, data: Any = None,
           extra: dict | None = None) -> None:
    """Writes `state` and its metadata as checkpoint `step` (blocks until on disk)."""
    if not isinstance(state, TrainState):
      raise ValueError(f"state must be a precision.checkpoint.TrainState, got {type(state)}")
    meta = {"format": FORMAT_VERSION, "step": int(step), "recipe": recipe.to_dict(),
            "model_config": model_config, "data": _json_data(data), "extra": extra}
    self._manager.save(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def _step(self, step: int | None) -> int:
    steps = self.steps()
    if not steps:
      raise FileNotFoundError(f"No complete checkpoint in {self.directory}")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise ValueError(f"step={step!r} has no checkpoint in {self.directory}; saved: {steps}")
    return step

  def metadata(self, step: int | None = None) -> dict:
    """The JSON saved with checkpoint `step` (latest when None)."""
    step = self._step(step)
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def _saved_shapes(self, step: int) -> dict:
    tree = self._manager.item_metadata(step)["state"]
    tree = getattr(tree, "tree", tree)
    return _tree.shapes_by_path(tree)

  def restore(self, target: TrainState, *, step: int | None = None,
              recipe: Recipe | None = None, model_config: dict | None = None,
              optimizer_for: Callable[[Recipe], Any] | None = None,
              mesh: jax.sharding.Mesh | None = None) -> Restored:
    """Restores checkpoint `step` (latest when None) into the structure of `target`.

    Args:
      target: a TrainState (arrays or ShapeDtypeStructs, possibly sharded) built for
        `recipe`, or for the saved recipe when `recipe` is None.
      recipe: restore into this recipe. When it differs from the saved one the state is
        converted (see `_convert`), which needs `optimizer_for`.
      model_config: if given, compared with the saved model config.
      optimizer_for: recipe -> the optax transformation built for it (same inner
        optimizer as the run used); needed for a cross-recipe restore.
      mesh: leaves of `target` without a sharding are restored replicated on `mesh`.

    Raises:
      CheckpointMismatchError (a ValueError) naming the first differing leaf (and model
      config field) when the target does not fit the checkpoint.
    """
    step = self._step(step)
    meta = self.metadata(step)
    saved_recipe = Recipe.from_dict(meta["recipe"])
    recipe = saved_recipe if recipe is None else recipe
    abstract = _tree.to_abstract(target)
    if mesh is not None:
      replicated = NamedSharding(mesh, PartitionSpec())
      abstract = jax.tree.map(
          lambda x: x if getattr(x, "sharding", None) is not None else
          jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), abstract)
    saved = self._saved_shapes(step)
    config_diff = _tree.config_difference(meta.get("model_config"), model_config)
    converting = recipe.to_dict() != saved_recipe.to_dict()

    def mismatch(diff: str) -> _tree.CheckpointMismatchError:
      head = f"Checkpoint {self.directory} step {step} does not fit the restore target: "
      tail = f"; {config_diff}" if config_diff else ""
      return _tree.CheckpointMismatchError(head + diff + tail)

    if not converting:
      diff = _tree.first_difference(saved, _tree.shapes_by_path(abstract))
      if diff is not None or config_diff is not None:
        raise mismatch(diff or "arrays match")
      state = self._restore_state(step, abstract)
      return Restored(state, step, recipe, saved_recipe, meta.get("model_config"),
                      meta.get("data"), meta.get("extra"), ())

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
    saved_model = abstract.model_state if model_fits else _raw_subtree(
        self._manager.item_metadata(step)["state"], "model_state")
    saved_abstract = TrainState(saved_params, saved_opt, saved_model, abstract.rng)
    diff = _tree.first_difference(saved, _tree.shapes_by_path(saved_abstract))
    if diff is not None:
      raise mismatch(f"{diff} (the state saved under {saved_recipe.name} is rebuilt with "
                     "optimizer_for; was the run's inner optimizer the same?)")
    got = self._restore_state(step, saved_abstract)
    params, opt, notes = _convert.convert(got.params, got.opt_state, saved_recipe,
                                          abstract.params, abstract.opt_state, recipe,
                                          optimizer_for(recipe))
    if model_fits:
      model_state = got.model_state
    else:
      model_state = target.model_state
      notes.append("model state (fp8 scaling) of the target kept: the checkpoint's does not fit")
    state = TrainState(params, opt, model_state, got.rng)
    return Restored(state, step, recipe, saved_recipe, meta.get("model_config"),
                    meta.get("data"), meta.get("extra"), tuple(notes))

  def _restore_state(self, step: int, abstract: TrainState) -> TrainState:
    got = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))
    return got.state

  def close(self) -> None:
    self._manager.close()


def _raw_subtree(metadata: Any, key: str) -> Any:
  tree = getattr(metadata, "tree", metadata)
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree[key],
                      is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def save(directory: str | os.PathLike, step: int, state: TrainState, *, recipe: Recipe,
         model_config: dict | None = None, data: Any = None, extra: dict | None = None,
         keep: int = 3) -> None:
  """One-shot `Checkpointer(directory, keep=keep).save(...)`."""
  ckpt = Checkpointer(directory, keep=keep)
  try:
    ckpt.save(step, state, recipe=recipe, model_config=model_config, data=data, extra=extra)
  finally:
    ckpt.close()


def restore(directory: str | os.PathLike, target: TrainState, *, step: int | None = None,
            recipe: Recipe | None = None, model_config: dict | None = None,
            optimizer_for: Callable[[Recipe], Any] | None = None,
            mesh: jax.sharding.Mesh | None = None) -> Restored:
  """One-shot `Checkpointer(directory).restore(...)`; see `Checkpointer.restore`."""
  ckpt = Checkpointer(directory)
  try:
    return ckpt.restore(target, step=step, recipe=recipe, model_config=model_config,
                        optimizer_for=optimizer_for, mesh=mesh)
  finally:
    ckpt.close()
