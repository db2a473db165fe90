"""Numerics telemetry of fp8 GEMMs in training: train_step / value_and_grad on an NNX model
(fp8 layers holding their scaling state), the study's programs (NNX layers, and autocast
with the scaling state explicit), and DataParallel with fp8_state=True.

An fp8 operand's row measures the value the cast to E4M3 / E5M2 rounds: the operand
divided by its scale (and clipped to the format's max), so its underflow, subnormal and
SQNR columns are those of the fp8 quantisation itself. The reference below recomputes
that value and its statistics with numpy and ml_dtypes, independently of the library.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FRACTIONS = ("underflow", "subnormal", "overflow", "saturated")


@pytest.fixture(autouse=True)
def _faithful():
  mp.enable_faithful_rounding()
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


def _bits(a, b) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _reference(v32: np.ndarray, dtype: np.dtype) -> dict:
  """underflow / subnormal / saturated fractions of the nonzero finite values and SQNR
  of their rounding to `dtype`, by ml_dtypes (round to nearest even)."""
  v = v32[np.isfinite(v32) & (v32 != 0)].astype(np.float32)
  r = v.astype(dtype).astype(np.float64)
  fi = ml_dtypes.finfo(dtype)
  n = v.size
  noise = np.sum((v.astype(np.float64) - r) ** 2)
  return dict(underflow=np.count_nonzero(r == 0) / n,
              subnormal=np.count_nonzero((r != 0) & (np.abs(r) < float(fi.smallest_normal))) / n,
              saturated=np.count_nonzero(np.abs(r) == float(fi.max)) / n,
              overflow=np.count_nonzero(~np.isfinite(r)) / n,
              sqnr_db=10 * np.log10(np.sum(v.astype(np.float64) ** 2) / noise))


def _current_scaled(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Per-tensor current scaling as the fp8 GEMM computes it in f32: the scale is
  1 / (fmax / amax), the operand divided by it, clipped to +-fmax."""
  fmax = np.float32(ml_dtypes.finfo(dtype).max)
  amax = np.float32(np.max(np.abs(x)))
  scale = np.float32(1.0) / (fmax / amax)
  return np.clip(x.astype(np.float32) / scale, -fmax, fmax)


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(32, 64, rngs=rngs)
    self.head = nnx.Linear(64, 32, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.fc1(x)))


def _loss(m, x, y):
  return jnp.mean((m(x) - y) ** 2)


def _data():
  x = 3.0 * jax.random.normal(jax.random.key(5), (32, 32))
  y = jax.random.normal(jax.random.key(6), (32, 32))
  return x, y


def _case(recipe):
  model = mp.flax.apply_recipe(_MLP(nnx.Rngs(0)), recipe)
  tx = mp.optim.build_optimizer(recipe, optax.adam(1e-3))
  return model, tx, tx.init(nnx.state(model, nnx.Param))


CURRENT = mp.get_recipe("fp8_hybrid").replace(
    name="fp8_current", fp8=mp.Fp8Config(scaling="current"))


def _step_and_probe(recipe):
  model, tx, opt = _case(recipe)
  x, y = _data()
  probe_model = nnx.clone(model)
  step = nnx.jit(mp.train_step, static_argnums=(1, 3))
  probe = nnx.jit(functools.partial(mp.train_step, telemetry=True), static_argnums=(1, 3))
  kernel = np.asarray(model.fc1.kernel[...])
  loss, new_opt = step(model, tx, opt, _loss, x, y)
  p_loss, p_opt, record = probe(probe_model, tx, opt, _loss, x, y)
  # The telemetry's own evaluation leaves the step, the fp8 scaling state included, as is.
  same = (_bits(loss, p_loss) and _bits(new_opt, p_opt)
          and _bits(nnx.state(model), nnx.state(probe_model)))
  return same, record.report().rows, np.asarray(x), kernel


@pytest.fixture(scope="module")
def current_probe():
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    mp.enable_faithful_rounding()
    return _step_and_probe(CURRENT)


