"""precision.train_step / precision.value_and_grad: one loop for every recipe, and the
warning when a loss-scaling optimizer is fed gradients computed without its scale."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp
from precision import _trace_state
from precision.optim import _guard

RECIPES = ("fp32", "bf16_master", "f16_mixed", "fp8_hybrid")
STEPS = 20
LR = 0.1


class MLP(nnx.Module):
  """Two Linear layers with biases around a GELU: 8 -> 32 -> 4."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(8, 32, rngs=rngs)
    self.out = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.gelu(self.hidden(x)))


def loss_fn(model, x, y):
  return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))


@pytest.fixture(scope="module")
def data():
  r = np.random.default_rng(0)
  x = r.normal(size=(64, 8)).astype(np.float32)
  w = r.normal(size=(8, 4)).astype(np.float32)
  return x, np.tanh(x @ w).astype(np.float32)


@pytest.fixture
def fresh_warning(monkeypatch):
  """The once-per-process warning re-armed, and no scale read pending in this thread."""
  monkeypatch.setattr(_guard, "_warned", False)
  token = _trace_state.SCALE_READ.set(False)
  yield
  _trace_state.SCALE_READ.reset(token)


def _setup(recipe, inner=None):
  model = mp.flax.apply_recipe(MLP(nnx.Rngs(0)), recipe)
  tx = mp.optim.build_optimizer(recipe, inner or optax.sgd(LR))
  return model, tx, tx.init(nnx.state(model, nnx.Param))


def _step_by_hand(tx, value_and_grad_of):
  """A jitted training step written out by hand: `value_and_grad_of(opt_state)` gives the
  function that differentiates loss_fn, then the optimizer's update and apply."""

  @nnx.jit
  def step(model, opt_state, x, y):
    loss, grads = value_and_grad_of(opt_state)(model, x, y)
    params = nnx.state(model, nnx.Param)
    updates, opt_state = tx.update(grads, opt_state, params)
    nnx.update(model, mp.optim.apply_updates(params, updates))
    return loss, opt_state

  return step


def _unscaled_warnings(caught):
  return [w for w in caught if issubclass(w.category, mp.optim.UnscaledGradientsWarning)]


def _train(recipe, data, steps=STEPS):
  """`steps` jitted train_steps; the losses and the model."""
  x, y = data
  model, tx, opt_state = _setup(recipe)
  step = nnx.jit(mp.train_step, static_argnums=(1, 3))
  losses = []
  for _ in range(steps):
    loss, opt_state = step(model, tx, opt_state, loss_fn, x, y)
    losses.append(float(loss))
  return np.array(losses), model, opt_state


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_step_loss_drops(recipe, data, fresh_warning):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    losses, model, opt_state = _train(recipe, data)
  assert not _unscaled_warnings(caught)
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.7 * losses[0], losses
  metrics = mp.optim.optimizer_metrics(opt_state)
  assert int(metrics["skipped_steps"]) == 0
  if recipe == "f16_mixed":
    assert float(metrics["loss_scale"]) == 2.0 ** 15       # the scale was in play
  if recipe == "fp8_hybrid":
    fp8 = mp.fp8.fp8_metrics(model)
    # The gradient operand's scaling state came out of the backward pass.
    assert int(fp8["fp8/gemms"]) == 2 and float(fp8["hidden/grad_amax"]) > 0


@pytest.mark.parametrize("recipe", ["f16_mixed", "fp8_hybrid"])
def test_value_and_grad_by_hand_loss_drops(recipe, data, fresh_warning):
  x, y = data
  model, tx, opt_state = _setup(recipe)

  step = _step_by_hand(tx, lambda opt_state: mp.value_and_grad(loss_fn, opt_state))

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    losses = []
    for _ in range(STEPS):
      loss, opt_state = step(model, opt_state, x, y)
      losses.append(float(loss))
  assert not _unscaled_warnings(caught)
  assert losses[-1] < 0.7 * losses[0], losses


def _first_update(recipe, data):
  """(params before, params after) of one eager train_step, as f32 numpy."""
  x, y = data
  model, tx, opt_state = _setup(recipe)
  before = jax.tree.map(lambda p: np.asarray(p, np.float32), nnx.state(model, nnx.Param))
  loss, _ = mp.train_step(model, tx, opt_state, loss_fn, x, y)
  after = jax.tree.map(lambda p: np.asarray(p, np.float32), nnx.state(model, nnx.Param))
  return before, after, loss


