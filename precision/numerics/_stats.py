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
from precision._dtypes import is_float

# What-if formats: (column prefix, element dtype, scaling): "none" (the values as they
# are), "tensor" (per-tensor current scaling, `current_scale`) or "block" (MXFP8: one
# power-of-two scale per MX_BLOCK elements along the tensor's block axes, `mxfp8_round`).
WHATIF = (
    ("bf16", np.dtype(ml_dtypes.bfloat16), "none"),
    ("f16", np.dtype(np.float16), "none"),
    ("e4m3", np.dtype(ml_dtypes.float8_e4m3fn), "tensor"),
    ("e5m2", np.dtype(ml_dtypes.float8_e5m2), "tensor"),
    ("mxfp8", np.dtype(ml_dtypes.float8_e4m3fn), "block"),
)
WHATIF_STATS = ("underflow", "overflow", "sqnr_db")
MX_BLOCK = 32
# E4M3's max 448 = 0.875 * 2**9 (frexp): the MXFP8 scale exponent of a block with
# amax = m * 2**e (m in [0.5, 1)) is e - 9, plus one where m > 0.875.
_MX_FREXP_MANT, _MX_FREXP_EXP = 0.875, 9
_E8M0_MAX = 127




def is_fp8(dtype: Any) -> bool:
  return np.dtype(dtype).itemsize == 1 and is_float(dtype)


def current_scale(amax: float, dtype: Any) -> np.float32:
  """Transformer Engine's per-tensor current scaling: fp8 max / amax in f32 (1 when amax
  is 0 or not finite)."""
  if not (amax > 0 and math.isfinite(amax)):
    return np.float32(1.0)
  return np.float32(formats.info(dtype).max) / np.float32(amax)


def block_layout(shape: tuple, block_axes: Any = None) -> tuple:
  """How MXFP8 blocks run through a tensor of `shape`: (perm, pre, k, post).

  The block axes (default: the last axis; () for a 0-d tensor) are flattened, in the
  order given, into one axis of length k, cut into blocks of MX_BLOCK consecutive
  elements (a trailing partial block is a block of its own). When the axes are
  consecutive and increasing the tensor is read in place as [pre, k, post] (perm None);
  otherwise it is first transposed by `perm` (the other axes, then the block axes), and
  post is 1. No block axes (a GEMM without contraction): k = 1, every element a block.

  Raises:
    ValueError: an axis out of range, repeated, or not an integer.
  """
  shape = tuple(int(d) for d in shape)
  nd = len(shape)
  axes = (nd - 1,) if block_axes is None and nd else tuple(block_axes or ())
  for a in axes:
    if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or not -nd <= a < nd:
      raise ValueError(f"block_axes={block_axes!r} for shape {shape}; accepted: distinct "
                       f"ints in [{-nd}, {nd})")
  axes = tuple(int(a) % nd for a in axes)
  if len(set(axes)) != len(axes):
    raise ValueError(f"block_axes={block_axes!r} repeats an axis; accepted: distinct ints")
  prod = lambda dims: int(np.prod(dims, dtype=np.int64))
  if not axes:
    return None, prod(shape), 1, 1
  if axes == tuple(range(axes[0], axes[0] + len(axes))):
    return (None, prod(shape[:axes[0]]), prod(shape[axes[0]:axes[-1] + 1]),
            prod(shape[axes[-1] + 1:]))
  others = tuple(a for a in range(nd) if a not in axes)
  return others + axes, prod([shape[a] for a in others]), prod([shape[a] for a in axes]), 1


