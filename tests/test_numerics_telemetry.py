"""precision.numerics' training-time telemetry: the device statistics against the numpy
reference on the same tensors, the traced rows against inspect's, the monitors against
hand computations, and the study's telemetry (trajectory unchanged, first anomaly)."""

import importlib.util
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp
from _asserts import bit_identical
from precision.numerics import _device_stats
from precision.numerics import _stats

FRACTIONS = ("nonfinite", "zeros", "underflow", "subnormal", "overflow", "saturated") + tuple(
    f for f in _device_stats.WHATIF_FIELDS if not f.endswith("sqnr_db"))
DBS = ("sqnr_db",) + tuple(f for f in _device_stats.WHATIF_FIELDS if f.endswith("sqnr_db"))


@pytest.fixture(autouse=True)
def _faithful():
  mp.enable_faithful_rounding()
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


def _agree(ref: dict, got: dict, where: str, pp: float = 1e-3) -> None:
  """Fractions to 0.1 percentage points, amax/amin exactly (both f32), dynamic range and
  SQNR to 0.01 (bits, dB)."""
  for f in FRACTIONS:
    assert abs(ref[f] - got[f]) <= pp, (where, f, ref[f], got[f])
  for f in ("amax", "amin_nonzero"):
    assert np.float32(ref[f]) == np.float32(got[f]), (where, f, ref[f], got[f])
  assert ref["nonzero"] == got["nonzero"], where
  for f in DBS + ("dynamic_range_bits",):
    a, b = ref[f], got[f]
    # Above 300 dB both say "exact at f32 precision" (see _device_stats on SQNR).
    assert (a == b) or abs(a - b) <= 1e-2 or min(a, b) > 300, (where, f, a, b)


def _device_dicts(values, dtypes, block_axes=None):
  out = np.asarray(jax.jit(lambda *v: _device_stats.batch_stats(v, dtypes, True,
                                                                block_axes))(*values))
  return [dict(zip(_device_stats.FIELDS, row)) for row in out]


# ------------------------------------------------------------------ statistics vs numpy


def _edge_tensor(dtype) -> np.ndarray:
  """Log-uniform magnitudes over the whole f32 range of interest, both signs, with the
  format's boundary values: zeros, subnormals, the smallest normal, ties, max, beyond
  max, inf and NaN."""
  rng = np.random.default_rng(7)
  mag = np.exp(rng.uniform(np.log(1e-12), np.log(1e6), 20000)).astype(np.float32)
  v = mag * rng.choice([-1.0, 1.0], mag.size).astype(np.float32)
  info = ml_dtypes.finfo(dtype)
  tiny = float(info.smallest_subnormal)
  extra = [0.0, -0.0, tiny, tiny / 2, tiny * 1.5, tiny * 2.5, float(info.smallest_normal),
           float(info.max), float(info.max) * 1.01, float(info.max) * 4, np.inf, -np.inf,
           np.nan, 1.0 + float(info.eps) / 2, 1.0 + 1.5 * float(info.eps)]
  with np.errstate(over="ignore"):
    return np.concatenate([v, np.asarray(extra, np.float32)])


EDGE_DTYPES = (np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
               ml_dtypes.float8_e5m2, np.float32)


def test_device_statistics_equal_the_numpy_reference_on_edge_values():
  # Inputs below f32's smallest normal are left out: XLA:CPU flushes f32 subnormals to
  # zero in compiled code (bf16's subnormals are f32's, so bf16 has none to test here).
  xs = []
  for d in EDGE_DTYPES:
    x = _edge_tensor(d)
    xs.append(x[~(np.abs(x) < np.finfo(np.float32).smallest_normal) | (x == 0)])
  dts = [np.dtype(d) for d in EDGE_DTYPES]
  for x, d, got in zip(xs, dts, _device_dicts(xs, dts)):
    _agree(_stats.tensor_stats(x, d), got, d.name)


