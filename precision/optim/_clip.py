"""Global grad norm and global-norm clipping, computed in f32 whatever the grad dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from precision import _dtypes
from precision.optim import _compat
from precision.optim import _tree


def global_norm(tree: Any, axis_name: str | None = None) -> jax.Array:
  """f32 scalar: sqrt of the sum of squares of every floating element of `tree`.

  Squares and sums run in f32 (a bf16 sum of squares loses the small terms and an f16 one
  overflows past 65504). With `axis_name`, `tree` holds this rank's shards and the sum of
  squares is psum-ed over that axis, so every rank gets the norm of the whole tree.
  """
  return jnp.sqrt(_sum_of(jnp.square, tree, axis_name))


def _sum_of(square, tree: Any, axis_name: str | None) -> jax.Array:
  """f32 sum over every floating element of `tree` of ``square(f32 element)``: per leaf,
  then over the leaves, then psum-ed over `axis_name`."""
  sums = [jnp.sum(square(x.astype(jnp.float32)))
          for x in jax.tree.leaves(tree) if _dtypes.is_float(x)]
  total = jnp.sum(jnp.stack(sums)) if sums else jnp.zeros((), jnp.float32)
  if axis_name is not None:
    total = jax.lax.psum(total, axis_name)
  return total


def norm_and_finite(tree: Any, axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
  """``(norm, finite)`` from one pass over `tree`: the f32 global norm, and whether every
  floating element is finite.

  Each element x contributes ``(x + x * 0) * x`` in f32: ``x * x`` bit for bit when x is
  finite (``x * 0`` is a zero of x's sign and ``x + ±0 == x``), NaN when x is inf or NaN
  (``inf * 0`` is NaN). The sum of squares is then NaN exactly when some element is not
  finite: a sum of finite squares can overflow to +inf but never becomes NaN. So the norm
  is `global_norm`'s bit for bit on finite trees (NaN on the others, where `global_norm`
  gives inf for an inf without a NaN), and the all-finite check needs no second reduction
  of its own. With `axis_name` the sum is psum-ed first: NaN on one rank is NaN on all.
  """
  total = _sum_of(_square_or_nan, tree, axis_name)
  return jnp.sqrt(total), jnp.logical_not(jnp.isnan(total))


def _square_or_nan(x: jax.Array) -> jax.Array:
  # Written so that no subexpression is the `x * x` an optimizer computes from the same
  # grads (Adam's second moment): XLA would share it and keep it as a temporary.
  return (x + x * jnp.zeros((), x.dtype)) * x


def clip_by_global_norm(max_norm: float, axis_name: str | None = None
                        ) -> optax.GradientTransformation:
  """Scales updates by ``min(1, max_norm / norm)`` with the norm and the scaling in f32.

  Each leaf is multiplied in f32 and rounded back to its own dtype. Stateless.

  Examples:
    >>> tx = optax.chain(clip_by_global_norm(1.0), optax.adamw(1e-3))
  """
  if not max_norm > 0:
    raise ValueError(f"max_norm={max_norm!r}; must be > 0")

  def update_fn(updates, state, params=None):
    del params
    norm = global_norm(updates, axis_name)
    # Written as optax does (select, no division when under the limit) so that in-range
    # updates pass through bit for bit.
    trigger = norm < jnp.float32(max_norm)
    factor = jnp.float32(max_norm) / jnp.maximum(norm, jnp.float32(max_norm))

    def one(u):
      if not _dtypes.is_float(u):
        return u
      return jnp.where(trigger, u, (u.astype(jnp.float32) * factor).astype(u.dtype))

    return jax.tree.map(one, updates), state

  return _compat.own(optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn))
