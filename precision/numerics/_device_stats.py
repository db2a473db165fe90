"""The statistics of precision.numerics.TensorStats computed on the device, in jnp.

The same definitions as the host-side numpy version (precision.numerics._stats, which is
the reference the tests hold this one to), computed inside a compiled program so a
training step can measure every GEMM tensor without copying it to the host:

* Rounding to bf16, f16 and E5M2 is `lax.reduce_precision` (IEEE semantics, subnormals
  kept, overflow to inf), which XLA never removes; a convert pair f32 -> bf16 -> f32 may
  be folded away where XLA allows excess precision. E4M3 (float8_e4m3fn: no inf, max
  448) is a 5-exponent-bit reduce_precision in its normal range, with its subnormals and
  its NaN on overflow applied by hand (the convert's results; see `round_to`); other
  formats are rounded by a convert there and back.
* Sums run in f32 (the device has no f64 without jax_enable_x64). SQNR of a tensor whose
  squares would overflow f32 is taken on its values divided by its amax (the ratio is
  unchanged; errors below f32's normal range then count as 0, so such a tensor's SQNR
  above ~300 dB reads as inf). x - round(x) is exact in f32 for every format here (the rounding only
  drops low bits of x), so the noise terms carry no extra rounding.
* Counts are int32 sums: exact for tensors of up to 2**31 - 1 elements.
* Cost: the counts and extrema of a group of rows come from two variadic reduces (one
  loop over the data each): the first before amax is known, the second after, with
  every format's counts taken from its rounding boundaries on |v| (`_thresholds`: the
  same counts as from the rounding, without computing it there). Each rounding is
  computed once, in its noise sum; each f32 sum (a signal or noise term) stays a
  reduction of its own, so its order of addition, and every bit of the SQNRs, is that of
  a plain f32 sum. MXFP8 adds one reduction (its block amax).
* A device that flushes f32 subnormals (XLA:CPU in compiled code) measures values below
  f32's smallest normal (1.2e-38) as zeros; only bf16's own subnormals live there.
"""

from __future__ import annotations


import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from precision import formats
from precision.fp8 import _microscale
from precision.numerics import _stats

# The order of the statistics in the vector `tensor_stats` returns (after `size`, which is
# static): the fields of TensorStats from `nonzero` on.
BASE_FIELDS = ("nonzero", "nonfinite", "zeros", "amax", "amin_nonzero",
               "dynamic_range_bits", "underflow", "subnormal", "overflow", "saturated",
               "sqnr_db")
WHATIF_FIELDS = tuple(f"whatif_{prefix}_{stat}" for prefix, _, _ in _stats.WHATIF
                      for stat in _stats.WHATIF_STATS)
FIELDS = BASE_FIELDS + WHATIF_FIELDS

# (exponent bits, mantissa bits, smallest subnormal) of the IEEE-like formats rounded by
# reduce_precision in their normal range and by hand below it (XLA's reduce_precision
# flushes results below the target's normal range to zero).
_REDUCE = {np.dtype(jnp.bfloat16): (8, 7, None), np.dtype(jnp.float16): (5, 10, 2.0 ** -24),
           np.dtype(jnp.float8_e5m2): (5, 2, 2.0 ** -16)}
_E4M3 = np.dtype(jnp.float8_e4m3fn)
# MXFP8 (see _MxRounded): E4M3's half smallest subnormal; the scale exponent at which a
# dequantised element can pass f32's max (ceil(log2(f32 max / 448))); the scaled
# magnitude from which it does.
_MX_UNDER = np.float32(2.0 ** -10)
_MX_OVER_S = 120
_MX_OVER_Y = np.float32(248.0)