def test_one_batched_pass_measures_each_tensor_on_its_own():
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal(s).astype(np.float32) * sc
        for s, sc in (((17, 3), 1e-6), ((5,), 1e4), ((64, 8), 1.0), ((1,), 0.0))]
  dts = [np.dtype(np.float16), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
         np.dtype(np.float16)]
  for i, (x, d, got) in enumerate(zip(xs, dts, _device_dicts(xs, dts))):
    _agree(_stats.tensor_stats(x, d), got, f"tensor {i}")


def test_device_mxfp8_equals_the_numpy_reference_on_every_block_layout():
  """The MXFP8 columns on the device against _stats on blocks read in place (last axis,
  a middle axis), zero-padded (an axis of 45: a partial block), transposed (axes (2, 0))
  and with no block axis, in one batch with tensors of the same size and another
  layout; one tensor with an outlier above 2**60 (SQNR's normalised branch)."""
  rng = np.random.default_rng(4)

  def spread(shape):
    v = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 3)
    return v.astype(np.float32)
  cases = [((16, 64), (1,)), ((16, 64), (0,)), ((4, 64, 3), (1,)), ((6, 5, 45), (2, 0)),
           ((6, 5, 45), (2,)), ((6, 5, 45), ()), ((8, 45), None)]
  xs = [spread(shape) for shape, _ in cases]
  xs[4][0, 0, 3] = 2.0 ** 63
  xs[3][1, 2, 3], xs[3][2, 2, 2] = np.inf, np.nan
  axes = [a for _, a in cases]
  dts = [np.dtype(ml_dtypes.bfloat16)] * 3 + [np.dtype(np.float16)] * 2 + [
      np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.bfloat16)]
  got = _device_dicts(xs, dts, axes)
  for x, d, a, g in zip(xs, dts, axes, got):
    ref = _stats.tensor_stats(x, d, a)
    _agree(ref, g, f"{x.shape} {a}")
    # Fractions exactly (the same elements are counted).
    for stat in ("underflow", "overflow"):
      assert ref[f"whatif_mxfp8_{stat}"] == g[f"whatif_mxfp8_{stat}"], (x.shape, a, stat)
  assert got[4]["whatif_mxfp8_underflow"] > 0 and got[0]["whatif_mxfp8_underflow"] > 0


# ------------------------------------------------------------------ rows vs inspect


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.gelu(self.norm(self.fc1(x))))


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.tanh(nn.Dense(16)(x)))


def _nnx_case():
  model = _MLP(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (32, 8))
  y = jax.random.normal(jax.random.key(2), (32, 4))

  def grads(m, x, y):
    return nnx.value_and_grad(lambda m: 1e-4 * jnp.mean((m(x) - y) ** 2))(m)
  return grads, (model, x, y)


def _linen_case():
  module = _LinenMLP()
  x = jax.random.normal(jax.random.key(1), (32, 8))
  params = module.init(jax.random.key(0), x)["params"]

  def grads(p, x):
    return jax.value_and_grad(
        lambda p: 1e-5 * jnp.mean(module.apply({"params": p}, x) ** 2))(p)
  return grads, (params, x)


def _plain_case():
  k = jax.random.split(jax.random.key(3), 3)
  w1, w2 = jax.random.normal(k[0], (8, 32)), 0.1 * jax.random.normal(k[1], (32, 10))
  x = jax.random.normal(k[2], (16, 8))
  labels = jnp.arange(16) % 10

  def loss(w1, w2, x):
    h = jnp.tanh(x @ w1)
    attn = jax.nn.softmax(h @ h.T)
    logits = (attn @ h) @ w2
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return jax.value_and_grad(loss, argnums=(0, 1)), (w1, w2, x)


CASES = {"nnx": _nnx_case, "linen": _linen_case, "plain": _plain_case}


@pytest.mark.parametrize("kind", [pytest.param("linen", marks=pytest.mark.slow), "nnx",
                                  pytest.param("plain", marks=pytest.mark.slow)])
def test_device_statistics_of_captured_tensors_equal_numpy(kind):
  """The statistics the telemetry program computes, applied to the tensors `capture`
  takes from the same program, against numpy/ml_dtypes on those tensors."""
  fn, args = CASES[kind]()
  caps = mp.numerics.capture(fn, "f16_mixed", *args)
  assert caps
  got = _device_dicts([c.value for c in caps], [c.dtype for c in caps],
                      [c.info.block_axes for c in caps])
  for c, g in zip(caps, got):
    _agree(_stats.tensor_stats(c.value, c.dtype, c.info.block_axes), g,
           f"{kind} {c.info.index} {c.info.role}")


