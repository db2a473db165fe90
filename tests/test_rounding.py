"""Stochastic rounding: semantics (unbiasedness, neighbours, specials), determinism, and
bit-identity of the Pallas kernel (interpret mode) with the XLA reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import precision as mp
from precision import formats
from precision.rounding import leaf_seed
from precision.rounding import stochastic_round
from precision.rounding import stochastic_round_pallas
from precision.rounding import stochastic_round_reference
from _asserts import assert_bit_identical
from _asserts import bits

TARGETS = ("bf16", "f16", "e4m3", "e5m2")
# (target, input dtype): f32 for every target, bf16 for the fp8 targets.
PAIRS = [(t, "f32") for t in TARGETS] + [("e4m3", "bf16"), ("e5m2", "bf16")]
N_DRAWS = 10_000
F32_MAX = float(np.finfo(np.float32).max)
# Jitted once per target: eager jnp would compile every op of the reference separately.
_ref = jax.jit(stochastic_round_reference, static_argnums=1)


def _uint(fi):
  return np.uint8 if fi.bits == 8 else np.uint16


def _values(fi, in_dtype, n_sub=100, n_norm=200, seed=0):
  """|x| spread log-uniformly: n_sub from tiny/8 up to the smallest normal (subnormals of
  the target, and below its smallest subnormal), n_norm from there to max/2; random
  signs and f32 mantissas. Rounded to `in_dtype`; values representable in the target
  are kept (they must come back unchanged)."""
  rng = np.random.default_rng(seed)
  lo, mid, hi = np.log2(fi.smallest_subnormal) - 3, np.log2(fi.smallest_normal), np.log2(fi.max) - 1
  e = np.concatenate([rng.uniform(lo, mid, n_sub), rng.uniform(mid, hi, n_norm)])
  x = np.exp2(e) * rng.choice([-1.0, 1.0], e.size)
  return x.astype(np.float32).astype(formats.info(in_dtype).dtype)


def _neighbours(ax, fi):
  """a <= |x| < b: consecutive target values around |x| (float64), for 0 <= |x| < max."""
  u = _uint(fi)
  near = ax.astype(fi.dtype)
  nb = near.view(u).astype(np.int64)
  lo = np.where(near.astype(np.float64) > ax, nb - 1, nb)
  a = lo.astype(u).view(fi.dtype).astype(np.float64)
  b = (lo + 1).astype(u).view(fi.dtype).astype(np.float64)
  return a, b


@pytest.mark.parametrize("target,in_dtype", PAIRS)
def test_unbiased_and_neighbours(target, in_dtype):
  fi = formats.info(target)
  x = _values(fi, in_dtype)
  ax = np.abs(x.astype(np.float64))
  a, b = _neighbours(ax, fi)
  # One call on a [values, 10000] array: each row is one value rounded 10,000 times.
  xs = jnp.broadcast_to(jnp.asarray(x)[:, None], (x.size, N_DRAWS))
  out = np.asarray(_ref(xs, target, 11, 5)).astype(np.float64)
  r = np.abs(out)
  # Always one of the two neighbours, with x's sign.
  assert ((r == a[:, None]) | (r == b[:, None])).all()
  assert (np.signbit(out) == np.signbit(x)[:, None]).all()  # zeros too: +-0 keep x's sign
  # Mean within 4 standard errors (+ the documented 2**-24 resolution below `tiny`).
  p = (ax - a) / (b - a)
  mean = r.mean(axis=1)
  se = (b - a) * np.sqrt(p * (1 - p) / N_DRAWS)
  bad = np.abs(mean - ax) > 4 * se + (b - a) * 2.0 ** -24
  assert not bad.any(), (x[bad], mean[bad], ax[bad], se[bad])
  # Up-frequency vs (x - a) / (b - a): chi-square over values with enough expected counts,
  # neither too far off (wrong probability) nor too close (not random).
  k = (r == b[:, None]).sum(axis=1)
  use = np.minimum(N_DRAWS * p, N_DRAWS * (1 - p)) >= 10
  assert use.sum() >= 200
  chi2 = (((k - N_DRAWS * p) ** 2)[use] / (N_DRAWS * p * (1 - p))[use]).sum()
  dof = int(use.sum())
  assert 1e-3 < stats.chi2.cdf(chi2, dof) < 1 - 1e-3, (chi2, dof)
  # The subnormal range of the target was exercised.
  sub = (ax < fi.smallest_normal) & (ax > 0)
  assert sub.sum() >= 50 and (b[sub] <= fi.smallest_normal).all()


@pytest.mark.parametrize("target", TARGETS)
def test_representable_values_unchanged(target):
  fi = formats.info(target)
  u = _uint(fi)
  every = np.arange(2 ** fi.bits, dtype=np.int64).astype(u).view(fi.dtype)
  finite = every[np.isfinite(every.astype(np.float32))]
  x = jnp.asarray(finite.astype(np.float32))
  out = _ref(x, target, 3, 1)
  np.testing.assert_array_equal(bits(out), finite.view(u))  # signed zeros included
  if fi.bits == 8:  # exactly representable bf16 inputs too
    out = _ref(x.astype(jnp.bfloat16), target, 3, 1)
    np.testing.assert_array_equal(bits(out), finite.view(u))


@pytest.mark.parametrize("target", TARGETS)
def test_f32_subnormal_inputs_keep_their_sign(target):
  """f32 subnormals are far below the smallest subnormal of f16/fp8 (and inside bf16's
  subnormal range): the result is a neighbour with x's sign, never -0 for positive x."""
  fi = formats.info(target)
  rng = np.random.default_rng(1)
  mag = rng.integers(1, 2 ** 23, 100_000, dtype=np.uint32)
  sign = rng.integers(0, 2, mag.size, dtype=np.uint32) << np.uint32(31)
  x = (mag | sign).view(np.float32)
  out = np.asarray(_ref(jnp.asarray(x), target, 4, 0)).astype(np.float64)
  np.testing.assert_array_equal(np.signbit(out), np.signbit(x))
  a, b = _neighbours(np.abs(x.astype(np.float64)), fi)
  assert ((np.abs(out) == a) | (np.abs(out) == b)).all()