def round_to(x32: jnp.ndarray, dtype) -> jnp.ndarray:
  """x32 (f32) rounded to nearest-even in `dtype` (subnormals kept, overflow to inf;
  E4M3 to NaN as its convert does), returned in f32."""
  dtype = np.dtype(dtype)
  if dtype.itemsize >= 4:
    return x32
  if dtype in _REDUCE:
    e, m, tiny = _REDUCE[dtype]
    r = lax.reduce_precision(x32, exponent_bits=e, mantissa_bits=m)
    if tiny is None:   # bf16: its subnormals are f32's, below what training values reach
      return r
    # Below the smallest normal the format's values are the multiples of its smallest
    # subnormal: x / tiny is exact (a power-of-two scaling) and jnp.round ties to even.
    sub = jnp.round(x32 / np.float32(tiny)) * np.float32(tiny)
    return jnp.where(jnp.abs(x32) < np.float32(formats.info(dtype).smallest_normal), sub, r)
  if dtype == _E4M3:
    # E4M3's normal values are those of a 5-exponent-bit, 3-mantissa-bit IEEE format
    # between 2**-6 and 448 (it uses the top exponent for numbers: 256 to 448, no inf);
    # above, where the convert gives NaN (its only non-finite value), so does this. Bit
    # for bit the convert's result (checked over 9.5 million f32 values), at a fraction
    # of its cost on XLA:CPU, which expands the f8 convert into integer code.
    r = lax.reduce_precision(x32, exponent_bits=5, mantissa_bits=3)
    sub = jnp.round(x32 / np.float32(2.0 ** -9)) * np.float32(2.0 ** -9)
    r = jnp.where(jnp.abs(x32) < np.float32(2.0 ** -6), sub, r)
    return jnp.where(jnp.abs(r) > np.float32(448.0), np.float32(np.nan), r)
  return x32.astype(dtype).astype(jnp.float32)


def _frac(count, total):
  return jnp.where(total > 0, count.astype(jnp.float32)
                   / jnp.maximum(total, 1).astype(jnp.float32), 0.0)


def _row_reduce(terms) -> list:
  """Several row statistics of [g, n] operands in one pass: `terms` holds (kind, operand)
  pairs, kind "count" (a bool mask, summed as int32), "max" or "min" (f32). One variadic
  reduce: XLA emits a single loop over the rows with every operand's elementwise producer
  fused into it, where separate reductions are one pass over the data each (XLA:CPU does
  not fuse sibling reductions). Counts and extrema do not depend on the order of the
  reduction; f32 sums do, and are `_sum`s of their own. Returns the [g] results in order."""
  kinds = [k for k, _ in terms]
  ops = tuple(m.astype(jnp.int32) if k == "count" else m for k, m in terms)
  init = tuple(np.int32(0) if k == "count" else
               np.float32(-np.inf) if k == "max" else np.float32(np.inf) for k in kinds)

  def combine(a, b):
    return tuple(u + v if k == "count" else jnp.maximum(u, v) if k == "max" else
                 jnp.minimum(u, v) for k, u, v in zip(kinds, a, b))
  return list(lax.reduce(ops, init, combine, (1,)))


def _sum(e):
  """The f32 row sums of e * e: a reduction of its own, in the order XLA chooses for a
  single-operand f32 sum (vectorised partial sums on the CPU), which a variadic reduce
  does not keep: its loop adds element by element."""
  return jnp.sum(e * e, axis=1)


def _sqnr(signal, noise, overflow, n):
  sqnr = jnp.where(noise > 0, 10.0 * jnp.log10(signal / jnp.where(noise > 0, noise, 1.0)),
                   jnp.inf)
  return jnp.where(overflow > 0, -jnp.inf, jnp.where(n > 0, sqnr, jnp.inf))


