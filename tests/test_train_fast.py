"""precision.jit_train_step: the step of `nnx.jit(precision.train_step, ...)` bit for bit,
jitted once over the model's arrays, with the model kept current and its buffers donated."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp
from _asserts import assert_bit_identical, bit_identical


class Net(nnx.Module):
  """Linear -> BatchNorm -> GELU -> Dropout -> Linear, 6 -> 16 -> 3: Params, batch
  statistics and an RNG counter, the three kinds of state a step carries."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(6, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(jax.nn.gelu(self.norm(self.hidden(x)))))


def loss_fn(model, x, y):
  return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))


def _batches(n, nan_at=()):
  rng = np.random.default_rng(0)
  out = []
  for t in range(n):
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = rng.standard_normal((8, 3)).astype(np.float32)
    if t in nan_at:
      y[0, 0] = np.nan          # the loss and every gradient NaN: the guard skips
    out.append((x, y))
  return out


def _setup(recipe, inner=None):
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), recipe)
  tx = mp.optim.build_optimizer(recipe, inner or optax.adamw(1e-2))
  return model, tx, tx.init(nnx.state(model, nnx.Param))


def _snapshot(model, opt_state):
  """Copies of every model Variable and of the optimizer state (kept through donation)."""
  return jax.tree.map(jnp.copy, (nnx.state(model), opt_state))


def _nnx_jit_run(recipe, batches, inner=None):
  model, tx, opt_state = _setup(recipe, inner)
  step = nnx.jit(mp.train_step, static_argnums=(1, 3))
  losses, skipped = [], []
  for x, y in batches:
    loss, new = step(model, tx, opt_state, loss_fn, x, y)
    skipped.append(bool(mp.optim.step_skipped(opt_state, new)))
    losses.append(np.asarray(loss))
    opt_state = new
  return losses, skipped, _snapshot(model, opt_state)


def _fast_run(recipe, batches, inner=None, donate=True):
  model, tx, opt_state = _setup(recipe, inner)
  step = mp.jit_train_step(model, tx, loss_fn, donate=donate)
  losses, skipped = [], []
  for x, y in batches:
    # Read before the call: the call donates (deletes) the state passed in.
    count = int(mp.optim.optimizer_metrics(opt_state)["skipped_steps"])
    loss, opt_state = step(opt_state, x, y)
    skipped.append(int(mp.optim.optimizer_metrics(opt_state)["skipped_steps"]) > count)
    losses.append(np.asarray(loss))
  return losses, skipped, _snapshot(model, opt_state), model


@pytest.mark.parametrize("recipe,nan_at", [
    ("bf16_master", ()), ("f16_mixed", (1,)), ("bf16_sr", ()), ("fp8_hybrid", (2,))],
    ids=["bf16_master", "f16_mixed-skip", "bf16_sr", "fp8_hybrid-skip"])
def test_bit_identical_to_the_nnx_jit_step(recipe, nan_at):
  batches = _batches(4, nan_at)
  want_losses, want_skipped, want = _nnx_jit_run(recipe, batches)
  got_losses, got_skipped, got, model = _fast_run(recipe, batches)
  assert got_skipped == want_skipped == [t in nan_at for t in range(4)]
  assert_bit_identical(got_losses, want_losses, "losses")
  assert_bit_identical(got, want, "model state and optimizer state")
  # The steps did train: params, batch statistics and the RNG counter all moved.
  fresh = _setup(recipe)[0]
  for kind in (nnx.Param, nnx.BatchStat, nnx.RngCount):
    assert not bit_identical(jax.tree.map(jnp.copy, nnx.state(model, kind)),
                             jax.tree.map(jnp.copy, nnx.state(fresh, kind))), kind


