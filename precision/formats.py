"""Facts about the floating-point formats a training recipe uses.

Every figure is derived from the bit layout (sign, exponent, mantissa) and cross-checked
against ``ml_dtypes.finfo`` in the tests.

Examples:
  >>> from precision import formats
  >>> formats.info("bf16").eps
  0.0078125
  >>> formats.swamped(1.0, 1e-5, "bf16")   # the update vanishes
  True
  >>> float(formats.round_to(1 + 2**-11 + 2**-40, "f16"))   # one rounding from f64
  1.0009765625
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
  v = np.abs(round_to(x, dtype).astype(np.float64))  # past the max: inf (or NaN), ulp NaN
  with np.errstate(divide="ignore", invalid="ignore"):
    exponent = np.floor(np.log2(np.where(v > 0, v, fi.smallest_normal)))
  exponent = np.maximum(exponent, np.log2(fi.smallest_normal))
  out = np.exp2(exponent - fi.mantissa_bits)
  return np.where(np.isfinite(v), out, np.nan)


_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)


def _f64_to_f32_round_to_odd(x: np.ndarray) -> np.ndarray:
  """f64 -> f32 rounded to odd: exact values stay, inexact ones take the neighbour (of the
  two f32 values around x) whose last significand bit is 1.

  Rounding to odd keeps a "sticky" trace of everything below the f32 precision, so a
  second rounding to nearest-even at a precision at most 22 bits (f32's 24 minus 2) gives
  the correctly rounded result of x itself (Boldo & Melquiond, "Emulation of FMA and
  correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008). f32 has
  at least 16 bits below the ulp of every 16- and 8-bit format everywhere they have
  values (bf16 shares f32's exponent range, subnormals included), so that holds.
  """
  with np.errstate(over="ignore", invalid="ignore"):
    nearest = x.astype(_F32)  # round to nearest even (IEEE, exact for NaN and inf)
  inexact = np.isfinite(x) & (nearest.astype(_F64) != x)
  # Truncate toward zero: step back one f32 ulp where nearest-even rounded away from zero
  # (an overflow to inf steps back to the f32 max).
  away = inexact & (np.abs(nearest.astype(_F64)) > np.abs(x))
  trunc = np.where(away, np.nextafter(nearest, np.float32(0)), nearest)
  # The truncation or its successor, whichever is odd: setting the last bit picks it.
  bits = trunc.view(np.uint32) | np.where(inexact, np.uint32(1), np.uint32(0))
  return bits.view(_F32)


def round_to(x: Any, dtype: Any) -> np.ndarray:
  """`x` rounded once, to nearest (ties to even), into `dtype`; a numpy array of `dtype`.

  One rounding from the input's own precision: f32, f16, bf16 and fp8 inputs are cast
  directly (ml_dtypes rounds each of those correctly); f64 inputs (and Python floats)
  are rounded from their exact f64 value, not through f32, which would round twice
  (1 + 2**-11 + 2**-40 would become 1 + 2**-11, a tie, then 1.0 in f16 instead of
  1.0009765625). Out of range values become what the format's cast gives: inf (f16, bf16,
  e5m2) or NaN (e4m3, which has no inf).

  Args:
    x: a number or array of float dtype (f64, f32, f16, bf16, e4m3, e5m2), or of integer
      dtype with every |x| <= 2**53 (exact in f64).
    dtype: the target, a dtype or a name ("bf16", "e4m3", ...).

  Raises:
    ValueError: another input dtype, or an integer beyond 2**53.

  Examples:
    >>> float(round_to(1 + 2**-11 + 2**-40, "f16"))
    1.0009765625
    >>> float(round_to(1.0 + 2**-8, "bf16"))   # a tie: to even
    1.0
  """
  target = info(dtype).dtype
  a = np.asarray(x)
  if a.dtype.kind in "iub":
    if a.size and np.max(np.abs(a.astype(_F64))) > 2.0 ** 53:
      raise ValueError(f"round_to: integer input up to {np.max(np.abs(a))} is not exact in "
                       "f64; accepted: integers with |x| <= 2**53, or a float array")
    a = a.astype(_F64)
  elif a.dtype not in _INFOS:
    raise ValueError(f"round_to: input dtype {a.dtype.name!r}; accepted: "
                     f"{', '.join(sorted(dtype_name(d) for d in _INFOS))} or integers")
  if a.dtype == target:
    return a.copy()
  if a.dtype != _F64 or target in (_F64, _F32):
    # Narrower inputs: ml_dtypes' casts round once. f64 -> f32 is the IEEE cast.
    with np.errstate(over="ignore", invalid="ignore"):
      return a.astype(target)
  with np.errstate(over="ignore", invalid="ignore"):
    return _f64_to_f32_round_to_odd(a).astype(target)


def swamped(weight: Any, update: Any, dtype: Any) -> np.ndarray:
  """Whether ``weight + update``, computed and rounded in `dtype`, rounds back to `weight`.

  This is the failure that master weights, Kahan summation and stochastic rounding exist
  to prevent (in bf16, 1.0 + 1e-5 is 1.0; the next value above 1.0 is 1.0078125).
  `weight` and `update` are first rounded to `dtype` (`round_to`).
  """
  w = round_to(weight, dtype)
  u = round_to(update, dtype)
  # The sum in f64, then one rounding to the target: what a correctly rounded add does.
  # It is exact when the exponents are within 29 of each other (two values of at most 24
  # significant bits); otherwise the smaller one is under 2**-28 of the larger, far below
  # half an ulp of any target, and the f64 rounding cannot change the final result.
  total = round_to(w.astype(np.float64) + u.astype(np.float64), dtype)
  return np.asarray(total == w) & np.asarray(u != 0)


__all__ = ["FORMATS", "FormatInfo", "info", "round_to", "swamped", "ulp"]