def _thresholds(dtype) -> tuple:
  """(under, over, sub_lo, sub_hi, sat_lo): f32 bounds on |v| of a finite f32 v that say
  what its round-to-nearest-even r in `dtype` is, without rounding: r == 0 iff
  |v| <= under; r non-finite iff |v| > over; r subnormal (finite, nonzero, below the
  smallest normal) iff sub_lo < |v| < sub_hi; |r| == max iff sat_lo < |v| <= over.
  Ties go to the even neighbour: 0 below the smallest subnormal, the smallest normal
  above the largest subnormal, and at max + ulp/2 to inf where max's last mantissa bit
  is 1 (bf16, f16, E5M2) but to max where it is 0 (E4M3, whose 464 rounds to 448). For
  f32 (stored as is) nothing is rounded: no bound is ever crossed."""
  dtype = np.dtype(dtype)
  if dtype.itemsize >= 4:
    return (np.float32(-1.0), np.float32(np.inf), np.float32(np.inf), np.float32(0.0),
            np.float32(np.inf))
  fi = ml_dtypes.finfo(dtype)
  tiny, normal, fmax = (float(fi.smallest_subnormal), float(fi.smallest_normal),
                        float(fi.max))
  ulp = 2.0 ** (math.floor(math.log2(fmax)) - int(fi.nmant))
  even = int(round(fmax / ulp)) % 2 == 0   # max's last mantissa bit
  below = lambda t: np.nextafter(np.float32(t), np.float32(0))   # |v| >= t iff |v| > below(t)
  over = np.float32(fmax + ulp / 2) if even else below(fmax + ulp / 2)
  sat_lo = below(fmax - ulp / 2) if even else np.float32(fmax - ulp / 2)
  return (np.float32(tiny / 2), over, np.float32(tiny / 2), np.float32(normal - tiny / 2),
          sat_lo)


class _Rounded:
  """One rounding r of the values v of a block ([g, n] f32, scaled as SQNR measures them
  with `inv` [g, 1]): its noise, and its count terms from `_thresholds` on |v| (the same
  counts as from r, without computing r in the pass that counts)."""

  def __init__(self, v, r, nz, inv, bounds):
    self.v, self.r, self.nz, self.inv = v, r, nz, inv
    self.under, self.over = bounds

  def counts(self):
    """(kind, mask) terms of underflow and overflow."""
    mag = jnp.abs(self.v)
    return [("count", self.nz & (mag <= self.under)), ("count", self.nz & (mag > self.over))]

  def noise(self):
    finite = jnp.isfinite(self.r)
    return _sum(jnp.where(self.nz & finite, (self.v - self.r) * self.inv, 0.0))


def _normaliser(amax):
  """What SQNR's sums multiply each value by: 1/amax for tensors whose squares would
  overflow f32 (amax > 2**60), else 1 (dividing small tensors by their amax would push
  the errors of their smallest elements into f32's flushed subnormals)."""
  big = amax > np.float32(2.0 ** 60)
  return jnp.where(big, 1.0 / jnp.where(big, amax, 1.0), np.float32(1.0))


def _current_scale(amax, dtype):
  """precision.numerics._stats.current_scale on the device: fp8 max / amax in f32, 1 when
  amax is 0 or not finite."""
  ok = (amax > 0) & jnp.isfinite(amax)
  return jnp.where(ok, np.float32(formats.info(dtype).max) / jnp.where(ok, amax, 1.0),
                   np.float32(1.0))


def _pow2(k):
  """2.0**k in f32 for int32 k in [-126, 127] (a normal number), from its bits."""
  return lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << np.uint32(23),
                                  jnp.float32)