@pytest.mark.parametrize("kind", [pytest.param("linen", marks=pytest.mark.slow), "nnx",
                                  pytest.param("plain", marks=pytest.mark.slow)])
def test_traced_rows_are_inspects_rows_forward_and_backward(kind):
  fn, args = CASES[kind]()
  ref = mp.numerics.inspect(fn, "f16_mixed", *args)
  record = jax.jit(lambda *a: mp.numerics.gemm_telemetry(fn, "f16_mixed", *a))(*args)
  got = record.report()
  key = lambda r: (r.index, r.primitive, r.scope, r.direction, r.role, r.shape, r.dtype)
  assert [key(r) for r in got.rows] == [key(r) for r in ref.rows]
  fwd = {r.index for r in got.rows if r.direction == "fwd"}
  cot = [r for r in got.rows if r.role == "cotangent"]
  # Every forward GEMM of a weight gets backward GEMMs fed by a cotangent.
  assert len({r.index for r in cot}) >= len(fwd), kind
  for a, b in zip(ref.rows, got.rows):
    # Compiled and eager evaluations of one jaxpr may round a few f32 values differently
    # (fused reductions), so the values measured can differ slightly: 1 pp.
    for f in FRACTIONS:
      assert abs(getattr(a, f) - getattr(b, f)) <= 0.01, (kind, a.index, a.role, f)


def test_monitors_are_the_max_logit_and_log_partition():
  fn, args = _plain_case()
  w1, w2, x = args
  record = jax.jit(lambda *a: mp.numerics.gemm_telemetry(fn, "bf16_mixed", *a))(*args)
  mon = record.monitors()
  # Hand computation of what the program computes: bf16 GEMMs, f32 softmax.
  bf = lambda a: a.astype(jnp.bfloat16)
  h = jnp.tanh(jnp.matmul(bf(x), bf(w1), preferred_element_type=jnp.float32)
               .astype(jnp.bfloat16).astype(jnp.float32))
  s = jnp.matmul(bf(h), bf(h).T, preferred_element_type=jnp.float32)
  softmax_keys = [k for k in mon if k.startswith("logit_max") and k.endswith("softmax")]
  assert len(softmax_keys) == 1
  np.testing.assert_allclose(mon[softmax_keys[0]], float(jnp.max(s)), rtol=1e-2)
  logz_mean = [v for k, v in mon.items() if k.startswith("log_z_mean")]
  assert len(logz_mean) == 1 and math.isfinite(logz_mean[0])
  # log Z of the output logits, from the loss itself: mean CE = mean(logZ - logit_y).
  assert any(k.startswith("log_z_absmax") for k in mon)


def test_param_monitors_see_swamping_and_adams_ratio():
  p0 = {"w": jnp.full((64,), 256.0, jnp.bfloat16), "b": jnp.zeros((4,), jnp.float32)}
  g = {"w": jnp.ones((64,), jnp.float32), "b": jnp.arange(4, dtype=jnp.float32)}
  # bf16 at 256 has an ulp of 2: an update of 1e-3 leaves every element where it was.
  p1 = {"w": (p0["w"].astype(jnp.float32) - 1e-3).astype(jnp.bfloat16),
        "b": p0["b"] - 1e-3 * g["b"]}
  tx = optax.adam(1e-3)
  state = tx.init(p0)
  _, state = tx.update(jax.tree.map(lambda x: x * 0.5, g), state, p0)
  mon = {"/".join(k[:2]): float(v)
         for k, v in mp.numerics.param_monitors(p0, p1, g, state).items()}
  assert mon["update_lost/w"] == 1.0
  assert mon["update_lost/b"] == pytest.approx(0.0)
  assert mon["update_rms/w"] == 0.0
  np.testing.assert_allclose(mon["update_rms/b"],
                             np.sqrt(np.mean((1e-3 * np.arange(4.0)) ** 2)), rtol=1e-5)
  # nu after one step of 0.5 g is (1 - b2) (0.5 g)^2, bias-corrected (0.5 g)^2: the ratio
  # is about 2 wherever g != 0; the reference takes optax's nu as stored (f32).
  nu, count = state[0].nu, int(state[0].count)
  for name in ("w", "b"):
    gg = np.asarray(g[name], np.float64)
    vhat = np.asarray(nu[name], np.float64) / (1 - 0.999 ** count)
    ok = vhat > 0
    ref = np.sqrt(np.mean(gg[ok] ** 2 / vhat[ok]))
    np.testing.assert_allclose(mon[f"adam_rms_g2_over_v/{name}"], ref, rtol=1e-5)
    assert abs(ref - 2.0) < 1e-3
  with pytest.raises(ValueError, match="structures"):
    mp.numerics.param_monitors(p0, {"w": p1["w"]})


