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

class Own(optax.GradientTransformation):
  """A transformation built by this package: its code runs under strict promotion, so
  `compat` does not wrap it again. The capability is the object's type (optax's own
  `GradientTransformationExtraArgs` is one the same way), not an entry in a registry."""
  __slots__ = ()


class OwnExtraArgs(optax.GradientTransformationExtraArgs, Own):
  """An `Own` transformation whose update takes extra arguments (``value=``)."""
  __slots__ = ()


def own(tx: optax.GradientTransformation) -> Own:
  """`tx` as a transformation built by this package (its code runs under strict
  promotion): the same init and update, typed `Own` (`OwnExtraArgs` when `tx` takes extra
  arguments)."""
  if isinstance(tx, optax.GradientTransformationExtraArgs):
    return OwnExtraArgs(tx.init, tx.update)
  return Own(tx.init, tx.update)


def compat(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` with its init/update run under standard promotion, unless it is our own."""
  if isinstance(inner, Own):
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
