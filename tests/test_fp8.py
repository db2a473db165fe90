"""precision.fp8: fp8 GEMM error bounds per recipe, block vs per-tensor on outliers, Flax
fp8_ops parity for delayed scaling, saturation, state flow (NNX, Linen, data parallel,
checkpoint), apply_fp8, and a tiny transformer trained under fp8_hybrid vs bf16_mixed."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen import fp8_ops

import precision as mp
from precision import formats
from precision.fp8 import _scaling as sc
from _asserts import assert_bit_identical

F32 = jnp.float32
DN = (((1,), (0,)), ((), ()))  # [M, K] x [K, N]
RECIPES = ("current", "delayed", "per_channel", "block")


def _operands(dist: str, seed: int = 0):
  """x [32, 256], w [256, 192], cotangent g [32, 192], f32."""
  rng = np.random.default_rng(seed)
  if dist == "gaussian":
    x = rng.standard_normal((32, 256))
    w = 0.05 * rng.standard_normal((256, 192))
    g = 1e-3 * rng.standard_normal((32, 192))
  else:  # heavy-tailed: Student-t (df=2) everywhere plus 100x outliers in a few channels
    x = rng.standard_t(2, (32, 256))
    x[:, [3, 77, 200]] *= 100.0
    w = 0.05 * rng.standard_t(2, (256, 192))
    g = 1e-3 * rng.standard_t(2, (32, 192))
  return tuple(np.asarray(a, np.float32) for a in (x, w, g))


def _step(spec):
  """jitted (x, w, g, state) -> (out, dx, dw, new_state), state updated as value_and_grad does."""

  @jax.jit
  def step(x, w, g, state):
    def f(x, w, gs):
      return mp.fp8.fp8_dot_general(x, w, DN, state._replace(grad=gs), spec)

    (out, new), vjp = jax.vjp(f, x, w, state.grad)
    zero = jax.tree.map(jnp.zeros_like, new)
    dx, dw, new_grad = vjp((g, zero))
    return out, dx, dw, new._replace(grad=new_grad)

  return step


def _run_two_steps(recipe: str, x, w, g, **config):
  """Two steps on the same data: delayed scaling then scales with this data's amax."""
  spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling=recipe, amax_history_len=4, **config))
  step = _step(spec)
  state = spec.init_state()
  for _ in range(2):
    out, dx, dw, state = step(x, w, g, state)
  return np.asarray(out), np.asarray(dx), np.asarray(dw), state


def _elem_error(x, fmt):
  """Upper bound on |x - dequant(quant(x))| for any recipe whose scales are <= amax/fmax
  (every recipe here once its amax is known): u|x| in the normal range, half the smallest
  subnormal (times the scale) below it; plus the f32 division x/s (2^-24 relative)."""
  fi = formats.info(fmt)
  amax = np.max(np.abs(x)).astype(np.float64)
  s_max = amax / fi.max * (1 + 2.0 ** -20)
  return np.maximum((fi.unit_roundoff + 2.0 ** -23) * np.abs(x), s_max * fi.smallest_subnormal / 2)


def _gemm_bound(a, b, ea, eb):
  """|fl(A~ B~) - A B| <= Ea|B| + |A|Eb + Ea Eb + f32 accumulation and dequantization."""
  a, b = np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64))
  k = a.shape[1]
  return ea @ b + a @ eb + ea @ eb + (k + 4) * 2.0 ** -24 * ((a + ea) @ (b + eb))


