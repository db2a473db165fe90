"""Microscaled formats: MXFP8 / NVFP4 quantisers against numpy + ml_dtypes references,
stochastic rounding, the random Hadamard transform, and the mxfp8 / nvfp4 recipes.

The references are written here with numpy (f64 for the power-of-two MXFP8 arithmetic,
which is exact there; f32 IEEE arithmetic for NVFP4, which defines its scales in f32) and
ml_dtypes casts; they share no code with precision.fp8._microscale.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import precision as mp
from precision import fp8 as mpf

FMT = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
E2M1 = ml_dtypes.float4_e2m1fn


# ---------------------------------------------------------------------------------------
# Inputs: >= 100k log-uniform values over many magnitudes, plus boundary blocks.


def _random(n_blocks, block, seed=0):
  """Blocks of values with a per-block magnitude 2**[-150, 120] and per-element spread
  2**[-24, 0] (log-uniform), random signs: f32 subnormal to near-overflow blocks."""
  rng = np.random.default_rng(seed)
  mag = rng.uniform(-150, 120, (n_blocks, 1))
  spread = rng.uniform(-24, 0, (n_blocks, block))
  sign = rng.choice([-1.0, 1.0], (n_blocks, block))
  return (sign * np.exp2(mag + spread)).astype(np.float32)


def _boundary(block, fmax):
  """Blocks of boundary cases: zeros, f32 subnormals, the format max (exactly, just above
  and below), amax significands either side of fmax's, inf/NaN, ties."""
  f32 = np.float32
  rows = [np.zeros(block), -np.zeros(block),
          np.full(block, 1e-45), np.linspace(1e-45, 1e-39, block),  # f32 subnormals
          np.full(block, fmax), np.full(block, np.nextafter(f32(fmax), f32(np.inf))),
          np.full(block, np.nextafter(f32(fmax), f32(0))),
          np.full(block, 3.4e38), np.full(block, -2.0 ** -126)]
  for k in (-140, -120, -30, 0, 17, 100):
    base = np.linspace(-1, 1, block) * 2.0 ** k
    for sig in (1.75, 1.7499999, 1.7500001, 1.0, 1.999999, 1.5):
      row = base.copy()
      row[3] = sig * 2.0 ** k  # the block amax
      rows.append(row)
  for bad in (np.inf, -np.inf, np.nan):
    row = np.linspace(-3, 3, block)
    row[5] = bad
    rows.append(row)
  # Ties: amax exactly 2**e * fmax-significand, elements at midpoints of the E4M3/E5M2/E2M1
  # grids once scaled (1 + 1/16, 1 + 1/8, 2.5 = midway 2..3, 0.25 = midway 0..0.5, ...).
  ties = np.array([1.0625, 1.125, 1.1875, 1.25, 2.5, 0.25, 0.75, 5.0, 3.5, 1.5,
                   2 ** -7 * 1.5, 2 ** -10, 2 ** -17, 2 ** -16 * 1.5])
  row = np.resize(ties, block)
  row[0] = fmax
  rows.append(row)
  rows.append(row * 2.0 ** -40)
  row6 = np.resize(ties, block)
  row6[0] = 6.0 * 448.0
  rows.append(row6)
  if len(rows) % 2:  # an even count: the tests put two blocks on a row
    rows.append(np.zeros(block))
  return np.stack(rows).astype(np.float32)


def _jit(f, **static):
  """f jitted with its keyword arguments fixed (eager op-by-op dispatch is slow)."""
  return jax.jit(functools.partial(f, **static))


def _bits(a):
  return np.asarray(a).view(np.uint8)


# ---------------------------------------------------------------------------------------
# MXFP8 reference (numpy f64: every value here is an f32 times a power of two, exact).


