"""precision.numerics.inspect: every statistic against an offline numpy/ml_dtypes reference
on the tensors of the same program (NNX, Linen, plain JAX; forward and backward), the
cotangent role, and seeded faults (f16 underflow without loss scaling, f16 overflow, an
fp8 outlier) found at the right scope, direction and role."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import precision as mp
from precision.fp8 import _microscale
from precision.numerics import _stats
from tests._zoo import user_code

F16 = "p=f32,c=f16,o=f32"
BF16 = "bf16_mixed"
FRACTION_TOL = 1e-3   # 0.1 percentage points
DB_TOL = 0.1

_FORMATS = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
            "float32": np.float32, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
            "float8_e5m2": ml_dtypes.float8_e5m2}


# ----------------------------------------------------------------------------- reference


def _classify(v: np.ndarray, fmt) -> dict:
  """Reference classification of nonzero finite f32 values `v` by the format's thresholds
  (derived by hand from ml_dtypes.finfo, round to nearest even), in f64."""
  fi = ml_dtypes.finfo(fmt)
  mag = np.abs(v.astype(np.float64))
  if np.dtype(fmt).itemsize >= 4:   # f32: stored as is
    return dict(underflow=0.0, overflow=0.0,
                subnormal=float(np.mean(mag < float(fi.smallest_normal))))
  sub, normal, fmax = (float(fi.smallest_subnormal), float(fi.smallest_normal), float(fi.max))
  half_ulp_max = 2.0 ** (math.floor(math.log2(fmax)) - fi.nmant - 1)
  # Ties: at sub/2 to even (0); at normal - sub/2 to even (normal); at max + half-ulp to
  # inf where the format has one (max is odd), to max (even) for E4M3 (no inf).
  if np.dtype(fmt) == np.dtype(ml_dtypes.float8_e4m3fn):
    over = mag > fmax + half_ulp_max
  else:
    over = mag >= fmax + half_ulp_max
  return dict(underflow=float(np.mean(mag <= sub / 2)), overflow=float(np.mean(over)),
              subnormal=float(np.mean((mag > sub / 2) & (mag < normal - sub / 2))))


def _sqnr(v: np.ndarray, fmt) -> float:
  x = v.astype(np.float64)
  with np.errstate(over="ignore"):   # overflow to inf is what is measured
    r = v.astype(fmt).astype(np.float64) if np.dtype(fmt).itemsize < 4 else x
  if not np.all(np.isfinite(r)):
    return -math.inf
  noise = np.sum((x - r) ** 2)
  return math.inf if noise == 0 else 10 * math.log10(np.sum(x * x) / noise)


def _mxfp8_reference(value: np.ndarray, block_axes) -> dict:
  """MXFP8 (E4M3 elements, E8M0 scales rounded up, blocks of 32 along `block_axes`),
  recomputed block by block: the axes moved last and flattened, each row cut into
  blocks (the last one shorter), scale 2**e with e the smallest integer such that
  block_amax / 2**e <= 448 (clamped to [-127, 127]), elements rounded by ml_dtypes."""
  x = np.asarray(value, np.float32)
  axes = [a % x.ndim for a in block_axes] if x.ndim else []
  k = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
  rows = np.moveaxis(x, axes, list(range(x.ndim - len(axes), x.ndim))).reshape(-1, k)
  vals, rounded = [], []
  for row in rows:
    for start in range(0, k, 32):
      b = row[start:start + 32]
      nz = np.isfinite(b) & (b != 0)
      if not nz.any():
        continue
      amax = float(np.max(np.abs(b[nz])))
      e = math.ceil(math.log2(amax / 448.0))
      while amax / 2.0 ** e > 448.0:
        e += 1
      while amax / 2.0 ** (e - 1) <= 448.0:
        e -= 1
      e = min(max(e, -127), 127)
      q = (b[nz].astype(np.float64) / 2.0 ** e).astype(np.float32)
      q = q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** e
      with np.errstate(over="ignore"):   # read back in f32: inf past its max
        rounded.append(q.astype(np.float32).astype(np.float64))
      vals.append(b[nz].astype(np.float64))
  if not vals:
    return dict(underflow=0.0, overflow=0.0, sqnr_db=math.inf)
  v, r = np.concatenate(vals), np.concatenate(rounded)
  if not np.all(np.isfinite(r)):
    return dict(underflow=float(np.mean(r == 0)), overflow=float(np.mean(~np.isfinite(r))),
                sqnr_db=-math.inf)
  noise = np.sum((v - r) ** 2)
  return dict(underflow=float(np.mean(r == 0)), overflow=0.0,
              sqnr_db=math.inf if noise == 0 else 10 * math.log10(np.sum(v * v) / noise))


def _reference(value: np.ndarray, dtype, block_axes=None) -> dict:
  """Every statistic of TensorStats, recomputed from the captured f32 tensor (MXFP8
  blocks along `block_axes`, default the last axis)."""
  fmt = _FORMATS[np.dtype(dtype).name]
  x = np.asarray(value, np.float32).ravel()
  finite = np.isfinite(x)
  v = x[finite & (x != 0)]
  amax = float(np.max(np.abs(v))) if v.size else 0.0
  amin = float(np.min(np.abs(v))) if v.size else 0.0
  ref = dict(nonfinite=float(np.mean(~finite)), zeros=float(np.mean(x == 0)),
             amax=amax, amin_nonzero=amin,
             dynamic_range_bits=math.log2(amax / amin) if v.size else 0.0)
  if v.size == 0:
    return ref
  ref.update(_classify(v, fmt), sqnr_db=_sqnr(v, fmt))
  is_fp8 = np.dtype(fmt).itemsize == 1
  ref["saturated"] = float(np.mean(np.abs(v.astype(fmt).astype(np.float64))
                                   == float(ml_dtypes.finfo(fmt).max))) if is_fp8 else 0.0
  for name, f in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
    c = _classify(v, f)
    ref[f"whatif_{name}_underflow"] = c["underflow"]
    ref[f"whatif_{name}_overflow"] = c["overflow"]
    ref[f"whatif_{name}_sqnr_db"] = _sqnr(v, f)
  for name, f in (("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)):
    scale = np.float32(ml_dtypes.finfo(f).max) / np.float32(amax)   # current scaling, f32
    s = (v * scale).astype(np.float32)
    c = _classify(s, f)
    ref[f"whatif_{name}_underflow"] = c["underflow"]
    ref[f"whatif_{name}_overflow"] = c["overflow"]
    ref[f"whatif_{name}_sqnr_db"] = _sqnr(s, f)
  if block_axes is None:
    block_axes = (np.ndim(value) - 1,) if np.ndim(value) else ()
  for stat, want in _mxfp8_reference(value, block_axes).items():
    ref[f"whatif_mxfp8_{stat}"] = want
  return ref


def _close(name, got, want):
  if "sqnr" in name:
    if math.isinf(want):
      return got == want
    return abs(got - want) <= DB_TOL
  if name in ("amax", "amin_nonzero"):
    return got == pytest.approx(want, rel=1e-6, abs=0)
  if name == "dynamic_range_bits":
    return got == pytest.approx(want, abs=1e-6)
  return abs(got - want) <= FRACTION_TOL


def _check_against_reference(fn, recipe, *args):
  """inspect's rows == the offline reference on capture's tensors, row by row."""
  report = mp.numerics.inspect(fn, recipe, *args)
  captured = mp.numerics.capture(fn, recipe, *args)
  assert len(report.rows) == len(captured) > 0
  compared = 0
  for row, cap in zip(report.rows, captured):
    assert (row.index, row.scope, row.direction, row.role, row.shape, row.dtype) == (
        cap.info.index, cap.info.scope, cap.info.direction, cap.info.role, cap.info.shape,
        cap.info.dtype)
    assert cap.value.shape == row.shape and row.size == cap.value.size
    assert row.block_axes == cap.info.block_axes
    for name, want in _reference(cap.value, cap.dtype, cap.info.block_axes).items():
      got = getattr(row, name)
      assert _close(name, got, want), (row.index, row.scope, row.role, name, got, want)
      compared += 1
  return report, compared


def _spread(key, shape, decades=4.0):
  """Normal values whose magnitudes span many binades (log-normal scale): enough range
  that f16 and fp8 lose some of them, so the reference comparisons are not all zeros."""
  k1, k2 = jax.random.split(key)
  return jax.random.normal(k1, shape) * jnp.exp(jax.random.normal(k2, shape) * decades)


# ----------------------------------------------------------------------------- models


class MLP(nnx.Module):
  """User-style NNX: Flax defaults, Linear with biases, LayerNorm, gelu."""

  def __init__(self, d_in=16, d=32, d_out=8, *, rngs):
    self.up = nnx.Linear(d_in, d, rngs=rngs)
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, d_out, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.gelu(self.norm(self.up(x))))


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(nn.Dense(32, name="up")(x))
    return nn.Dense(8, name="head")(nn.relu(h))


def _mse(y, target):
  return jnp.mean((y - target) ** 2)


def plain_loss(params, x, c):
  """No Flax: two GEMMs; d loss / d (second GEMM's output) is exactly `c`."""
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.sum((h @ params["w2"]) * c)


def _plain_args(key=0, batch=16):
  k = jax.random.split(jax.random.key(key), 4)
  params = {"w1": _spread(k[0], (16, 32), 1.5) / 8, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k[1], (32, 8)) / 6}
  x = _spread(k[2], (batch, 16), 2.5)
  c = _spread(k[3], (batch, 8), 3.0) * 1e-3
  return params, x, c