@pytest.mark.parametrize("dist", ["gaussian", "heavy"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_error_within_fp8_bound(recipe, dist):
  x, w, g = _operands(dist)
  out, dx, dw, state = _run_two_steps(recipe, x, w, g)
  x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
  ex, ew, eg = _elem_error(x, "e4m3"), _elem_error(w, "e4m3"), _elem_error(g, "e5m2")
  checks = {
      "out": (out, x64 @ w64, _gemm_bound(x, w, ex, ew)),
      "dx": (dx, g64 @ w64.T, _gemm_bound(g, w.T, eg, ew.T)),
      "dw": (dw, x64.T @ g64, _gemm_bound(x.T, g, ex.T, eg)),
  }
  for name, (got, ref, bound) in checks.items():
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= bound), (name, float(np.max(err / bound)))
  if dist == "gaussian":
    # The bound is tight, not vacuous: relative to |A||B| it is about u_A + u_B
    # (E4M3 2^-4, E5M2 2^-3), the precision the formats give.
    rel_bound = checks["out"][2] / (np.abs(x64) @ np.abs(w64))
    assert np.median(rel_bound) < 1.5 * 2 * formats.info("e4m3").unit_roundoff
    rel_bound = checks["dx"][2] / (np.abs(g64) @ np.abs(w64.T))
    assert np.median(rel_bound) < 1.5 * (formats.info("e4m3").unit_roundoff
                                         + formats.info("e5m2").unit_roundoff)
  assert all(np.isfinite(a).all() for a in (out, dx, dw))
  # Gaussian data: normwise error of the order of the unit roundoff (E4M3 0.0625).
  if dist == "gaussian":
    rel = np.linalg.norm(out - x64 @ w64) / np.linalg.norm(x64 @ w64)
    assert rel < formats.info("e4m3").unit_roundoff, rel
    assert float(state.grad.scale) > 0 and float(state.grad.amax_history[0]) > 0


def test_block_scaling_beats_per_tensor_on_outliers():
  # Massive activations: two tokens (rows) 10^5 x larger than the rest. E4M3 spans about
  # 15 binades of normal numbers, so one per-tensor scale set by the outliers pushes every
  # other row into the subnormal range (or to zero); 1x128 tiles give each row its own
  # scales. Errors are measured on the ordinary rows (the outlier rows' own products are
  # precise under every recipe and would dominate any norm).
  rng = np.random.default_rng(1)
  x = rng.standard_normal((32, 512)).astype(np.float32)
  x[[3, 17]] *= 1e5
  w = (0.05 * rng.standard_normal((512, 64))).astype(np.float32)
  g = (1e-3 * rng.standard_normal((32, 64))).astype(np.float32)
  ref = x.astype(np.float64) @ w.astype(np.float64)
  rows = np.setdiff1d(np.arange(32), [3, 17])
  errs = {}
  for recipe in ("current", "delayed", "block"):
    out = _run_two_steps(recipe, x, w, g)[0]
    errs[recipe] = np.linalg.norm((out - ref)[rows]) / np.linalg.norm(ref[rows])
  assert errs["block"] * 4 < errs["current"], errs
  assert errs["block"] * 4 < errs["delayed"], errs
  assert errs["block"] < formats.info("e4m3").unit_roundoff, errs


def test_delayed_matches_flax_fp8_ops():
  """Same inputs, same history length, five steps with a growing amax: outputs, gradients,
  scales and histories agree with flax.linen.fp8_ops.Fp8DirectDotGeneralOp.

  Where they differ by design: when the amax is zero or non-finite both keep the previous
  scale, but Flax returns 1/(1/prev) (can differ from prev in the last bit for a scale that
  is not a power of two), we return prev exactly. Flax quantizes in the layer's compute
  dtype (x / scale rounded to bf16, then to fp8: a double rounding under bf16); we divide
  in f32. With f32 operands, as here, both are the same arithmetic.
  """
  hist = 8
  rng = np.random.default_rng(2)
  op = fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=hist)
  x0 = jnp.ones((16, 64), F32)
  w0 = jnp.ones((64, 32), F32)
  with jax.numpy_dtype_promotion("standard"):  # flax fp8_ops mixes dtypes implicitly
    flax_vars = op.init(jax.random.key(0), x0, w0, DN)

  @jax.jit
  def flax_step(v, x, w, g):
    with jax.numpy_dtype_promotion("standard"):
      out, vjp = jax.vjp(lambda x, w, v: op.apply(v, x, w, DN), x, w, v)
      dx, dw, dv = vjp(g)
    return out, dx, dw, dv

  spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="delayed", amax_history_len=hist))
  ours = _step(spec)
  state = spec.init_state()
  for t in range(5):
    grow = 2.0 ** (2 * t)  # amax grows: the delayed scale lags one step behind
    x = jnp.asarray(grow * rng.standard_normal((16, 64)), F32)
    w = jnp.asarray(0.05 * rng.standard_normal((64, 32)), F32)
    g = jnp.asarray(grow * 1e-2 * rng.standard_normal((16, 32)), F32)
    f_out, f_dx, f_dw, f_new = flax_step(flax_vars, x, w, g)
    flax_vars = f_new  # OVERWRITE_WITH_GRADIENT: the "gradient" is the new state
    out, dx, dw, state = ours(x, w, g, state)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f_out))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(f_dx))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(f_dw))
    fv = f_new["_overwrite_with_gradient"]
    for ours_st, name in ((state.lhs, "input"), (state.rhs, "kernel"), (state.grad, "output_grad")):
      np.testing.assert_array_equal(np.asarray(ours_st.scale), np.asarray(fv[f"{name}_scale"])[0])
      np.testing.assert_array_equal(np.asarray(ours_st.amax_history),
                                    np.asarray(fv[f"{name}_amax_history"]))
  assert float(state.lhs.saturated) > 0  # the growing amax did saturate a lagging scale


def test_saturation_counted_and_outputs_finite():
  # Delayed scaling starts from scale 1: inputs beyond E4M3's 448 and gradients beyond
  # E5M2's 57344 saturate on the first step (clipped, not inf/NaN) and are counted.
  rng = np.random.default_rng(3)
  x = (1e4 * rng.standard_normal((16, 128))).astype(np.float32)
  w = rng.standard_normal((128, 32)).astype(np.float32)
  g = (1e6 * rng.standard_normal((16, 32))).astype(np.float32)
  spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="delayed", amax_history_len=4))
  out, dx, dw, st = _step(spec)(x, w, g, spec.init_state())
  assert all(np.isfinite(np.asarray(a)).all() for a in (out, dx, dw))
  assert float(st.lhs.saturated) == np.sum(np.abs(x) > 464.0)  # 448 + ulp/2, ties to 448
  assert float(st.rhs.saturated) == np.sum(np.abs(w) > 464.0)
  assert float(st.grad.saturated) == np.sum(np.abs(g) >= 61440.0)  # 57344 + ulp/2, ties up
  assert float(st.lhs.saturated) > 0 and float(st.grad.saturated) > 0
  # Current scaling adapts to the range: nothing saturates, even at 1e30.
  spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="current"))
  out, dx, dw, st = _step(spec)(x * np.float32(1e26), w, g, spec.init_state())
  assert all(np.isfinite(np.asarray(a)).all() for a in (out, dx, dw))
  assert float(st.lhs.saturated) == 0 and float(st.grad.saturated) == 0


@pytest.mark.parametrize("fmt,values,expected", [
    ("e4m3", [448.0, 463.0, 464.0, 465.0, 1e6, -np.inf, np.nan], 2),
    ("e5m2", [57344.0, 61439.0, 61440.0, 1e9, np.inf, -np.inf, np.nan], 2),
])
def test_saturation_boundary_matches_rounding(fmt, values, expected):
  recipe = sc.OperandRecipe(fmt=fmt, scaling="current")
  x = jnp.asarray(values, F32).reshape(1, 1, -1)
  q, sat, unf = sc.quantize(x, jnp.ones((1, 1, 1), F32), (1, len(values)), recipe)
  assert float(sat) == expected
  # The clip is what rounding to nearest would give wherever it is not counted.
  dt = ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2
  direct = np.asarray(values, np.float32).astype(dt).astype(np.float32)
  kept = np.isfinite(direct)
  got = np.asarray(q.q, np.float32).ravel()
  np.testing.assert_array_equal(got[kept], direct[kept])
  assert float(unf) == 0
  # Finite values are clipped, never made inf; non-finite ones stay non-finite (not
  # clipped to the max, and not counted as saturated): E5M2 keeps +-inf, E4M3 has no inf.
  finite_in = np.isfinite(np.asarray(values, np.float32))
  np.testing.assert_array_equal(np.isfinite(got), finite_in)
  if fmt == "e5m2":
    np.testing.assert_array_equal(got[np.isinf(values)], [np.inf, -np.inf])


