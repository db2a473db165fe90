"""`moment_dtypes`: store an optimizer's first and second moments each in its own dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from precision import _dtypes
from precision._policy import parse_dtype
from precision.optim import _compat
from precision.optim import _tree

# State fields recognised as moments, by attribute name in the optax state NamedTuples:
# ScaleByAdamState / ScaleByLionState (mu, nu), TraceState (trace, SGD momentum).
MU_FIELDS = ("mu", "trace", "momentum")
NU_FIELDS = ("nu",)


def _field_names(path) -> set[str]:
  names = set()
  for k in path:
    if isinstance(k, jax.tree_util.GetAttrKey):
      names.add(k.name)
    elif isinstance(k, jax.tree_util.DictKey):
      names.add(str(k.key))
  return names


def _moment_dtype(path, mu_dtype, nu_dtype):
  names = _field_names(path)
  if names & set(NU_FIELDS):
    return nu_dtype
  if names & set(MU_FIELDS):
    return mu_dtype
  return None


def moment_dtypes(inner: optax.GradientTransformation, mu_dtype: Any = jnp.float32,
                  nu_dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """Stores `inner`'s moments in `mu_dtype` / `nu_dtype` and computes with them in f32.

  optax offers only `mu_dtype` (issue 1552: no `nu_dtype`), and computes Adam's update in
  the moments' dtype, so ``eps=1e-8`` vanishes in f16 (PR 1755). Here the stored moments
  (state leaves under a field named mu/trace/momentum -> `mu_dtype`, nu -> `nu_dtype`) are
  upcast to f32 before `inner.update`, so the whole update, epsilon included, runs in f32;
  the new moments are rounded to nearest into their storage dtype. Other state leaves
  (counts, ...) are untouched. Grads are upcast to f32 too.

  Examples:
    >>> tx = moment_dtypes(optax.adamw(1e-3), mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  """
  mu_dtype, nu_dtype = parse_dtype(mu_dtype), parse_dtype(nu_dtype)

  def store(state):
    def one(path, x):
      dt = _moment_dtype(path, mu_dtype, nu_dtype)
      return x.astype(dt) if dt is not None and _dtypes.is_float(x) else x

    return jax.tree_util.tree_map_with_path(one, state)

  inner = _compat.compat(inner)

  def init_fn(params):
    return store(inner.init(_tree.cast(params, jnp.float32)))

  def update_fn(grads, state, params=None):
    wide = _tree.cast(state, jnp.float32)
    p32 = None if params is None else _tree.cast(params, jnp.float32)
    u, new = inner.update(_tree.cast(grads, jnp.float32), wide, p32)
    # Leaves that are not moments go back to exactly their previous dtype.
    new = store(jax.tree.map(lambda n, o: n.astype(o.dtype) if _dtypes.is_float(o) else n,
                             new, state))
    return u, new

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))
