"""Counter-based random bits: a hash of (seed, step, flat element index).

The flat element index is the element's row-major position plus an `index_offset`
(uint32 arithmetic, wrapping): a slice or shard holding elements [a, b) of a larger flat
array passes ``index_offset=a`` and draws exactly the bits the whole array would give
those elements, so a sharded rounding equals the unsharded one bit for bit.

No random array is ever materialised: each element's 32 random bits are a pure function of
three uint32 counters, so a kernel can compute them where it reads the element, and any
rounding can be replayed for a bit-exact resume (llm.c's design; its hash is
SquirrelNoise5, ours is Wellons' "lowbias32", a bijection on uint32 with very low bias).

Only uint32 multiply, xor, add and shift are used, so the same function runs in plain jnp
and inside a Pallas kernel and gives the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_U32 = jnp.uint32


def mix32(h: jax.Array) -> jax.Array:
  """lowbias32 (Chris Wellons, 2018): a well-mixed bijection uint32 -> uint32."""
  h = h ^ (h >> _U32(16))
  h = h * _U32(0x21F0AAAD)
  h = h ^ (h >> _U32(15))
  h = h * _U32(0xD35A2D97)
  h = h ^ (h >> _U32(15))
  return h


def stream_keys(seed: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two uint32 keys for one (seed, step) stream. Computed once per call, outside kernels."""
  seed = jnp.asarray(seed).astype(_U32)
  step = jnp.asarray(step).astype(_U32)
  k1 = mix32(seed ^ _U32(0x6A09E667))
  k2 = mix32(step ^ k1 ^ _U32(0xBB67AE85))
  return k1, k2


def bits_at(index: jax.Array, k1: jax.Array, k2: jax.Array) -> jax.Array:
  """32 random bits for each flat element index (uint32) of the stream (k1, k2)."""
  return mix32(mix32(index ^ k2) + k1)


def offset_from(index_offset) -> jax.Array:
  """The uint32 scalar of an `index_offset`: a Python int in [0, 2**32) or an integer
  scalar array (traced values welcome; cast to uint32, so negative values wrap)."""
  if isinstance(index_offset, (bool, np.bool_)):
    raise ValueError(f"index_offset={index_offset!r}; accepted: an int in [0, 2**32) or an "
                     "integer scalar array")
  if isinstance(index_offset, (int, np.integer)):
    if not 0 <= int(index_offset) < 2 ** 32:
      raise ValueError(f"index_offset={int(index_offset)}; accepted: an int in [0, 2**32) "
                       "or an integer scalar array")
    return jnp.asarray(np.uint32(int(index_offset)))
  index_offset = jnp.asarray(index_offset)
  if index_offset.shape != () or not jnp.issubdtype(index_offset.dtype, jnp.integer):
    raise ValueError(
        f"index_offset must be an int in [0, 2**32) or an integer scalar array; got dtype "
        f"{index_offset.dtype} shape {index_offset.shape}")
  return index_offset.astype(_U32)


def shard_offset(axis_name: str | None, shard_size: int) -> jax.Array | int:
  """The `index_offset` of this device's shard: its first element's global flat index.

  The layout of `precision.parallel` (ZeRO stages 1-3): a leaf is flattened row-major,
  zero-padded to a multiple of the axis size n and cut into n contiguous shards of
  `shard_size` elements; device r (``jax.lax.axis_index(axis_name)``, inside shard_map or
  pmap) holds flat elements [r * shard_size, (r + 1) * shard_size). Returns 0 when
  `axis_name` is None (whole leaves), else a traced uint32 scalar. The product is formed
  in uint32 like the counters themselves (int32 would overflow past 2**31 elements).
  """
  if axis_name is None:
    return 0
  rank = jax.lax.axis_index(axis_name).astype(_U32)
  return rank * np.uint32(shard_size & 0xFFFFFFFF)


def random_bits(seed, step, shape, index_offset=0) -> jax.Array:
  """uint32 random bits of `shape` for (seed, step): the element at row-major position i
  gets ``bits_at(index_offset + i, ...)`` (uint32 arithmetic: the index wraps at 2**32).

  `index_offset` (int or integer scalar, may be traced): the flat index of this array's
  first element in a larger array it is a contiguous slice of (0 for a whole array).
  """
  k1, k2 = stream_keys(seed, step)
  n = int(np.prod(shape)) if len(shape) else 1
  index = jax.lax.iota(_U32, n).reshape(shape) + offset_from(index_offset)
  return bits_at(index, k1, k2)


def seed_from(key) -> jax.Array:
  """A uint32 seed from an int, a uint32 array, or a `jax.random` key (typed or raw)."""
  if isinstance(key, (int, np.integer)):
    return jnp.asarray(np.uint32(int(key) & 0xFFFFFFFF))
  key = jnp.asarray(key)
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.bits(key, (), jnp.uint32)
  if key.shape == (2,) and key.dtype == jnp.uint32:  # raw PRNGKey
    return jax.random.bits(key, (), jnp.uint32)
  if key.shape != () or not jnp.issubdtype(key.dtype, jnp.integer):
    raise ValueError(
        f"A stochastic-rounding key must be an int, a uint32 scalar or a jax.random key; "
        f"got dtype {key.dtype} shape {key.shape}")
  return key.astype(_U32)


def leaf_seed(seed, leaf_index: int) -> jax.Array:
  """The uint32 seed of leaf `leaf_index` (jax.tree.leaves order) of a pytree rounded with
  `seed`: every leaf gets its own stream, so equal-shaped leaves do not share bits."""
  return mix32(seed_from(seed) ^ mix32(jnp.asarray(np.uint32(leaf_index))))