def _check_fp8_rows(same, rows):
  assert same
  for scope in ("fc1", "head"):
    mine = [r for r in rows if r.scope.startswith(scope)]
    fwd = {(r.role, r.dtype) for r in mine if r.direction == "fwd"}
    assert ("lhs", "float8_e4m3fn") in fwd and ("rhs", "float8_e4m3fn") in fwd, scope
    cot = {r.dtype for r in mine if r.role == "cotangent"}
    assert cot == {"float8_e5m2"}, scope   # both backward GEMMs take the E5M2 cotangent
  # A quantised operand is measured before its rounding: SQNR is finite (the rounded
  # values themselves would measure +inf).
  assert all(np.isfinite(r.sqnr_db) for r in rows if r.dtype.startswith("float8"))


def test_train_step_telemetry_of_fp8_layers_takes_the_same_step(current_probe):
  _check_fp8_rows(*current_probe[:2])


@pytest.mark.slow  # the fast set has the current-scaling case
def test_train_step_telemetry_of_delayed_fp8_layers_takes_the_same_step():
  _check_fp8_rows(*_step_and_probe("fp8_hybrid")[:2])


def test_current_scaled_operand_rows_equal_an_ml_dtypes_reference(current_probe):
  _, rows, x, w = current_probe
  fc1 = [r for r in rows if r.scope.startswith("fc1") and r.direction == "fwd"]
  lhs = next(r for r in fc1 if r.role == "lhs")
  rhs = next(r for r in fc1 if r.role == "rhs")
  for row, value in ((lhs, x), (rhs, w)):
    scaled = _current_scaled(value, E4M3)
    ref = _reference(scaled, E4M3)
    assert row.amax == pytest.approx(float(np.max(np.abs(scaled))), rel=1e-6)
    for f in FRACTIONS:   # 0.1 percentage points
      assert abs(getattr(row, f) - ref[f]) <= 1e-3, (row.role, f, getattr(row, f), ref[f])
    assert row.sqnr_db == pytest.approx(ref["sqnr_db"], abs=0.05), row.role
    # Current scaling puts the amax element on the format's max.
    assert row.saturated > 0


@pytest.mark.slow  # ~15 s: an eager inspect and a compiled telemetry step of fp8 layers
def test_seeded_fault_frozen_fp8_scale_saturates_the_named_operand():
  """A delayed scale stuck far below its tensor's amax (fc1's input scale set to 1e-4,
  against inputs of |x| up to ~10): E4M3 clips nearly all of fc1's forward lhs to 448.
  inspect (under the model's own fp8 layers) and the step's telemetry both name that
  operand, and no other operand saturates."""
  model, tx, opt = _case("fp8_hybrid")
  x, y = _data()
  model.fc1.dot_general.lhs_scale[...] = jnp.float32(1e-4)
  expected = np.mean(np.abs(np.asarray(x)) / np.float32(1e-4) >= 432.0)  # rounds to 448
  report = mp.numerics.inspect(nnx.grad(_loss), "fp8_hybrid", model, x, y)
  _, _, record = nnx.jit(functools.partial(mp.train_step, telemetry=True),
                         static_argnums=(1, 3))(nnx.clone(model), tx, opt, _loss, x, y)
  for rows in (report.rows, record.report().rows):
    worst = max(rows, key=lambda r: r.saturated)
    assert (worst.scope, worst.direction, worst.role, worst.dtype) == (
        "fc1/dot_general", "fwd", "lhs", "float8_e4m3fn")
    assert worst.saturated == pytest.approx(expected, abs=1e-3) and expected > 0.9
    others = [r.saturated for r in rows if r is not worst
              and not (r.scope == worst.scope and r.role == "rhs" and r.direction == "bwd")]
    assert max(others) < 0.05
  assert float(model.fc1.dot_general.lhs_scale[...]) == pytest.approx(1e-4)  # untouched