def test_spike_guard_gets_the_loss_and_skips_alike():
  recipe = mp.get_recipe("bf16_master").replace(
      name="bf16_master_sg", spike_guard=mp.SpikeGuardConfig(window=4, threshold=3.0,
                                                             min_history=3))
  batches = _batches(7)
  x, y = batches[5]
  batches[5] = (x, y * np.float32(1e3))            # a loss spike, finite
  want_losses, want_skipped, want = _nnx_jit_run(recipe, batches, optax.sgd(0.05))
  model, tx, opt_state = _setup(recipe, optax.sgd(0.05))
  step = mp.jit_train_step(model, tx, loss_fn)
  losses = []
  for x, y in batches:
    loss, opt_state = step(opt_state, x, y)
    losses.append(np.asarray(loss))
  assert want_skipped[5] and sum(want_skipped) == 1
  assert int(mp.optim.spike_metrics(opt_state)["spike_skipped_steps"]) == 1
  assert_bit_identical(losses, want_losses, "losses")
  assert_bit_identical(_snapshot(model, opt_state), want, "state")


def test_the_model_is_current_when_calls_and_steps_mix():
  """Eager calls (which advance the Dropout counter and the batch statistics) and an
  nnx.update between steps: the next step starts from what they left, as nnx.jit's."""
  batches = _batches(3)
  other = nnx.state(mp.flax.apply_recipe(Net(nnx.Rngs(1)), "bf16_master"))
  results = []
  for fast in (False, True):
    model, tx, opt_state = _setup("bf16_master")
    if fast:
      step = mp.jit_train_step(model, tx, loss_fn)
    else:
      jitted = nnx.jit(mp.train_step, static_argnums=(1, 3))
      step = lambda o, x, y: jitted(model, tx, o, loss_fn, x, y)  # noqa: E731
    outs = []
    for t, (x, y) in enumerate(batches):
      loss, opt_state = step(opt_state, x, y)
      outs.append((np.asarray(loss), np.asarray(model(x))))  # eager: counter, stats move
      if t == 0:                     # another model's arrays, as a restore would write
        nnx.update(model, jax.tree.map(jnp.copy, other))
    model.eval()
    outs.append(np.asarray(model(batches[0][0])))
    results.append((outs, _snapshot(model, opt_state)))
  # nnx.jit reads the model at every call; a step that kept arrays of its own would have
  # trained on past the other model's arrays and differ here.
  assert_bit_identical(results[1], results[0])


def _aliased_setup():
  """Adam's two moments one array each, as optimizer inits may give, a moment holding a
  param's own array (as an f32 master copy of f32 params would: ``astype`` to the same
  dtype returns its input), and two Variables of the model holding one array: each
  buffer may be donated only once."""
  model, tx, opt_state = _setup("fp32", optax.adam(1e-2))
  adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
  opt_state = jax.tree.map(lambda s: s._replace(nu=s.mu) if adam(s) else s, opt_state,
                           is_leaf=adam)
  moments = [s for s in jax.tree.leaves(opt_state, is_leaf=adam) if adam(s)]
  moments[0].mu["hidden"]["bias"].set_raw_value(model.hidden.bias.get_raw_value())  # zeros
  leaves = jax.tree.leaves(opt_state)
  assert len({id(x) for x in leaves}) < len(leaves)
  model.norm.bias.set_raw_value(model.norm.mean.get_raw_value())
  return model, tx, opt_state


def test_donation_keeps_the_model_usable_and_shared_buffers_work():
  batches = _batches(2)
  model, tx, opt_state = _aliased_setup()
  jitted = nnx.jit(mp.train_step, static_argnums=(1, 3))
  want_losses = []
  for x, y in batches:
    loss, opt_state = jitted(model, tx, opt_state, loss_fn, x, y)
    want_losses.append(np.asarray(loss))
  want = _snapshot(model, opt_state)

  model, tx, opt_state = _aliased_setup()
  kernel = model.hidden.kernel.get_raw_value()
  opt_in = [x for x in jax.tree.leaves(opt_state) if isinstance(x, jax.Array)]
  step = mp.jit_train_step(model, tx, loss_fn)
  losses = []
  for x, y in batches:
    loss, opt_state = step(opt_state, x, y)
    losses.append(np.asarray(loss))
  assert kernel.is_deleted()                       # the model's old array was donated
  assert all(leaf.is_deleted() for leaf in opt_in if leaf.size > 1)
  # The model holds the new arrays: the nnx.jit step's bit for bit, and callable.
  assert_bit_identical(losses, want_losses, "losses")
  assert_bit_identical(_snapshot(model, opt_state), want, "state")
  assert np.all(np.isfinite(np.asarray(model(batches[0][0]))))