def test_bad_input_is_refused():
  fn, args = _plain_case()
  with pytest.raises(ValueError, match="whatif"):
    mp.numerics.gemm_telemetry(fn, "bf16_mixed", *args, whatif="yes")


# ------------------------------------------------------------------ in the study


def _load(name):
  path = os.path.join(os.path.dirname(__file__), "study_tasks", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"tele_{name}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def tiny_loss_studies(tmp_path_factory):
  """The researcher's NNX MLP task with its loss scaled by 1e-6 (a loss whose gradients
  f16 cannot hold without loss scaling), run with telemetry every 4 steps and without."""
  m = _load("nnx_mlp")
  task = mp.study.Task(
      init=m.task.init, loss=lambda model, b: 1e-6 * m.loss(model, b), batches=m.batches,
      optimizer=optax.adamw(3e-3), name="tiny-loss")
  noscale = mp.get_recipe("f16_mixed").replace(
      name="f16_noscale", loss_scale=mp.LossScaleConfig(kind="none"),
      allow_f16_without_loss_scale=True)
  mp.enable_faithful_rounding()
  out = {}
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    for every in (4, 0):
      d = str(tmp_path_factory.mktemp(f"tele{every}"))
      out[every] = (d, mp.study.run(task, ["fp32", noscale], seeds=2, steps=8, out=d,
                                    telemetry=every, timing_rounds=0, progress=False))
  return out


@pytest.mark.slow
def test_study_telemetry_leaves_the_trajectory_alone(tiny_loss_studies):
  (on_dir, on), (_, off) = tiny_loss_studies[4], tiny_loss_studies[0]
  assert on.rows["f16_noscale"]["deltas"] == off.rows["f16_noscale"]["deltas"]
  for arm in ("fp32", "f16_noscale"):
    for seed in (0, 1):
      strip = lambda recs: [{k: v for k, v in r.items() if k != "step_time_s"} for r in recs]
      assert strip(on.runs(arm, seed)) == strip(off.runs(arm, seed))
  cells = os.path.join(on_dir, "cells")
  for name in os.listdir(cells):
    with open(os.path.join(cells, name, "done.json")) as f:
      fp_on = json.load(f)["fingerprint"]
    with open(os.path.join(tiny_loss_studies[0][0], "cells", name, "done.json")) as f:
      assert json.load(f)["fingerprint"] == fp_on
    with open(os.path.join(cells, name, "telemetry.jsonl")) as f:
      recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [0, 4]
    assert all(r["rows"] and r["monitors"] for r in recs)
  assert not os.path.exists(os.path.join(tiny_loss_studies[0][0], "cells", "fp32__s0",
                                         "telemetry.jsonl"))


@pytest.mark.slow
def test_study_names_the_first_anomaly(tiny_loss_studies):
  on_dir, on = tiny_loss_studies[4]
  tele = on.summary["telemetry"]
  assert tele["fp32"]["first_anomaly"] is None
  fa = tele["f16_noscale"]["first_anomaly"]
  assert fa["step"] == 0 and fa["statistic"] == "underflow"
  assert fa["row"]["direction"] == "bwd" and fa["row"]["role"] == "cotangent"
  assert fa["row"]["dtype"] == "float16"
  # The output layer's cotangent is the first the backward pass meets.
  assert fa["row"]["scope"] == "out"
  assert "## Numerics telemetry" in on.markdown and "`out` bwd cotangent" in on.markdown
  assert os.path.exists(os.path.join(on_dir, "telemetry_f16_noscale.png"))
  with pytest.raises(ValueError, match="telemetry=-1"):
    mp.study.run(_load("params_mlp").task, telemetry=-1, out=on_dir + "_bad")


def test_swamped_updates_are_named_in_the_16_bit_params_not_in_the_master():
  """A learning rate far below half an ulp of bf16 weights: pure_bf16 (no master copy)
  loses nearly every weight update to rounding; bf16_master keeps them in its f32 master."""
  from precision.study import _models

  m = _load("params_mlp")
  task = mp.study.Task(init=m.init, loss=m.loss, batches=m.batches,
                       optimizer=optax.adam(1e-5), name="tiny-lr")
  batch = next(iter(m.batches(0)))
  lost = {}
  for recipe in ("pure_bf16", "bf16_master"):
    prog = _models.build(task, mp.get_recipe(recipe), 0)
    mon = prog.telemetry(prog.state, batch, jnp.int32(0), False).monitors()
    lost[recipe] = mon["update_lost/w1"]
  # |w1| ~ 0.35: a bf16 ulp of 2**-9 there, against Adam's first update of lr = 1e-5.
  assert lost["pure_bf16"] > 0.9
  assert lost["bf16_master"] == 0.0


# ------------------------------------------------------------------ train_step option


class _DropoutMLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(self.drop(nnx.relu(self.fc1(x))))


def _step_case(recipe):
  model = mp.flax.apply_recipe(_DropoutMLP(nnx.Rngs(0)), recipe)
  tx = mp.optim.build_optimizer(recipe, optax.adam(1e-3))
  opt = tx.init(nnx.state(model, nnx.Param))
  x = jax.random.normal(jax.random.key(5), (32, 8))
  y = jax.random.normal(jax.random.key(6), (32, 4))
  return model, tx, opt, x, y


def _loss(m, x, y):
  return jnp.mean((m(x) - y) ** 2)


def test_train_step_with_telemetry_takes_the_same_step():
  import functools
  model, tx, opt, x, y = _step_case("f16_mixed")
  probe_model = nnx.clone(model)
  step = nnx.jit(mp.train_step, static_argnums=(1, 3))
  probe = nnx.jit(functools.partial(mp.train_step, telemetry=True), static_argnums=(1, 3))
  loss, new_opt = step(model, tx, opt, _loss, x, y)
  p_loss, p_opt, record = probe(probe_model, tx, opt, _loss, x, y)
  assert bit_identical(loss, p_loss) and bit_identical(new_opt, p_opt)
  assert bit_identical(nnx.state(model), nnx.state(probe_model))   # dropout RNG included
  rows = record.report().rows
  assert {r.scope for r in rows} == {"fc1", "head"}
  assert any(r.role == "cotangent" and r.dtype == "float16" for r in rows)
  mon = record.monitors()
  assert mon["update_rms/head/kernel"] > 0 and mon["update_lost/head/kernel"] == 0.0


def test_train_step_without_telemetry_is_the_documented_composition():
  """telemetry=False lowers to exactly the program of value_and_grad + tx.update +
  apply_updates written out (nothing of the option is left in it)."""
  model, tx, opt, x, y = _step_case("bf16_master")

  def by_hand(model, opt, x, y):
    params = nnx.state(model, nnx.Param)
    loss, grads = mp.value_and_grad(_loss, opt)(model, x, y)
    updates, new = tx.update(grads, opt, params)
    nnx.update(model, mp.optim.apply_updates(params, updates))
    return loss, new

  def body(text):
    return text.split("\n", 1)[1]  # the module's name line differs

  a = nnx.jit(lambda m, o, x, y: mp.train_step(m, tx, o, _loss, x, y)).lower(model, opt, x, y)
  b = nnx.jit(by_hand).lower(model, opt, x, y)
  assert body(a.as_text()) == body(b.as_text())


def test_telemetry_option_needs_a_spec():
  model = _DropoutMLP(nnx.Rngs(0))
  opt = mp.optim.build_optimizer("bf16_mixed", optax.adam(1e-3)).init(
      nnx.state(model, nnx.Param))
  x = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="not marked"):
    mp.value_and_grad(_loss, opt, telemetry=True)(model, x, jnp.zeros((4, 4)))
  with pytest.raises(ValueError, match="autocast'ed"):
    mp.value_and_grad(lambda p, x: jnp.sum(x @ p), opt, telemetry=True)(jnp.ones((8, 2)), x)
  with pytest.raises(ValueError, match="telemetry"):
    mp.value_and_grad(_loss, opt, telemetry=1)


