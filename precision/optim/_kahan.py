"""Kahan-compensated updates of 16-bit params without a master copy (optimi/AnyPrecisionAdamW)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from precision.optim import _apply
from precision.optim import _compat
from precision.optim import _direct
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
    comp = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype) if _tree.is_float(p) else p, params)
    return KahanState(comp, inner.init(_tree.cast(params, jnp.float32)))

  def update_fn(grads, state, params=None):
    _, u, inner_state = _direct.inner_update_f32(inner, "kahan_updates", grads,
                                                 state.inner_state, params)

    def one(p, d, c):
      if not _tree.is_float(p) or p.dtype.itemsize >= 4:
        return p, c  # f32 params take the f32 update directly (see `deltas`)
      f = p.astype(jnp.float32)
      y = d + c.astype(jnp.float32)
      new = (f + y).astype(p.dtype)
      comp = (y - (new.astype(jnp.float32) - f)).astype(c.dtype)
      return new, comp

    pairs = jax.tree.map(one, params, u, state.compensation)
    new_params, comp = jax.tree.transpose(
        jax.tree.structure(params), jax.tree.structure((0, 0)), pairs)
    return _apply.deltas(new_params, params, u), KahanState(comp, inner_state)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))