def _mx_reference(x, fmt, rounding, block=32):
  fmax = float(ml_dtypes.finfo(FMT[fmt]).max)
  xb = x.reshape(-1, block).astype(np.float64)
  finite = np.isfinite(xb)
  amax = np.max(np.where(finite, np.abs(xb), 0.0), axis=1)
  with np.errstate(divide="ignore"):
    if rounding == "up":
      s = np.ceil(np.log2(amax / fmax))
    else:
      s = np.floor(np.log2(amax)) - np.floor(np.log2(fmax))
  s = np.clip(np.where(amax > 0, s, -127), -127, 127).astype(np.int64)
  with np.errstate(invalid="ignore", over="ignore"):
    y = xb / np.exp2(s.astype(np.float64))[:, None]
    y = np.where(finite, np.clip(y, -fmax, fmax), y)
  q = y.astype(np.float32).astype(FMT[fmt]).reshape(x.shape)
  scales = (s + 127).astype(np.uint8)
  deq = (q.reshape(-1, block).astype(np.float64) * np.exp2(s.astype(np.float64))[:, None])
  with np.errstate(over="ignore"):  # 448 * 2**127 is beyond f32: inf, as the format says
    return q, scales, deq.astype(np.float32).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_mxfp8_matches_reference(fmt, rounding):
  fmax = float(ml_dtypes.finfo(FMT[fmt]).max)
  x = np.concatenate([_random(3200, 32).reshape(-1), _boundary(32, fmax).reshape(-1)])
  assert x.size >= 100_000
  x = x.reshape(-1, 64)  # two blocks per row, quantised along the last axis
  q, s = jax.jit(lambda v: mpf.mxfp8_quantize(v, fmt, scale_rounding=rounding))(x)
  deq = jax.jit(mpf.mxfp8_dequantize)(q, s)
  rq, rs, rdeq = _mx_reference(x, fmt, rounding)
  assert q.dtype == FMT[fmt] and s.dtype == ml_dtypes.float8_e8m0fnu
  assert s.shape == (x.shape[0], 2)
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  np.testing.assert_array_equal(_bits(s).reshape(-1), rs)
  np.testing.assert_array_equal(np.asarray(deq).view(np.uint32), rdeq.view(np.uint32))


def test_mxfp8_along_another_axis_is_the_transpose():
  x = _random(64, 32, seed=1).reshape(64, 32).T.copy()  # [32, 64]: blocks down axis 0
  q0, s0 = _jit(mpf.mxfp8_quantize, fmt="e4m3", axis=0)(x)
  q1, s1 = _jit(mpf.mxfp8_quantize, fmt="e4m3", axis=-1)(x.T)
  np.testing.assert_array_equal(_bits(q0), _bits(np.asarray(q1).T))
  np.testing.assert_array_equal(_bits(s0), _bits(np.asarray(s1).T))
  np.testing.assert_array_equal(np.asarray(_jit(mpf.mxfp8_dequantize, axis=0)(q0, s0)),
                                np.asarray(_jit(mpf.mxfp8_dequantize)(q1, s1)).T)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scale_roundings_differ_exactly_where_amax_significand_exceeds_fmax(fmt):
  """"up" is "floor" + 1 exactly in the blocks whose amax significand is above fmax's
  (1.75): there "floor" saturates the block's largest elements and "up" does not."""
  fmax = float(ml_dtypes.finfo(FMT[fmt]).max)
  x = np.concatenate([_random(2000, 32, seed=2), _boundary(32, fmax)])
  x = x[np.all(np.isfinite(x), axis=1)]
  q_up, s_up = _jit(mpf.mxfp8_quantize, fmt=fmt, scale_rounding="up")(x)
  q_fl, s_fl = _jit(mpf.mxfp8_quantize, fmt=fmt, scale_rounding="floor")(x)
  e_up = _bits(s_up).astype(int).reshape(-1) - 127
  e_fl = _bits(s_fl).astype(int).reshape(-1) - 127
  amax = np.max(np.abs(x.astype(np.float64)), axis=1)
  sig, _ = np.frexp(amax)  # amax = sig * 2**e, sig in [0.5, 1): significand 2 * sig
  unclamped = (e_fl > -127) & (amax > 0)
  above = 2 * sig > 1.75
  np.testing.assert_array_equal((e_up - e_fl)[unclamped], above[unclamped].astype(int))
  assert above[unclamped].any() and (~above[unclamped]).any()
  # Where they differ, "floor" clips the amax element to fmax and "up" represents it.
  q_fl, q_up = (np.asarray(q).astype(np.float64) for q in (q_fl, q_up))
  differ = unclamped & above
  assert np.all(np.max(np.abs(q_fl[differ]), axis=1) == fmax)
  assert np.all(np.max(np.abs(q_up[unclamped]), axis=1) <= fmax)


