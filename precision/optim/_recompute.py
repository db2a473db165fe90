"""An optimizer's updates computed a second time from its NEW state, for a second consumer.

Kahan's compensated update has two outputs, the new params and the new compensation, and
each needs the inner optimizer's update ``u`` (Adam's ``m / (sqrt(v) + eps)``, ...). XLA
does not duplicate an expensive elementwise computation (a divide, a sqrt) into two
consumers, so it keeps ``u`` as an f32 temporary of 4 bytes per parameter between them.

`update_twice` evaluates the inner update once as usual, then evaluates the equations
that lead to its updates a second time, with every new state leaf read back through
`precision.optim._inplace.opaque` (its own bits, in a form no compiler pass merges with
the first evaluation). Each consumer then recomputes ``u`` inside its own fusion from the
moments already written in place: the same operations on the same values, so the same
bits. Equations upstream of the new state are not repeated (they read the old state, which
the in-place update overwrites); where the updates read an old state leaf directly, the
second evaluation reads it too (correct, only without the saving).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.extend import core as jex_core

from precision import _dtypes
from precision.optim import _inplace
from precision.optim import _select
from precision.optim import _tree


def update_twice(update: Callable[..., tuple[Any, Any]], grads: Any, state: Any,
                 params: Any) -> tuple[Any, Any, Any]:
  """``(updates, new_state, updates_again)`` of ``update(grads, state, params)``.

  `updates_again` holds the same values as `updates`, bit for bit, computed from the new
  state (see the module docstring). Called eagerly (no tracer among the arguments), the
  update runs once and both are the same arrays: nothing is fused there.
  """
  if not any(isinstance(x, jax.core.Tracer)
             for x in jax.tree_util.tree_leaves((grads, state, params))):
    updates, new_state = update(grads, state, params)
    return updates, new_state, updates

  traced = _select.trace_update(update, grads, state, params)
  jaxpr, n_updates = traced.closed.jaxpr, traced.n_updates
  outs = jex_core.jaxpr_as_fun(traced.closed)(*traced.flat)
  updates, new_state = traced.trees(outs)

  # The second evaluation: each new state leaf defined by an equation is read back opaque.
  outer = set(jaxpr.invars) | set(jaxpr.constvars)
  again: dict = {}
  for v, x in zip(jaxpr.outvars[n_updates:], outs[n_updates:]):
    if not isinstance(v, jex_core.Literal) and v not in outer:
      again[v] = _inplace.opaque(x) if _dtypes.is_float(x) and x.size else x
  vals, read = traced.environment()
  vals.update(again)
  needed = _needed(jaxpr, jaxpr.outvars[:n_updates], stop=set(again))
  for eqn in jaxpr.eqns:
    if not any(v in needed and v not in again for v in eqn.outvars):
      continue
    for v, x in zip(eqn.outvars, _select.rebind(eqn, [read(v) for v in eqn.invars])):
      vals[v] = again.get(v, x)
  updates_again, _ = traced.trees([read(v) for v in jaxpr.outvars])
  return updates, new_state, updates_again


def _needed(jaxpr, targets, stop: set) -> set:
  """The variables the `targets` are computed from, not looking past the `stop` ones
  (their values are given)."""
  producer = {}
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      producer[v] = eqn
  needed, todo = set(), [v for v in targets if not isinstance(v, jex_core.Literal)]
  while todo:
    v = todo.pop()
    if v in needed:
      continue
    needed.add(v)
    if v in stop or v not in producer:
      continue
    for w in producer[v].invars:
      if not isinstance(w, jex_core.Literal):
        todo.append(w)
  return needed
