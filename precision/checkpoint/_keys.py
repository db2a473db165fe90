"""Typed PRNG key leaves in a checkpoint: saved as their uint32 key data, restored as keys.

Neither numpy nor Orbax (0.12) knows JAX's extended dtypes, so a typed key (a
``jax.random.key``, the `RngKey` of every ``nnx.Rngs``, hence of ``nnx.Dropout``) cannot
be written as it is. The Orbax item holds each key leaf as its ``jax.random.key_data``:
uint32, the key's shape followed by the impl's key shape ((2,) for threefry2x32).
integrity.json records the leaf as the key it is (``"dtype": "key<fry>"``, the key's
shape, ``"key_impl": "threefry2x32"``, the SHA-256 taken over the key data), and restore
wraps the data back (``jax.random.wrap_key_data``) into keys of the impl they were saved
with: a target whose leaf has another impl, or is no key, does not fit the checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from precision.checkpoint._errors import CheckpointError


def is_key(x: Any) -> bool:
  """Whether `x` (an array or a ShapeDtypeStruct) has a typed PRNG key dtype."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=None)
def _data_shape(dtype: Any) -> tuple[int, ...]:
  """The impl's key shape: the trailing dimensions of one key's uint32 data."""
  return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape


@functools.lru_cache(maxsize=None)
def impl_name(dtype: Any) -> str:
  """The name `jax.random.key_dtype` accepts for a key dtype ('threefry2x32' for key<fry>).

  Raises:
    ValueError for a key dtype of an unregistered impl (no name to save it under).
  """
  probe = jax.random.wrap_key_data(jnp.zeros(_data_shape(dtype), jnp.uint32), dtype=dtype)
  impl = jax.random.key_impl(probe)
  if not isinstance(impl, str):
    raise ValueError(f"PRNG key dtype {dtype} has an unregistered impl ({impl}); accepted "
                     "in a checkpoint: keys of a registered impl (threefry2x32, rbg, "
                     "unsafe_rbg)")
  return impl


def key_dtype(impl: str, what: str) -> Any:
  """The key dtype of a saved impl name; `what` names the leaf in the error."""
  try:
    return jax.random.key_dtype(impl)
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"{what} is a PRNG key of impl {impl!r}, which this JAX does not "
                          f"know ({e})") from None


def _data_sharding(sharding: Any, ndim: int, extra: int) -> Any:
  """The sharding of a key array's data: the key's, the trailing key dims replicated."""
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec) + extra)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec),
                         memory_kind=sharding.memory_kind)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  return None


def to_data(tree: Any) -> Any:
  """`tree` with every typed key leaf as its uint32 key data (arrays) or the
  ShapeDtypeStruct of that data, sharding kept (abstract leaves); the rest as it is."""

  def one(x):
    if not is_key(x):
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      extra = _data_shape(x.dtype)
      return jax.ShapeDtypeStruct(
          tuple(x.shape) + extra, jnp.uint32,
          sharding=_data_sharding(getattr(x, "sharding", None), len(x.shape), len(extra)))
    return jax.random.key_data(x)

  return jax.tree.map(one, tree)


def from_data(tree: Any, abstract: Any) -> Any:
  """The leaves of `tree` (as `to_data(abstract)` restored) that are keys in `abstract`,
  wrapped back into typed keys of `abstract`'s key dtype."""
  return jax.tree.map(
      lambda x, a: jax.random.wrap_key_data(x, dtype=a.dtype) if is_key(a) else x,
      tree, abstract)


def typed_shapes(saved: dict, manifest: dict | None, what: str) -> dict:
  """`saved` ({leaf path: (shape, dtype)} of the Orbax item, key data as uint32) with the
  key leaves the manifest records as keys: (key shape, key dtype)."""
  if manifest is None:
    return saved
  out = dict(saved)
  for name, entry in manifest.get("arrays", {}).items():
    if "key_impl" in entry and name in out:
      out[name] = (tuple(int(d) for d in entry["shape"]),
                   key_dtype(entry["key_impl"], f"{what}: leaf '{name}'"))
  return out