def test_scale_rules():
  recipe = sc.OperandRecipe(fmt="e4m3", scaling="delayed", margin=1, power_of_two=True)
  prev = jnp.asarray(0.375, F32)
  amax = jnp.asarray([3.0, 0.0, np.inf, np.nan, 448.0], F32)
  s = np.asarray(sc.scale_from_amax(amax, recipe, prev))
  # 3/448*2 = 0.0134 -> 2^-6 (power of two, >= amax/max*2^margin); zero/inf/nan keep prev.
  np.testing.assert_array_equal(s, [2.0 ** -6, 0.375, 0.375, 0.375, 2.0])
  hist = sc.push_history(jnp.asarray([5.0, 1.0, 2.0], F32), jnp.asarray(7.0, F32))
  np.testing.assert_array_equal(np.asarray(hist), [7.0, 2.0, 5.0])
  assert float(sc.history_amax(hist, recipe)) == 7.0
  recent = sc.OperandRecipe(fmt="e4m3", scaling="delayed", amax_compute="most_recent")
  assert float(sc.history_amax(jnp.asarray([1.0, 9.0], F32), recent)) == 1.0


def test_fp8_dtypes_in_jaxpr_forward_and_backward():
  spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="block"))
  x, w, g = _operands("gaussian")
  jaxpr = jax.make_jaxpr(lambda *a: _step(spec)(*a))(x, w, g, spec.init_state())
  assert "f8_e4m3fn" in str(jaxpr) and "f8_e5m2" in str(jaxpr)

  def dot_operand_dtypes(jxpr):
    found = []
    for eqn in jxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(tuple(str(v.aval.dtype) for v in eqn.invars)
                     + (str(eqn.params["preferred_element_type"]),))
      for p in eqn.params.values():
        for inner in p if isinstance(p, (tuple, list)) else (p,):
          inner = getattr(inner, "jaxpr", inner)
          if hasattr(inner, "eqns"):
            found += dot_operand_dtypes(inner)
    return found

  dtypes = set(dot_operand_dtypes(jaxpr.jaxpr))
  # Forward E4M3 x E4M3; both backward GEMMs take the E5M2 gradient as left operand.
  assert dtypes == {("float8_e4m3fn", "float8_e4m3fn", "float32"),
                    ("float8_e5m2", "float8_e4m3fn", "float32")}, dtypes


def test_per_operand_override_and_bad_config():
  cfg = mp.Fp8Config(scaling="delayed")
  spec = mp.fp8.Fp8Spec.from_config(cfg, {"rhs": "block", "grad": "current"})
  assert (spec.lhs.scaling, spec.rhs.scaling, spec.grad.scaling) == ("delayed", "block", "current")
  assert spec.rhs.fmt == "e4m3" and spec.grad.fmt == "e5m2"
  x, w, g = _operands("gaussian")
  out = _step(spec)(x, w, g, spec.init_state())[0]
  assert np.linalg.norm(out - x @ w) / np.linalg.norm(x @ w) < 0.1
  with pytest.raises(ValueError, match="accepted operands"):
    mp.fp8.Fp8Spec.from_config(cfg, {"weights": "block"})
  with pytest.raises(ValueError, match="accepted: current"):
    mp.fp8.Fp8Spec.from_config(cfg, "rowwise")
  with pytest.raises(ValueError, match="equal contraction tiles"):
    mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="block", weight_block=(64, 128)))
  with pytest.raises(ValueError, match="Fp8Config"):
    mp.fp8.apply_fp8(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), {"scaling": "block"})


@pytest.mark.parametrize("eqn,ls,rs", [
    ("bk,kn->bn", (3, 5), (5, 4)),
    ("btk,hkd->bthd", (2, 3, 5), (4, 5, 6)),
    ("bhk,bhn->bnh", (2, 3, 5), (2, 3, 4)),
    ("...a,ab->...b", (2, 3, 5), (5, 4)),
    ("abc,cd->ad", (2, 3, 5), (5, 4)),  # b summed out of the lhs
])
def test_einsum_matches_jnp(eqn, ls, rs):
  rng = np.random.default_rng(4)
  a, b = rng.standard_normal(ls).astype(np.float32), rng.standard_normal(rs).astype(np.float32)
  dn, lsum, rsum, perm = mp.fp8.einsum_dimension_numbers(eqn, ls, rs)
  a2 = a.sum(axis=lsum) if lsum else a
  b2 = b.sum(axis=rsum) if rsum else b
  got = jnp.transpose(jax.lax.dot_general(a2, b2, dn), perm)
  np.testing.assert_allclose(np.asarray(got), np.einsum(eqn, a, b), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="repeated index"):
    mp.fp8.einsum_dimension_numbers("aa,ab->b", (3, 3), (3, 4))


