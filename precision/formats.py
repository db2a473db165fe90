"""Facts about the floating-point formats a training recipe uses.

Every figure is derived from the bit layout (sign, exponent, mantissa) and cross-checked
against ``ml_dtypes.finfo`` in the tests.

Examples:
  >>> from precision import formats
  >>> formats.info("bf16").eps
  0.0078125
  >>> formats.swamped(1.0, 1e-5, "bf16")   # seed 004: the update vanishes
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from precision._policy import dtype_name, parse_dtype


@dataclasses.dataclass(frozen=True)
class FormatInfo:
  """Bit layout and range of one float format. Values are Python floats (exact)."""

  name: str
  dtype: np.dtype
  bits: int
  sign_bits: int
  exponent_bits: int
  mantissa_bits: int  # explicit fraction bits; precision is mantissa_bits + 1
  exponent_bias: int
  eps: float  # distance from 1.0 to the next larger value
  max: float  # largest finite value
  smallest_normal: float
  smallest_subnormal: float
  has_inf: bool
  has_nan: bool

  @property
  def precision_bits(self) -> int:
    return self.mantissa_bits + 1

  @property
  def unit_roundoff(self) -> float:
    """Relative error bound of round-to-nearest: eps / 2."""
    return self.eps / 2


def _derive(dtype: np.dtype) -> FormatInfo:
  fi = ml_dtypes.finfo(dtype)
  bits = dtype.itemsize * 8
  mant = int(fi.nmant)
  exp_bits = bits - 1 - mant
  bias = 2 ** (exp_bits - 1) - 1
  # IEEE-like formats: the top exponent is reserved for inf/NaN. float8_e4m3fn ("fn":
  # finite, NaN) has no inf and uses the top exponent for normal values except S.1111.111.
  has_inf = dtype != np.dtype(ml_dtypes.float8_e4m3fn)
  if has_inf:
    max_exp = 2 ** exp_bits - 2 - bias
    max_val = (2.0 - 2.0 ** -mant) * 2.0 ** max_exp
  else:
    max_exp = 2 ** exp_bits - 1 - bias
    max_val = (2.0 - 2.0 ** (1 - mant)) * 2.0 ** max_exp
  min_exp = 1 - bias
  return FormatInfo(
      name=dtype_name(dtype), dtype=dtype, bits=bits, sign_bits=1,
      exponent_bits=exp_bits, mantissa_bits=mant, exponent_bias=bias,
      eps=2.0 ** -mant, max=max_val, smallest_normal=2.0 ** min_exp,
      smallest_subnormal=2.0 ** (min_exp - mant), has_inf=has_inf, has_nan=True)


FORMATS: tuple[str, ...] = ("f32", "bf16", "f16", "e4m3", "e5m2")
_INFOS = {parse_dtype(n): _derive(parse_dtype(n)) for n in FORMATS + ("f64",)}


def info(dtype: Any) -> FormatInfo:
  """FormatInfo for a dtype or a name accepted by ``get_policy`` ("bf16", "e4m3", ...)."""
  return _INFOS[parse_dtype(dtype)]


def ulp(x: Any, dtype: Any) -> np.ndarray:
  """Unit in the last place of `x` in `dtype`: the gap between |x| (rounded to dtype) and
  the next representable value of larger magnitude. Returned as float64 (exact).

  For subnormal |x| this is the smallest subnormal; for inf/NaN it is NaN.
  """
  fi = info(dtype)
  with np.errstate(over="ignore"):  # |x| past the max becomes inf (or NaN): ulp is NaN
    v = np.abs(np.asarray(x, dtype=np.float64).astype(fi.dtype).astype(np.float64))
  with np.errstate(divide="ignore", invalid="ignore"):
    exponent = np.floor(np.log2(np.where(v > 0, v, fi.smallest_normal)))
  exponent = np.maximum(exponent, np.log2(fi.smallest_normal))
  out = np.exp2(exponent - fi.mantissa_bits)
  return np.where(np.isfinite(v), out, np.nan)


def round_to(x: Any, dtype: Any) -> np.ndarray:
  """`x` rounded to nearest-even in `dtype` (through ml_dtypes, strict per-op rounding)."""
  return np.asarray(x, dtype=np.float32).astype(info(dtype).dtype)


def swamped(weight: Any, update: Any, dtype: Any) -> np.ndarray:
  """Whether ``weight + update``, computed and rounded in `dtype`, rounds back to `weight`.

  This is the failure that master weights, Kahan summation and stochastic rounding exist
  to prevent (seed 004: in bf16, 1.0 + 1e-5 is 1.0; the next value above 1.0 is 1.0078125).
  """
  dt = info(dtype).dtype
  w = np.asarray(weight, dtype=np.float64).astype(dt)
  u = np.asarray(update, dtype=np.float64).astype(dt)
  # Exact sum in float64, then one rounding to the target: what a correctly rounded add does.
  total = (w.astype(np.float64) + u.astype(np.float64)).astype(dt)
  return np.asarray(total == w) & np.asarray(u != 0)