def _special_inputs(fi):
  ulp_max = 2.0 ** (np.floor(np.log2(fi.max)) - fi.mantissa_bits)
  half = fi.max + ulp_max / 2
  vals = [fi.max, np.nextafter(np.float32(half), np.float32(0)), half,
          np.nextafter(np.float32(half), np.float32(np.inf)), min(fi.max + ulp_max, F32_MAX), F32_MAX, np.inf]
  vals = np.array(vals, np.float32)
  return np.concatenate([vals, -vals])


@pytest.mark.parametrize("target", TARGETS)
def test_nan_inf_overflow_follow_the_targets_own_cast(target):
  """|x| >= max (inf included): exactly what ml_dtypes' (= XLA's) nearest cast gives.

  bf16/f16/e5m2: max up to (excluding) max + ulp/2, inf from there. float8_e4m3fn has no
  inf: max up to 464 inclusive (ties to even 448), NaN beyond and for +-inf."""
  fi = formats.info(target)
  big = _special_inputs(fi)
  x = np.tile(big, 50)  # many flat indices: the result must not depend on the random bits
  out = np.asarray(_ref(jnp.asarray(x), target, 9, 2))
  with np.errstate(over="ignore"):  # ml_dtypes warns when its cast overflows to inf
    expect = x.astype(fi.dtype)
  np.testing.assert_array_equal(bits(out), expect.view(_uint(fi)))
  o = out.astype(np.float32)[: big.size]
  if fi.has_inf:
    assert np.isinf(o[big == np.inf]).all() and (o[big == np.inf] > 0).all()
    assert np.isinf(o[big == -np.inf]).all() and (o[big == -np.inf] < 0).all()
  else:  # e4m3fn: inf -> NaN; 464 -> 448; just above 464 -> NaN
    assert np.isnan(o[np.abs(big) == np.inf]).all()
    assert (o[big == 464.0] == 448.0).all() and (o[big == -464.0] == -448.0).all()
    assert np.isnan(o[np.abs(big) == 480.0]).all()
  # NaN stays NaN and keeps its sign.
  nan = jnp.asarray(np.array([np.nan, -np.nan] * 20, np.float32))
  out = np.asarray(_ref(nan, target, 9, 2)).astype(np.float32)
  assert np.isnan(out).all()
  np.testing.assert_array_equal(np.signbit(out), np.signbit(np.asarray(nan)))


