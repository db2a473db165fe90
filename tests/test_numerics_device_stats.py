"""The device statistics' passes (precision.numerics._device_stats): bit for bit the
results of the straightforward formulation they replace (one reduction per statistic,
kept here as the reference), on tensors with zeros, f32 subnormals, inf, NaN and values
above 2**60, and the number of reduction loops the compiled program holds."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precision import formats
from precision.numerics import _device_stats
from precision.numerics import _stats

OLD_WHATIF = (("bf16", np.dtype(ml_dtypes.bfloat16), False),
              ("f16", np.dtype(np.float16), False),
              ("e4m3", np.dtype(ml_dtypes.float8_e4m3fn), True),
              ("e5m2", np.dtype(ml_dtypes.float8_e5m2), True))
OLD_FIELDS = _device_stats.BASE_FIELDS + tuple(
    f"whatif_{p}_{s}" for p, _, _ in OLD_WHATIF for s in ("underflow", "overflow", "sqnr_db"))


@pytest.fixture(autouse=True)
def _promotion():
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


# ------------------------------------------- the reference: one reduction per statistic

def _count(mask):
  return jnp.sum(mask, axis=1, dtype=jnp.int32)


def _frac(count, total):
  return jnp.where(total > 0, count.astype(jnp.float32)
                   / jnp.maximum(total, 1).astype(jnp.float32), 0.0)


def _rounding(x, r, nz, n, inv, fp8_max, signal):
  finite_r = jnp.isfinite(r)
  mag = jnp.abs(r)
  underflow = _frac(_count(nz & (r == 0)), n)
  overflow = _frac(_count(nz & ~finite_r), n)
  if fp8_max is None:
    saturated = jnp.zeros(n.shape, jnp.float32)
  else:
    saturated = _frac(_count(nz & (fp8_max > 0) & (mag == fp8_max)), n)
  e = jnp.where(nz & finite_r, (x - r) * inv, 0.0)
  noise = jnp.sum(e * e, axis=1)
  sqnr = jnp.where(noise > 0, 10.0 * jnp.log10(signal / jnp.where(noise > 0, noise, 1.0)),
                   jnp.inf)
  sqnr = jnp.where(overflow > 0, -jnp.inf, jnp.where(n > 0, sqnr, jnp.inf))
  return [underflow, overflow, saturated, sqnr, finite_r, mag]


def _signal(x, nz, inv):
  s = jnp.where(nz, x * inv, 0.0)
  return jnp.sum(s * s, axis=1)


def _normaliser(amax):
  big = amax > np.float32(2.0 ** 60)
  return jnp.where(big, 1.0 / jnp.where(big, amax, 1.0), np.float32(1.0))


def _current_scale(amax, dtype):
  ok = (amax > 0) & jnp.isfinite(amax)
  return jnp.where(ok, np.float32(formats.info(dtype).max) / jnp.where(ok, amax, 1.0),
                   np.float32(1.0))


def _reference_block(x, dtypes, whatif):
  size = x.shape[1]
  finite = jnp.isfinite(x)
  nz = finite & (x != 0)
  n = _count(nz)
  mag = jnp.where(nz, jnp.abs(x), 0.0)
  amax = jnp.where(n > 0, jnp.max(mag, axis=1), 0.0)
  amin = jnp.where(n > 0, jnp.min(jnp.where(nz, mag, jnp.inf), axis=1), 0.0)
  drange = jnp.where(n > 0, jnp.log2(jnp.where(n > 0, amax, 1.0))
                     - jnp.log2(jnp.where(n > 0, amin, 1.0)), 0.0)
  kinds = sorted(set(dtypes), key=str)
  which = np.asarray([kinds.index(d) for d in dtypes], np.int32)[:, None]
  r = x
  fp8_max = np.zeros((len(dtypes), 1), np.float32)
  smallest = np.zeros((len(dtypes), 1), np.float32)
  for j, d in enumerate(kinds):
    rows = which == j
    if d.itemsize < 4:
      r = jnp.where(rows, _device_stats.round_to(x, d), r) if len(kinds) > 1 else \
          _device_stats.round_to(x, d)
      smallest[rows] = formats.info(d).smallest_normal
      if _stats.is_fp8(d):
        fp8_max[rows] = formats.info(d).max
  inv = _normaliser(amax)[:, None]
  signal = _signal(x, nz, inv)
  underflow, overflow, saturated, sqnr, finite_r, rmag = _rounding(
      x, r, nz, n, inv, fp8_max if fp8_max.any() else None, signal)
  subnormal = _frac(_count(nz & finite_r & (r != 0) & (rmag < smallest)), n)
  total = jnp.full(n.shape, size, jnp.int32)
  out = [n.astype(jnp.float32), _frac(_count(~finite), total), _frac(_count(x == 0), total),
         amax, amin, drange, underflow, subnormal, overflow, saturated, sqnr]
  if whatif:
    for _, fmt, scaled in OLD_WHATIF:
      if scaled:
        scale = _current_scale(amax, fmt)
        v, a = x * scale[:, None], amax * scale
        w_inv = _normaliser(a)[:, None]
        w_signal = _signal(v, nz, w_inv)
      else:
        v, w_inv, w_signal = x, inv, signal
      u, o, _, q, _, _ = _rounding(v, _device_stats.round_to(v, fmt), nz, n, w_inv, None,
                                   w_signal)
      out += [u, o, q]
  return jnp.stack([jnp.asarray(c, jnp.float32) for c in out], axis=1)


# ------------------------------------------------------------------------------ tests

def _rows(g, n, seed):
  """[g, n] f32: log-uniform magnitudes from 2e-38 to 1e30, both signs (the subnormals of
  f16, E4M3 and E5M2 and values that underflow in each), with zeros, +-inf, NaN and
  values above 2**60 scattered in, one all-zero row. No f32 subnormal: XLA:CPU flushes
  them in some fusions and not in others, so how a value below 1.2e-38 is counted
  depends on how XLA fuses the program, in either formulation."""
  rng = np.random.default_rng(seed)
  mag = np.exp(rng.uniform(np.log(2e-38), np.log(1e30), (g, n)))
  x = (mag * rng.choice([-1.0, 1.0], (g, n))).astype(np.float32)
  flat = x.reshape(-1)
  idx = rng.permutation(flat.size)[:12 * g]
  k = len(idx) // 6
  flat[idx[:k]] = 0.0
  flat[idx[k:2 * k]] = np.inf
  flat[idx[2 * k:3 * k]] = -np.inf
  flat[idx[3 * k:4 * k]] = np.nan
  flat[idx[4 * k:]] = (2.0 ** 62 * rng.standard_normal(len(idx) - 4 * k)).astype(np.float32)
  # Every format's rounding boundaries and their f32 neighbours, in rows 1 to g-2: half
  # the smallest subnormal, the largest subnormal's tie with the smallest normal, max's
  # ties with its lower neighbour and with overflow (each a tie to even).
  edges = []
  for d in (BF16, F16, E4M3, E5M2):
    fi = ml_dtypes.finfo(d)
    tiny, normal, fmax = float(fi.smallest_subnormal), float(fi.smallest_normal), float(fi.max)
    ulp = 2.0 ** (np.floor(np.log2(fmax)) - fi.nmant)
    for t in (tiny / 2, 1.5 * tiny, normal - tiny / 2, fmax - ulp / 2, fmax, fmax + ulp / 2):
      t = np.float32(t)
      if t >= np.finfo(np.float32).smallest_normal:
        edges += [t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(np.inf))]
  edges = np.asarray(edges + [-e for e in edges], np.float32)
  x[1:-1, -len(edges):] = edges
  x[-1] = 0.0
  # A row of ordinary values (no huge one): SQNR's unnormalised branch with real noise.
  x[0] = rng.standard_normal(n).astype(np.float32)
  x[0, :3] = (np.inf, np.nan, 0.0)   # not measured: SQNR stays finite
  return x


BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
F32 = np.dtype(np.float32)


# The mixed group (every format at once) is the fast case; one-format groups run with the
# slow set.
_SLOW = pytest.mark.slow
@pytest.mark.parametrize("dtypes", [
    pytest.param([BF16] * 4, marks=_SLOW), pytest.param([F16] * 3, marks=_SLOW),
    [BF16, F16, E4M3, E5M2, F32], pytest.param([E4M3, E4M3], marks=_SLOW),
    pytest.param([F32, F32], marks=_SLOW)], ids=str)
@pytest.mark.parametrize("whatif", [True, False])
def test_passes_are_bit_identical_to_one_reduction_per_statistic(dtypes, whatif):
  x = _rows(len(dtypes), 1031, len(dtypes))
  want = np.asarray(jax.jit(lambda x: _reference_block(x, dtypes, whatif))(x))
  got = np.asarray(jax.jit(lambda x: _device_stats.batch_stats(list(x), dtypes, whatif))(x))
  fields = OLD_FIELDS if whatif else _device_stats.BASE_FIELDS
  got = got[:, [(_device_stats.FIELDS if whatif else _device_stats.BASE_FIELDS).index(f)
                for f in fields]]
  assert want.shape == got.shape
  diff = np.argwhere(want.view(np.uint32) != got.view(np.uint32))
  assert diff.size == 0, [(fields[j], want[i, j], got[i, j]) for i, j in diff[:8]]
  # Not a vacuous comparison: a finite SQNR (row 0, no huge value) and some underflow.
  dbs = [j for j, f in enumerate(fields) if f.endswith("sqnr_db")]
  assert np.isfinite(want[0, dbs]).any() or dtypes[0] == F32
  assert (want[:, fields.index("nonfinite")] > 0).any()


def test_reductions_in_the_compiled_program():
  """Counts and extrema of a group of rows come from two variadic reduce loops (one
  before amax is known, one after, with MXFP8's counts where its blocks tile the rows
  in place); each f32 sum (signal and noise terms) is its own, and MXFP8 adds one
  reduction for its block amax."""
  x = jnp.asarray(_rows(4, 512, 0))
  # bf16 rows: signal and noise; what-ifs: f16 noise, e4m3 and e5m2 signal and noise,
  # MXFP8 noise and block amax (the bf16 what-if is the rows' own rounding).
  for whatif, sums in ((False, 2), (True, 2 + 1 + 4 + 2)):
    hlo = jax.jit(lambda x: _device_stats.batch_stats(list(x), [BF16] * 4, whatif)).lower(
        x).as_text()
    assert hlo.count("stablehlo.reduce(") == 2 + sums, (whatif, hlo.count("stablehlo.reduce("))


def test_e4m3_rounding_is_the_converts_bit_for_bit():
  """round_to(E4M3) (a reduce_precision with hand-made subnormals and NaN) against
  ml_dtypes' float8_e4m3fn rounding on random f32 bit patterns and every boundary: the
  subnormal grid 2**-9, the smallest normal 2**-6, the max 448, the tie 464 and beyond."""
  rng = np.random.default_rng(3)
  x = rng.integers(0, 2 ** 32, 2 ** 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
  # XLA:CPU flushes f32 subnormals in compiled code: leave them out (ml_dtypes keeps them).
  x = x[~(np.abs(x) < np.finfo(np.float32).smallest_normal) | (x == 0)]
  edges = np.asarray([0.0, 2.0 ** -10, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9,
                      2.0 ** -6 - 2.0 ** -10, 2.0 ** -6, 448.0, 464.0, 480.0, 1e6, 3e38,
                      np.inf, np.nan], np.float32)
  near = np.concatenate([np.nextafter(edges, np.float32(0)),
                         np.nextafter(edges, np.float32(np.inf)), edges])
  x = np.concatenate([x, near, -near]).astype(np.float32)
  got = np.asarray(jax.jit(lambda v: _device_stats.round_to(v, E4M3))(x))
  with np.errstate(over="ignore", invalid="ignore"):   # past 464: NaN, the measured case
    want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  assert same.all(), (x[~same][:5], got[~same][:5], want[~same][:5])
  assert np.isnan(want).sum() > 1000 and (want == 448.0).any() and (want == 2.0 ** -9).any()


@pytest.mark.parametrize("axis", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_device_mxfp8_is_the_recipes_quantiser_bit_for_bit(axis):
  """The MXFP8 what-if's rounding on the device against precision.fp8.mxfp8_quantize
  then mxfp8_dequantize (scale_rounding "up"), along the last and a middle axis, with
  magnitudes over 2**+-26 and blocks near f32's max (where 2**s * 448 passes it and a
  dequantised element overflows to inf)."""
  from precision.fp8 import _microscale
  rng = np.random.default_rng(2)
  x = rng.standard_normal((4, 64, 96)) * np.exp(rng.standard_normal((4, 64, 96)) * 6)
  x = x.astype(np.float32)
  x[0, 0, :5] = (3e38, -3.3e38, 1e-30, 2.0 ** 100, 0.0)
  x[1, 1, :32] = 3.3e38
  q, s = _microscale.mxfp8_quantize(jnp.asarray(x), "e4m3", axis=axis)
  want = np.asarray(_microscale.mxfp8_dequantize(q, s, axis=axis))
  layout = _stats.block_layout(x.shape, (axis,))
  got = np.asarray(jax.jit(lambda v: _device_stats._mxfp8(
      v.reshape(1, -1), layout, jnp.ones((1, 1), jnp.float32)).r)(x)).reshape(x.shape)
  assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
  assert np.isinf(want).any() and (want == 0).any()