# ----------------------------------------------------------------------------- reference tests


@pytest.mark.parametrize("recipe", [BF16, F16])
def test_plain_jax_statistics_match_reference(recipe):
  params, x, c = _plain_args()
  with user_code():
    report, compared = _check_against_reference(jax.value_and_grad(plain_loss), recipe,
                                                 params, x, c)
  assert compared > 300
  assert {r.direction for r in report.rows} == {"fwd", "bwd"}
  # The comparison is not of zeros only: the spread inputs lose values to f16 and fp8.
  assert max(r.whatif_f16_underflow for r in report.rows) > 0.01
  assert max(r.whatif_e4m3_underflow for r in report.rows) > 0.01
  if recipe == F16:
    assert max(r.underflow for r in report.rows) > 0.01
    assert max(r.subnormal for r in report.rows) > 0.01


def test_captured_tensors_are_the_programs():
  """The values measured are the program's own, before rounding: the forward GEMM's
  operands are x and w1 in f32, its result is the f32 product of their bf16 roundings,
  and the cotangent of the second GEMM is d loss / d output = c, exactly."""
  params, x, c = _plain_args()
  with user_code():
    caps = mp.numerics.capture(jax.value_and_grad(plain_loss), BF16, params, x, c)
  by = {(k.info.index, k.info.operand): k for k in caps}
  assert by[(0, "lhs")].info.dtype == "bfloat16"
  np.testing.assert_array_equal(by[(0, "lhs")].value, np.asarray(x))
  np.testing.assert_array_equal(by[(0, "rhs")].value, np.asarray(params["w1"]))
  bf = lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)
  exact = bf(x) @ bf(params["w1"])   # f64; the program accumulates in f32
  np.testing.assert_allclose(by[(0, "out")].value, exact, rtol=0,
                             atol=1e-6 * np.abs(exact).max())
  assert by[(0, "out")].info.dtype == "bfloat16"        # the accumulator is rounded next
  cots = [k for k in caps if k.info.role == "cotangent" and k.info.shape == c.shape]
  assert len(cots) == 2                                 # dgrad and wgrad of the 2nd GEMM
  for k in cots:
    np.testing.assert_array_equal(k.value, np.asarray(c))
    assert k.info.direction == "bwd" and k.info.dtype == "bfloat16"