def test_f16_sgd_update_has_the_fp32_magnitude(data):
  """SGD's update is lr * grad: a missing loss scale makes it 2**15 times too small, a
  missing unscale 2**15 times too large. f16 compute rounds the GEMM operands (2**-11
  relative), so the update agrees with fp32's to ~1e-3; 2e-2 leaves room and fails by
  orders of magnitude on a scale/unscale mismatch."""
  ref_before, ref_after, ref_loss = _first_update("fp32", data)
  before, after, loss = _first_update("f16_mixed", data)
  assert loss.dtype == jnp.float32
  assert abs(float(loss) - float(ref_loss)) <= 1e-2 * float(ref_loss)  # unscaled
  ref_u = np.concatenate([(a - b).ravel() for a, b in zip(jax.tree.leaves(ref_after),
                                                          jax.tree.leaves(ref_before))])
  u = np.concatenate([(a - b).ravel() for a, b in zip(jax.tree.leaves(after),
                                                      jax.tree.leaves(before))])
  assert np.linalg.norm(ref_u) > 1e-3
  assert np.linalg.norm(u - ref_u) <= 2e-2 * np.linalg.norm(ref_u)


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_eager_and_jitted_steps_agree(data):
  """train_step eagerly (no jit) trains the fp8 model like the jitted one: same losses
  to f32 rounding of differently fused programs."""
  x, y = data
  eager_model, tx, opt_state = _setup("fp8_hybrid")
  eager = []
  for _ in range(2):
    loss, opt_state = mp.train_step(eager_model, tx, opt_state, loss_fn, x, y)
    eager.append(float(loss))
  jitted, _, _ = _train("fp8_hybrid", data, steps=2)
  np.testing.assert_allclose(eager, jitted, rtol=1e-4)
  assert eager[-1] < eager[0]
  # The batch by keyword: bound to loss_fn, not differentiated.
  expected = float(loss_fn(nnx.clone(eager_model), x, y))    # the loss before the update
  loss, _ = mp.train_step(eager_model, tx, opt_state, loss_fn, x, y=y)
  np.testing.assert_allclose(float(loss), expected, rtol=1e-6)


def test_params_pytree_grads_are_scaled_and_loss_is_not():
  recipe = mp.get_recipe("f16_mixed")
  tx = mp.optim.build_optimizer(recipe, optax.sgd(LR))
  params = {"w": jnp.asarray([[1.0, -2.0], [0.5, 3.0]], jnp.float32)}
  opt_state = tx.init(params)
  x = jnp.asarray([[1.0, 2.0]], jnp.float32)

  def f(p, x):
    y = x @ p["w"]
    return jnp.sum(y * y), {"y": y}

  (loss, aux), grads = mp.value_and_grad(f, opt_state, has_aux=True)(params, x)
  ref_loss, ref_grads = jax.value_and_grad(lambda p: f(p, x)[0])(params)
  assert loss.dtype == jnp.float32 and float(loss) == float(ref_loss)
  np.testing.assert_array_equal(aux["y"], x @ params["w"])
  np.testing.assert_array_equal(grads["w"], ref_grads["w"] * 2.0 ** 15)
  updates, _ = tx.update(grads, opt_state, params)          # unscaled by the guard
  np.testing.assert_allclose(updates["w"], -LR * ref_grads["w"], rtol=1e-6)


def test_unscaled_gradients_warn_once_and_stall(data, fresh_warning):
  """The trap: f16_mixed + SGD with plain nnx.value_and_grad. Nothing scales the loss, the
  optimizer unscales anyway, and the loss barely moves; the update warns, once."""
  x, y = data
  model, tx, opt_state = _setup("f16_mixed")

  plain_step = _step_by_hand(tx, lambda opt_state: nnx.value_and_grad(loss_fn))

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plain = [float(plain_step(model, opt_state, x, y)[0])]
    for _ in range(STEPS):
      loss, opt_state = plain_step(model, opt_state, x, y)
      plain.append(float(loss))
    # A second traced program with the same mistake: still one warning per process.
    eager_loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    tx.update(grads, opt_state, nnx.state(model, nnx.Param))
  found = _unscaled_warnings(caught)
  assert len(found) == 1, [str(w.message) for w in caught]
  assert "precision.value_and_grad" in str(found[0].message)
  assert found[0].filename == __file__                       # points at the user's update
  good, _, _ = _train("f16_mixed", data)
  assert plain[0] - plain[-1] < 1e-2 * (good[0] - good[-1])  # stalled vs trained


