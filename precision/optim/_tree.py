"""Small pytree helpers shared by the optimizer transforms (floating leaves only)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_float(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast(tree: Any, dtype: Any) -> Any:
  """Casts floating leaves to `dtype`; integer/bool/key leaves and None pass through."""
  dtype = np.dtype(dtype)
  return jax.tree.map(lambda x: x.astype(dtype) if is_float(x) and x.dtype != dtype else x, tree)


def cast_like(tree: Any, like: Any) -> Any:
  """Casts each floating leaf of `tree` to the dtype of the matching leaf of `like`."""
  return jax.tree.map(
      lambda x, y: x.astype(y.dtype) if is_float(x) and x.dtype != y.dtype else x, tree, like)


def all_finite(tree: Any) -> jax.Array:
  """bool scalar: every floating element of `tree` is finite (no host sync)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if is_float(x)]
  if not leaves:
    return jnp.asarray(True)
  return jnp.stack(leaves).all()


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Leafwise ``jnp.where(pred, a, b)``: an elementwise select, not `lax.cond`.

  A select keeps every dtype (optax issue 377: `cond` over bf16 trees breaks) and returns
  `on_false` bit for bit when `pred` is False, NaN payloads included.
  """
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def dtype_of(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.dtype, tree)