def test_recorder_computes_what_autocast_computes():
  """The evaluator that measures the tensors runs the same program: its outputs (loss and
  gradients) equal autocast's own, op by op (the default branch of autocast's CPU switch
  and the f32-upcast GEMMs give the same products, accumulated in f32)."""
  from precision.numerics import _interpret  # pylint: disable=g-import-not-at-top
  params, x, c = _plain_args()
  f = mp.autocast(jax.value_and_grad(plain_loss), BF16)
  with user_code():
    closed = jax.make_jaxpr(f)(params, x, c)
    want = jax.tree.leaves(f(params, x, c))
  got = _interpret.Recorder(lambda *a: None).run(closed, jax.tree.leaves((params, x, c)))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=1e-5, atol=1e-6 * float(np.abs(w).max()))


def test_nnx_model_statistics_and_scopes():
  with user_code():
    model = MLP(rngs=nnx.Rngs(0))
    x = _spread(jax.random.key(1), (16, 16), 2.0)
    target = jnp.zeros((16, 8))
    loss = lambda m, x, t: _mse(m(x), t)
    before = nnx.state(model)
    report, compared = _check_against_reference(nnx.value_and_grad(loss), F16, model, x,
                                                 target)
  assert compared > 300
  assert {(r.scope, r.direction) for r in report.rows} == {
      ("up", "fwd"), ("head", "fwd"), ("up", "bwd"), ("head", "bwd")}
  # The model passed in is left as it was.
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), before,
                                   nnx.state(model)))