def test_mxfp8_nonfinite_and_zero_blocks():
  x = np.zeros((3, 32), np.float32)
  x[1, 4], x[1, 7] = np.inf, 2.0
  x[2, 0] = np.nan
  q, s = _jit(mpf.mxfp8_quantize, fmt="e5m2")(x)
  deq = np.asarray(_jit(mpf.mxfp8_dequantize)(q, s))
  assert _bits(s)[0, 0] == 0  # an all-zero block: 2**-127
  assert np.isposinf(deq[1, 4]) and deq[1, 7] == 2.0 and np.isnan(deq[2, 0])
  assert np.all(deq[0] == 0)


# ---------------------------------------------------------------------------------------
# NVFP4 reference (numpy f32 arithmetic, the order the format's definition gives).


def _nv_reference(x, block=16):
  f32 = np.float32
  finite = np.isfinite(x)
  a = np.where(finite, np.abs(x), f32(0))
  ts = np.maximum(np.max(a) / f32(2688.0), f32(2.0 ** -110))
  xb = x.reshape(-1, block)
  ab = a.reshape(-1, block)
  bad = ~np.all(finite.reshape(-1, block), axis=1)
  with np.errstate(invalid="ignore"):
    sbf = np.minimum(np.max(ab, axis=1) / (f32(6.0) * ts), f32(448.0))
  sb = np.where(bad, f32(np.nan), sbf).astype(ml_dtypes.float8_e4m3fn)
  d = (sb.astype(f32) * ts)[:, None]
  usable = np.isfinite(d) & (d > 0)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    y = np.clip(xb / np.where(usable, d, f32(1)), f32(-6), f32(6))
  y = np.where(usable, y, f32(0))
  q = y.astype(E2M1)
  deq = q.astype(f32) * d
  return q.reshape(x.shape), sb, ts, deq.reshape(x.shape)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -100, 2.0 ** 100])
def test_nvfp4_matches_reference(scale):
  rng = np.random.default_rng(3)
  # Per-block magnitudes over 2**[-30, 0] of the tensor's (the E4M3 block scales range).
  x = (_random(6400, 16, seed=4) * 0 + 1) * np.exp2(
      rng.uniform(-30, 0, (6400, 1)) + rng.uniform(-12, 0, (6400, 16)))
  x = (x * rng.choice([-1.0, 1.0], x.shape) * scale).astype(np.float32)
  x = np.concatenate([x, _boundary(16, 6.0 * 448.0 * scale)])
  assert x.size >= 100_000
  x = x.reshape(-1, 32)
  q, sb, ts = jax.jit(mpf.nvfp4_quantize)(x)
  deq = jax.jit(mpf.nvfp4_dequantize)(q, sb, ts)
  rq, rsb, rts, rdeq = _nv_reference(x)
  assert q.dtype == E2M1 and sb.dtype == ml_dtypes.float8_e4m3fn and sb.shape == (x.shape[0], 2)
  assert np.asarray(ts).view(np.uint32) == np.asarray(rts).view(np.uint32)
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  np.testing.assert_array_equal(_bits(sb).reshape(-1), _bits(rsb))
  np.testing.assert_array_equal(np.asarray(deq), rdeq)  # NaN == NaN here


