"""`master_weights`: a wide master copy of 16-bit params, updated by any optax optimizer."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision._policy import dtype_name
from precision._policy import parse_dtype
from precision.optim import _apply
from precision.optim import _compat
from precision.optim import _tree


class MasterState(NamedTuple):
  """count: int32 steps taken (the stochastic-rounding step); master: params in the master
  dtype; inner_state: the wrapped optimizer's state, built on the master."""

  count: jax.Array
  master: Any
  inner_state: Any


def master_weights(inner: optax.GradientTransformation, master_dtype: Any = jnp.float32,
                   rounding: str = "nearest", seed: int = 0, *,
                   axis_name: str | None = None) -> optax.GradientTransformation:
  """Keeps a `master_dtype` copy of the params and runs `inner` on it.

  Each step: grads are upcast to the master dtype (exact for bf16/f16); `inner` updates the
  master (``master + u``, as optax.apply_updates would on master-dtype params); the params
  become the master rounded to their own dtype, `nearest` (round-to-nearest-even) or
  `stochastic` (leaf i at step t: ``stochastic_round(master_i, dtype, key=leaf_seed(seed,
  i), step=t)``, t = count before this step). The returned updates are f32 deltas that
  `precision.optim.apply_updates` turns into exactly those rounded params.

  Args:
    inner: any optax transformation (its state is built on the master).
    master_dtype: the master dtype (default f32).
    rounding: "nearest" or "stochastic" (stochastic needs an f32 master).
    seed: int seed of the stochastic rounding.
    axis_name: None when `update` sees whole leaves. Set it when `update` runs inside
      shard_map/pmap on ZeRO shards (contiguous chunks of each flattened, padded leaf, as
      precision.parallel lays them out): stochastic rounding then counts elements by
      their global flat index (`precision.optim._apply.round_tree`), bit-identical to the
      unsharded update.

  Returns:
    An optax.GradientTransformation whose state is a `MasterState`; `update` needs params.

  Examples:
    >>> tx = master_weights(optax.adamw(1e-3))
    >>> opt_state = tx.init(params_bf16)
    >>> updates, opt_state = tx.update(grads, opt_state, params_bf16)
    >>> params_bf16 = precision.optim.apply_updates(params_bf16, updates)
  """
  master_dtype = parse_dtype(master_dtype)
  if rounding not in _apply.ROUNDINGS:
    raise ValueError(f"rounding={rounding!r}; accepted: {', '.join(_apply.ROUNDINGS)}")
  if rounding == "stochastic" and master_dtype != np.dtype(np.float32):
    raise ValueError(f"stochastic rounding reads an f32 master; got master_dtype="
                     f"{dtype_name(master_dtype)}")

  inner = _compat.compat(inner)

  def init_fn(params):
    master = _tree.cast(params, master_dtype)
    return MasterState(jnp.zeros((), jnp.int32), master, inner.init(master))

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError("master_weights needs params in update(grads, state, params)")
    grads = _tree.cast(grads, master_dtype)
    u, inner_state = inner.update(grads, state.inner_state, state.master)
    u = _tree.cast_like(u, state.master)
    master = _apply.apply_updates(state.master, u)
    new_params = _apply.round_tree(master, params, rounding, seed, state.count,
                                   axis_name=axis_name)
    updates = _apply.deltas(new_params, params, u)
    return updates, MasterState(state.count + 1, master, inner_state)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))
