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


def stream_keys(seed, step) -> tuple[jax.Array, jax.Array]:
  """Two uint32 keys for one (seed, step) stream. Computed once per call, outside kernels.

  `seed` and `step` are uint32 counters, validated as `uint32_scalar` says (`seed` is
  usually `seed_from`'s result already)."""
  seed = uint32_scalar(seed, "seed")
  step = uint32_scalar(step, "step")
  k1 = mix32(seed ^ _U32(0x6A09E667))
  k2 = mix32(step ^ k1 ^ _U32(0xBB67AE85))
  return k1, k2


def bits_at(index: jax.Array, k1: jax.Array, k2: jax.Array) -> jax.Array:
  """32 random bits for each flat element index (uint32) of the stream (k1, k2)."""
  return mix32(mix32(index ^ k2) + k1)


_UINT32_END = 2 ** 32
_ACCEPTED = "an int in [0, 2**32) or an integer scalar array (a traced one wraps mod 2**32)"


def _concrete_int(value: jax.Array | np.ndarray) -> int | None:
  """The Python int of a concrete integer scalar array; None for a traced one."""
  try:
    return int(value)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return None


def uint32_scalar(value, name: str, accepted: str = _ACCEPTED) -> jax.Array:
  """A uint32 scalar array from a counter argument (`key`, `step`, `index_offset`).

  Accepted: a Python or NumPy int in [0, 2**32); an integer scalar array of any signed or
  unsigned dtype whose value, when it is concrete, lies in [0, 2**32); a traced integer
  scalar (its value cannot be checked: it is cast to uint32, i.e. taken mod 2**32, which
  is how the optimizer passes its int32 step count). Anything else (bool, float, NaN,
  str, a non-scalar, an out-of-range value) raises ValueError naming `name` and
  `accepted`: a silent wrap or cast would give the random bits of another counter.
  """
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name}={value!r}; accepted: {accepted}")
  if isinstance(value, (int, np.integer)):
    v = int(value)
    if not 0 <= v < _UINT32_END:
      raise ValueError(f"{name}={v} is outside the uint32 range; accepted: {accepted}")
    return jnp.asarray(np.uint32(v))
  if not isinstance(value, (jax.Array, np.ndarray)):
    raise ValueError(f"{name}={value!r} (a {type(value).__name__}); accepted: {accepted}")
  if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
    raise ValueError(f"{name} must be {accepted}; got an array of dtype {value.dtype} and "
                     f"shape {value.shape}")
  v = _concrete_int(value)
  if v is not None and not 0 <= v < _UINT32_END:
    raise ValueError(f"{name}={v} (dtype {value.dtype}) is outside the uint32 range; "
                     f"accepted: {accepted}")
  return jnp.asarray(value).astype(_U32)


def offset_from(index_offset) -> jax.Array:
  """The uint32 scalar of an `index_offset` (see `uint32_scalar`; traced values welcome)."""
  return uint32_scalar(index_offset, "index_offset")


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
  """A uint32 seed from `key`: an int in [0, 2**32), an integer scalar array (see
  `uint32_scalar`), or a `jax.random` key (typed, or a raw uint32[2] PRNGKey), whose
  seed is 32 bits drawn from it.

  Raises:
    ValueError: for anything else (a float, a bool, a string, an int outside the uint32
      range, ...), naming the value and what is accepted.
  """
  if isinstance(key, (jax.Array, np.ndarray)):
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      return jax.random.bits(key, (), jnp.uint32)
    if key.shape == (2,) and key.dtype == jnp.uint32:  # raw PRNGKey
      return jax.random.bits(jnp.asarray(key), (), jnp.uint32)
  return uint32_scalar(key, "key", _ACCEPTED + ", or a jax.random key")


def leaf_seed(seed, leaf_index: int) -> jax.Array:
  """The uint32 seed of leaf `leaf_index` (jax.tree.leaves order) of a pytree rounded with
  `seed`: every leaf gets its own stream, so equal-shaped leaves do not share bits."""
  return mix32(seed_from(seed) ^ mix32(jnp.asarray(np.uint32(leaf_index))))
