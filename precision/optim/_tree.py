"""Small pytree helpers shared by the optimizer transforms (floating leaves only)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precision._dtypes import is_float


def cast(tree: Any, dtype: Any) -> Any:
  """Casts floating leaves to `dtype`; integer/bool/key leaves and None pass through."""
  dtype = np.dtype(dtype)
  return jax.tree.map(lambda x: x.astype(dtype) if is_float(x) and x.dtype != dtype else x, tree)


def cast_like(tree: Any, like: Any) -> Any:
  """Casts each floating leaf of `tree` to the dtype of the matching leaf of `like`."""
  return jax.tree.map(
      lambda x, y: x.astype(y.dtype) if is_float(x) and x.dtype != y.dtype else x, tree, like)


def bool_scalar(pred: Any, what: str) -> jax.Array:
  """`pred` as a bool scalar array, or ValueError naming `what`: a vector predicate would
  turn a scalar state into a vector, and a float (0.5) would silently read as True."""
  if isinstance(pred, (bool, np.bool_)):
    return jnp.asarray(bool(pred))
  dtype, shape = getattr(pred, "dtype", None), getattr(pred, "shape", None)
  if dtype is None or np.dtype(dtype) != np.bool_ or tuple(shape) != ():
    desc = (f"dtype {np.dtype(dtype).name}, shape {tuple(shape)}" if dtype is not None
            else repr(pred))
    raise ValueError(f"{what}: {desc}; accepted: a bool scalar, e.g. "
                     "precision.all_finite(grads)")
  return jnp.asarray(pred)


def all_finite(tree: Any) -> jax.Array:
  """bool scalar array: every element of every floating leaf of `tree` is finite.

  jmp's `all_finite`, without a host sync (the result stays on device). Integer, bool and
  PRNG-key leaves are finite by definition; Python numbers are checked as arrays; an empty
  tree (or None) gives True.

  Args:
    tree: a pytree of arrays (any dtypes) or Python numbers.

  Examples:
    >>> bool(all_finite({"w": jnp.ones(3), "b": jnp.asarray(jnp.nan)}))
    False
  """
  checks = []
  for x in jax.tree.leaves(tree):
    if isinstance(x, (int, float, complex)):
      x = jnp.asarray(x)
    if not hasattr(x, "dtype"):
      raise ValueError(f"all_finite: leaf {x!r}; accepted: arrays and Python numbers")
    if jnp.issubdtype(x.dtype, jnp.inexact):
      checks.append(jnp.all(jnp.isfinite(x)))
  if not checks:
    return jnp.asarray(True)
  return jnp.stack(checks).all()


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
  """Leafwise ``on_true if pred else on_false`` for a bool scalar `pred` (jmp's select_tree).

  An elementwise select (`jnp.where`), not `lax.cond`: every dtype is kept (optax issue
  377: `cond` over bf16 trees breaks), and `on_false` comes back bit for bit when `pred` is
  False, NaN payloads included.

  Args:
    pred: a bool scalar (Python bool or a bool array of shape ()), traced is fine.
    on_true, on_false: pytrees of one structure whose matching leaves have equal dtypes
      and shapes.

  Raises:
    ValueError: `pred` is not a bool scalar, or two matching leaves differ in dtype or
      shape (a select would silently promote or broadcast).

  Examples:
    >>> select_tree(all_finite(grads), new_state, old_state)
  """
  pred = bool_scalar(pred, "select_tree pred")

  def one(path, a, b):
    if hasattr(a, "dtype") and hasattr(b, "dtype") and (
        np.dtype(a.dtype) != np.dtype(b.dtype) or np.shape(a) != np.shape(b)):
      raise ValueError(
          f"select_tree: leaf {jax.tree_util.keystr(path)} is {np.dtype(a.dtype).name}"
          f"{list(np.shape(a))} in on_true but {np.dtype(b.dtype).name}{list(np.shape(b))} "
          "in on_false; accepted: equal dtypes and shapes")
    return jnp.where(pred, a, b)

  return jax.tree_util.tree_map_with_path(one, on_true, on_false)


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Leafwise ``jnp.where(pred, a, b)`` for the optimizer guard (no dtype checks; see
  `select_tree`, its public, checked form)."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def neg_zero_like(u: Any) -> Any:
  """-0.0 in the shape and dtype of floating `u` (other leaves pass through): the update
  of a skipped step, since ``x + -0.0 == x`` bit for bit for every x, +-0.0 included."""
  return jnp.full(u.shape, -0.0, u.dtype) if is_float(u) else u


def skip_updates(ok: Any, updates: Any) -> Any:
  """Floating updates -0.0 unless `ok` (a skipped step: ``x + -0.0 == x`` bit for bit,
  +-0.0 included); other leaves as they are."""
  return jax.tree.map(lambda u: jnp.where(ok, u, neg_zero_like(u)) if is_float(u) else u,
                      updates)


def dtype_of(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.dtype, tree)