def to_blocks(x: np.ndarray, layout: tuple) -> np.ndarray:
  """x arranged as [pre, n_blocks, MX_BLOCK, post] by `layout` (block_layout), the last
  block of each run zero-padded."""
  perm, pre, k, post = layout
  a = (np.transpose(x, perm) if perm is not None else x).reshape(pre, k, post)
  nb = -(-k // MX_BLOCK)
  a = np.pad(a, ((0, 0), (0, nb * MX_BLOCK - k), (0, 0)))
  return a.reshape(pre, nb, MX_BLOCK, post)


def mxfp8_round(blocks: np.ndarray) -> np.ndarray:
  """MXFP8 (E4M3 elements) quantise-dequantise of f32 `blocks` [..., MX_BLOCK, post]
  (blocks along axis -2), as precision.fp8.mxfp8_quantize with scale_rounding "up":
  s = ceil(log2(amax / 448)) clamped to [-127, 127] from the block's largest finite
  |x| (exact, from frexp; a block without a nonzero finite element has s = -127 and
  nothing to measure), elements x / 2**s rounded to nearest even in E4M3 (no element
  exceeds 448), read back as q * 2**s in f32 (inf past f32's max). Non-finite elements
  stay non-finite. Returns f32 values of the same shape."""
  b = np.asarray(blocks, np.float32)
  fin = np.isfinite(b)
  amax = np.max(np.where(fin, np.abs(b), np.float32(0)), axis=-2, keepdims=True)
  m, e = np.frexp(amax)
  s = (e - _MX_FREXP_EXP + (m > _MX_FREXP_MANT)).astype(np.int32)
  s = np.clip(np.where(amax > 0, s, -_E8M0_MAX), -_E8M0_MAX, _E8M0_MAX)
  with np.errstate(over="ignore", invalid="ignore"):
    y = np.ldexp(b.astype(np.float64), -s).astype(np.float32)   # exact, then f32's rounding
    q = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.ldexp(q, s).astype(np.float32)


def _mxfp8(x32: np.ndarray, block_axes: Any) -> dict:
  """underflow, overflow and sqnr_db of the nonzero finite elements of x32 (shaped)
  quantised to MXFP8 along `block_axes`."""
  blocks = to_blocks(x32, block_layout(x32.shape, block_axes))
  r = mxfp8_round(blocks)
  nz = np.isfinite(blocks) & (blocks != 0)
  return _measure(blocks[nz], r[nz].astype(np.float64), None)


def _measure(v32: np.ndarray, r: np.ndarray, info) -> dict:
  """The statistics of nonzero finite f32 values v32 against their rounding r (f64);
  `info` the format's formats.info for subnormal and saturated (None: not measured)."""
  n = v32.size
  if n == 0:
    return dict(underflow=0.0, subnormal=0.0, overflow=0.0, saturated=0.0,
                sqnr_db=math.inf)
  finite = np.isfinite(r)
  mag = np.abs(r)
  underflow = np.count_nonzero(r == 0) / n
  overflow = np.count_nonzero(~finite) / n
  subnormal = saturated = 0
  if info is not None:
    subnormal = np.count_nonzero(finite & (r != 0) & (mag < info.smallest_normal)) / n
    saturated = np.count_nonzero(mag == info.max) / n if info.fp8 else 0
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


class _Info:
  def __init__(self, dtype):
    fi = formats.info(dtype)
    self.smallest_normal, self.max, self.fp8 = fi.smallest_normal, fi.max, is_fp8(dtype)


def _rounding(v32: np.ndarray, dtype: np.dtype) -> dict:
  """underflow, subnormal, overflow, saturated and sqnr_db of the nonzero finite f32
  values `v32` rounded to `dtype`."""
  if dtype.itemsize >= 4:   # f32 (or wider): the stored value is the value
    r = v32.astype(np.float64)
  else:
    with np.errstate(over="ignore", invalid="ignore"):   # overflow is what is measured
      r = v32.astype(dtype).astype(np.float64)
  return _measure(v32, r, _Info(dtype))


def tensor_stats(x: Any, dtype: Any, block_axes: Any = None) -> dict:
  """Every statistic of one tensor (see precision.numerics.TensorStats for definitions).

  Args:
    x: the tensor's values (any float array; taken in f32).
    dtype: the format the program rounds it to (or stores it in).
    block_axes: the axes the MXFP8 what-if's blocks run along (`block_layout`; default
      the last axis): a GEMM operand's contraction axes.
  Returns:
    {statistic name: float}: size, nonzero, nonfinite, zeros, amax, amin_nonzero,
    dynamic_range_bits, underflow, subnormal, overflow, saturated, sqnr_db and the
    whatif_<format>_<underflow|overflow|sqnr_db> columns.
  """
  dtype = np.dtype(dtype)
  shaped = np.asarray(x).astype(np.float32)
  x32 = shaped.ravel()
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
  for prefix, fmt, scaling in WHATIF:
    if scaling == "tensor":
      # Scaled in f32 as the fp8 GEMM would be; SQNR is then measured on the scaled
      # values (the scale cancels in the ratio, up to the f32 rounding of the product).
      s = _rounding(v * current_scale(amax, fmt), fmt)
    elif scaling == "block":   # measured on the dequantised values: scales differ by block
      s = _mxfp8(shaped, block_axes)
    else:
      s = _rounding(v, fmt)
    for stat in WHATIF_STATS:
      out[f"whatif_{prefix}_{stat}"] = s[stat]
  return out
