"""Float format facts, cross-checked against ml_dtypes.finfo; `round_to` and `ulp` against a
reference built from every value of each format (decoded by ml_dtypes)."""

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from precision import formats

ML = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16,
      "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


@pytest.mark.parametrize("name", formats.FORMATS)
def test_against_ml_dtypes(name):
  fi, ref = formats.info(name), ml_dtypes.finfo(ML[name])
  assert fi.bits == ref.bits
  assert fi.mantissa_bits == ref.nmant
  assert fi.exponent_bits == ref.nexp
  assert fi.eps == float(ref.eps)
  assert fi.max == float(ref.max)
  assert fi.smallest_normal == float(ref.smallest_normal)
  assert fi.smallest_subnormal == float(ref.smallest_subnormal)
  assert fi.sign_bits + fi.exponent_bits + fi.mantissa_bits == fi.bits
  # inf exists iff casting inf gives inf
  assert fi.has_inf == bool(np.isinf(np.array(np.inf, np.float32).astype(ML[name])))


def test_known_values():
  assert formats.info("bf16").eps == 2.0 ** -7
  assert formats.info("e4m3").max == 448.0 and not formats.info("e4m3").has_inf
  assert formats.info("e5m2").max == 57344.0 and formats.info("e5m2").has_inf
  assert formats.info("f16").max == 65504.0
  assert formats.info("f16").smallest_subnormal == 2.0 ** -24


def _next_up(v, name):
  """The next representable value above v >= 0 (v already in the format), from its bit
  pattern: +1 on the unsigned integer view, independent of `formats.ulp`'s formula."""
  dt = np.dtype(ML[name])
  u = np.dtype(f"u{dt.itemsize}")
  return (np.asarray(v, dt).view(u) + u.type(1)).view(dt).astype(np.float64)


@pytest.mark.parametrize("name", formats.FORMATS)
def test_ulp(name):
  fi = formats.info(name)
  assert formats.ulp(1.0, name) == fi.eps == _next_up(1.0, name) - 1.0
  assert formats.ulp(-2.0, name) == 2 * fi.eps == _next_up(2.0, name) - 2.0
  assert formats.ulp(fi.smallest_subnormal, name) == fi.smallest_subnormal
  assert formats.ulp(0.0, name) == fi.smallest_subnormal == _next_up(0.0, name)
  # 1 + ulp(1) is representable and nothing lies between: the midpoint rounds (to even)
  # back to 1, anything above it to 1 + ulp.
  one_up = 1.0 + formats.ulp(1.0, name)
  assert float(formats.round_to(one_up, name)) == one_up
  assert float(formats.round_to(1.0 + fi.eps / 2, name)) == 1.0
  assert float(formats.round_to(1.0 + fi.eps / 2 * (1 + 2.0 ** -20), name)) == one_up
  assert np.isnan(formats.ulp(np.inf, "bf16"))


@pytest.mark.parametrize("name", formats.FORMATS)
def test_ulp_is_the_gap_to_the_next_value(name):
  """ulp(x) == next_up(|round(x)|) - |round(x)| for random finite values of every binade."""
  fi = formats.info(name)
  x = _random_f64(fi, 20_000, np.random.default_rng(5))
  v = np.abs(formats.round_to(x, name).astype(np.float64))
  keep = np.isfinite(v) & (v < fi.max)
  x, v = x[keep], v[keep]
  np.testing.assert_array_equal(formats.ulp(x, name), _next_up(v, name) - v)


# ---------------------------------------------------------------------- round_to exactness