class _Attn(nnx.Module):
  def __init__(self, d, rngs):
    self.q = nnx.Linear(d, d, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
    self.kv = nnx.LinearGeneral(d, (2, d), use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
    self.o = nnx.Einsum("bthk,hkd->btd", (4, d // 4, d), dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    q = self.q(x).astype(F32)
    kv = self.kv(x).astype(F32)
    k, v = kv[:, :, 0], kv[:, :, 1]
    # Scores and softmax in f32 (an f32 island); values back to the compute dtype.
    s = jnp.einsum("btd,bsd->bts", q, k) / np.float32(np.sqrt(d))
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, np.float32(-1e30))
    y = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), v)
    return self.o(y.reshape(b, t, 4, d // 4).astype(jnp.bfloat16))


class _Block(nnx.Module):
  def __init__(self, d, rngs):
    self.attn = _Attn(d, rngs)
    self.up = nnx.Linear(d, 4 * d, dtype=jnp.bfloat16, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x).astype(F32)
    return x + self.down(jax.nn.gelu(self.up(x))).astype(F32)


class TinyLM(nnx.Module):
  """2-block causal transformer over bytes; params f32, GEMMs in bf16 (bf16_mixed)."""

  def __init__(self, vocab=64, d=64, rngs=None):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([_Block(d, rngs) for _ in range(2)])
    self.lm_head = nnx.Linear(d, vocab, dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for blk in self.blocks:
      x = blk(x)
    return self.lm_head(x).astype(F32)


def _lm_loss(model, batch):
  logits = model(batch[:, :-1])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))


def _train(recipe_name: str, steps: int, batches):
  model = TinyLM(rngs=nnx.Rngs(0))
  recipe = mp.get_recipe(recipe_name)
  if recipe.fp8 is not None:
    mp.fp8.apply_fp8(model, recipe.fp8, recipe.policy)
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, batch):
    loss, grads = mp.value_and_grad(_lm_loss)(model, batch)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes int/float scalars
      opt.update(model, grads)
    return loss, mp.fp8.fp8_metrics(model)

  losses = []
  for i in range(steps):
    loss, metrics = step(model, opt, batches[i % len(batches)])
    losses.append(loss)
  return np.asarray(jnp.stack(losses)), metrics, model


@pytest.fixture(scope="module")
def lm_batches():
  text = (b"the quick brown fox jumps over the lazy dog; pack my box with five dozen "
          b"liquor jugs. ") * 20
  data = np.frombuffer(text, np.uint8).astype(np.int32) % 64
  rng = np.random.default_rng(0)
  starts = rng.integers(0, len(data) - 33, size=(50, 8))
  return jnp.asarray(np.stack([np.stack([data[s:s + 33] for s in row]) for row in starts]))


@pytest.fixture(scope="module")
def fp8_run(lm_batches):
  return _train("fp8_hybrid", 200, lm_batches)


def test_tiny_lm_fp8_hybrid_within_2pct_of_bf16(lm_batches, fp8_run):
  bf16, _, _ = _train("bf16_mixed", 200, lm_batches)
  fp8, metrics, model = fp8_run
  assert np.isfinite(bf16).all() and np.isfinite(fp8).all()
  assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
  final_bf16, final_fp8 = bf16[-20:].mean(), fp8[-20:].mean()
  assert final_bf16 < 0.5 * bf16[0]  # it learned
  assert abs(final_fp8 - final_bf16) <= 0.02 * final_bf16, (final_fp8, final_bf16)
  # 5 Linear/LinearGeneral/Einsum GEMMs per block in fp8; embed and lm_head kept in bf16.
  assert float(metrics["fp8/gemms"]) == 10
  assert not isinstance(model.lm_head.dot_general, mp.fp8.Fp8DotGeneral)


def test_state_flows_out_of_jitted_step(fp8_run):
  _, metrics, model = fp8_run
  up = model.blocks[0].up.dot_general
  for op in ("lhs", "rhs", "grad"):
    hist = np.asarray(getattr(up, f"{op}_amax_history")[...])
    assert hist.shape == (1024,)
    # 200 steps recorded (ring: newest at 0, older from the end), the rest still zero.
    assert np.count_nonzero(hist) == 200, op
    assert float(getattr(up, f"{op}_scale")[...]) != 1.0
  assert float(metrics["blocks/0/up/grad_amax"]) > 0
  assert float(metrics["blocks/0/attn/o/rhs_amax"]) > 0  # Einsum path name
  assert "blocks/0/attn/kv/lhs_saturated" in metrics
  # Checkpointed with the model: nnx.state holds every fp8 variable (12 per GEMM).
  leaves = jax.tree.leaves(nnx.state(model, mp.fp8.Fp8State))
  assert len(leaves) == 12 * 10
  assert len(jax.tree.leaves(nnx.state(model, mp.fp8.Fp8GradState))) == 4 * 10


def test_checkpoint_round_trip_restores_fp8_state(tmp_path, fp8_run):
  import orbax.checkpoint as ocp

  _, _, model = fp8_run
  state = nnx.state(model)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", nnx.to_pure_dict(state))
  fresh = TinyLM(rngs=nnx.Rngs(1))
  mp.fp8.apply_fp8(fresh, mp.get_recipe("fp8_hybrid").fp8, mp.get_recipe("fp8_hybrid").policy)
  target = nnx.state(fresh)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(tmp_path / "ckpt", nnx.to_pure_dict(target))
  nnx.replace_by_pure_dict(target, restored)
  nnx.update(fresh, target)
  a, b = nnx.state(model, mp.fp8.Fp8State), nnx.state(fresh, mp.fp8.Fp8State)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_apply_fp8_paths_and_patterns():
  model = TinyLM(rngs=nnx.Rngs(0))
  cfg = mp.Fp8Config(keep_high_precision=("*lm_head*", "*embed*", "blocks/1/*"))
  mp.fp8.apply_fp8(model, cfg, mp.get_policy("p=f32,c=bf16"))
  names = sorted(n for n, _ in mp.fp8.fp8_modules(model))
  assert names == ["blocks/0/attn/kv", "blocks/0/attn/o", "blocks/0/attn/q",
                   "blocks/0/down", "blocks/0/up"]
  assert isinstance(model.blocks[0].attn.o.einsum_op, mp.fp8.Fp8Einsum)
  assert model.blocks[1].up.dot_general is jax.lax.dot_general
  before = model.blocks[0].up.dot_general
  mp.fp8.apply_fp8(model, cfg)  # idempotent
  assert model.blocks[0].up.dot_general is before


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_sync_fp8_state_agrees_across_ranks():
  from jax.sharding import Mesh, PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  layer = nnx.Linear(16, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  mp.fp8.apply_fp8(layer, mp.Fp8Config(scaling="delayed", amax_history_len=4))
  graphdef, params, fp8_state = nnx.split(layer, nnx.Param, mp.fp8.Fp8State)
  x = np.random.default_rng(5).standard_normal((8, 4, 16)).astype(np.float32)
  x *= np.arange(1, 9, dtype=np.float32)[:, None, None]  # rank r sees amax ~ r

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")),
                     out_specs=(P("data"), P("data")), check_vma=False)
  def step(params, fp8_state, x):
    model = nnx.merge(graphdef, params, fp8_state)
    _, grads = mp.value_and_grad(lambda m, x: jnp.sum(m(x[0]).astype(F32) ** 2))(model, x)
    local = nnx.state(model, mp.fp8.Fp8State)
    synced = mp.fp8.sync_fp8_state(local, "data")
    pick = lambda s: jnp.stack([s["dot_general"]["lhs_amax_history"][...][0],
                                s["dot_general"]["grad_amax_history"][...][0],
                                s["dot_general"]["lhs_saturated"][...]])[None]
    return pick(local), pick(synced)

  local, synced = step(params, fp8_state, x)
  local, synced = np.asarray(local), np.asarray(synced)
  assert len(set(local[:, 0].tolist())) == 8  # ranks disagree before the sync
  np.testing.assert_array_equal(synced, np.broadcast_to(synced[0], synced.shape))
  np.testing.assert_array_equal(synced[0, :2], local[:, :2].max(axis=0))
  assert synced[0, 2] == local[:, 2].sum()
  with pytest.raises(ValueError, match="not fp8 state"):
    jax.vmap(lambda t: mp.fp8.sync_fp8_state(t, "i"), axis_name="i")({"kernel": jnp.ones((2,))})


def test_linen_collections_and_grad_state_merge():
  cfg = mp.Fp8Config(scaling="delayed", amax_history_len=4)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      dg = functools.partial(mp.fp8.LinenFp8DotGeneral, config=cfg)
      h = nn.Dense(16, dot_general_cls=dg)(x)
      return nn.Dense(4, dot_general_cls=dg)(jax.nn.relu(h))

  net = Net()
  x = jnp.asarray(np.random.default_rng(6).standard_normal((8, 8)), F32)
  v = net.init(jax.random.key(0), x)
  assert set(v) == {"params", mp.fp8.STATE_COLLECTION, mp.fp8.GRAD_COLLECTION}

  @jax.jit
  def step(v):
    def loss(params, gstate):
      out, upd = net.apply({**v, "params": params, mp.fp8.GRAD_COLLECTION: gstate}, x,
                           mutable=[mp.fp8.STATE_COLLECTION])
      return jnp.sum(out ** 2), upd
    (l, upd), (gp, gg) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        v["params"], v[mp.fp8.GRAD_COLLECTION])
    merged = mp.fp8.merge_grad_state(v[mp.fp8.GRAD_COLLECTION], gg)
    return {**v, **upd, mp.fp8.GRAD_COLLECTION: merged}

  v1 = step(v)
  v2 = step(v1)
  st, gs = v2[mp.fp8.STATE_COLLECTION], v2[mp.fp8.GRAD_COLLECTION]
  for layer in ("Dense_0", "Dense_1"):
    assert np.count_nonzero(np.asarray(st[layer]["LinenFp8DotGeneral_0"]["lhs_amax_history"])) == 2
    assert np.count_nonzero(np.asarray(gs[layer]["LinenFp8DotGeneral_0"]["grad_amax_history"])) == 2
  assert float(gs["Dense_0"]["LinenFp8DotGeneral_0"]["grad_scale"]) != 1.0