def test_linen_model_statistics_and_scopes():
  with user_code():
    model = LinenMLP()
    x = _spread(jax.random.key(2), (16, 16), 2.0)
    variables = model.init(jax.random.key(0), x)
    loss = lambda v, x: _mse(model.apply(v, x), 0.0)
    report, _ = _check_against_reference(jax.value_and_grad(loss), BF16, variables, x)
  assert {(r.scope, r.direction) for r in report.rows} == {
      ("LinenMLP/up", "fwd"), ("LinenMLP/head", "fwd"), ("LinenMLP/up", "bwd"),
      ("LinenMLP/head", "bwd")}


def test_every_backward_gemm_has_a_cotangent_and_forward_none():
  params, x, c = _plain_args()
  with user_code():
    model = MLP(rngs=nnx.Rngs(0))
    reports = [
        mp.numerics.inspect(jax.value_and_grad(plain_loss), BF16, params, x, c),
        # autocast outside the gradient: the residuals are cast again in the backward
        # pass, and stay "lhs"/"rhs".
        mp.numerics.inspect(jax.grad(lambda m, x: _mse(m(x), 0.0)), BF16, model, x),
        mp.numerics.inspect(jax.jit(jax.grad(mp.autocast(plain_loss, BF16))), "fp32",
                            params, x, c),
        mp.numerics.inspect(jax.grad(_conv_loss), BF16, jnp.ones((3, 3, 2, 4)) / 9,
                            jnp.ones((2, 6, 6, 2))),
    ]
  for report in reports:
    by_gemm: dict = {}
    for r in report.rows:
      by_gemm.setdefault((r.index, r.direction), []).append(r.role)
    fwd = [roles for (_, d), roles in by_gemm.items() if d == "fwd"]
    bwd = [roles for (_, d), roles in by_gemm.items() if d == "bwd"]
    assert fwd and bwd
    assert all(sorted(roles) == ["lhs", "out", "rhs"] for roles in fwd), fwd
    for roles in bwd:   # exactly one operand is the cotangent, the other a residual
      assert roles.count("cotangent") == 1 and roles.count("out") == 1, roles


def _conv_loss(k, x):
  """A convolution (its backward flips the kernel with `rev`) under jax.checkpoint."""
  layer = jax.checkpoint(lambda k, x: jnp.tanh(jax.lax.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))))
  return jnp.sum(layer(k, x) ** 2)


def test_checkpointed_conv_recomputed_forward_and_cotangents():
  with user_code():
    report = mp.numerics.inspect(jax.grad(_conv_loss), BF16, jnp.ones((3, 3, 2, 4)) / 9,
                                 jnp.ones((2, 6, 6, 2)))
  gemms = {(r.index, r.direction, r.recomputed) for r in report.rows}
  # The forward conv, its recomputation in the backward pass (fwd, recomputed), one
  # backward conv (the kernel gradient: x is not differentiated).
  assert sorted(g[1:] for g in gemms) == [("bwd", False), ("fwd", False), ("fwd", True)]
  assert {r.primitive for r in report.rows} == {"conv_general_dilated"}
  bwd = report.select(direction="bwd")
  assert sorted(r.role for r in bwd) == ["cotangent", "lhs", "out"]
  # MXFP8 blocks run along each operand's input-feature axis (NHWC: 3, HWIO: 2).
  fwd = {r.operand: r.block_axes for r in report.rows if r.direction == "fwd"}
  assert fwd == {"lhs": (3,), "rhs": (2,), "out": (3,)}, fwd


def test_scan_gemms_are_recorded_per_iteration():
  w = jax.random.normal(jax.random.key(0), (3, 8, 8)) / 3

  def f(x, w):
    h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
    return jnp.sum(h)

  with user_code():
    report = mp.numerics.inspect(f, BF16, jnp.ones((4, 8)), w)
  lhs = [r for r in report.rows if r.role == "lhs"]
  assert [r.iteration for r in lhs] == [(0,), (1,), (2,)]
  assert [r.index for r in lhs] == [0, 1, 2]


