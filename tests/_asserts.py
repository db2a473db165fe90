"""The test assertions on pytrees: one definition of bit-identical, one of close.

Bit-identical (`assert_bit_identical`, `bit_identical`): the same tree structure, and leaf
by leaf the same dtype, the same shape and the same bytes. So -0.0 differs from +0.0, a
NaN equals a NaN with the same bit pattern (and only that one), and a bf16 1.0 differs
from an f32 1.0. A typed PRNG key (``jax.random.key``) is compared by its key data and its
implementation; a raw uint32 key (``jax.random.PRNGKey``) is an ordinary uint32 array, so
it differs from a typed key with the same data. Non-array leaves (Python numbers, strings)
compare with ``==`` and their type.

Close (`assert_allclose`): the same structure, dtypes and shapes, and every element within
``atol + rtol * |want|``, computed in float64; NaNs must sit at the same places. The
tolerances have no defaults: each assertion says how close is close enough.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(x: Any) -> Any:
  """An array leaf as a NumPy array (typed keys as their key data); other leaves as is."""
  if _is_key(x):
    return np.asarray(jax.random.key_data(x))
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return np.asarray(x)
  return x


def bits(x: Any) -> np.ndarray:
  """The raw bit patterns of an array as unsigned integers of its itemsize (uint8 ..
  uint64), same shape; a typed key gives its key data."""
  a = np.ascontiguousarray(_host(x))
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _leaves(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in flat], treedef


def _leaf_difference(x: Any, y: Any) -> str | None:
  """Why leaf `x` is not bit-identical to `y`, or None when it is."""
  if _is_key(x) or _is_key(y):
    if not (_is_key(x) and _is_key(y)):
      return f"a typed PRNG key vs {type(y if _is_key(x) else x).__name__}"
    if jax.random.key_impl(x) != jax.random.key_impl(y):
      return f"key impl {jax.random.key_impl(x)} != {jax.random.key_impl(y)}"
  hx, hy = _host(x), _host(y)
  if not isinstance(hx, np.ndarray) or not isinstance(hy, np.ndarray):
    if type(hx) is not type(hy) or hx != hy:
      return f"{hx!r} ({type(hx).__name__}) != {hy!r} ({type(hy).__name__})"
    return None
  if hx.dtype != hy.dtype:
    return f"dtype {hx.dtype} != {hy.dtype}"
  if hx.shape != hy.shape:
    return f"shape {hx.shape} != {hy.shape}"
  if hx.tobytes() == hy.tobytes():
    return None
  bx, by = bits(hx).reshape(-1), bits(hy).reshape(-1)
  bad = np.flatnonzero(bx != by)
  first = bad[0]
  got, want = hx.reshape(-1)[first], hy.reshape(-1)[first]
  return (f"{bad.size} of {hx.size} elements differ; first at flat index {first}: "
          f"{got!r} (bits {bx[first]:#x}) != {want!r} (bits {by[first]:#x})")


def tree_difference(got: Any, want: Any) -> str | None:
  """The first way `got` is not bit-identical to `want` (path and reason), or None."""
  got_leaves, got_def = _leaves(got)
  want_leaves, want_def = _leaves(want)
  if got_def != want_def:
    return f"tree structure {got_def} != {want_def}"
  for (path, x), (_, y) in zip(got_leaves, want_leaves):
    why = _leaf_difference(x, y)
    if why is not None:
      return f"{path}: {why}"
  return None


def bit_identical(got: Any, want: Any) -> bool:
  """Whether two pytrees (or arrays) are bit-identical (see the module docstring)."""
  return tree_difference(got, want) is None


def assert_bit_identical(got: Any, want: Any, what: str = "") -> None:
  """Asserts two pytrees (or arrays) are bit-identical, naming the first differing leaf."""
  why = tree_difference(got, want)
  if why is not None:
    raise AssertionError(f"{what + ': ' if what else ''}not bit-identical: {why}")


def assert_allclose(got: Any, want: Any, *, rtol: float, atol: float, what: str = "") -> None:
  """Asserts same structure, dtypes and shapes and ``|got - want| <= atol + rtol *
  |want|`` elementwise (float64; NaNs at the same places), naming the leaf that fails."""
  got_leaves, got_def = _leaves(got)
  want_leaves, want_def = _leaves(want)
  prefix = f"{what + ': ' if what else ''}"
  if got_def != want_def:
    raise AssertionError(f"{prefix}tree structure {got_def} != {want_def}")
  for (path, x), (_, y) in zip(got_leaves, want_leaves):
    hx, hy = np.asarray(_host(x)), np.asarray(_host(y))
    if hx.dtype != hy.dtype or hx.shape != hy.shape:
      raise AssertionError(f"{prefix}{path}: {hx.dtype}{list(hx.shape)} != "
                           f"{hy.dtype}{list(hy.shape)}")
    np.testing.assert_allclose(hx.astype(np.float64), hy.astype(np.float64), rtol=rtol,
                               atol=atol, err_msg=f"{prefix}{path}")