def test_merge_grad_state_functional_step_keeps_unused_gemms():
  cfg = mp.Fp8Config(scaling="delayed", amax_history_len=4)
  model = nnx.Sequential(nnx.Linear(8, 8, use_bias=False, rngs=nnx.Rngs(0)),
                         nnx.Linear(8, 8, use_bias=False, rngs=nnx.Rngs(1)))
  mp.fp8.apply_fp8(model, cfg)
  graphdef, params, state = nnx.split(model, nnx.Param, mp.fp8.Fp8State)
  x = jnp.asarray(np.random.default_rng(7).standard_normal((4, 8)), F32)

  def loss(params, state):
    m = nnx.merge(graphdef, params, state)
    return jnp.sum(m.layers[0](x) ** 2), nnx.state(m, mp.fp8.Fp8State)  # layer 1 unused

  (_, new), (_, cts) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, state)
  merged = mp.fp8.merge_grad_state(new, cts)
  assert jax.tree.structure(merged) == jax.tree.structure(state)
  g0, g1 = (merged["layers"][i]["dot_general"] for i in (0, 1))
  c0 = cts["layers"][0]["dot_general"]
  assert float(c0["grad_scale"][...]) > 0                 # layer 0 ran: its new state
  for name in ("grad_amax_history", "grad_scale"):
    np.testing.assert_array_equal(g0[name][...], c0[name][...])
    # layer 1 took no part: zero cotangent, its old state is kept (not zeroed)
    np.testing.assert_array_equal(g1[name][...],
                                  state["layers"][1]["dot_general"][name][...])
  assert float(g1["grad_scale"][...]) > 0
  # forward-operand state comes from the forward pass
  np.testing.assert_array_equal(merged["layers"][0]["dot_general"]["lhs_amax_history"][...],
                                new["layers"][0]["dot_general"]["lhs_amax_history"][...])


# ---------------------------------------------- one GEMM used several times in one step

_GRAD_FIELDS = ("amax_history", "scale", "saturated", "underflowed")


def _grad_state(layer):
  """{field: np.ndarray} of an NNX fp8 layer's gradient-operand state."""
  return {f: np.asarray(getattr(layer.dot_general, f"grad_{f}")[...]) for f in _GRAD_FIELDS}


def _combined(states):
  """What one use of the concatenated gradient operand records: histories and scales by
  max, saturation and underflow counts summed."""
  return {f: (np.maximum.reduce if f in ("amax_history", "scale") else np.add.reduce)(
      [s[f] for s in states]).astype(states[0][f].dtype) for f in _GRAD_FIELDS}


def _assert_grad_state_equal(got, want):
  assert_bit_identical({f: got[f] for f in _GRAD_FIELDS}, {f: want[f] for f in _GRAD_FIELDS})


def _fp8_linear(grad_scaling="delayed", seed=0):
  """An 8x8 fp8 layer: current-scaled forward operands (no forward history, so a layer
  called twice quantizes as two fresh copies would), gradient scaled by `grad_scaling`."""
  layer = nnx.Linear(8, 8, use_bias=False, rngs=nnx.Rngs(seed))
  mp.fp8.apply_fp8(layer, mp.Fp8Config(scaling="delayed", amax_history_len=4),
                   scaling={"lhs": "current", "rhs": "current", "grad": grad_scaling})
  return layer


