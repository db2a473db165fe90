"""One optimizer step whose donated buffers XLA updates in place: `update_and_apply`.

A state leaf stored narrower than the arithmetic that reads it (bf16 moments of
`moment_dtypes`, Kahan's bf16 compensation) is read twice in one step: by the fusion
that writes its new value into its own buffer, and by the fusion that computes the new
params from its OLD value (Adam's step reads the f32 moment, not the rounded one). Nothing
in the program orders the two, so XLA's copy insertion keeps the old buffer alive by
copying it before the step (measured on XLA:CPU: pure_bf16 copies mu and nu, 4 bytes per
parameter of temporaries and 1.4x the step time of the same update without the copies).

`order_after(opt_state, params)` gives each such leaf a data dependency on the new params:
its stored bits are OR-ed with a zero computed from the new param's bits, which the
compiler cannot prove is zero (a population count compared with the bit width). The value
is the same bit for bit; the leaf's fusion now runs after the param's, which has read the
old value, so the buffer is overwritten in place and no copy is kept. `update_and_apply`
is ``tx.update``, `apply_updates` and `order_after`: the step every training loop of this
package takes (`precision.train_step`, `precision.parallel`, `precision.study`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision import _dtypes
from precision.optim import _apply
from precision.optim import _tree

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def opaque_zero(x: jax.Array, dtype: Any) -> jax.Array:
  """Zeros of `dtype` (an unsigned int) in the shape of `x`, computed from `x`'s bits.

  The population count of a w-bit word is at most w, so the comparison is always False;
  no HLO simplifier folds it (unlike ``x & 0``), so the result keeps `x` as an operand.
  """
  bits = jax.lax.bitcast_convert_type(x, _UINT[np.dtype(x.dtype).itemsize])
  width = 8 * np.dtype(x.dtype).itemsize
  return (jax.lax.population_count(bits) > width).astype(dtype)


def depend(x: jax.Array, on: jax.Array) -> jax.Array:
  """`x` bit for bit, computed after `on`: ``bits(x) | opaque_zero(on)``.

  Elementwise when the shapes agree (the dependency then stays inside one fusion, and
  shards alike), else through `on`'s first element.
  """
  ux = _UINT[np.dtype(x.dtype).itemsize]
  if np.shape(on) != np.shape(x):
    on = jnp.ravel(on)[0]
  bits = jax.lax.bitcast_convert_type(x, ux) | opaque_zero(on, ux)
  return jax.lax.bitcast_convert_type(bits, x.dtype)


def opaque(x: jax.Array) -> jax.Array:
  """`x` bit for bit, written so that no compiler pass can merge it with `x` (common
  subexpression elimination): a value a fusion recomputes on its own instead of reading
  a shared temporary."""
  return depend(x, x)


def _narrow(x: Any) -> bool:
  return _dtypes.is_float(x) and np.dtype(x.dtype).itemsize < 4 and np.size(x) > 0


def order_after(opt_state: Any, params: Any) -> Any:
  """`opt_state`, bit for bit, with each narrow state leaf written after its new param.

  Every subtree of `opt_state` with the tree structure of `params` (optax's moments,
  Kahan's compensation, a master copy) is matched leaf by leaf with `params`; its floating
  leaves narrower than f32 get a data dependency on the matching new param
  (`depend`), so the compiler overwrites their buffers in place (see the module
  docstring). Wider leaves, which the param update reads at their new value, are left
  as they are.

  Args:
    opt_state: the new optimizer state (``tx.update``'s).
    params: the new params (`apply_updates`'s), of the tree structure the state mirrors.

  Returns:
    The same state; only the order in which a compiled step writes it changes.
  """
  treedef = jax.tree.structure(params)
  if treedef.num_leaves == 0:
    return opt_state
  new = treedef.flatten_up_to(params)
  # jax.tree.structure of every node of opt_state would be quadratic: compare the node
  # type and leaf count first.
  node_type = type(params)

  def mirrors(node):
    if not isinstance(node, node_type) and treedef.num_leaves > 1:
      return False
    try:
      return jax.tree.structure(node) == treedef
    except (TypeError, ValueError):
      return False

  nodes, outer = jax.tree.flatten(opt_state, is_leaf=mirrors)
  out = []
  for node in nodes:
    if mirrors(node):
      leaves = treedef.flatten_up_to(node)
      node = treedef.unflatten([depend(s, p) if _narrow(s) and _dtypes.is_float(p) else s
                                for s, p in zip(leaves, new)])
    out.append(node)
  return outer.unflatten(out)


def update_and_apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any,
                     params: Any, **extra: Any) -> tuple[Any, Any]:
  """One optimizer step: ``(new_params, new_opt_state)``.

  ``updates, opt_state = tx.update(grads, opt_state, params, **extra)``, then
  ``params = apply_updates(params, updates)`` (exact rounding into 16-bit params), then
  `order_after` so that a jitted step with donated params and state updates every buffer
  in place (pure_bf16's bf16 moments and bf16_kahan's compensation included). The
  results are those two lines' bit for bit; this is the step `precision.train_step`,
  `precision.parallel` and `precision.study` take.

  Args:
    tx: any optax transformation (`precision.optim.build_optimizer`'s, or plain optax).
    grads, opt_state, params: ``tx.update``'s arguments.
    **extra: passed to ``tx.update`` (``value=loss`` for a spike-guarded optimizer).

  Examples:
    >>> params, opt_state = update_and_apply(tx, grads, opt_state, params)
  """
  updates, opt_state = tx.update(grads, opt_state, params, **extra)
  params = _apply.apply_updates(params, updates)
  return params, order_after(opt_state, params)