def test_without_donation_the_inputs_survive():
  model, tx, opt_state = _setup("bf16_master")
  kernel = model.hidden.kernel.get_raw_value()
  step = mp.jit_train_step(model, tx, loss_fn, donate=False)
  (x, y), = _batches(1)
  before = jax.tree.map(jnp.copy, opt_state)
  step(opt_state, x, y)
  assert not kernel.is_deleted()
  assert_bit_identical(jax.tree.map(jnp.copy, opt_state), before)
  assert not bit_identical(np.asarray(model.hidden.kernel.get_raw_value()), np.asarray(kernel))


def test_the_step_keeps_the_mode_it_was_built_with():
  """Like nnx.cached_partial: model.eval() after the step is built does not reach it."""
  batches = _batches(2)
  want_losses, _, want = _nnx_jit_run("bf16_master", batches)
  model, tx, opt_state = _setup("bf16_master")
  step = mp.jit_train_step(model, tx, loss_fn)
  model.eval()
  losses = []
  for x, y in batches:
    loss, opt_state = step(opt_state, x, y)
    losses.append(np.asarray(loss))
  model.train()
  assert_bit_identical(losses, want_losses)
  assert_bit_identical(_snapshot(model, opt_state), want)


def test_telemetry_record_matches_the_nnx_jit_probe():
  (x, y), = _batches(1)
  model, tx, opt_state = _setup("bf16_master")
  probe = nnx.jit(functools.partial(mp.train_step, telemetry=True), static_argnums=(1, 3))
  want = probe(model, tx, opt_state, loss_fn, x, y)
  model, tx, opt_state = _setup("bf16_master")
  got = mp.jit_train_step(model, tx, loss_fn, telemetry=True)(opt_state, x, y)
  assert len(got) == 3
  assert_bit_identical(jax.tree.map(jnp.copy, got), jax.tree.map(jnp.copy, want))


def test_bad_arguments():
  model, tx, opt_state = _setup("fp32")
  with pytest.raises(ValueError, match="model is a State; accepted: an nnx.Module"):
    mp.jit_train_step(nnx.state(model, nnx.Param), tx, loss_fn)
  with pytest.raises(ValueError, match="tx='adam'; accepted: an optax.GradientTransformation"):
    mp.jit_train_step(model, "adam", loss_fn)
  with pytest.raises(ValueError, match="loss_fn=3; accepted: a function"):
    mp.jit_train_step(model, tx, 3)
  with pytest.raises(ValueError, match="donate=1; accepted: True or False"):
    mp.jit_train_step(model, tx, loss_fn, donate=1)
  with pytest.raises(ValueError, match="telemetry='yes'; accepted: True or False"):
    mp.jit_train_step(model, tx, loss_fn, telemetry="yes")
  step = mp.jit_train_step(model, tx, loss_fn)
  (x, y), = _batches(1)
  with pytest.raises(ValueError, match=r"first argument; accepted: step\(opt_state, \*batch\)"):
    step(model, tx, opt_state, loss_fn, x, y)
  holder = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  holder.extra = nnx.Variable({"a": jnp.ones(2), "b": jnp.ones(2)})
  with pytest.raises(ValueError, match="Variable at 'extra' holds a dict; accepted: "
                                       "Variables holding one array each"):
    mp.jit_train_step(holder, tx, loss_fn)

  def grows(model, x, y):
    model.grown = nnx.BatchStat(jnp.zeros((), jnp.float32))
    return loss_fn(model, x, y)

  with pytest.raises(ValueError, match="changed the model's structure"):
    mp.jit_train_step(model, tx, grows)(opt_state, x, y)
