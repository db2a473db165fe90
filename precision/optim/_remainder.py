"""A memory-lean master: bf16 params plus int16 remainders hold the exact f32 master.

Transformer Engine's `store_param_remainders`: an f32 master is 32 bits; keep its high 16
bits, rounded to nearest, as the bf16 param, and the signed difference to the full f32 bit
pattern as an int16 remainder, so 4 bytes per param hold the f32 master exactly (instead
of 2 for the param plus 4 for a separate master).

The split, on the uint32 bit pattern M of the master (modular arithmetic):
  A = M + 0x8000;  hi = A >> 16 (the bf16 param bits);  r = (A & 0xFFFF) - 0x8000 (int16)
  M == (hi << 16) + r  for every bit pattern, r in [-32768, 32767].
`hi` is M rounded to nearest on its magnitude with ties away from zero (bf16's own cast
breaks ties to even: the two differ only on exact ties, 1 in 65536 patterns). Ties-to-even
would need 65537 remainder values: with hi even a tie can leave r = +0x8000 or -0x8000.
A NaN master whose magnitude bits are >= 0x7FFF8000 would carry into the sign; the loss-
scaling and non-finite guards keep non-finite values out of the master.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from precision import _dtypes
from precision.optim import _apply
from precision.optim import _compat
from precision.optim import _tree

_U32 = jnp.uint32


def split_master(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """f32 master -> (bf16 param, int16 remainder); `merge_master` inverts it bit for bit."""
  m = jax.lax.bitcast_convert_type(master.astype(jnp.float32), _U32)
  a = m + _U32(0x8000)
  hi = (a >> _U32(16)).astype(jnp.uint16)
  r = ((a & _U32(0xFFFF)).astype(jnp.int32) - 0x8000).astype(jnp.int16)
  return jax.lax.bitcast_convert_type(hi, jnp.bfloat16), r


def merge_master(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """(bf16 param, int16 remainder) -> the exact f32 master."""
  hi = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(_U32) << _U32(16)
  # Sign-extend the remainder to 32 bits, then add modulo 2**32.
  r = jax.lax.bitcast_convert_type(remainder.astype(jnp.int32), _U32)
  return jax.lax.bitcast_convert_type(hi + r, jnp.float32)


class RemainderState(NamedTuple):
  """count: int32 steps; remainder: int16 per bf16 param; inner_state: built on f32."""

  count: jax.Array
  remainder: Any
  inner_state: Any


def _check_bf16(params):
  for p in jax.tree.leaves(params):
    if _dtypes.is_float(p) and p.dtype != jnp.bfloat16:
      raise ValueError(f"remainder_master_weights stores bf16 params; got a {p.dtype} leaf")


def remainder_master_weights(inner: optax.GradientTransformation
                             ) -> optax.GradientTransformation:
  """`master_weights` with an f32 master kept as bf16 params + int16 remainders (TE's
  `store_param_remainders`): 2 bytes of state per param instead of 4.

  The master is rebuilt exactly from (params, remainder) each step, so the params passed
  to `update` must be the ones `apply_updates` produced (bit for bit). All float params
  must be bf16. After n steps the params equal the n-step f32 master run of
  `master_weights(inner)` rounded to nearest (ties away from zero, see `split_master`).

  Examples:
    >>> tx = remainder_master_weights(optax.adamw(1e-3))
  """

  inner = _compat.compat(inner)

  def init_fn(params):
    _check_bf16(params)
    rem = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.int16), params)
    return RemainderState(jnp.zeros((), jnp.int32), rem,
                          inner.init(_tree.cast(params, jnp.float32)))

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError("remainder_master_weights needs params in update(grads, state, params)")
    master = jax.tree.map(merge_master, params, state.remainder)
    u, inner_state = inner.update(_tree.cast(grads, jnp.float32), state.inner_state, master)
    master = _apply.apply_updates(master, _tree.cast_like(u, master))
    pairs = jax.tree.map(split_master, master)
    outer = jax.tree.structure(params)
    new_params, rem = jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)
    updates = _apply.deltas(new_params, params, u)
    return updates, RemainderState(state.count + 1, rem, inner_state)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))
