"""Updates straight into 16-bit params, no master: nearest (`f32_update`) or stochastic."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from precision.optim import _apply
from precision.optim import _compat
from precision.optim import _tree


def inner_update_f32(inner: optax.GradientTransformation, name: str, grads: Any,
                     inner_state: Any, params: Any) -> tuple[Any, Any, Any]:
  """`inner` run on f32 copies of 16-bit params and grads (no master copy is kept).

  Returns (params in f32, `inner`'s updates in f32, new inner state). `name` is the calling
  transform's, for the error when `params` is missing.
  """
  if params is None:
    raise ValueError(f"{name} needs params in update(grads, state, params)")
  p32 = _tree.cast(params, jnp.float32)
  u, inner_state = inner.update(_tree.cast(grads, jnp.float32), inner_state, p32)
  return p32, _tree.cast_like(u, p32), inner_state


def f32_update(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Runs `inner` in f32 on 16-bit params: grads and params are upcast (exact), the updates
  come back in f32, and `apply_updates` adds them in f32 and rounds once to nearest.

  No master copy: updates under half an ulp of a weight are lost (swamping; bf16 1.0 +
  1e-5 == 1.0). Use `master_weights`, `stochastic_updates` or `kahan_updates` to keep them.
  The state is `inner`'s own, built on f32 params.
  """

  inner = _compat.compat(inner)

  def init_fn(params):
    return inner.init(_tree.cast(params, jnp.float32))

  def update_fn(grads, state, params=None):
    p32 = None if params is None else _tree.cast(params, jnp.float32)
    return inner.update(_tree.cast(grads, jnp.float32), state, p32)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))


class StochasticState(NamedTuple):
  """count: int32 steps taken (the rounding step); inner_state: built on f32 params."""

  count: jax.Array
  inner_state: Any


def stochastic_updates(inner: optax.GradientTransformation, seed: int = 0, *,
                       axis_name: str | None = None) -> optax.GradientTransformation:
  """16-bit params without a master, rounded stochastically (as llm.c's bf16 path).

  Each step the new param is ``stochastic_round(f32(p) + u, dtype, key=leaf_seed(seed, i),
  step=count)``, unbiased in expectation, so small updates survive on average. The
  returned f32 deltas make `precision.optim.apply_updates` produce exactly that value.

  `axis_name`: None for whole leaves. Set it when `update` runs inside shard_map/pmap on
  ZeRO shards (contiguous chunks of each flattened, padded leaf, precision.parallel's
  layout): each element is then rounded with its global flat index as the counter
  (``index_offset = axis_index * shard size``), bit-identical to the unsharded update.

  Examples:
    >>> tx = stochastic_updates(optax.adamw(1e-3), seed=0)
  """

  inner = _compat.compat(inner)

  def init_fn(params):
    return StochasticState(jnp.zeros((), jnp.int32), inner.init(_tree.cast(params, jnp.float32)))

  def update_fn(grads, state, params=None):
    p32, u, inner_state = inner_update_f32(inner, "stochastic_updates", grads,
                                           state.inner_state, params)
    target = jax.tree.map(lambda p, d: p + d, p32, u)
    new_params = _apply.round_tree(target, params, "stochastic", seed, state.count,
                                   axis_name=axis_name)
    return _apply.deltas(new_params, params, u), StochasticState(state.count + 1, inner_state)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))
