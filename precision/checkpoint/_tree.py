"""Leaf-by-leaf comparison of a restore target with what a checkpoint holds."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from precision._keypath import key_name as _key_name
from precision.checkpoint._errors import CheckpointMismatchError  # noqa: F401  (re-export)


def leaf_path(path: tuple) -> str:
  """'params/blocks/0/attn/qkv/kernel' for a jax key path (nnx 'value' keys dropped)."""
  names = [_key_name(k) for k in path]
  return "/".join(n for n in names if n != "value")


def array_leaves(tree: Any) -> list[tuple[str, Any]]:
  """(leaf path, leaf) in flatten order for the array-like leaves of `tree` (arrays,
  ShapeDtypeStructs, orbax ArrayMetadata: anything with .shape and .dtype); None skipped."""
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
  return [(leaf_path(path), leaf) for path, leaf in leaves if leaf is not None]


def _dtype(dtype: Any) -> Any:
  # Extended dtypes (typed PRNG keys: key<fry>) have no numpy dtype; they stay as they are.
  return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def shapes_by_path(tree: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
  """{leaf path: (shape, dtype)} in flatten order (see `array_leaves`); numpy dtypes, and
  the key dtype of a typed PRNG key leaf."""
  return {name: (tuple(int(d) for d in leaf.shape), _dtype(leaf.dtype))
          for name, leaf in array_leaves(tree)}


def first_difference(saved: dict, target: dict, *, compare_dtype: bool = True) -> str | None:
  """Description of the first leaf (in target order) that differs, or None."""
  for path, (shape, dtype) in target.items():
    if path not in saved:
      return f"leaf '{path}' {shape} {dtype} is in the target but not in the checkpoint"
    s_shape, s_dtype = saved[path]
    if s_shape != shape or (compare_dtype and s_dtype != dtype):
      return (f"leaf '{path}': checkpoint has {s_shape} {s_dtype}, the target expects "
              f"{shape} {dtype}")
  for path, (shape, dtype) in saved.items():
    if path not in target:
      return f"leaf '{path}' {shape} {dtype} is in the checkpoint but not in the target"
  return None


def config_difference(saved: dict | None, target: dict | None) -> str | None:
  """First differing field of two model-config dicts, or None."""
  if saved is None or target is None:
    return None
  for key in sorted(set(saved) | set(target)):
    if saved.get(key) != target.get(key):
      return f"model config field '{key}': checkpoint {saved.get(key)!r}, target {target.get(key)!r}"
  return None


def to_abstract(tree: Any) -> Any:
  """ShapeDtypeStructs (keeping any sharding) for the array leaves of `tree`."""

  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      sharding = getattr(x, "sharding", None)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x

  return jax.tree.map(one, tree)