def _quiet(fn):
  """Runs fn with numpy's floating-point warnings off: the helpers cast NaN, inf and
  out-of-range values on purpose."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with np.errstate(all="ignore"):
      return fn(*args, **kwargs)

  return wrapped



@functools.lru_cache(maxsize=None)
@_quiet
def _table(name):
  """(values, even, overflow) of an 8- or 16-bit format: every finite value >= 0 as f64,
  ascending, one past the max (max + its ulp) appended; whether each one's significand is
  even; and the value an overflow becomes (ml_dtypes' cast of inf: inf, or NaN for e4m3)."""
  dt = np.dtype(ML[name])
  u = np.dtype(f"u{dt.itemsize}")
  bits = np.arange(2 ** (8 * dt.itemsize - 1), dtype=u)  # sign bit clear: 0 and positives
  vals = bits.view(dt).astype(np.float64)
  finite = np.isfinite(vals)
  vals, bits = vals[finite], bits[finite]
  order = np.argsort(vals)
  vals, even = vals[order], (bits[order] & 1) == 0
  beyond = vals[-1] + (vals[-1] - vals[-2])
  return (np.append(vals, beyond), np.append(even, not even[-1]),
          np.array(np.inf, np.float32).astype(dt))


@_quiet
def _reference(x, name):
  """Round-to-nearest-even of f64 `x` into an 8- or 16-bit format, exactly: the bracketing
  values from the table and a comparison with their midpoint (exact in f64: at most 12
  significant bits)."""
  vals, even, overflow = _table(name)
  dt = np.dtype(ML[name])
  a = np.abs(x)
  i = np.clip(np.searchsorted(vals, a, side="left"), 1, len(vals) - 1)  # vals[i-1] < a <= vals[i]
  lo, hi = vals[i - 1], vals[i]
  mid = (lo + hi) / 2
  take_hi = (a > mid) | ((a == mid) & even[i])
  mag = np.where(a == 0, 0.0, np.where(take_hi, hi, lo))
  with np.errstate(over="ignore", invalid="ignore"):
    out = (np.copysign(mag, x)).astype(np.float32).astype(dt)  # exact: mag is in the format
    over = take_hi & (i == len(vals) - 1) | (a > vals[-1])
    out = np.where(over, np.copysign(np.float32(overflow.astype(np.float32)), x)
                   .astype(np.float32).astype(dt), out)
  return np.where(np.isnan(x), np.array(np.nan, np.float32).astype(dt), out).astype(dt)


@_quiet
def _reference_f32(x):
  """Round-to-nearest-even of f64 `x` into f32, exactly: the two f32 neighbours (by
  nextafter, not a cast of x) and a comparison with their midpoint (exact in f64)."""
  with np.errstate(over="ignore"):
    c = np.clip(x, -np.finfo(np.float32).max, np.finfo(np.float32).max).astype(np.float32)
  c64 = c.astype(np.float64)
  lo = np.where(c64 > x, np.nextafter(c, np.float32(-np.inf)), c)
  hi = np.nextafter(lo, np.float32(np.inf))
  mid = (lo.astype(np.float64) + hi.astype(np.float64)) / 2
  even_hi = (hi.view(np.uint32) & 1) == 0
  pick = np.where((x > mid) | ((x == mid) & even_hi), hi, lo)
  pick = np.where(x == c64, c, pick)
  # Past the max: the midpoint to the next binade's first value (2**128) is the boundary;
  # the max's significand is odd, so the tie goes to 2**128, i.e. overflows to inf.
  fmax = float(np.finfo(np.float32).max)
  boundary = fmax + (2.0 ** 128 - fmax) / 2
  pick = np.where(np.abs(x) >= boundary, np.copysign(np.float32(np.inf), x), pick)
  return np.where(np.isnan(x), np.float32(np.nan), pick).astype(np.float32)


def _ref(x, name):
  return _reference_f32(x) if name == "f32" else _reference(x, name)


def _random_f64(fi, n, rng):
  """n f64 values with 52 random fraction bits, signs random, binades uniform from three
  below the smallest subnormal to two above the max (underflow and overflow included)."""
  lo = int(np.log2(fi.smallest_subnormal)) - 3
  hi = int(np.floor(np.log2(fi.max))) + 2
  m = 1.0 + rng.integers(0, 2 ** 52, n, dtype=np.int64) * 2.0 ** -52
  e = rng.integers(lo, hi + 1, n)
  return np.ldexp(m, e) * rng.choice([-1.0, 1.0], n)


@_quiet
def _ties(name, rng, n=20_000):
  """Midpoints of adjacent values (exact ties), and each nudged by +-2**-40 relative: below
  f32's precision, so rounding through f32 first lands on the tie and rounds wrongly."""
  if name == "f32":
    lo = rng.integers(0, 0x7F7FFFFF, n, dtype=np.int64).astype(np.uint32).view(np.float32)
    hi = np.nextafter(lo, np.float32(np.inf))
    mids = (lo.astype(np.float64) + hi.astype(np.float64)) / 2
  else:
    vals = _table(name)[0]
    mids = (vals[:-1] + vals[1:]) / 2
    mids = np.append(mids, (vals[-2] + vals[-1]) / 2)  # max + ulp/2: the overflow boundary
  mids = np.concatenate([mids, -mids])
  return np.concatenate([mids, mids * (1 + 2.0 ** -40), mids * (1 - 2.0 ** -40)])


@_quiet
def _assert_same(got, want, x):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype
  u = np.dtype(f"u{got.dtype.itemsize}")
  both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
  bad = ~both_nan & (got.view(u) != want.view(u))  # bit for bit: -0.0 is not +0.0
  assert not bad.any(), (f"{bad.sum()} of {bad.size} differ; first: x={x[bad][:3]!r} "
                         f"got {got[bad][:3]!r} want {want[bad][:3]!r}")


def test_round_to_double_rounding_case():
  assert float(formats.round_to(1 + 2 ** -11 + 2 ** -40, "f16")) == 1.0009765625
  assert float(formats.round_to(1 + 2 ** -8 + 2 ** -40, "bf16")) == 1.0078125
  assert float(formats.round_to(1 + 2 ** -4 + 2 ** -40, "e4m3")) == 1.125
  assert float(formats.round_to(-(1 + 2 ** -3 + 2 ** -40), "e5m2")) == -1.25
  assert float(formats.round_to(1 + 2 ** -24 + 2 ** -50, "f32")) == 1 + 2 ** -23


@pytest.mark.parametrize("name", formats.FORMATS)
def test_round_to_equals_exact_rounding_on_100k_random_f64(name):
  fi = formats.info(name)
  x = _random_f64(fi, 100_000, np.random.default_rng(abs(hash(name)) % 2 ** 32))
  x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, np.nan, fi.max, -fi.max]])
  _assert_same(formats.round_to(x, name), _ref(x, name), x)