def test_below_max_never_overflows():
  for target in TARGETS:
    fi = formats.info(target)
    below = np.nextafter(np.float32(fi.max), np.float32(0))
    x = jnp.full((4096,), below, jnp.float32)
    out = np.asarray(_ref(x, target, 1, 0)).astype(np.float32)
    assert set(np.unique(out)) <= {fi.max, float(np.float32(fi.max - 2.0 ** (
        np.floor(np.log2(fi.max)) - fi.mantissa_bits)))}
    assert (out == fi.max).mean() > 0.9


def _mixed_input(n, fi, in_dtype, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n) * np.exp2(rng.uniform(np.log2(fi.smallest_subnormal) - 2,
                                                   np.log2(fi.max), n))
  x = np.clip(x, -F32_MAX, F32_MAX).astype(np.float32)
  special = np.array([np.nan, -np.inf, np.inf, 0.0, -0.0, min(fi.max * 1.2, F32_MAX), -fi.max,
                      fi.smallest_subnormal / 3, 1e-45], np.float32)
  x[: special.size] = special
  x[-special.size:] = special
  return jnp.asarray(x.astype(formats.info(in_dtype).dtype))


@pytest.mark.parametrize("target,in_dtype", PAIRS)
def test_pallas_matches_reference_odd_size(target, in_dtype):
  fi = formats.info(target)
  x = _mixed_input(2053, fi, in_dtype, seed=len(target))  # 5 blocks of 512, the last partial
  got = stochastic_round_pallas(x, target, 1234, 77, block_size=512, interpret=True)
  ref = _ref(x, target, 1234, 77)
  assert got.dtype == ref.dtype == fi.dtype and got.shape == x.shape
  assert_bit_identical(got, ref)


@pytest.mark.parametrize("target", ["bf16", "e4m3"])
def test_pallas_matches_reference_non_contiguous(target):
  fi = formats.info(target)
  base = _mixed_input(61 * 45, fi, "f32", seed=3).reshape(61, 45)
  views = [base.T[::2, 3:], base[5:40:3, ::-1]]  # transposed + strided, reversed slices
  for x in views:
    got = stochastic_round_pallas(x, target, 5, 6, block_size=256, interpret=True)
    ref = _ref(x, target, 5, 6)
    assert got.shape == x.shape
    assert_bit_identical(got, ref)


def test_pallas_matches_reference_nd_traced_step_and_key():
  fi = formats.info("f16")
  x = _mixed_input(3 * 7 * 11 * 5, fi, "f32", seed=4).reshape(3, 7, 11, 5)
  key = jax.random.key(42)

  @jax.jit
  def both(x, step):
    return (stochastic_round(x, "f16", key, step, impl="pallas"),
            stochastic_round(x, "f16", key, step, impl="xla"))

  for step in (0, 2 ** 31 + 7):
    got, ref = both(x, jnp.uint32(step))
    assert_bit_identical(got, ref)