def test_value_and_grad_telemetry_on_a_params_pytree():
  _, (w1, w2, x) = _plain_case()

  def plain_loss(params, x):
    h = jnp.tanh(x @ params[0])
    return jnp.mean((h @ params[1]) ** 2)

  f = mp.autocast(plain_loss, "bf16_mixed")
  tx = mp.optim.build_optimizer("bf16_mixed", optax.adam(1e-3))
  opt = tx.init((w1, w2))
  loss_v, grads, record = jax.jit(
      lambda p, o, x: mp.value_and_grad(f, o, telemetry=True)(p, x))((w1, w2), opt, x)
  ref_loss, ref_grads = jax.jit(lambda p, o, x: mp.value_and_grad(f, o)(p, x))((w1, w2), opt, x)
  assert bit_identical(loss_v, ref_loss) and bit_identical(grads, ref_grads)
  rows = record.report().rows
  assert rows and all(r.dtype in ("bfloat16", "float32") for r in rows)
  assert {r.direction for r in rows} == {"fwd", "bwd"}


def test_scale_plot_png(tmp_path):
  fn, args = _plain_case()
  report = mp.numerics.inspect(fn, "f16_mixed", *args)
  path = report.scale_plot(tmp_path / "scales.png")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="max_rows"):
    report.scale_plot(tmp_path / "x.png", max_rows=0)


