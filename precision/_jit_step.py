"""`jit_train_step`: `precision.train_step` compiled once over the model's arrays.

``nnx.jit(precision.train_step, static_argnums=(1, 3))`` walks the model's object graph
in Python on every call (to split it into arrays going in and to write the arrays coming
out back), so its host time per step grows with the number of NNX Variables and, for a
small model on a fast accelerator, exceeds the step itself. The step built here walks
the graph once, when it is built: it keeps the graph definition (static) and the
model's Variable objects, and each call only reads one array out of each Variable,
runs one `jax.jit` program over plain arrays (params, other model state, optimizer
state, batch), and writes the new arrays back into the same Variables. The program is
`precision.train_step` itself on the model rebuilt from those arrays, so the results are
those of the ``nnx.jit`` step bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from precision import _keypath
from precision import _train


def _holds_one_array(value: Any) -> bool:
  """True for the values the fast step moves: one array (or scalar), not a container."""
  return isinstance(value, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _unaliased(leaves: list[Any]) -> list[Any]:
  """`leaves` with every jax.Array that appears a second time copied.

  A donated program must get each buffer once: optimizer inits often give several
  leaves one zeros array, an f32 master copy of f32 params is the params' own array
  (``astype`` to the same dtype returns it), and fp8 scaling state may start as one
  shared constant. Only `jax.Array`s are donated; numpy and Python values are copied to
  the device by the call anyway.
  """
  ids = [id(x) for x in leaves]
  if len(set(ids)) == len(ids):
    return leaves
  seen: set[int] = set()
  out = []
  for x, i in zip(leaves, ids):
    if i in seen and isinstance(x, jax.Array):
      x = jnp.copy(x)
    seen.add(i)
    out.append(x)
  return out


class _JitTrainStep:
  """The step `jit_train_step` returns: ``step(opt_state, *args, **kwargs)``."""

  def __init__(self, model: nnx.Module, tx: optax.GradientTransformation,
               loss_fn: Callable[..., Any], donate: bool, telemetry: bool):
    graphdef, state = nnx.split(model)
    # nnx.split hands back the model's own Variable objects (not copies): reading and
    # writing their arrays is reading and writing the model.
    found = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    variables = [variable for _, variable in found]
    for path, variable in found:
      value = variable.get_raw_value()
      if not _holds_one_array(value):
        where = _keypath.path_str(path)
        raise ValueError(
            f"jit_train_step: the model's {type(variable).__name__} at {where!r} holds a "
            f"{type(value).__name__}; accepted: Variables holding one array each (for "
            "others jit precision.train_step with nnx.jit(precision.train_step, "
            "static_argnums=(1, 3)))")
    values, state_def = jax.tree.flatten(state)
    if len(values) != len(variables):  # every Variable holds one leaf (checked above)
      raise AssertionError(f"{len(values)} arrays for {len(variables)} Variables")
    self._model = model
    self._variables = variables
    self._donate = donate

    def step(values, opt_leaves, opt_def, args, kwargs):
      model = nnx.merge(graphdef, jax.tree.unflatten(state_def, values))
      opt_state = jax.tree.unflatten(opt_def, opt_leaves)
      out = _train.train_step(model, tx, opt_state, loss_fn, *args, telemetry=telemetry,
                              **kwargs)
      new_graphdef, new_state = nnx.split(model)
      new_values, new_def = jax.tree.flatten(new_state)
      # Checked once, while tracing: the arrays go back into the Variables they came from.
      if new_graphdef != graphdef or new_def != state_def:
        raise ValueError(
            "jit_train_step: loss_fn changed the model's structure (added, removed or "
            "replaced a submodule, Variable or static attribute); accepted: a loss_fn that "
            "only computes with the model and updates its Variables' values")
      return new_values, out

    # The optimizer state goes in as its leaves and its tree structure (static): flattened
    # once per call here, where the leaves are needed anyway to find shared buffers.
    self._jitted = jax.jit(step, static_argnums=(2,),
                           donate_argnums=(0, 1) if donate else ())

  def __call__(self, opt_state: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    if isinstance(opt_state, nnx.Module):
      raise ValueError(
          "jit_train_step: the step was called with a model as its first argument; "
          "accepted: step(opt_state, *batch): the step is bound to the model it was built "
          "from (precision.jit_train_step(model, tx, loss_fn))")
    # The model's current arrays, read at every call: an eager call of the model, an
    # nnx.update or a restore into it between steps is what this step starts from.
    values = [v.get_raw_value() for v in self._variables]
    opt_leaves, opt_def = jax.tree.flatten(opt_state)
    if self._donate:
      both = _unaliased(values + opt_leaves)
      values, opt_leaves = both[:len(values)], both[len(values):]
    new_values, out = self._jitted(values, opt_leaves, opt_def, args, kwargs)
    # Written back at once: the donated arrays the model held are deleted by the call.
    for variable, value in zip(self._variables, new_values):
      variable.set_raw_value(value)
    return out

  def __repr__(self) -> str:
    return (f"jit_train_step({type(self._model).__name__}, {len(self._variables)} "
            f"Variables, donate={self._donate})")


def jit_train_step(model: nnx.Module, tx: optax.GradientTransformation,
                   loss_fn: Callable[..., Any], *, donate: bool = True,
                   telemetry: bool = False) -> Callable[..., tuple[Any, ...]]:
  """`precision.train_step` for `model`, jitted once, with the host cost of plain jax.jit.

  The returned ``step(opt_state, *args, **kwargs)`` runs ``precision.train_step(model,
  tx, opt_state, loss_fn, *args, **kwargs)`` (loss scaled by the optimizer's loss scale,
  skipped steps, fp8 scaling state carried and rolled back with a skipped step, the loss
  as ``value=`` to a spike guard, BatchNorm statistics and RNG counters updated) as one
  `jax.jit` program over the model's arrays, and gives the same results as
  ``nnx.jit(precision.train_step, static_argnums=(1, 3))`` bit for bit. The model is
  split once, here; each call reads the array of each of its Variables, runs the
  program, and writes the new arrays back into the same Variables, so `model` is the
  trained model after every call (evaluate it, audit it, checkpoint
  ``nnx.state(model, ...)``) and whatever changed its values in place between two calls
  (an eager forward pass, ``nnx.update(model, restored)``) is what the next step starts
  from.

  Like ``nnx.cached_partial``, the step keeps the model's structure as it was when
  built: a submodule or Variable object replaced afterwards, or static attributes
  toggled afterwards (``model.eval()`` / ``model.train()`` set ``deterministic`` and
  ``use_running_average``), are not seen by the step, which trains the Variables and
  the mode it was built with. Build a new step after such a change (it compiles again).

  Args:
    model: the NNX model, e.g. after `precision.flax.apply_recipe(model, recipe)`; each
      of its Variables holds one array.
    tx: the optimizer, e.g. ``plan.optimizer(optax.adamw(...))``, initialised on
      ``nnx.state(model, nnx.Param)``.
    loss_fn: ``loss_fn(model, *args, **kwargs) -> scalar loss`` (floating; the mean over
      the batch).
    donate: the model's arrays and `opt_state`'s are donated to the program, which
      updates them in place instead of holding two copies. The model is given the new
      arrays at once; an `opt_state` passed in is used up (keep the one returned), as is
      any array taken out of the model before the call and kept (``jnp.copy`` what you
      keep, or pass False).
    telemetry: each call also returns the step's `precision.numerics.TelemetryRecord`
      (see `precision.train_step`); build a second step with it and call that one every
      N steps.

  Returns:
    ``step(opt_state, *args, **kwargs) -> (loss, opt_state)`` (``(loss, opt_state,
    record)`` with `telemetry`): `args` and `kwargs` are `loss_fn`'s (the batch), traced
    like jax.jit's arguments; `loss` is the f32 unscaled loss before the update.

  Examples:
    >>> model = precision.flax.apply_recipe(MLP(rngs=nnx.Rngs(0)), "f16_mixed")
    >>> tx = precision.optim.build_optimizer("f16_mixed", optax.sgd(0.1))
    >>> opt_state = tx.init(nnx.state(model, nnx.Param))
    >>> step = precision.jit_train_step(model, tx, loss_fn)
    >>> for x, y in batches:
    ...   loss, opt_state = step(opt_state, x, y)
    >>> probe = precision.jit_train_step(model, tx, loss_fn, telemetry=True)
    >>> loss, opt_state, record = probe(opt_state, x, y)   # every 100 steps, instead
  """
  if not isinstance(model, nnx.Module):
    raise ValueError(
        f"jit_train_step: model is a {type(model).__name__}; accepted: an nnx.Module (for "
        "a pytree of params use precision.value_and_grad, tx.update and "
        "precision.optim.apply_updates under jax.jit)")
  if not isinstance(tx, optax.GradientTransformation):
    raise ValueError(f"jit_train_step: tx={tx!r}; accepted: an optax.GradientTransformation "
                     "(plan.optimizer's or precision.optim.build_optimizer's)")
  if not callable(loss_fn) or isinstance(loss_fn, nnx.Module):
    raise ValueError(f"jit_train_step: loss_fn={loss_fn!r}; accepted: a function "
                     "loss_fn(model, *batch) -> scalar loss")
  for name, value in (("donate", donate), ("telemetry", telemetry)):
    if not isinstance(value, bool):
      raise ValueError(f"jit_train_step: {name}={value!r}; accepted: True or False")
  return _JitTrainStep(model, tx, loss_fn, donate, telemetry)


__all__ = ["jit_train_step"]