def test_auto_is_xla_on_cpu_and_api_errors():
  x = jnp.linspace(-3, 3, 1001, dtype=jnp.float32)
  assert jax.default_backend() == "cpu"
  auto = jax.jit(lambda x: stochastic_round(x, jnp.bfloat16, 0))(x)
  assert_bit_identical(auto, _ref(x, "bf16", 0))
  assert mp.stochastic_round is stochastic_round
  with pytest.raises(ValueError, match="impl"):
    stochastic_round(x, "bf16", 0, impl="cuda")
  with pytest.raises(ValueError, match="targets are"):
    stochastic_round(x, "f32", 0)
  with pytest.raises(ValueError, match="float32 input"):
    stochastic_round(x.astype(jnp.float16), "bf16", 0)
  with pytest.raises(ValueError, match="float32 input"):
    stochastic_round(x.astype(jnp.bfloat16), "f16", 0)
  with pytest.raises(ValueError, match="power of two"):
    stochastic_round_pallas(x, "bf16", 0, block_size=1000)
  with pytest.raises(ValueError, match="key"):
    stochastic_round(x, "bf16", jnp.zeros((3,), jnp.float32))


@functools.lru_cache(maxsize=None)
def _halfway_fn():
  # 1 + 2**-8 is halfway between bf16 neighbours 1 and 1 + 2**-7: P(up) = 1/2.
  return jax.jit(lambda key, step: stochastic_round_reference(
      jnp.full((100_000,), 1.0 + 2.0 ** -8, jnp.float32), "bf16", key, step))


def _ups(key, step):
  return (np.asarray(_halfway_fn()(key, jnp.uint32(step))).astype(np.float32) > 1).astype(
      np.float64)


def test_determinism_and_independence():
  n = 100_000
  bound = 4 / np.sqrt(n)  # 4 standard errors of a correlation of independent bits
  u0 = _ups(jnp.uint32(7), 3)
  np.testing.assert_array_equal(u0, _ups(jnp.uint32(7), 3))  # same seed + step: same bits
  u1 = _ups(jnp.uint32(7), 4)
  assert 0.45 < (u0 != u1).mean() < 0.55  # another step: a fresh coin per element
  assert abs(u0.mean() - 0.5) < 4 * 0.5 / np.sqrt(n)
  corr = lambda a, b: np.corrcoef(a, b)[0, 1]
  assert abs(corr(u0[:-1], u0[1:])) < bound  # neighbouring elements
  assert abs(corr(u0[:-1000], u0[1000:])) < bound  # a row apart in a [*, 1000] matrix
  assert abs(corr(u0, u1)) < bound  # consecutive steps, same element
  l0, l1 = _ups(leaf_seed(7, 0), 3), _ups(leaf_seed(7, 1), 3)
  assert abs(corr(l0, l1)) < bound  # two leaves of one pytree
  assert abs(corr(u0, _ups(jnp.uint32(8), 3))) < bound  # neighbouring seeds


def test_swamping_with_stochastic_rounding():
  """Swamping: weight 1.0 plus 1e-5 per step for 100,000 steps. Nearest bf16 stays 1.0;
  stochastic rounding reaches 2.0 in expectation. Each step adds variance
  p(1-p) ulp**2 <= 1e-5 * ulp <= 1e-5 * 2**-6 (weights < 4), so one weight has standard
  deviation <= sqrt(1e5 * 1e-5 / 64) = 1/8, and the mean of 64 independent weights 1/64:
  the bound below is 4 of those."""
  steps, n = 100_000, 64

  @jax.jit
  def run():
    def body(carry, t):
      w_sr, w_near = carry
      w_sr = stochastic_round(w_sr.astype(jnp.float32) + np.float32(1e-5), jnp.bfloat16,
                              key=leaf_seed(0, 0), step=t)
      w_near = (w_near.astype(jnp.float32) + np.float32(1e-5)).astype(jnp.bfloat16)
      return (w_sr, w_near), None

    w0 = jnp.ones((n,), jnp.bfloat16)
    (w_sr, w_near), _ = jax.lax.scan(body, (w0, w0), jnp.arange(steps, dtype=jnp.uint32))
    return w_sr, w_near

  w_sr, w_near = (np.asarray(a).astype(np.float64) for a in run())
  assert (w_near == 1.0).all()
  assert w_sr.max() < 4.0
  assert abs(w_sr.mean() - 2.0) < 4 / 64, w_sr.mean()


