"""Flat, padded shards of a parameter pytree: the layout every ZeRO stage shares.

Each leaf is flattened (row-major) and zero-padded to a multiple of the device count n,
so a leaf of `size` elements becomes n shards of ``k = ceil(size / n)`` elements; shard r
holds flat elements ``[r*k, (r+1)*k)``. Sizes that do not divide n are padded, never
refused (llm.c's ZeRO-1 errors out or falls back to DDP instead). Padding elements are 0
in params, grads and optimizer state; an elementwise optimizer keeps them at 0 (zero
grad, zero moments, zero update) and they are dropped when the leaf is unflattened.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Shape, dtype and shard size of one parameter leaf on an n-device axis."""

  shape: tuple[int, ...]
  dtype: np.dtype
  devices: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def shard_size(self) -> int:
    """k = ceil(size / n): elements per device (padding included)."""
    return -(-self.size // self.devices)

  @property
  def padded_size(self) -> int:
    return self.shard_size * self.devices


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """The layout of a whole parameter pytree (hashable: it is static jit metadata)."""

  treedef: Any
  leaves: tuple[LeafLayout, ...]
  devices: int

  @classmethod
  def of(cls, params: Any, devices: int) -> ParamLayout:
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for i, leaf in enumerate(leaves):
      # Checked before np.dtype: a PRNG key (extended dtype) has no numpy dtype.
      if not jnp.issubdtype(leaf.dtype, jnp.floating):
        raise ValueError(
            f"Parameter leaf {i} has dtype {leaf.dtype}; data_parallel trains floating "
            "leaves only (accepted: float32, bfloat16, float16, float64); keep integer "
            "and PRNG-key state (nnx.Rngs) out of the params pytree: pass it as the "
            "model state (fp8_state=True)")
      out.append(LeafLayout(tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype),
                            devices))
    return cls(treedef, tuple(out), devices)

  @property
  def param_count(self) -> int:
    return sum(leaf.size for leaf in self.leaves)

  @property
  def padded_count(self) -> int:
    return sum(leaf.padded_size for leaf in self.leaves)

  def map(self, fn, *trees):
    """`fn(leaf_layout, *leaves)` over the leaves of `trees` (all with this treedef)."""
    flat = [self.treedef.flatten_up_to(t) for t in trees]
    return self.treedef.unflatten(
        [fn(lay, *xs) for lay, *xs in zip(self.leaves, *flat)])


def flatten_pad(x: jax.Array, leaf: LeafLayout) -> jax.Array:
  """Leaf -> flat vector of `leaf.padded_size` elements (zero padded), same dtype."""
  flat = x.reshape(-1)
  pad = leaf.padded_size - leaf.size
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
  return flat


def unflatten(flat: jax.Array, leaf: LeafLayout) -> jax.Array:
  """Flat padded vector -> the leaf's shape (padding dropped), same dtype."""
  return flat[:leaf.size].reshape(leaf.shape)


def own_shard(flat: jax.Array, leaf: LeafLayout, axis_name: str) -> jax.Array:
  """This device's k elements of a flat padded vector (inside shard_map or pmap)."""
  start = jax.lax.axis_index(axis_name) * leaf.shard_size
  return jax.lax.dynamic_slice_in_dim(flat, start, leaf.shard_size)