def test_nvfp4_nonfinite_block_reads_nan_and_zero_tensor():
  x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
  x[1, 3] = np.inf
  roundtrip = jax.jit(lambda v: mpf.nvfp4_dequantize(*mpf.nvfp4_quantize(v)))
  deq = np.asarray(roundtrip(x))
  assert np.all(np.isnan(deq[1])) and np.all(np.isfinite(deq[0]))
  assert np.all(np.asarray(roundtrip(np.zeros((2, 16), np.float32))) == 0)


# ---------------------------------------------------------------------------------------
# Stochastic rounding and the random Hadamard transform.


def test_nvfp4_stochastic_rounding_is_unbiased():
  """The mean of N stochastic quantisations of fixed values lands within 4 standard
  errors of the value (each draw has variance <= spacing**2 / 4)."""
  block = np.array([36.0, 0.3, 1.1, 2.7, -3.3, 4.9, 0.01, -0.26,
                    5.5, 1.25, -0.75, 2.0, 0.6, -5.9, 3.1, 0.4], np.float32)
  # block amax 36 -> with the tensor scale 36/2688 the block scale is exactly 448.
  x = np.tile(block, (1, 1))
  n = 4096
  quant = jax.jit(lambda step: mpf.nvfp4_dequantize(
      *mpf.nvfp4_quantize(x, stochastic=True, seed=7, step=step)))
  draws = np.asarray(jax.vmap(quant)(jnp.arange(n, dtype=jnp.uint32)))[:, 0, :]
  _, sb, ts = jax.jit(mpf.nvfp4_quantize)(x)
  nearest = np.asarray(jax.jit(mpf.nvfp4_dequantize)(*jax.jit(mpf.nvfp4_quantize)(x)))[0]
  d = np.float64(np.asarray(sb).astype(np.float32)[0, 0] * np.asarray(ts))
  grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
  y = np.abs(x[0].astype(np.float64)) / d
  i = np.searchsorted(grid, y, side="right")
  lo, hi = grid[i - 1], grid[np.minimum(i, len(grid) - 1)]
  err = np.abs(draws.mean(axis=0) - x[0])
  assert np.all(err <= 4 * (hi - lo) * d / 2 / np.sqrt(n)), (err, (hi - lo) * d)
  # Each draw is one of the two neighbours, the upper one about (y - lo) / (hi - lo) often.
  yd = np.abs(draws.astype(np.float64)) / d
  assert np.all((np.abs(yd - lo) < 1e-6) | (np.abs(yd - hi) < 1e-6))
  p_up = np.mean(np.abs(yd - hi) < 1e-6, axis=0)
  inside = hi > lo
  with np.errstate(invalid="ignore", divide="ignore"):
    want = np.where(inside, (y - lo) / (hi - lo), 0.0)
  np.testing.assert_allclose(p_up[inside], want[inside], atol=0.03)
  assert np.any(draws != nearest)


def test_hadamard_is_orthogonal():
  h = np.asarray(jax.jit(mpf.hadamard_matrix)(3)).astype(np.float64)
  np.testing.assert_array_equal(h.T @ h, np.eye(16))
  assert set(np.unique(h)) == {-0.25, 0.25}
  # (H a)^T (H b) == a^T b exactly for small integers (every product and sum exact in f32).
  rng = np.random.default_rng(5)
  a = rng.integers(-8, 9, (64, 5)).astype(np.float32)
  b = rng.integers(-8, 9, (64, 7)).astype(np.float32)
  rht = _jit(mpf.random_hadamard, axis=0, seed=3)
  ha, hb = rht(a), rht(b)
  np.testing.assert_array_equal(np.asarray(ha).T @ np.asarray(hb), a.T @ b)
  assert not np.array_equal(np.asarray(jax.jit(mpf.hadamard_matrix)(4)), h.astype(np.float32))
