"""The statistics of one tensor against rounding to a float format, on the host in numpy.

Every statistic is taken from the tensor's values in f32 (the value before the program
rounds it, see precision.numerics.inspect) and its rounding to a format by ml_dtypes
(round to nearest, ties to even, subnormals kept: what XLA's convert does with faithful
rounding). Sums run in f64. Fractions are over the tensor's nonzero finite elements.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from precision import formats

# What-if formats: (column prefix, dtype, per-tensor current scaling).
WHATIF = (
    ("bf16", np.dtype(ml_dtypes.bfloat16), False),
    ("f16", np.dtype(np.float16), False),
    ("e4m3", np.dtype(ml_dtypes.float8_e4m3fn), True),
    ("e5m2", np.dtype(ml_dtypes.float8_e5m2), True),
)
WHATIF_STATS = ("underflow", "overflow", "sqnr_db")


def is_float(dtype: Any) -> bool:
  """True for numpy's floats and ml_dtypes' (bfloat16, the float8 formats)."""
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.floating):
    return True
  try:
    ml_dtypes.finfo(dtype)
  except (ValueError, TypeError):
    return False
  return True


def is_fp8(dtype: Any) -> bool:
  return np.dtype(dtype).itemsize == 1 and is_float(dtype)


def current_scale(amax: float, dtype: Any) -> np.float32:
  """Transformer Engine's per-tensor current scaling: fp8 max / amax in f32 (1 when amax
  is 0 or not finite)."""
  if not (amax > 0 and math.isfinite(amax)):
    return np.float32(1.0)
  return np.float32(formats.info(dtype).max) / np.float32(amax)


def _rounding(v32: np.ndarray, dtype: np.dtype) -> dict:
  """underflow, subnormal, overflow, saturated and sqnr_db of the nonzero finite f32
  values `v32` rounded to `dtype`."""
  n = v32.size
  if n == 0:
    return dict(underflow=0.0, subnormal=0.0, overflow=0.0, saturated=0.0,
                sqnr_db=math.inf)
  info = formats.info(dtype)
  if dtype.itemsize >= 4:   # f32 (or wider): the stored value is the value
    r = v32.astype(np.float64)
  else:
    with np.errstate(over="ignore", invalid="ignore"):   # overflow is what is measured
      r = v32.astype(dtype).astype(np.float64)
  finite = np.isfinite(r)
  mag = np.abs(r)
  underflow = np.count_nonzero(r == 0) / n
  overflow = np.count_nonzero(~finite) / n
  subnormal = np.count_nonzero(finite & (r != 0) & (mag < info.smallest_normal)) / n
  saturated = np.count_nonzero(mag == info.max) / n if is_fp8(dtype) else 0
  underflow, overflow, subnormal, saturated = map(
      float, (underflow, overflow, subnormal, saturated))
  v = v32.astype(np.float64)
  signal = float(np.sum(v * v))
  if overflow:
    sqnr = -math.inf
  else:
    noise = float(np.sum((v - r) ** 2))
    sqnr = math.inf if noise == 0 else 10.0 * math.log10(signal / noise)
  return dict(underflow=underflow, subnormal=subnormal, overflow=overflow,
              saturated=saturated, sqnr_db=sqnr)


def tensor_stats(x: Any, dtype: Any) -> dict:
  """Every statistic of one tensor (see precision.numerics.TensorStats for definitions).

  Args:
    x: the tensor's values (any float array; taken in f32).
    dtype: the format the program rounds it to (or stores it in).
  Returns:
    {statistic name: float}: size, nonzero, nonfinite, zeros, amax, amin_nonzero,
    dynamic_range_bits, underflow, subnormal, overflow, saturated, sqnr_db and the
    whatif_<format>_<underflow|overflow|sqnr_db> columns.
  """
  dtype = np.dtype(dtype)
  x32 = np.asarray(x).astype(np.float32).ravel()
  size = x32.size
  finite = np.isfinite(x32)
  v = x32[finite & (x32 != 0)]
  mag = np.abs(v)
  amax = float(mag.max()) if v.size else 0.0
  amin = float(mag.min()) if v.size else 0.0
  out = dict(size=size, nonzero=int(v.size),
             nonfinite=float(np.count_nonzero(~finite) / size) if size else 0.0,
             zeros=float(np.count_nonzero(x32 == 0) / size) if size else 0.0,
             amax=amax, amin_nonzero=amin,
             dynamic_range_bits=(math.log2(amax) - math.log2(amin)) if v.size else 0.0)
  out.update(_rounding(v, dtype))
  for prefix, fmt, scaled in WHATIF:
    if scaled:
      # Scaled in f32 as the fp8 GEMM would be; SQNR is then measured on the scaled
      # values (the scale cancels in the ratio, up to the f32 rounding of the product).
      s = _rounding(v * current_scale(amax, fmt), fmt)
    else:
      s = _rounding(v, fmt)
    for stat in WHATIF_STATS:
      out[f"whatif_{prefix}_{stat}"] = s[stat]
  return out
