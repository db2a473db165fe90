"""Kahan-compensated updates of 16-bit params without a master copy (optimi/AnyPrecisionAdamW)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from precision import _dtypes
from precision.optim import _compat
from precision.optim import _recompute
from precision.optim import _tree


class KahanState(NamedTuple):
  """compensation: per param, in the param's dtype, what rounding dropped so far;
  inner_state: the wrapped optimizer's state, built on f32 params."""

  compensation: Any
  inner_state: Any


def kahan_updates(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Compensated summation of updates into 16-bit params (2 extra bytes per bf16 param).

  Each step, in f32 (exact for every bf16/f16 operand):
    y = u + c;  p_new = round_nearest(p + y);  c = round_to_param_dtype(y - (p_new - p))
  `c` carries the part of the update the 16-bit param could not take, so it is added back
  next step instead of being lost (1.0 + 1e-5 per step in bf16 reaches 2.0 after 100k
  steps instead of staying at 1.0). optimi and AnyPrecisionAdamW do these adds in bf16;
  doing them in f32 leaves the compensation's own bf16 rounding as the only error.
  ``p_new - p`` is exact in f32 (Sterbenz), and so is ``y - (p_new - p)`` up to one rounding.

  The update returned is ``y`` in f32: `precision.optim.apply_updates` rounds ``p + y``
  once, which is ``p_new`` itself. The new compensation is computed from ``u`` evaluated
  again from the new moments (the same bits; `_recompute`), so the params' and the
  compensation's fusions each compute their own and no f32 ``u`` is kept between them;
  with `precision.optim.update_and_apply`, which writes the compensation after the params,
  the step's only temporary is a copy of the old params (both outputs read both old
  buffers: 2 bytes per bf16 param on XLA:CPU, which forms no multi-output fusion here).

  Limit (tests/test_optim_master.py::test_kahan_bf16_compensation_limit): the bf16 buffer
  keeps 8 significant bits of what it carries, so param + compensation holds about 16
  bits. Updates below ~2**-16 of the weight drift (bf16 1.0 + 1e-5 per step runs ahead of
  the exact sum by up to ~14 ulps) and stall once |c| is large enough that the update is
  under half its ulp (from 2.0 on in that example). Use master weights (or their 16-bit
  remainder variant) where updates are that small.

  Examples:
    >>> tx = kahan_updates(optax.adamw(1e-3))
  """

  inner = _compat.compat(inner)

  def init_fn(params):
    comp = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype) if _dtypes.is_float(p) else p, params)
    return KahanState(comp, inner.init(_tree.cast(params, jnp.float32)))

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError("kahan_updates needs params in update(grads, state, params)")
    p32 = _tree.cast(params, jnp.float32)
    # `u` for the new params, `u_again` (the same bits, recomputed from the new moments)
    # for the new compensation: each output's fusion computes its own, so no f32 update
    # is kept between them (`_recompute`).
    u, inner_state, u_again = _recompute.update_twice(
        inner.update, _tree.cast(grads, jnp.float32), state.inner_state, p32)
    u, u_again = _tree.cast_like(u, p32), _tree.cast_like(u_again, p32)

    def step(p, d, c):
      # The f32 update that `apply_updates` rounds once into p: round(p + y) is new.
      if not _dtypes.is_float(p) or p.dtype.itemsize >= 4:
        return d  # f32 params take the f32 update directly
      return d + c.astype(jnp.float32)

    def compensation(p, d, c):
      if not _dtypes.is_float(p) or p.dtype.itemsize >= 4:
        return c
      f = p.astype(jnp.float32)
      y = d + c.astype(jnp.float32)
      new = (f + y).astype(p.dtype)
      return (y - (new.astype(jnp.float32) - f)).astype(c.dtype)

    updates = jax.tree.map(step, params, u, state.compensation)
    comp = jax.tree.map(compensation, params, u_again, state.compensation)
    return updates, KahanState(comp, inner_state)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))