def _mxfp8(xm, layout, inv) -> _Rounded:
  """The MXFP8 rounding of rows xm (f32 [g, pre * k * post], the tensors arranged by
  `layout`, see _stats.block_layout) on the rows zero-padded to whole blocks:
  [g, pre * n_blocks * MX_BLOCK * post].

  As precision.fp8.mxfp8_quantize and mxfp8_dequantize compute it (scale_rounding
  "up"): the same scale exponent s (`e8m0_exponent`) and E4M3 rounding (`round_to`'s,
  bit for bit the convert's); the scalings by 2**-s and 2**s, which those do with an
  exact integer ldexp, are multiplications by normal powers of two (2**s in two halves):
  exact wherever the result is a normal f32, so the same values, at a fraction of the
  cost. Below f32's smallest normal a backend that flushes subnormals reads 0 where the
  ldexp keeps a subnormal: an element scaled that far down is 0 in E4M3 either way, and
  a dequantised value there belongs to a tensor whose values are themselves f32
  subnormals (which such a backend flushes on input, see the module docstring)."""
  _, pre, k, post = layout
  g, nb = xm.shape[0], -(-k // _stats.MX_BLOCK)
  a = xm.reshape(g, pre, k, post)
  if nb * _stats.MX_BLOCK != k:
    a = jnp.pad(a, ((0, 0), (0, 0), (0, nb * _stats.MX_BLOCK - k), (0, 0)))
  b = a.reshape(g, pre, nb, _stats.MX_BLOCK, post)
  amax = jnp.max(jnp.where(jnp.isfinite(b), jnp.abs(b), 0.0), axis=3, keepdims=True)
  # s <= 120 for any finite amax (f32's max is below 448 * 2**120), so 2**-s is normal.
  s = _microscale.e8m0_exponent(amax, "e4m3", "up")
  half = s // 2   # s in [-127, 120]: both halves in [-64, 60]
  down, up1, up2 = _pow2(jnp.maximum(-s, -126)), _pow2(half), _pow2(s - half)
  # |b * 2**-s| <= 448 by the choice of s: the quantiser's clip to +-448 changes nothing.
  q = round_to(b * down, _E4M3)
  r = ((q * up1) * up2).reshape(g, -1)
  nz = jnp.isfinite(b) & (b != 0)
  return _MxRounded(b.reshape(g, -1), r, nz.reshape(g, -1), inv,
                    (jnp.abs(b * down) <= _MX_UNDER).reshape(g, -1),
                    ((s == _MX_OVER_S) & (jnp.abs(b * down) >= _MX_OVER_Y)).reshape(g, -1))


class _MxRounded(_Rounded):
  """An MXFP8 rounding: underflow and overflow from the scaled element y = x / 2**s
  without rounding it: y rounds to 0 in E4M3 iff |y| <= 2**-10 (half its smallest
  subnormal, a tie to 0); q * 2**s passes f32's max only for s = 120 (the largest s
  of a finite amax) and |q| >= 256, i.e. |y| >= 248 (the tie of 240 and 256 goes to
  256)."""

  def __init__(self, v, r, nz, inv, zero, big):
    super().__init__(v, r, nz, inv, (None, None))
    self.zero, self.big = zero, big

  def counts(self):
    return [("count", self.nz & self.zero), ("count", self.nz & self.big)]


def _block_stats(x, dtypes, whatif: bool, layout=None, xm=None,
                 elements=None) -> jnp.ndarray:
  """The statistics of each row of x (f32 [g, n]), row i rounded to dtypes[i]: [g, F].

  `layout` (_stats.block_layout of the rows' tensors; default: the rows as they are)
  places the MXFP8 blocks, `xm` the rows transposed by its perm (None: x).

  Two passes over the data for every count and extremum (one variadic reduce each: the
  first for amax, which the scaled roundings and SQNR's normaliser need, the second for
  every rounding's counts; MXFP8's join it where its blocks tile the rows in place, and
  add a block amax reduction), plus one f32 sum per signal and noise term.

  `elements` (int32 [g], or None: every row's n): the elements each row holds, the rest
  of it zeros that are no elements (an expert group's part, see
  precision.numerics._interpret.take): they count in no fraction's total."""
  size = x.shape[1]
  finite = jnp.isfinite(x)
  nz = finite & (x != 0)
  mag = jnp.where(nz, jnp.abs(x), 0.0)
  n, n_nonfinite, n_zeros, amax_all, amin_all = _row_reduce(
      [("count", nz), ("count", ~finite), ("count", x == 0), ("max", mag),
       ("min", jnp.where(nz, mag, jnp.inf))])
  amax = jnp.where(n > 0, amax_all, 0.0)
  amin = jnp.where(n > 0, amin_all, 0.0)
  drange = jnp.where(n > 0, jnp.log2(jnp.where(n > 0, amax, 1.0))
                     - jnp.log2(jnp.where(n > 0, amin, 1.0)), 0.0)
  # Each row's format: one rounding per distinct dtype, selected by row.
  kinds = sorted(set(dtypes), key=str)
  which = np.asarray([kinds.index(d) for d in dtypes], np.int32)[:, None]
  r = x
  bounds = np.zeros((5, len(dtypes), 1), np.float32)
  fp8 = np.zeros((len(dtypes), 1), bool)
  for j, d in enumerate(kinds):
    rows = which == j
    if d.itemsize < 4:
      r = jnp.where(rows, round_to(x, d), r) if len(kinds) > 1 else round_to(x, d)
    fp8[rows] = _stats.is_fp8(d)
    for b, t in zip(bounds, _thresholds(d)):
      b[rows] = t
  under, over, sub_lo, sub_hi, sat_lo = (b if len(kinds) > 1 else b[:1] for b in bounds)
  inv = _normaliser(amax)[:, None]
  own = _Rounded(x, r, nz, inv, (under, over))
  terms = own.counts() + [("count", nz & (mag > sub_lo) & (mag < sub_hi))]
  if fp8.any():
    sat = nz & (mag > sat_lo) & (mag <= over)
    terms.append(("count", sat & fp8 if not fp8.all() else sat))
  sums = [_sum(jnp.where(nz, x * inv, 0.0)), own.noise()]   # signal, own noise
  # What-ifs: each format's rounding once, its counts in the same pass as the others'.
  # A what-if format that is every row's own (bf16 rows, bf16 what-if) is the same
  # rounding of the same values: its statistics are the row's own.
  plan = []
  extra = []   # counts of an MXFP8 rounding whose padded rows are not x's
  if whatif:
    for _, fmt, scaling in _stats.WHATIF:
      if scaling == "none" and kinds == [np.dtype(fmt)]:
        plan.append(("own", None))
        continue
      if scaling == "block":
        layout = layout or (None, 1, size, 1)
        w = _mxfp8(x if xm is None else xm, layout, inv)
        sums.append(w.noise())   # its signal: the values', summed above
        if layout[0] is None and layout[2] % _stats.MX_BLOCK == 0:
          plan.append((len(terms), (0, len(sums) - 1)))
          terms += w.counts()
        else:
          plan.append((("extra", len(extra)), (0, len(sums) - 1)))
          extra += w.counts()
        continue
      if scaling == "tensor":
        scale = _current_scale(amax, fmt)
        v = x * scale[:, None]
        w_inv = _normaliser(amax * scale)[:, None]
        signal = len(sums)
        sums.append(_sum(jnp.where(nz, v * w_inv, 0.0)))
      else:  # the values measured above: their signal is the one already summed
        v, w_inv, signal = x, inv, 0
      w = _Rounded(v, round_to(v, fmt), nz, w_inv, _thresholds(fmt)[:2])
      plan.append((len(terms), (signal, len(sums))))
      terms += w.counts()
      sums.append(w.noise())
  counts = _row_reduce(terms)
  extra = _row_reduce(extra) if extra else []
  underflow, overflow = _frac(counts[0], n), _frac(counts[1], n)
  subnormal = _frac(counts[2], n)
  saturated = (_frac(counts[3], n) if fp8.any() else jnp.zeros(n.shape, jnp.float32))
  sqnr = _sqnr(sums[0], sums[1], overflow, n)
  total = jnp.full(n.shape, size, jnp.int32)
  if elements is not None:   # a padding zero is no element: not a zero of the tensor
    n_zeros = n_zeros - (total - elements)
    total = elements
  out = [n.astype(jnp.float32), _frac(n_nonfinite, total), _frac(n_zeros, total),
         amax, amin, drange, underflow, subnormal, overflow, saturated, sqnr]
  for at, where in plan:
    if at == "own":
      out += [underflow, overflow, sqnr]
      continue
    signal, noise = where
    c, at = (extra, at[1]) if isinstance(at, tuple) else (counts, at)
    u, o = _frac(c[at], n), _frac(c[at + 1], n)
    out += [u, o, _sqnr(sums[signal], sums[noise], o, n)]
  return jnp.stack([jnp.asarray(c, jnp.float32) for c in out], axis=1)


def batch_stats(values, dtypes, whatif: bool = True, block_axes=None,
                counts=None) -> jnp.ndarray:
  """The statistics of each tensor `values[i]` rounded to `dtypes[i]`, as f32
  [len(values), len(FIELDS)] (BASE_FIELDS only when `whatif` is False). Definitions:
  precision.numerics.TensorStats.

  `block_axes[i]`: the axes the MXFP8 what-if's blocks run along in `values[i]`
  (_stats.block_layout: a GEMM operand's contraction axes); None (for the whole list or
  one tensor): its last axis.

  Tensors of one size and one block layout are stacked and measured together (dense
  reductions along the rows), so the program has one set of operations per distinct
  tensor shape, not per tensor (a transformer's layers repeat a few); it holds one f32
  copy of each stacked group while it runs (two where the blocks need a transposition).

  `counts[i]` (an int32 scalar, or None: its size): how many elements `values[i]` holds,
  the rest zeros that are none (an expert group's rows under a jitted telemetry).
  """
  k = len(values)
  fields = FIELDS if whatif else BASE_FIELDS
  if k == 0:
    return jnp.zeros((0, len(fields)), jnp.float32)
  dtypes = [np.dtype(d) for d in dtypes]
  if block_axes is None:
    block_axes = [None] * k
  if len(block_axes) != k or len(dtypes) != k:
    raise ValueError(f"batch_stats: {k} values, {len(dtypes)} dtypes and "
                     f"{len(block_axes)} block_axes; accepted: one of each per tensor")
  layouts = [_stats.block_layout(np.shape(v), a) for v, a in zip(values, block_axes)]
  groups: dict[tuple, list[int]] = {}
  for i, v in enumerate(values):
    n = int(np.prod(np.shape(v)))
    # The layout only matters to the MXFP8 column: without what-ifs, group by size.
    groups.setdefault((n, layouts[i] if whatif else None), []).append(i)
  blocks, order = [], []
  for (n, layout), idx in groups.items():
    if n == 0:
      blocks.append(_empty(len(idx), whatif))
    else:
      x = jnp.stack([jnp.ravel(values[i]).astype(jnp.float32) for i in idx])
      xm = None
      if layout is not None and layout[0] is not None:
        xm = jnp.stack([jnp.ravel(jnp.transpose(values[i], layout[0])).astype(jnp.float32)
                        for i in idx])
      c = None
      if counts is not None and any(counts[i] is not None for i in idx):
        c = jnp.stack([jnp.asarray(n if counts[i] is None else counts[i], jnp.int32)
                       for i in idx])
      blocks.append(_block_stats(x, [dtypes[i] for i in idx], whatif, layout, xm, c))
    order += idx
  if len(blocks) == 1:
    return blocks[0]
  # Back to the callers' order: a static permutation of k rows.
  return jnp.concatenate(blocks)[jnp.asarray(np.argsort(np.asarray(order)))]


def _empty(g: int, whatif: bool) -> jnp.ndarray:
  """Rows of empty tensors: no nonzero element, SQNR +inf (rounding loses nothing)."""
  names = FIELDS if whatif else BASE_FIELDS
  row = np.asarray([np.inf if f.endswith("sqnr_db") else 0.0 for f in names], np.float32)
  return jnp.asarray(np.tile(row, (g, 1)))


def tensor_stats(x, dtype, whatif: bool = True, block_axes=None) -> jnp.ndarray:
  """batch_stats of one tensor: an f32 vector in the order of FIELDS."""
  return batch_stats([x], [dtype], whatif, [block_axes])[0]