@pytest.mark.parametrize("stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_data_parallel_telemetry_is_one_shards_inspect(stage):
  """DataParallel.telemetry: the rows of inspect on the first device's slice of the batch
  with the full params and the loss scaled as the step scales it (ZeRO-3 gathers)."""
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()), ("data",))

  def loss_fn(p, b):
    return 1e-6 * jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

  rng = np.random.default_rng(0)
  params = {"w1": rng.standard_normal((8, 16)).astype(np.float32),
            "w2": rng.standard_normal((16, 4)).astype(np.float32)}
  n = len(jax.devices())
  batch = {"x": rng.standard_normal((4 * n, 8)).astype(np.float32),
           "y": np.zeros((4 * n, 4), np.float32)}
  dp = mp.parallel.data_parallel(loss_fn, optax.adam(1e-3), mesh, zero_stage=stage,
                                 recipe="f16_mixed")
  state = dp.init(params)
  got = dp.telemetry(state, batch).report()
  scale = float(mp.optim.loss_scale_of(state.opt_state))
  ref = mp.numerics.inspect(jax.value_and_grad(lambda p, b: loss_fn(p, b) * scale),
                            "f16_mixed", params, {k: v[:4] for k, v in batch.items()})
  key = lambda r: (r.index, r.direction, r.role, r.shape, r.dtype)
  assert [key(r) for r in got.rows] == [key(r) for r in ref.rows]
  for a, b in zip(ref.rows, got.rows):
    for f in FRACTIONS:
      assert abs(getattr(a, f) - getattr(b, f)) <= 0.01, (a.index, a.role, f)
  state, _ = dp.step(state, batch)   # the state is the step's to donate, untouched
  no_recipe = mp.parallel.data_parallel(loss_fn, optax.adam(1e-3), mesh)
  with pytest.raises(ValueError, match="no recipe"):
    no_recipe.telemetry(no_recipe.init(params), batch)