# ----------------------------------------------------------------------------- seeded faults


@pytest.fixture(scope="module")
def tiny_loss_reports():
  """(f16 report, bf16 report) of nnx.grad of an MLP's loss x 1e-6, no loss scale."""
  with user_code():
    model = MLP(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (64, 16))
    target = jax.random.normal(jax.random.key(2), (64, 8))
    loss = lambda m, x, t: 1e-6 * _mse(m(x), t)
    return tuple(mp.numerics.inspect(nnx.grad(loss), r, model, x, target) for r in (F16, BF16))


def test_fault_f16_without_loss_scaling_underflows_cotangents(tiny_loss_reports):
  """A tiny loss (x 1e-6) under f16 with no loss scale: the backward GEMMs' cotangents
  underflow; the first anomaly is the cotangent of the last layer's backward GEMM."""
  f16, bf16 = tiny_loss_reports
  worst = f16.worst(1)[0]
  assert (worst.direction, worst.role) == ("bwd", "cotangent") and worst.underflow > 0.5
  first = f16.first_anomaly({"underflow": 0.5})
  assert (first.scope, first.direction, first.role) == ("head", "bwd", "cotangent")
  assert all(r.underflow == 0 for r in f16.rows if r.direction == "fwd")
  # Every gradient below the head is computed from the flushed cotangent: all zeros.
  (up_cot,) = f16.select(scope="up", direction="bwd", role="cotangent")
  assert up_cot.zeros == 1.0 and up_cot.underflow == 0
  assert bf16.select(scope="up", direction="bwd", role="cotangent")[0].zeros == 0
  # bf16 has f32's range: nothing underflows, and its what-if column says f16 would.
  assert max(r.underflow for r in bf16.rows) == 0
  w = bf16.worst(1, by="whatif_f16_underflow")[0]
  assert (w.direction, w.role) == ("bwd", "cotangent") and w.whatif_f16_underflow > 0.5
  assert "cotangent" in f16.table(worst=3).splitlines()[4]


class Overflowing(nnx.Module):
  """The middle layer's activations exceed f16's max (65504)."""

  def __init__(self, *, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.big = nnx.Linear(32, 32, rngs=rngs)
    self.big.kernel.set_value(self.big.kernel.get_value() * 3e4)
    self.head = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.head(self.big(self.up(x)))


def test_fault_f16_overflow_at_the_layer_that_overflows():
  with user_code():
    model = Overflowing(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))
    # Overflow, inf and NaN statistics against the reference too.
    f16, _ = _check_against_reference(lambda m, x: m(x), F16, model, x)
    bf16, _ = _check_against_reference(lambda m, x: m(x), BF16, model, x)
  worst = f16.worst(1)[0]
  assert (worst.scope, worst.direction, worst.role) == ("big", "fwd", "out")
  assert worst.overflow > 0 and worst.sqnr_db == -math.inf
  assert f16.first_anomaly() == worst
  assert f16.select(scope="head", role="lhs")[0].nonfinite > 0   # the inf flows on
  assert max(r.overflow for r in bf16.rows) == 0
  w = bf16.first_anomaly({"whatif_f16_overflow": 0.0})
  assert (w.scope, w.direction, w.role) == ("big", "fwd", "out")
  assert w.whatif_f16_overflow > 0