# --- key / step / index_offset: uint32 counters, validated ---------------------------------

_X8 = jnp.linspace(0.1, 3.0, 8, dtype=jnp.float32)  # between bf16 neighbours: bits matter


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_counters_accept_the_uint32_range(impl):
  sr = functools.partial(stochastic_round, _X8, "bf16", impl=impl)
  top = 2 ** 32 - 1
  # Python ints up to 2**32 - 1 (2**31 used to raise OverflowError), equal to the uint32
  # array of the same value; signed and unsigned integer arrays alike.
  for step in (2 ** 31, top):
    np.testing.assert_array_equal(bits(sr(key=3, step=step)),
                                  bits(sr(key=3, step=jnp.uint32(step))))
  np.testing.assert_array_equal(bits(sr(key=top, step=0)),
                                bits(sr(key=jnp.uint32(top), step=0)))
  np.testing.assert_array_equal(bits(sr(key=jnp.int32(5), step=np.int64(9))),
                                bits(sr(key=5, step=9)))
  np.testing.assert_array_equal(bits(sr(key=np.uint8(5), step=np.array(9, np.int16))),
                                bits(sr(key=5, step=9)))
  # Distinct counters give distinct bits (so the equalities above are not vacuous).
  assert (bits(sr(key=3, step=2 ** 31)) != bits(sr(key=3, step=0))).any()
  assert (bits(sr(key=top, step=0)) != bits(sr(key=0, step=0))).any()
  # Traced values cannot be checked: they are taken mod 2**32, as documented.
  traced = jax.jit(lambda k, s: sr(key=k, step=s))(jnp.int32(-1), jnp.int32(-2))
  assert_bit_identical(traced, sr(key=top, step=top - 1))
  # jax.random keys, typed and raw, still work.
  k = jax.random.key(4)
  np.testing.assert_array_equal(bits(sr(key=k)), bits(sr(key=jax.random.key_data(k))))


@pytest.mark.parametrize("impl", ("xla", "pallas", "auto"))
@pytest.mark.parametrize("arg,value,why", [
    ("key", 2 ** 32, "outside the uint32 range"),
    ("key", 2 ** 40, "outside the uint32 range"),
    ("key", -1, "outside the uint32 range"),
    ("key", "abc", "str"),
    ("key", None, "NoneType"),
    ("key", 1.0, "float"),
    ("key", True, "True"),
    ("key", np.array(-1, np.int32), "outside the uint32 range"),
    ("key", np.zeros((3,), np.uint32), "shape (3,)"),
    ("key", jnp.float32(2.0), "dtype float32"),
    ("step", float("nan"), "nan"),
    ("step", 2 ** 32, "outside the uint32 range"),
    ("step", -1, "outside the uint32 range"),
    ("step", 1.5, "float"),
    ("step", np.float32(3.0), "float32"),
    ("step", np.bool_(True), "True"),
    ("step", "3", "str"),
    ("step", jnp.zeros((2,), jnp.uint32), "shape (2,)"),
    ("index_offset", jnp.int32(-5), "outside the uint32 range"),
])
def test_counters_reject_what_is_not_uint32(impl, arg, value, why):
  kwargs = {"key": 0, "step": 0, "index_offset": 0, arg: value}
  with pytest.raises(ValueError, match=arg) as e:
    stochastic_round(_X8, "bf16", kwargs["key"], kwargs["step"], impl=impl,
                     index_offset=kwargs["index_offset"])
  assert why in str(e.value) and "2**32" in str(e.value), str(e.value)
