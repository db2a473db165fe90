"""Gradient and parameter collectives with explicit dtypes.

Every reduction of gradients runs in the recipe's `reduce_dtype` (f32, bf16 or f16) and
is SUMMED before it is divided by the device count n: a gradient finite on every rank
can overflow in that sum, and the optimizer's finite check, made after the reduction,
must see it (the step is skipped and the loss scale backs off, rather than training on a
reduction that lost its range). Dividing first would hide the overflow (each addend <=
max/n) and change the rounding of every reduced element. The division itself happens in
the gradient dtype handed to the optimizer, the wider of the param and reduce dtypes, so
an f32 reduction of bf16 grads is not rounded back to bf16 (for n a power of two the
division is exact barring underflow).

Stage 2 and 3 reduce inside the backward pass through two custom-VJP "views" of a param
shard: the cotangent of the full (gathered) leaf is reduce-scattered the moment backward
finishes it, so no full-size gradient survives the reduction.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Reduction(NamedTuple):
  """Static description of one leaf's collectives (hashable, used as a nondiff arg)."""

  axis_name: str
  devices: int
  reduce_dtype: np.dtype    # dtype the sum runs in
  grad_dtype: np.dtype      # dtype of the mean handed to the optimizer
  compute_dtype: np.dtype   # dtype params are gathered in (stage 3)
  param_dtype: np.dtype     # dtype loss_fn sees a gathered param in (stage 3)


def wider_dtype(a, b) -> np.dtype:
  """The wider of two float dtypes (f32 for bf16 vs f16): the dtype grads are handed to
  the optimizer in, so a reduction never loses what its dtype gained."""
  a, b = np.dtype(a), np.dtype(b)
  if a == b:
    return a
  if a.itemsize != b.itemsize:
    return a if a.itemsize > b.itemsize else b
  return np.dtype(np.float32)


def _mean_of_sum(total: jax.Array, red: Reduction) -> jax.Array:
  return total.astype(red.grad_dtype) / jnp.asarray(red.devices, red.grad_dtype)


def all_reduce_mean(g: jax.Array, red: Reduction) -> jax.Array:
  """Stage 0: mean over the axis of a full gradient, summed in `red.reduce_dtype`."""
  return _mean_of_sum(jax.lax.psum(g.astype(red.reduce_dtype), red.axis_name), red)


def reduce_scatter_mean(flat: jax.Array, red: Reduction) -> jax.Array:
  """Stages 1-3: this device's shard (k of n*k elements) of the mean of a flat padded
  gradient, summed in `red.reduce_dtype` by one reduce-scatter."""
  total = jax.lax.psum_scatter(flat.astype(red.reduce_dtype), red.axis_name,
                               scatter_dimension=0, tiled=True)
  return _mean_of_sum(total, red)


def all_gather_flat(shard: jax.Array, red: Reduction) -> jax.Array:
  """The full flat padded leaf from every device's shard, moved in the shard's dtype."""
  return jax.lax.all_gather(shard, red.axis_name, axis=0, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_view(shard: jax.Array, red: Reduction) -> jax.Array:
  """Stage 3: flat padded full leaf, gathered from a shard in the COMPUTE dtype and handed
  out in the param dtype.

  Forward: cast the shard to `red.compute_dtype`, all-gather (a bf16 recipe moves bf16,
  half the bytes of gathering f32 and casting after), widen to `red.param_dtype` (exact:
  loss_fn sees params in their own dtype, as at stages 0-2, and its policy GEMMs cast
  them back). Backward: the cotangent of the full leaf (param dtype, straight from the
  GEMMs' f32 accumulators) is reduce-scattered in `red.reduce_dtype` and divided by n in
  `red.grad_dtype`, which must be the shard's dtype: never rounded to the compute dtype.
  """
  return all_gather_flat(shard.astype(red.compute_dtype), red).astype(red.param_dtype)


def _gather_fwd(shard, red):
  return gather_view(shard, red), None


def _gather_bwd(red, _, ct):
  return (reduce_scatter_mean(ct, red),)


gather_view.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def replicated_view(shard: jax.Array, full: jax.Array, red: Reduction) -> jax.Array:
  """Stage 2: returns `full` (this device's replicated flat padded leaf) while routing
  its cotangent, reduce-scattered, to `shard` - the reduction runs inside backward and
  the full-size gradient of the leaf is dead right after it."""
  del shard
  return full


def _replicated_fwd(shard, full, red):
  del shard
  return full, None


def _replicated_bwd(red, _, ct):
  return reduce_scatter_mean(ct, red), jnp.zeros_like(ct)


replicated_view.defvjp(_replicated_fwd, _replicated_bwd)