def _recur(model, h, steps, mode):
  """h <- tanh(model(h)) `steps` times, unrolled in Python or in nnx.scan (model as carry)."""
  if mode == "python":
    for _ in range(steps):
      h = jnp.tanh(model(h))
    return h

  def step(carry, _):
    m, h = carry
    return (m, jnp.tanh(m(h))), None

  (_, h), _ = nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
      (model, h), jnp.arange(steps))
  return h


@pytest.mark.parametrize("mode", ["python", "scan"])
def test_tied_recurrent_gemm_combines_grad_state_by_max(mode):
  """One fp8 layer applied 3 times (tied weights, a recurrence) records what 3 fresh
  copies of it would, combined: amax history and scale by max, counts summed. Autodiff
  alone adds the three states (the scale triples every step)."""
  x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 8)), F32)
  loss = lambda h: jnp.sum(h * h)
  tied = _fp8_linear()
  nnx.jit(lambda m, x: mp.value_and_grad(lambda m, x: loss(_recur(m, x, 3, mode)))(m, x))(
      tied, x)
  copies = [_fp8_linear() for _ in range(3)]  # same kernel (seed), same fresh state

  @nnx.jit
  def untied_step(a, b, c, x):
    def f(models, x):
      h = x
      for m in models:
        h = jnp.tanh(m(h))
      return loss(h)
    return mp.value_and_grad(f)(nnx.List([a, b, c]), x)

  untied_step(*copies, x)
  want = _combined([_grad_state(m) for m in copies])
  assert len({float(_grad_state(m)["amax_history"][0]) for m in copies}) == 3  # uses differ
  _assert_grad_state_equal(_grad_state(tied), want)
  # Next steps on the same data: the amax stays put instead of tripling each step.
  step = nnx.jit(lambda m, x: mp.value_and_grad(
      lambda m, x: loss(_recur(m, x, 3, mode)))(m, x))
  for _ in range(2):
    step(tied, x)
  hist = _grad_state(tied)["amax_history"]
  assert hist[0] < 1.1 * want["amax_history"][0], hist


@pytest.mark.parametrize("grad_scaling", ["delayed", "current"])
@pytest.mark.parametrize("loop", ["python", "scan"])
def test_microbatch_accumulation_matches_one_concatenated_batch(grad_scaling, loop):
  """Gradient accumulation over 3 micro-batches inside one differentiated step records
  exactly the gradient state of one pass over the concatenated batch, bit for bit. The
  loss is linear in the output, so every row's gradient is the same in both (its
  cotangent `c`), and every micro-batch holds the same largest |c|, so even current
  scaling picks the same scale per micro-batch as for the whole batch."""
  rng = np.random.default_rng(9)
  xs = jnp.asarray(rng.standard_normal((3, 4, 8)), F32)
  cs = rng.standard_normal((3, 4, 8)).astype(np.float32) * 1e-3
  cs[:, 0, 0] = 0.05  # the same amax in every micro-batch
  cs[:, 1] *= 1e-6  # and values that underflow E5M2 at its scale, so counts are compared
  cs = jnp.asarray(cs)

  def accumulate(m, xs, cs):
    if loop == "python":
      return sum(jnp.sum(m(xs[i]) * cs[i]) for i in range(3))

    def body(carry, xc):
      m, acc = carry
      return (m, acc + jnp.sum(m(xc[0]) * xc[1])), None

    (_, acc), _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
        (m, jnp.zeros((), F32)), (xs, cs))
    return acc

  micro, whole = _fp8_linear(grad_scaling), _fp8_linear(grad_scaling)
  step = nnx.jit(lambda m, xs, cs: mp.value_and_grad(accumulate)(m, xs, cs))
  full = nnx.jit(lambda m, x, c: mp.value_and_grad(lambda m, x, c: jnp.sum(m(x) * c))(
      m, x, c))
  for _ in range(3):  # the delayed scale takes effect from the second step on
    step(micro, xs, cs)
    full(whole, xs.reshape(12, 8), cs.reshape(12, 8))
    _assert_grad_state_equal(_grad_state(micro), _grad_state(whole))
  assert float(_grad_state(whole)["scale"]) != 1.0 and _grad_state(whole)["underflowed"] > 0


def test_linen_shared_gemm_combines_grad_state_by_max():
  """A shared Linen Dense called twice records what two separate Denses with the same
  params record, combined (max / sum), with the grad collection immutable."""
  cfg = mp.Fp8Config(scaling="delayed", amax_history_len=4)
  dg = functools.partial(mp.fp8.LinenFp8DotGeneral, config=cfg,
                         scaling={"lhs": "current", "rhs": "current", "grad": "delayed"})

  class Net(nn.Module):
    tied: bool

    @nn.compact
    def __call__(self, x):
      first = nn.Dense(8, use_bias=False, dot_general_cls=dg, name="first")
      second = first if self.tied else nn.Dense(8, use_bias=False, dot_general_cls=dg,
                                                name="second")
      return second(jnp.tanh(first(x)))

  x = jnp.asarray(np.random.default_rng(10).standard_normal((4, 8)), F32)

  def grad_state(net, v):
    def loss(params, gs):
      out, _ = net.apply({**v, "params": params, mp.fp8.GRAD_COLLECTION: gs}, x,
                         mutable=[mp.fp8.STATE_COLLECTION])
      return jnp.sum(out ** 2)
    g = jax.jit(jax.grad(loss, argnums=1))(v["params"], v[mp.fp8.GRAD_COLLECTION])
    return mp.fp8.merge_grad_state(v[mp.fp8.GRAD_COLLECTION], g)

  tied, untied = Net(True), Net(False)
  vt = tied.init(jax.random.key(0), x)
  vu = untied.init(jax.random.key(0), x)
  vu = {**vu, "params": {"first": vt["params"]["first"], "second": vt["params"]["first"]}}
  got = grad_state(tied, vt)["first"]["LinenFp8DotGeneral_0"]
  per_use = grad_state(untied, vu)
  states = [{f: np.asarray(per_use[n]["LinenFp8DotGeneral_0"][f"grad_{f}"]) for f in _GRAD_FIELDS}
            for n in ("first", "second")]
  assert states[0]["amax_history"][0] != states[1]["amax_history"][0]
  _assert_grad_state_equal({f: np.asarray(got[f"grad_{f}"]) for f in _GRAD_FIELDS},
                           _combined(states))