# NNX's fp8 layers are train_step's path (tested above): its study case is in the slow set.
@pytest.mark.parametrize("kind", [pytest.param("nnx", marks=pytest.mark.slow), "params"])
def test_study_telemetry_has_fp8_rows(kind):
  """The study's telemetry program under fp8_hybrid: NNX fp8 layers, and a params
  function whose GEMMs autocast runs in fp8 with the scaling state explicit; the
  program does not change the state (the step after it is the step without it)."""
  from precision.study import _models

  task = mp.study.load_task(os.path.join(os.path.dirname(__file__), "study_tasks",
                                          ("nnx_mlp" if kind == "nnx" else "params_mlp")
                                          + ".py:task"))
  # Two GEMMs of a params MLP are its first and last: keep them in fp8 here.
  recipe = mp.get_recipe("fp8_hybrid")
  recipe = recipe.replace(fp8=dataclasses.replace(recipe.fp8, keep_first_last=False))
  prog = _models.build(task, recipe, 0)
  batch = next(iter(task.batches(0)))
  before = jax.tree.map(jnp.copy, prog.state)
  record = prog.telemetry(prog.state, batch, jnp.int32(0), True)
  assert _bits(before, prog.state)
  rows = record.report().rows
  fwd = [r for r in rows if r.direction == "fwd" and r.role in ("lhs", "rhs")]
  assert fwd and all(r.dtype == "float8_e4m3fn" for r in fwd), [r.dtype for r in fwd]
  cot = [r for r in rows if r.role == "cotangent"]
  assert cot and all(r.dtype == "float8_e5m2" for r in cot)
  assert len({r.index for r in cot}) == 2 * len({r.index for r in fwd})
  assert record.monitors()   # the update's parameter monitors beside the rows


@pytest.mark.slow  # 8 devices, ZeRO-1: ~20 s
def test_data_parallel_fp8_state_telemetry_is_one_shards_value_and_grad_telemetry():
  from jax.sharding import Mesh

  from test_parallel import _fp8_setup   # its two-layer NNX model, loss and batch

  recipe, model, params, fp8_state, loss, batch = _fp8_setup()
  n = len(jax.devices())
  dp = mp.parallel.data_parallel(loss, optax.adamw(1e-3), Mesh(np.array(jax.devices()),
                                                               ("data",)),
                                 zero_stage=1, recipe=recipe, fp8_state=True)
  state = dp.init(jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, fp8_state))
  got = dp.telemetry(state, batch).report().rows
  # The same shard through value_and_grad's telemetry on the NNX model itself.
  opt = mp.optim.build_optimizer(recipe, optax.adamw(1e-3)).init(nnx.state(model, nnx.Param))
  shard = {k: v[:v.shape[0] // n] for k, v in batch.items()}
  _, _, record = mp.value_and_grad(
      lambda mdl, b: jnp.mean(jnp.square(mdl(b["x"]).astype(jnp.float32) - b["y"])),
      opt, telemetry=True)(model, shard)
  ref = record.report().rows
  key = lambda row: (row.index, row.direction, row.role, row.shape, row.dtype)
  assert [key(a) for a in got] == [key(b) for b in ref]
  assert {a.dtype for a in got if a.role == "cotangent"} == {"float8_e5m2"}
  for a, b in zip(got, ref):
    for f in FRACTIONS:
      assert abs(getattr(a, f) - getattr(b, f)) <= 1e-3, (a.index, a.role, f)
    assert a.amax == pytest.approx(b.amax, rel=1e-6)
  state, _ = dp.step(state, batch)   # the state is still the step's to donate


def test_explicit_fp8_state_functions_are_refused_by_value_and_grad_telemetry():
  recipe = mp.get_recipe("fp8_hybrid")
  fn = mp.autocast(lambda p, x: jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"]), recipe,
                   fp8_state=True)
  opt = mp.optim.build_optimizer(recipe, optax.adam(1e-3)).init({})
  with pytest.raises(ValueError, match="fp8_state=True"):
    mp.value_and_grad(fn, opt, telemetry=True)(
        {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 16))}, jnp.ones((16, 16)))
