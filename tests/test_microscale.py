"""Microscaled formats: MXFP8 / NVFP4 quantisers against numpy + ml_dtypes references,
stochastic rounding, the random Hadamard transform, and the mxfp8 / nvfp4 recipes.

The references are written here with numpy (f64 for the power-of-two MXFP8 arithmetic,
which is exact there; f32 IEEE arithmetic for NVFP4, which defines its scales in f32) and
ml_dtypes casts; they share no code with precision.fp8._microscale.
"""

import dataclasses
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
  # The transform is the matrix: H D applied to each run of 16 (exact here: small integers).
  np.testing.assert_array_equal(np.asarray(ha)[16:32], h.astype(np.float32) @ a[16:32])


# ---------------------------------------------------------------------------------------
# Recipes: mxfp8 / nvfp4 through precision.autocast and the fp8 dot_general.

DIMS = (32, 64, 64, 64, 32)


def _mlp_params(seed=0):
  keys = jax.random.split(jax.random.key(seed), len(DIMS) - 1)
  return [jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a)
          for k, a, b in zip(keys, DIMS[:-1], DIMS[1:])]


def _loss(ws, x, y):
  for w in ws[:-1]:
    x = jnp.tanh(x @ w)
  return jnp.mean((x @ ws[-1] - y) ** 2)


def _data():
  kx, ky = jax.random.split(jax.random.key(1))
  return (jax.random.normal(kx, (32, DIMS[0]), jnp.float32),
          jax.random.normal(ky, (32, DIMS[-1]), jnp.float32))


def test_presets_and_config_round_trip():
  for name, scaling, fmts in (("mxfp8", "mxfp8", ("e4m3", "e4m3")),
                              ("nvfp4", "nvfp4", ("e2m1", "e2m1"))):
    r = mp.get_recipe(name)
    assert r.fp8.scaling == scaling
    assert (r.fp8.forward_format, r.fp8.backward_format) == fmts
    assert mp.Recipe.from_dict(r.to_dict()) == r
  nv = mp.get_recipe("nvfp4").fp8
  assert nv.block_size == 16 and nv.stochastic_gradients and nv.hadamard_wgrad
  assert mp.get_recipe("mxfp8").fp8.block_size == 32
  assert mp.get_recipe("mxfp8").fp8.scale_rounding == "up"
  # The other configs' dicts are unchanged: no microscaled field is written for them,
  # and a dict without them reads their defaults.
  d = mp.get_recipe("fp8_hybrid").fp8.to_dict()
  assert not {"micro_block", "scale_rounding", "stochastic_gradients", "hadamard_wgrad",
              "seed"} & set(d)
  assert mp.Fp8Config.from_dict(d) == mp.get_recipe("fp8_hybrid").fp8
  c = mp.Fp8Config(scaling="mxfp8", micro_block=64, scale_rounding="floor")
  assert c.to_dict()["micro_block"] == 64 and mp.Fp8Config.from_dict(c.to_dict()) == c
  nv = dataclasses.replace(nv, seed=3, hadamard_wgrad=False)
  assert nv.to_dict()["seed"] == 3 and "hadamard_wgrad" not in nv.to_dict()  # default
  assert mp.Fp8Config.from_dict(nv.to_dict()) == nv