def test_scaling_by_hand_and_the_projects_paths_do_not_warn(data, fresh_warning):
  x, y = data
  model, tx, opt_state = _setup("f16_mixed")
  params = nnx.state(model, nnx.Param)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # By hand, as precision.optim documents it.
    scale = mp.optim.loss_scale_of(opt_state)
    _, grads = nnx.value_and_grad(lambda m: loss_fn(m, x, y) * scale)(model)
    tx.update(grads, opt_state, params)
    # precision.value_and_grad on a params pytree.
    pt = {"w": jnp.ones((8, 4), jnp.float32)}
    pt_state = tx.init(pt)
    _, g = mp.value_and_grad(lambda p: jnp.mean(jnp.square(x @ p["w"] - y)), pt_state)(pt)
    tx.update(g, pt_state, pt)
    # precision.parallel on 8 devices, stage 1.
    mesh = jax.make_mesh((8,), ("data",))
    dp = mp.parallel.data_parallel(lambda p, b: jnp.mean(jnp.square(b[0] @ p["w"] - b[1])),
                                   optax.sgd(LR), mesh, zero_stage=1, recipe="f16_mixed")
    dp.step(dp.init({"w": np.ones((8, 4), np.float32)}), (x, y))
  assert not _unscaled_warnings(caught), [str(w.message) for w in caught]
  # Recipes without loss scaling never warn, whatever computed the grads.
  model, tx, opt_state = _setup("bf16_master")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    tx.update(grads, opt_state, nnx.state(model, nnx.Param))
  assert not _unscaled_warnings(caught)


def test_skipped_step_leaves_params_optimizer_and_fp8_state_bit_identical(data):
  """A non-finite batch: the guard skips the step, train_step rolls the fp8 scaling state
  (histories, scales, counters of every operand) back with it."""
  x, y = data
  model, tx, opt_state = _setup("fp8_hybrid")
  step = nnx.jit(mp.train_step, static_argnums=(1, 3))
  _, opt_state = step(model, tx, opt_state, loss_fn, x, y)   # non-trivial fp8 state
  snap = lambda: jax.tree.map(np.asarray, nnx.state(model, nnx.Any(nnx.Param,
                                                                   mp.fp8.Fp8State)))
  before, opt_before = snap(), jax.tree.map(np.asarray, opt_state)
  bad = y.copy()
  bad[0, 0] = np.nan          # the loss and every gradient NaN
  loss, new_opt = step(model, tx, opt_state, loss_fn, x, bad)
  assert not np.isfinite(float(loss))
  assert bool(mp.optim.step_skipped(opt_state, new_opt))
  after = snap()
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(new_opt.inner_state), jax.tree.leaves(opt_before.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_bad_arguments(data):
  x, y = data
  model, tx, opt_state = _setup("fp32")
  with pytest.raises(ValueError, match="accepted: an nnx.Module"):
    mp.train_step(nnx.state(model, nnx.Param), tx, opt_state, loss_fn, x, y)
  with pytest.raises(ValueError, match="accepted: an optax.GradientTransformation"):
    mp.train_step(model, "adam", opt_state, loss_fn, x, y)
  with pytest.raises(ValueError, match=r"float32\[64, 4\]; accepted: a floating scalar"):
    mp.value_and_grad(lambda m, x: m(x).astype(jnp.float32), opt_state)(model, x)
  with pytest.raises(ValueError, match="accepted: a pair"):
    mp.value_and_grad(lambda m: loss_fn(m, x, y), opt_state, has_aux=True)(model)
  with pytest.raises(ValueError, match="has_aux=1"):
    mp.value_and_grad(loss_fn, opt_state, has_aux=1)
