"""`apply_updates` (exact under strict promotion) and rounding of f32 values into params.

optax.apply_updates computes ``(p + u).astype(p.dtype)`` with standard promotion: a bf16
param plus an f32 update is added in f32 and rounded once to bf16. Strict promotion
forbids the mixed add, so `apply_updates` below spells out that same computation with
explicit casts: the sum is formed in ``promote_types(p.dtype, u.dtype)`` and rounded once
to the param dtype. On f32 params and f32 updates it is bit-identical to optax.

The transforms of this package that own the rounding (master weights, stochastic, Kahan)
return f32 deltas ``u = f32(new) - f32(old)`` between two param-dtype values. Then
``round(f32(old) + u) == new`` exactly whenever `new` is +0.0 or a normal number of the
param dtype with ``|old| < 2**(22 - m) * |new|``, m the param's explicit mantissa bits
(bf16: |old| < 2**15 |new|; f16: 2**12): the two f32 roundings together err by at most
``(|new - old| + |new|) * 2**-24``, under half an ulp of `new` in the param dtype. Not
covered: a -0.0 target (comes back +0.0), f16 subnormal targets, and updates that shrink a
weight by a factor of 4096 (f16) / 32768 (bf16) or more in one step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from precision import _dtypes
from precision.optim import _tree
from precision.rounding import leaf_seed
from precision.rounding import stochastic_round
from precision.rounding._hash import shard_offset

ROUNDINGS = ("nearest", "stochastic")


def apply_updates(params: Any, updates: Any) -> Any:
  """``params + updates`` rounded once to each param's dtype (drop-in for optax's).

  Args:
    params: pytree of arrays (any float dtypes; None and non-float leaves pass through).
    updates: pytree of the same structure; f32 updates to 16-bit params are added in f32.

  Returns:
    New params, each leaf in its original dtype.

  Examples:
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = precision.optim.apply_updates(params, updates)
  """

  def one(p, u):
    if p is None or u is None or not _dtypes.is_float(p):
      return p
    # The dtype optax's standard-promotion add would use (a dtype lookup, no arithmetic).
    with jax.numpy_dtype_promotion("standard"):
      wide = jnp.promote_types(p.dtype, u.dtype)
    return (p.astype(wide) + u.astype(wide)).astype(p.dtype)

  return jax.tree.map(one, params, updates, is_leaf=lambda x: x is None)


def round_tree(values: Any, like: Any, rounding: str, seed: int, count: jax.Array, *,
               axis_name: str | None = None) -> Any:
  """Rounds the f32 leaves of `values` to the dtypes of the matching leaves of `like`.

  `nearest`: round-to-nearest-even cast. `stochastic`: the project convention, leaf i (in
  jax.tree.leaves order) at step `count` uses ``stochastic_round(x, dtype,
  key=leaf_seed(seed, i), step=count, index_offset=o)``. Leaves already in the target
  dtype, or whose target is f32, are cast with nearest rounding (a no-op for f32).

  `axis_name`: None when the leaves are whole (o = 0). Set when they are ZeRO shards
  inside shard_map/pmap (precision.parallel's layout: each leaf flattened row-major,
  zero-padded, device r holding the contiguous flat elements [r*k, (r+1)*k), k = x.size):
  o = ``axis_index(axis_name) * x.size``, the shard's global flat index, so each element
  gets the bits of the unsharded rounding whatever the device count.
  """
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding={rounding!r}; accepted: {', '.join(ROUNDINGS)}")
  leaves, treedef = jax.tree.flatten(values)
  like_leaves = treedef.flatten_up_to(like)
  out = []
  for i, (x, p) in enumerate(zip(leaves, like_leaves)):
    if rounding == "stochastic" and _dtypes.is_float(p) and p.dtype.itemsize < 4:
      out.append(stochastic_round(x.astype(jnp.float32), p.dtype, key=leaf_seed(seed, i),
                                  step=count.astype(jnp.uint32),
                                  index_offset=shard_offset(axis_name, x.size)))
    elif _dtypes.is_float(p):
      out.append(x.astype(p.dtype))
    else:
      out.append(x)
  return treedef.unflatten(out)


def deltas(new: Any, old: Any, inner_updates: Any) -> Any:
  """f32 updates taking 16-bit `old` params to `new` under `apply_updates` (exact: see the
  module docstring). Leaves whose params are f32 (or wider) get `inner_updates` unchanged:
  there the master is the param and ``p + u`` is exactly what optax would compute.
  """

  def one(n, o, u):
    if not _dtypes.is_float(o):
      return u
    if o.dtype.itemsize >= 4:
      return u
    return n.astype(jnp.float32) - o.astype(jnp.float32)

  return jax.tree.map(one, new, old, inner_updates)