@pytest.mark.parametrize("kwargs, match", [
    (dict(forward_format="e2m1"), r"fp8\.forward_format='e2m1'.*e4m3 or e5m2.*'delayed'"),
    (dict(scaling="delayed", backward_format="e2m1"), r"fp8\.backward_format='e2m1'"),
    (dict(scaling="nvfp4"), r"fp8\.forward_format='e4m3'; accepted: e2m1"),
    (dict(scaling="current", micro_block=32), r"fp8\.micro_block=32.*mxfp8, nvfp4"),
    (dict(scaling="mxfp8", scale_rounding="nearest"), r"fp8\.scale_rounding.*up, floor"),
    (dict(scaling="mxfp8", stochastic_gradients=True), r"fp8\.stochastic_gradients"),
    (dict(scaling="mxfp8", micro_block=0), r"fp8\.micro_block=0"),
    (dict(scaling="mxfp8", seed=-1), r"fp8\.seed=-1"),
    (dict(scaling="mxfp8", seed=2), r"fp8\.seed=2.*only with fp8\.scaling='nvfp4'"),
    (dict(scaling="current", scale_rounding="floor"), r"fp8\.scale_rounding='floor'"),
])
def test_bad_microscaled_configs(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mp.Fp8Config(**kwargs)


def test_block_not_dividing_the_contraction_is_refused():
  recipe = mp.Recipe("mx48", "p=f32,c=bf16,o=f32",
                     fp8=mp.Fp8Config(scaling="mxfp8", keep_first_last=False))
  ws = [jnp.ones((48, 32), jnp.float32)]
  f = lambda ws, x: jnp.sum(x @ ws[0])
  with pytest.raises(ValueError, match=r"fp8\.micro_block=32 \(mxfp8\) does not divide K"):
    jax.eval_shape(mp.autocast(f, recipe), ws, jnp.ones((32, 48), jnp.float32))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _fake(name, x, axis):
  """x quantised in the format's blocks along `axis` (E4M3 elements for mxfp8), in f32."""
  if name == "mxfp8":
    return mpf.mxfp8_dequantize(*mpf.mxfp8_quantize(x, "e4m3", axis=axis), axis=axis)
  return mpf.nvfp4_dequantize(*mpf.nvfp4_quantize(x, axis=axis), axis=axis)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_autocast_gemm_is_the_format_emulation(name):
  """The forward GEMM of a selected site is the f32 product of the operands quantised
  along the contraction (the reference built from the public quantisers)."""
  base = mp.get_recipe(name)
  recipe = base.replace(name=f"{name}_all",
                        fp8=dataclasses.replace(base.fp8, keep_first_last=False))
  ws, (x, _) = _mlp_params(), _data()
  f = lambda ws, x: x @ ws[1]
  h = jax.jit(lambda x, w: jnp.tanh(x @ w))(x, ws[0])
  got = jax.jit(mp.autocast(f, recipe))(ws, h)
  # The operands reach the fp8 GEMM as they arrive (f32 here); its result is rounded
  # once to the compute dtype (bf16), then cast to the output dtype.
  a, b = _fake(name, h, 1), _fake(name, ws[1], 0)
  if recipe.fp8.weight_block_2d:   # the nvfp4 preset: the weight in 16x16 tiles
    q, tiles, ts = mpf.nvfp4_quantize_2d(ws[1], axes=(0, 1))
    b = mpf.nvfp4_dequantize(q, mpf.expand_tile_scales(tiles, (0, 1), 0), ts, axis=0)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(got.astype(jnp.bfloat16), np.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2 ** -8, atol=1e-6)
  unquantised = np.asarray(h, np.float64) @ np.asarray(ws[1], np.float64)
  assert np.max(np.abs(want - unquantised)) > 10 * np.max(np.abs(np.asarray(got) - want))
  sites = mp.fp8.autocast_gemms(f, recipe, ws, h)
  assert [s.fp8 for s in sites] == [True]


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_plain_jax_mlp_trains(name):
  ws, (x, y) = _mlp_params(), _data()
  sites = mp.fp8.autocast_gemms(_loss, name, ws, x, y)
  assert [s.fp8 for s in sites] == [False, True, True, False]  # first and last in bf16
  vg = jax.jit(jax.value_and_grad(mp.autocast(_loss, name)))
  losses = []
  for _ in range(8):
    loss, g = vg(ws, x, y)
    losses.append(float(loss))
    ws = [w - 0.5 * gw for w, gw in zip(ws, g)]
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


def _nv_fake(x, axis):
  return mpf.nvfp4_dequantize(*mpf.nvfp4_quantize(x, axis=axis), axis=axis)


@jax.jit
def _nv_backward_reference(a, b, g):
  """(dgrad, wgrad) of a @ b with cotangent g, nearest rounding, Hadamard seed 11."""
  rht = lambda x: mpf.random_hadamard(x, 0, 11)
  return (_nv_fake(g, 1) @ _nv_fake(b, 1).T, _nv_fake(rht(a), 0).T @ _nv_fake(rht(g), 0))


@pytest.mark.parametrize("stochastic", [False, True])
def test_nvfp4_gemm_backward_is_the_recipe(stochastic):
  """dgrad and wgrad of one nvfp4 GEMM: every operand quantised along the GEMM's own
  contraction, the wgrad operands after the random Hadamard transform along M; with
  stochastic gradients the same GEMMs with the gradient rounded stochastically (fixed
  bits: the same inputs give the same result)."""
  config = mp.Fp8Config(scaling="nvfp4", forward_format="e2m1", backward_format="e2m1",
                        hadamard_wgrad=True, stochastic_gradients=stochastic, seed=11)
  spec = mpf.Fp8Spec.from_config(config)
  ka, kb, kg = jax.random.split(jax.random.key(2), 3)
  a = jax.random.normal(ka, (32, 64), jnp.float32)
  b = jax.random.normal(kb, (64, 48), jnp.float32)
  g = jax.random.normal(kg, (32, 48), jnp.float32)

  def f(a, b):
    return mpf.fp8_dot_general(a, b, (((1,), (0,)), ((), ())), spec.init_state(), spec,
                               out_dtype=jnp.float32)[0]

  vjp = jax.jit(lambda a, b, g: jax.vjp(f, a, b)[1](g))
  da, db = vjp(a, b, g)
  da2, db2 = vjp(a, b, g)
  np.testing.assert_array_equal(np.asarray(da), np.asarray(da2))
  np.testing.assert_array_equal(np.asarray(db), np.asarray(db2))
  da_ref, db_ref = (np.asarray(v, np.float64) for v in _nv_backward_reference(a, b, g))
  exact = np.asarray(a, np.float64).T @ np.asarray(g, np.float64)
  if not stochastic:
    np.testing.assert_allclose(np.asarray(da), da_ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(db), db_ref, rtol=1e-5, atol=1e-4)
  else:  # other roundings of g; the errors against the exact product of the same size
    assert not np.allclose(np.asarray(db), db_ref, rtol=1e-5, atol=1e-4)
    err_sr = np.linalg.norm(np.asarray(db) - exact)
    err_rn = np.linalg.norm(db_ref - exact)
    assert 0.5 * err_rn < err_sr < 2.5 * err_rn, (err_sr, err_rn)
  # Quantisation error, not a wiring error: within 25% (relative, Frobenius) of a^T g.
  assert np.linalg.norm(np.asarray(db) - exact) < 0.25 * np.linalg.norm(exact)


def test_audit_requires_the_microscaled_gemms():
  """A program lowered under bf16 fails the mxfp8 check (no microscaled GEMM); the same
  function under mxfp8 passes it."""
  from precision.audit import lower  # pylint: disable=g-import-not-at-top
  ws, (x, y) = _mlp_params(), _data()
  good = lower(jax.grad(mp.autocast(_loss, "mxfp8")), ws, x, y, platform="cuda")
  good.check("mxfp8")
  names = [g.name for g in good.gemms if "mxfp8_gemm" in g.name]
  assert len(names) == 6  # two microscaled forward GEMMs and their 4 gradient GEMMs
  bad = lower(jax.grad(mp.autocast(_loss, "bf16_mixed")), ws, x, y, platform="cuda")
  found = bad.violations("mxfp8")
  assert any("no fwd fp8 GEMM" in v for v in found) and any("no bwd" in v for v in found)


@pytest.mark.slow  # 5-16 s on the shared 2-core machine (two NNX jits and gradients)
@pytest.mark.parametrize("name", ["nvfp4"])  # mxfp8 takes the same path, fewer options
def test_nnx_layers_and_autocast_are_bit_identical(name):
  """The same NNX model and recipe (every GEMM microscaled): its fp8 layers
  (`apply_fp8`) and `autocast` of the unmodified model give the same output and the same
  gradients, bit for bit (one fp8_dot_general behind both)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(a, b, use_bias=False, rngs=rngs)
                              for a, b in zip(DIMS[:-1], DIMS[1:])])

    def __call__(self, x):
      for layer in self.layers[:-1]:
        x = jax.nn.relu(layer(x))
      return self.layers[-1](x)

  base = mp.get_recipe(name)
  recipe = base.replace(name=f"{name}_all", fp8=dataclasses.replace(
      base.fp8, keep_first_last=False, keep_high_precision=()))
  x, _ = _data()
  f = lambda m, x: m(x)
  total = lambda g: lambda m, x: jnp.sum(g(m, x).astype(jnp.float32))
  auto = mp.autocast(f, recipe)
  with jax.numpy_dtype_promotion("standard"):  # user code: bf16 inputs meet f32 kernels
    out_b = jax.jit(auto)(Net(nnx.Rngs(0)), x)
    grads_b = nnx.jit(nnx.grad(total(auto), argnums=(0, 1)))(Net(nnx.Rngs(0)), x)
    layered = mp.fp8.apply_fp8(Net(nnx.Rngs(0)), recipe.fp8, recipe.policy)
    out_a = nnx.jit(f)(layered, x)
    grads_a = nnx.jit(nnx.grad(total(f), argnums=(0, 1)))(layered, x)
  np.testing.assert_array_equal(np.asarray(out_a, np.float32), np.asarray(out_b))
  np.testing.assert_array_equal(np.asarray(grads_a[1]), np.asarray(grads_b[1]))
  kernels_a, kernels_b = jax.tree.leaves(grads_a[0]), jax.tree.leaves(grads_b[0])
  assert len(kernels_a) == len(kernels_b) == len(DIMS) - 1
  for ka, kb in zip(kernels_a, kernels_b):
    np.testing.assert_array_equal(np.asarray(ka), np.asarray(kb))
