"""Running third-party optax transformations under strict dtype promotion.

optax's own code mixes Python floats with int32 counts (e.g. ``b1 ** count`` in Adam's bias
correction), which `jax_numpy_dtype_promotion="strict"` rejects. Every transformation of
this package therefore calls a user-supplied `inner` through `compat(inner)`, which scopes
"standard" promotion around that call only; this package's own code stays strict.
Transformations built here are marked with `own` and are not wrapped again.
"""

from __future__ import annotations

import jax
import optax

_OWN: set = set()


def own(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """Marks `tx` as built by this package (its code runs under strict promotion)."""
  _OWN.add(tx.update)
  return tx


def compat(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` with its init/update run under standard promotion, unless it is our own."""
  if inner.update in _OWN:
    return inner

  def init_fn(params):
    # optax code mixes Python scalars with int32/bf16 arrays: needs standard promotion.
    with jax.numpy_dtype_promotion("standard"):
      return inner.init(params)

  def update_fn(updates, state, params=None, **extra):
    # optax code mixes Python scalars with int32/bf16 arrays: needs standard promotion.
    with jax.numpy_dtype_promotion("standard"):
      return inner.update(updates, state, params, **extra)

  return optax.GradientTransformation(init_fn, update_fn)
