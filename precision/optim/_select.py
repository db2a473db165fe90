"""A skipped step's select placed where each state leaf is computed, so donated state
updates in place.

The guard keeps a skipped step bit-identical by selecting, leaf by leaf, the old state
when the step is not finite. Written as ``select(ok, inner.update(...).state, old)``,
the selects sit after the whole inner update, and every value the update computes from
a new state leaf (Adam's update from the new moments, the rounded params from the new
master) is computed from the UNSELECTED new leaf. XLA then fuses that leaf's arithmetic
twice, once into the select that writes the donated buffer and once into the update that
reads it, so the old value must stay alive after the buffer is overwritten: it copies
each state buffer before the step (measured: 8 bytes per parameter of transient memory
and 4-5x the step time of the unguarded update on 10M parameters on a CPU).

`skip_unless(ok, update, grads, state, params)` traces ``update`` to a jaxpr and
evaluates it again with the select applied right where each new state leaf is defined,
so every later use reads the selected value. This changes no result: when ``ok`` the
selected leaf IS the new leaf, bit for bit; when not, every output is discarded anyway
(the state outputs are the old leaves, the updates -0.0). The program then has the shape
of the unguarded update: each state buffer is read by the fusion that writes its new
value and by nothing that runs later, so XLA updates it in place with no copy.

It applies to any optax transformation whose state has the same tree structure, shapes
and dtypes before and after `update` (all of optax's and this package's do). Where that
does not hold, or the traced update has side effects, it falls back to selecting after
the update (the same results, with the copies); so does an eager call (no tracer among
the arguments), where nothing is donated.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from precision import _compat
from precision.optim import _tree


def skip_unless(ok: jax.Array, update: Callable[..., tuple[Any, Any]], grads: Any,
                state: Any, params: Any) -> tuple[Any, Any]:
  """``update(grads, state, params)`` when `ok`, else (-0.0 updates, `state`), computed
  so that each state leaf is selected where it is defined (see the module docstring).

  Args:
    ok: bool scalar: apply the step.
    update: ``(grads, state, params) -> (updates, new_state)``, e.g. an optax update.
    grads, state, params: its arguments.

  Returns:
    ``(updates, new_state)``: `update`'s outputs bit for bit when `ok`; otherwise updates
    of -0.0 for floating leaves (``x + -0.0 == x`` for every x; other leaves as computed)
    and `state` bit for bit.
  """
  flat = jax.tree_util.tree_leaves((grads, state, params))
  n_grads = len(jax.tree_util.tree_leaves(grads))
  old = flat[n_grads:n_grads + len(jax.tree_util.tree_leaves(state))]

  if not any(isinstance(x, jax.core.Tracer) for x in (ok, *flat)):
    # Eager: nothing is donated or fused, and replaying the jaxpr op by op would run
    # optax's jitted helpers unjitted (XLA:CPU can then move an element by an ulp).
    updates, new_state = update(grads, state, params)
    return _tree.skip_updates(ok, updates), _tree.select(ok, new_state, state)

  traced = trace_update(update, grads, state, params)
  closed, n_updates = traced.closed, traced.n_updates
  if not _same_layout(state, traced.state_shape) or closed.jaxpr.effects:
    updates, new_state = traced.trees(jex_core.jaxpr_as_fun(closed)(*flat))
    return _tree.skip_updates(ok, updates), _tree.select(ok, new_state, state)
  jaxpr = closed.jaxpr
  state_out = jaxpr.outvars[n_updates:]
  at_definition = _selectable(jaxpr, state_out, old)
  vals, read = traced.environment()
  for eqn in jaxpr.eqns:
    for v, x in zip(eqn.outvars, rebind(eqn, [read(v) for v in eqn.invars])):
      vals[v] = jnp.where(ok, x, at_definition[v]) if v in at_definition else x
  updates, new_state = traced.trees(
      [read(v) for v in jaxpr.outvars[:n_updates]]
      + [read(v) if v in at_definition else jnp.where(ok, read(v), o)
         for v, o in zip(state_out, old)])
  return _tree.skip_updates(ok, updates), new_state


class TracedUpdate(NamedTuple):
  """``update(grads, state, params)`` traced to one jaxpr over the flat leaves of its
  arguments (`trace_update`), for the evaluators that replay it equation by equation."""

  flat: list  # the leaves of (grads, state, params), the jaxpr's inputs
  closed: Any  # the ClosedJaxpr; outputs: the updates' leaves, then the new state's
  updates_shape: Any  # ShapeDtypeStruct trees of the outputs
  state_shape: Any

  @property
  def n_updates(self) -> int:
    return len(jax.tree_util.tree_leaves(self.updates_shape))

  def trees(self, outs: list) -> tuple[Any, Any]:
    """(updates, new_state) from values of the jaxpr's outputs, in order."""
    n = self.n_updates
    return (jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.updates_shape),
                                         outs[:n]),
            jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.state_shape),
                                         outs[n:]))

  def environment(self) -> tuple[dict, Callable[[Any], Any]]:
    """(vals, read): the jaxpr's constants and inputs by variable, and a reader of a
    variable's value (from `vals`, which the replay extends) or of a literal."""
    jaxpr = self.closed.jaxpr
    vals: dict = dict(zip(jaxpr.constvars, self.closed.consts))
    vals.update(zip(jaxpr.invars, self.flat))
    return vals, lambda v: literal(v) if isinstance(v, jex_core.Literal) else vals[v]