@pytest.mark.parametrize("name", formats.FORMATS)
def test_round_to_equals_exact_rounding_on_ties(name):
  x = _ties(name, np.random.default_rng(1))
  _assert_same(formats.round_to(x, name), _ref(x, name), x)


@pytest.mark.parametrize("name", [n for n in formats.FORMATS if n != "f32"])
@_quiet
def test_reference_agrees_with_ml_dtypes_on_f32_inputs(name):
  """The reference is right where ml_dtypes is the authority (one rounding from f32):
  random f32 values and every f32 midpoint of the format, so neither can drift."""
  fi = formats.info(name)
  rng = np.random.default_rng(2)
  x32 = _random_f64(fi, 50_000, rng).astype(np.float32)
  vals = _table(name)[0]
  x32 = np.concatenate([x32, ((vals[:-1] + vals[1:]) / 2).astype(np.float32)])
  with np.errstate(over="ignore"):
    direct = x32.astype(ML[name])
  _assert_same(direct, _reference(x32.astype(np.float64), name), x32)
  _assert_same(formats.round_to(x32, name), direct, x32)


@pytest.mark.parametrize("src,name", [(s, t) for s in ("bf16", "f16")
                                      for t in ("e4m3", "e5m2", "bf16", "f16") if s != t])
@_quiet
def test_round_to_from_16_bit_inputs_every_value(src, name):
  """Every bf16/f16 value into each narrower or sibling format: one rounding."""
  x = np.arange(2 ** 16, dtype=np.uint16).view(ML[src])
  _assert_same(formats.round_to(x, name), _reference(x.astype(np.float64), name),
               x.astype(np.float64))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(formats.FORMATS), st.integers(0, 2 ** 16 - 2),
       st.sampled_from([-1.0, 1.0]), st.integers(-50, -25) | st.just(None))
def test_round_to_ties_property(name, k, sign, nudge):
  """A tie between two adjacent values (or the overflow boundary), exact or nudged by
  2**nudge relative, rounds as the exact rule says."""
  if name == "f32":
    lo = np.array([k * 65_521], np.uint32).view(np.float32)  # spread over the binades
    mid = (float(lo[0]) + float(np.nextafter(lo, np.float32(np.inf))[0])) / 2
  else:
    vals = _table(name)[0]
    j = k % (len(vals) - 1)
    mid = (vals[j] + vals[j + 1]) / 2
  x = np.array([sign * mid * (1 + (2.0 ** nudge if nudge is not None else 0.0))])
  _assert_same(formats.round_to(x, name), _ref(x, name), x)


def test_round_to_rejects_bad_input():
  with pytest.raises(ValueError, match="integer input"):
    formats.round_to(np.array([2 ** 60], np.int64), "bf16")
  with pytest.raises(ValueError, match="input dtype 'complex128'"):
    formats.round_to(np.array([1j]), "bf16")
  assert float(formats.round_to(2 ** 53, "f32")) == 2.0 ** 53


def test_swamping_in_bf16():
  assert formats.swamped(1.0, 1e-5, "bf16")
  assert not formats.swamped(1.0, 1e-5, "f32")
  assert float(np.array(1.0, np.float32).astype(ml_dtypes.bfloat16)) + formats.ulp(1.0, "bf16") == 1.0078125
  assert not formats.swamped(1.0, 0.0078125, "bf16")
  assert formats.swamped(1.0, 0.0078125 / 2, "bf16")  # tie rounds to even: 1.0
  assert not formats.swamped(1.0, 0.0078125 / 2 * 1.01, "bf16")
  np.testing.assert_array_equal(formats.swamped(np.ones(3), np.array([1e-3, 1e-2, 0.0]), "bf16"),
                                [True, False, False])