def test_linen_bound_module_across_traces():
  """A bound Linen fp8 module called under two jits and eagerly: each trace starts its own
  token chain (a token of one trace reused in another would be an escaped tracer)."""
  dense = nn.Dense(8, dot_general_cls=functools.partial(
      mp.fp8.LinenFp8DotGeneral, config=mp.Fp8Config(scaling="delayed", amax_history_len=4)))
  x = jnp.ones((2, 8), F32)
  bound = dense.bind(dense.init(jax.random.key(0), x))
  a = jax.jit(lambda x: bound(x))(x)
  b = jax.jit(lambda x: bound(x) * 2)(x)
  np.testing.assert_array_equal(np.asarray(b), 2 * np.asarray(a))
  np.testing.assert_array_equal(np.asarray(bound(x)), np.asarray(a))


def test_linen_microbatches_threaded_through_applies():
  """Two applies in one differentiated function, each given the collections the previous
  one returned: the gradient state is that of one apply on the concatenated batch."""
  cfg = mp.Fp8Config(scaling="delayed", amax_history_len=4)
  dense = nn.Dense(8, use_bias=False, dot_general_cls=functools.partial(
      mp.fp8.LinenFp8DotGeneral, config=cfg))
  rng = np.random.default_rng(15)
  x = jnp.asarray(rng.standard_normal((2, 4, 8)), F32)
  c = jnp.asarray(rng.standard_normal((2, 4, 8)), F32)
  v = dense.init(jax.random.key(0), x[0])
  cols = [mp.fp8.STATE_COLLECTION, mp.fp8.GRAD_COLLECTION]

  def micro(params, gs):
    state = {**v, "params": params, mp.fp8.GRAD_COLLECTION: gs}
    total = jnp.zeros((), F32)
    for i in range(2):
      out, upd = dense.apply(state, x[i], mutable=cols)
      state = {**state, **upd}
      total = total + jnp.sum(out * c[i])
    return total

  def whole(params, gs):
    out, _ = dense.apply({**v, "params": params, mp.fp8.GRAD_COLLECTION: gs},
                         x.reshape(8, 8), mutable=cols)
    return jnp.sum(out * c.reshape(8, 8))

  gs = v[mp.fp8.GRAD_COLLECTION]
  got = jax.jit(jax.grad(micro, argnums=1))(v["params"], gs)
  want = jax.jit(jax.grad(whole, argnums=1))(v["params"], gs)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert float(want["LinenFp8DotGeneral_0"]["grad_amax_history"][0]) > 0


def test_functional_state_threaded_through_lax_scan():
  """fp8_dot_general in a lax.scan recurrence, its state carried: the gradient state that
  comes out (the cotangent of the initial state) is the max over the uses."""
  spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="delayed", amax_history_len=4),
                                    {"lhs": "current", "rhs": "current", "grad": "delayed"})
  rng = np.random.default_rng(11)
  w = jnp.asarray(0.5 * rng.standard_normal((8, 8)), F32)
  x = jnp.asarray(rng.standard_normal((4, 8)), F32)

  def run(gs, threaded):
    def body(carry, _):
      h, st = carry
      y, new = mp.fp8.fp8_dot_general(h, w, DN, st, spec)
      return (jnp.tanh(y), new if threaded else st), None
    (h, _), _ = jax.lax.scan(body, (x, spec.init_state()._replace(grad=gs)), None, length=3)
    return jnp.sum(h * h)

  gs0 = spec.init_state().grad
  threaded = jax.jit(jax.grad(lambda gs: run(gs, True)))(gs0)

  def per_use(gs_list):  # three separate states, one per step: the uncombined reference
    h = x
    for gs in gs_list:
      y, _ = mp.fp8.fp8_dot_general(h, w, DN, spec.init_state()._replace(grad=gs), spec)
      h = jnp.tanh(y)
    return jnp.sum(h * h)

  sep = jax.jit(jax.grad(per_use))([gs0] * 3)
  want = _combined([{f: np.asarray(getattr(s, f)) for f in _GRAD_FIELDS} for s in sep])
  _assert_grad_state_equal({f: np.asarray(getattr(threaded, f)) for f in _GRAD_FIELDS}, want)
  assert float(want["amax_history"][0]) > float(min(s.amax_history[0] for s in sep))


def test_two_calls_from_one_state_raise_naming_the_layer():
  model = nnx.Sequential(_fp8_linear(), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
  x = jnp.ones((4, 8), F32)

  def forked(m, x):
    copy = nnx.clone(m)  # a second model from the same state: its calls start over
    return jnp.sum(m(x) ** 2) + jnp.sum(copy(x) ** 2)

  with pytest.raises(ValueError, match="fp8 GEMM 'layers/0': two calls read the same"):
    nnx.jit(lambda m, x: mp.value_and_grad(forked)(m, x))(model, x)


# ------------------------------------------------------------------- non-finite amaxes


@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
def test_nonfinite_amax_does_not_freeze_the_delayed_scale(amax_compute):
  """Delayed scaling, history 4: a step whose gradient holds inf is recorded, then the
  scale follows the finite data again from the next step on. (With inf taking part in the
  history's max, the scale stayed frozen until the inf left the history, 4 steps.)"""
  spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="delayed", amax_history_len=4,
                                                 amax_compute=amax_compute))
  step = _step(spec)
  rng = np.random.default_rng(12)
  x = jnp.asarray(rng.standard_normal((8, 16)), F32)
  w = jnp.asarray(rng.standard_normal((16, 8)), F32)
  g = rng.standard_normal((8, 8)).astype(np.float32)
  g /= np.abs(g).max()  # amax 1
  bad = g.copy()
  bad[0, 0] = np.inf
  state = spec.init_state()
  amaxes = [1.0, np.inf, 4.0, 4.0, 16.0]
  used = []
  for a, gi in zip(amaxes, [g, bad, 4 * g, 4 * g, 16 * g]):
    _, dx, dw, state = step(x, w, jnp.asarray(gi), state)
    used.append(float(state.grad.scale))  # the scale this step quantized with
  fmax = formats.info("e5m2").max
  # Each step scales with the largest finite amax of the steps before it (the first with
  # the initial 1.0); "most_recent" keeps the previous scale once, after the inf step.
  expected = {"max": [1.0, 1 / fmax, 1 / fmax, 4 / fmax, 4 / fmax],
              "most_recent": [1.0, 1 / fmax, 1 / fmax, 4 / fmax, 4 / fmax]}[amax_compute]
  np.testing.assert_allclose(used, expected, rtol=1e-6)
  hist = np.asarray(state.grad.amax_history)
  # A ring, newest at 0 (Flax and TE order): 16, then inf, 4, 4 from the end; 1 dropped.
  np.testing.assert_array_equal(hist, [16.0, np.inf, 4.0, 4.0])  # the inf is recorded
  assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()