def trace_update(update: Callable[..., tuple[Any, Any]], grads: Any, state: Any,
                 params: Any) -> TracedUpdate:
  """`update` traced on the flat leaves of (grads, state, params); no tracer is needed
  among them (eager arguments trace too)."""
  flat, in_tree = jax.tree_util.tree_flatten((grads, state, params))

  def flat_update(*leaves):
    g, s, p = jax.tree_util.tree_unflatten(in_tree, leaves)
    return update(g, s, p)

  closed, (updates_shape, state_shape) = jax.make_jaxpr(flat_update, return_shape=True)(
      *flat)
  return TracedUpdate(flat, closed, updates_shape, state_shape)


def rebind(eqn, invals: list) -> list:
  """The outputs of jaxpr equation `eqn` bound again on `invals`, as a list, with the
  source information and context it was traced with (so the program reads as the
  user's code in profiles and cache-miss reports)."""
  name_stack = _compat.current_name_stack() + eqn.source_info.name_stack
  with _compat.user_context(eqn.source_info.traceback, name_stack), \
      _compat.eqn_context(eqn):
    outs = _compat.bind_eqn(eqn, invals)
  return outs if eqn.primitive.multiple_results else [outs]


def literal(v) -> Any:
  """A literal's value in its traced dtype (a bare Python float would be bound as f64
  where x64 is on, or weakly typed)."""
  dtype = getattr(v.aval, "dtype", None)
  return np.asarray(v.val, dtype) if dtype is not None else v.val


def _same_layout(state: Any, new_shape: Any) -> bool:
  """Whether the new state has the old one's tree structure, shapes and dtypes."""
  old_leaves, old_tree = jax.tree_util.tree_flatten(state)
  new_leaves, new_tree = jax.tree_util.tree_flatten(new_shape)
  if old_tree != new_tree:
    return False
  return all(jnp.shape(a) == tuple(b.shape) and jnp.result_type(a) == b.dtype
             for a, b in zip(old_leaves, new_leaves))


def _selectable(jaxpr, state_out, old) -> dict:
  """{variable: old value} for the state outputs selected where they are defined: each
  one an equation's result that is no other state output. An output that is an input or
  a constant, or that appears twice, is selected at the output instead."""
  counts: dict = {}
  for v in state_out:
    if not isinstance(v, jex_core.Literal):
      counts[v] = counts.get(v, 0) + 1
  outer = set(jaxpr.invars) | set(jaxpr.constvars)
  return {v: o for v, o in zip(state_out, old)
          if not isinstance(v, jex_core.Literal) and counts[v] == 1 and v not in outer}