def test_fault_fp8_outlier_flushes_the_bulk():
  """One huge outlier sets the per-tensor current scale (448 / amax): under E4M3 the rest
  of that operand lands below half the smallest subnormal and flushes to zero. That
  operand is the worst row by what-if E4M3 underflow; E5M2's wider range keeps it.

  SQNR is energy-weighted, and a lone outlier carries the tensor's energy (and is itself
  represented exactly at the format max), so the operand's what-if E4M3 SQNR stays high:
  it cannot see this fault, underflow does (pinned here so the docs stay true)."""
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (64, 64))
  w = jax.random.normal(k[1], (64, 64)) / 8
  spiky = jax.random.normal(k[2], (64, 64)).at[3, 5].set(1e6)

  def f(x, w, spiky):
    return jnp.sum(jnp.tanh(x @ w) @ spiky)

  with user_code():
    report = mp.numerics.inspect(f, BF16, x, w, spiky)
  worst = report.worst(1, by="whatif_e4m3_underflow")[0]
  assert (worst.index, worst.direction, worst.role, worst.shape) == (1, "fwd", "rhs",
                                                                      (64, 64))
  assert worst.whatif_e4m3_underflow > 0.9
  # Only that operand, and the result it spreads its outlier column into, lose values.
  assert max(r.whatif_e4m3_underflow for r in report.rows
             if r is not worst and r.role != "out") < 0.05
  assert worst.whatif_e5m2_underflow < 0.01
  assert worst.dynamic_range_bits > 25
  assert worst.whatif_e4m3_sqnr_db > 30 and worst.sqnr_db > 40   # the SQNR blind spot
  # MXFP8's scales are per 32 elements along the contraction (spiky's axis 0): the
  # outlier costs only its own block (31 of 4096 elements at most).
  assert worst.block_axes == (0,) and worst.whatif_mxfp8_underflow < 32 / 4096


def test_block_axes_are_each_gemms_contraction_and_mxfp8_matches_reference():
  """A dense layer over [batch, seq, d]: forward operands block along d (x) and along
  the weight's input axis; the weight-gradient GEMM contracts batch and seq, so its
  operands (x and the cotangent) block along (0, 1): blocks of 32 run across the
  sequence boundary of the flattened batch x seq axis (seq = 12 here)."""
  k = jax.random.split(jax.random.key(5), 2)
  x = _spread(k[0], (8, 12, 40), decades=2.0)
  w = jax.random.normal(k[1], (40, 24)) / 6

  def loss(w, x):
    return 1e-3 * jnp.sum(jnp.tanh(jnp.einsum("bsd,df->bsf", x, w)) ** 2)

  with user_code():
    report, compared = _check_against_reference(jax.grad(loss), BF16, w, x)
  assert compared > 0
  fwd = {r.operand: r.block_axes for r in report.rows if r.direction == "fwd"}
  assert fwd == {"lhs": (2,), "rhs": (0,), "out": (2,)}, fwd
  wgrad = [r for r in report.rows if r.direction == "bwd" and r.operand != "out"]
  assert {(r.shape, r.block_axes) for r in wgrad} == {((8, 12, 40), (0, 1)),
                                                      ((8, 12, 24), (0, 1))}
  assert any(0 < r.whatif_mxfp8_underflow for r in report.rows)


def test_mxfp8_whatif_against_reference_on_partial_and_transposed_blocks():
  """tensor_stats' MXFP8 columns against the block-by-block reference: a last axis of
  45 (a partial block of 13), blocks along non-adjacent axes in reverse order (2, 0), an
  outlier above 2**60 (its block's scale is 2**55; the rest of its block underflows),
  blocks without a nonzero element, inf and NaN (not measured)."""
  rng = np.random.default_rng(11)
  x = (rng.standard_normal((6, 5, 45)) * np.exp(rng.standard_normal((6, 5, 45)) * 3))
  x = x.astype(np.float32)
  x[0, 0, 3] = 2.0 ** 63
  x[1, :, :] = 0.0
  x[2, 1, 7], x[2, 1, 8], x[3, 4, 44] = np.inf, np.nan, -np.inf
  for axes in [(2,), (2, 0), (0, 1), (1,), ()]:
    got = _stats.tensor_stats(x, ml_dtypes.bfloat16, axes)
    want = _mxfp8_reference(x, axes)
    for stat, w in want.items():
      assert _close(f"whatif_mxfp8_{stat}", got[f"whatif_mxfp8_{stat}"], w), (axes, stat)
    # Elements sharing the outlier's block underflow; with no block axes every element
    # is a block of its own and nothing does.
    assert (want["underflow"] > 0) == bool(axes) and math.isfinite(want["sqnr_db"])
  # The recipe's own quantiser (scale_rounding "up") gives the same values.
  part = x[:, :, :32]
  q, sc = _microscale.mxfp8_quantize(jnp.asarray(part), "e4m3", axis=2)
  recipe = np.asarray(_microscale.mxfp8_dequantize(q, sc, axis=2))
  layout = _stats.block_layout(part.shape, (2,))
  blocks = _stats.to_blocks(part, layout)
  ok = np.isfinite(blocks)
  assert np.array_equal(_stats.mxfp8_round(blocks)[ok], _stats.to_blocks(recipe, layout)[ok])


