"""Dtype predicates, one home for the package: which dtypes are floating, and which are
narrower than f32.

Floating means a real floating dtype, numpy's or ml_dtypes' (bfloat16, the float8, float6
and float4 formats), as `jnp.issubdtype(dtype, jnp.floating)` says; integer, bool,
complex and extended dtypes (PRNG keys) are not. Casts touch floating leaves only (rule
3), and "below f32" is what needs f32 accumulation, f32 islands and loss scaling.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np


def _dtype(x: Any) -> np.dtype | None:
  """The numpy dtype of `x` (a dtype, its name, a scalar type, or anything with a
  ``dtype``: an array, a ShapeDtypeStruct), or None (extended dtypes, non-arrays)."""
  candidate = x if isinstance(x, (np.dtype, str, type)) else getattr(x, "dtype", None)
  if candidate is None:
    return None
  try:
    return np.dtype(candidate)
  except TypeError:  # extended dtypes (PRNG keys), Python objects
    return None


def is_float(x: Any) -> bool:
  """True for a real floating dtype (f64 .. fp4), or an array / value of one."""
  dtype = _dtype(x)
  return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def below_f32(x: Any) -> bool:
  """True for a floating dtype narrower than f32 (f16, bf16, fp8, fp6, fp4), or an array
  of one."""
  dtype = _dtype(x)
  return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating)) and (
      dtype.itemsize < 4)


__all__ = ["below_f32", "is_float"]