def test_nonfinite_forward_amax_recorded_not_scaled_with():
  recipe = sc.OperandRecipe(fmt="e4m3", scaling="delayed", history_len=3)
  hist = jnp.asarray([np.inf, 2.0, np.nan], F32)
  assert float(sc.history_amax(hist, recipe)) == 2.0
  assert float(sc.history_amax(jnp.asarray([np.nan, np.inf, 0.0], F32), recipe)) == 0.0
  recent = sc.OperandRecipe(fmt="e4m3", scaling="delayed", amax_compute="most_recent")
  prev = jnp.asarray(0.25, F32)
  assert float(sc.scale_from_amax(sc.history_amax(hist, recent), recent, prev)) == 0.25


# ------------------------------------------------------- rollback with a skipped step


def _fp8_state_np(state):
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
          jax.tree_util.tree_flatten_with_path(nnx.filter_state(state, mp.fp8.Fp8State))[0]}


def test_rollback_fp8_state_with_guard():
  """A step the guard skips (non-finite grads) leaves the fp8 state bit-identical, forward
  and gradient operands alike; a finite step updates it."""
  recipe = mp.get_recipe("fp8_hybrid")
  model = nnx.Sequential(nnx.Linear(8, 16, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                         nnx.Linear(16, 4, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(1)))
  mp.fp8.apply_fp8(model, mp.Fp8Config(amax_history_len=4), recipe.policy)
  graphdef, params, state = nnx.split(model, nnx.Param, ...)
  tx = mp.optim.build_optimizer(recipe, optax.sgd(0.1))
  opt_state = tx.init(params)
  x = jnp.asarray(np.random.default_rng(13).standard_normal((4, 8)), F32)

  @jax.jit
  def step(params, state, opt_state, poison):
    before = jax.tree.map(lambda v: v, state)
    m = nnx.merge(graphdef, params, state)
    _, grads = mp.value_and_grad(
        lambda m: jnp.sum(m(x).astype(F32) ** 2) * poison)(m)
    updates, new_opt = tx.update(grads, opt_state, params)
    skipped = mp.optim.step_skipped(opt_state, new_opt)
    new_state = mp.fp8.rollback_fp8_state(nnx.state(m, nnx.Not(nnx.Param)), before, skipped)
    return mp.optim.apply_updates(params, updates), new_state, new_opt, skipped

  p1, s1, o1, skipped = step(params, state, opt_state, jnp.float32(1.0))
  assert not bool(skipped)
  before, after = _fp8_state_np(state), _fp8_state_np(s1)
  changed = [k for k in before if not np.array_equal(before[k], after[k])]
  assert any("lhs_amax_history" in k for k in changed)
  assert any("grad_amax_history" in k for k in changed)
  # An overflowed loss (inf cotangent): the fp8 backward keeps the inf (E5M2), the grads
  # are non-finite and the step is skipped. (Clipping it to the E5M2 max made them finite
  # and let the overflow through.)
  _, s_inf, o_inf, skipped = step(p1, s1, o1, jnp.float32(np.inf))
  assert bool(skipped) and int(mp.optim.optimizer_metrics(o_inf)["skipped_steps"]) == 1
  # A NaN loss: NaN grads.
  p2, s2, o2, skipped = step(p1, s1, o1, jnp.float32(np.nan))
  assert bool(skipped) and int(mp.optim.optimizer_metrics(o2)["skipped_steps"]) == 1
  assert_bit_identical(_fp8_state_np(s2), _fp8_state_np(s1))
  with pytest.raises(ValueError, match="only one of the two optimizer states"):
    mp.optim.step_skipped(o1, {})
  assert not bool(mp.optim.step_skipped({}, {}))


def test_trainlib_step_rolls_back_fp8_state_of_a_skipped_step():
  """experiments.trainlib's step: a finite step updates the fp8 state; a step made
  non-finite (NaN in the bf16 lm_head, after every fp8 GEMM) is skipped by the guard and
  leaves params and fp8 state bit-identical."""
  from experiments import trainlib
  from models import gpt

  one_block = gpt.GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
  cfg = trainlib.TrainConfig(recipe="fp8_hybrid", model=one_block, steps=2, batch=2,
                             progress=False)
  run, state = trainlib.init_state(cfg)
  tokens = np.random.default_rng(14).integers(0, 256, (2, 16)).astype(np.int32)
  compiled = trainlib.compile_step(run, state, tokens)
  fp8_0 = _fp8_state_np(state.model_state)
  state, m1 = trainlib.step_once(compiled, state, tokens)
  fp8_1 = _fp8_state_np(state.model_state)
  assert m1["skipped_steps"] == 0
  histories = [k for k in fp8_0 if "amax_history" in k]
  assert len(histories) == 15  # 5 fp8 GEMMs in the block x 3 operands
  assert all(not np.array_equal(fp8_0[k], fp8_1[k]) for k in histories)
  poisoned = jax.tree_util.tree_map_with_path(
      lambda p, v: jnp.full_like(v, np.nan) if "lm_head" in jax.tree_util.keystr(p) else v,
      state.params)
  params_1 = jax.tree.map(np.asarray, poisoned)
  state = state._replace(params=poisoned)
  state, m2 = trainlib.step_once(compiled, state, tokens)
  assert m2["skipped_steps"] == 1 and not np.isfinite(m2["loss"])
  fp8_2 = _fp8_state_np(state.model_state)
  assert_bit_identical(fp8_2, fp8_1)
  assert_bit_identical(state.params, params_1)