def test_fp8_operands_saturated_against_reference():
  """A GEMM the program itself runs in E4M3 (scaled and clipped by hand, kept as written
  under the fp32 recipe): the operand is measured as the clipped f32 value it converts,
  and `saturated` counts the elements at E4M3's max (448)."""

  def f(x, w):
    xs = jnp.clip(x * 4.0, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    ws = w.astype(jnp.float8_e4m3fn)
    return jnp.sum(jax.lax.dot_general(xs, ws, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32))

  x = jax.random.normal(jax.random.key(0), (16, 32)) * 100
  w = jax.random.normal(jax.random.key(1), (32, 8))
  with user_code():
    report, _ = _check_against_reference(f, "fp32", x, w)
  lhs, rhs, out = report.rows
  assert (lhs.dtype, rhs.dtype, out.dtype) == ("float8_e4m3fn", "float8_e4m3fn", "float32")
  # At the max: clipped (>= 448) or rounded up to it (E4M3's neighbours there are 416 and
  # 448; 432 is the tie, which goes to the even 448).
  clipped = np.mean(np.abs(np.asarray(x) * 4.0) >= 432.0)
  assert lhs.saturated == pytest.approx(clipped, abs=FRACTION_TOL) and lhs.saturated > 0.2
  assert rhs.saturated == 0 and out.saturated == 0 and lhs.amax == 448.0


# ----------------------------------------------------------------------------- API


def test_report_api_and_bad_input():
  params, x, c = _plain_args()
  with user_code():
    report = mp.numerics.inspect(jax.value_and_grad(plain_loss), F16, params, x, c)
  recs = report.to_records()
  assert len(recs) == len(report.rows) and recs[0]["scope"] == report.rows[0].scope
  assert set(mp.numerics.STATISTICS) <= set(recs[0])
  assert report.policy == "p=f32,c=f16,o=f32"
  text = report.table(worst=5)
  assert text.count("\n| ") == 6 and "sqnr dB" in text
  assert report.first_anomaly({"sqnr_db": -1e9}) is None
  with pytest.raises(ValueError, match="'underflw'.*underflow"):
    report.first_anomaly({"underflw": 0.1})
  with pytest.raises(ValueError, match="'nope'"):
    report.worst(3, by="nope")
  with pytest.raises(ValueError, match="threshold|Threshold"):
    report.first_anomaly({"underflow": "high"})
  with pytest.raises(ValueError, match="callable.*'not a function'"):
    mp.numerics.inspect("not a function", BF16, x)
  with pytest.raises(ValueError):
    mp.numerics.inspect(plain_loss, "p=f32,c=f12", params, x, c)


def test_docstring_example_runs_as_written():
  import doctest  # pylint: disable=g-import-not-at-top
  test = doctest.DocTestParser().get_doctest(mp.numerics.inspect.__doc__, {}, "inspect",
                                             None, 0)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  with user_code():
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.failed == 0 and result.attempted >= 7


def test_heatmap_png(tmp_path, tiny_loss_reports):
  report = tiny_loss_reports[0]
  from precision.numerics import _heatmap  # pylint: disable=g-import-not-at-top
  layers, cols, values = _heatmap.grid(report.rows, "underflow")
  assert layers == ["up", "head"] and cols[:3] == ["fwd lhs", "fwd rhs", "fwd out"]
  assert "bwd cotangent" in cols
  head_cot = values[layers.index("head"), cols.index("bwd cotangent")]
  assert head_cot == max(r.underflow for r in report.select(scope="head", role="cotangent"))
  path = report.heatmap(tmp_path / "numerics.png", ("underflow", "overflow", "sqnr_db"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="'underflw'"):
    report.heatmap(tmp_path / "x.png", ("underflw",))


def test_gemms_inside_shard_map_are_named_as_unseen():
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  body = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("d"), P()),
                       out_specs=P("d"))
  x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
  with user_code():
    report = mp.numerics.inspect(lambda x, w: jnp.tanh(body(x, w)) @ w, BF16, x, w)
  assert report.unvisited == ("shard_map",)
  assert len({r.index for r in report.rows}) == 1       # the GEMM outside it
  assert "not seen" in report.table().splitlines()[0]
