"""The optimizer guard skips a step whose LOSS is inf/NaN even when its gradients are
finite (issue 27 item 5), and changes no bit of a finite step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision as mp
import precision.optim  # noqa: F401
from _asserts import bit_identical


def _loss(params, bad):
  """A finite-gradient loss with an inf term under stop_gradient when `bad`."""
  base = jnp.sum(params["w"].astype(jnp.float32) ** 2)
  return base + jax.lax.stop_gradient(jnp.where(bad, jnp.inf, 0.0).astype(jnp.float32))


@pytest.mark.parametrize("recipe", ["fp32", "f16_mixed", "bf16_master"])
def test_update_with_a_nonfinite_value_is_skipped(recipe):
  rc = mp.get_recipe(recipe)
  tx = mp.optim.build_optimizer(rc, optax.adam(1e-2))
  params = rc.policy.cast_to_param({"w": jnp.arange(6.0).reshape(2, 3)})
  opt = tx.init(params)
  scale = mp.optim.loss_scale_of(opt)
  grads = jax.grad(lambda p: _loss(p, False) * scale)(params)
  update = jax.jit(lambda g, o, p, v: tx.update(g, o, p, value=v))
  # A finite loss: bit for bit the update without the value.
  u_plain, o_plain = jax.jit(tx.update)(grads, opt, params)
  mp.optim.loss_scale_of(opt)
  u_val, o_val = update(grads, opt, params, jnp.float32(3.0))
  assert bit_identical(u_plain, u_val) and bit_identical(o_plain, o_val)
  # An inf or NaN loss with the same finite grads: skipped, params and state kept.
  for bad in (jnp.inf, jnp.nan):
    mp.optim.loss_scale_of(opt)
    u, o = update(grads, opt, params, jnp.float32(bad))
    new_params = mp.optim.apply_updates(params, u)
    assert bit_identical(new_params, params)
    m = mp.optim.optimizer_metrics(o)
    assert int(m["skipped_steps"]) == 1 and int(m["nonfinite_steps"]) == 1
    assert bool(mp.optim.step_skipped(opt, o))


def test_loss_guard_makes_grads_nonfinite_only_when_the_loss_is():
  params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)}
  plain = jax.jit(jax.value_and_grad(lambda p: _loss(p, False)))
  guarded = jax.jit(jax.value_and_grad(
      lambda p, bad: mp.optim.nonfinite_loss_guard(_loss(p, bad))))
  assert bit_identical(plain(params), guarded(params, False))
  loss, grads = guarded(params, True)
  assert np.isinf(loss) and np.all(np.isnan(grads["w"]))
  # Without the guard the same loss has finite gradients: the step would be applied.
  assert np.all(np.isfinite(jax.grad(lambda p: _loss(p, True))(params)["w"]))


def test_training_step_skips_an_inf_loss_with_finite_grads(monkeypatch):
  from experiments import data as data_lib
  from experiments import trainlib
  real = trainlib.gpt_lib.loss_fn
  flag = {"bad": False}

  def loss_fn(model, tokens):  # inf at trace time when asked; gradients stay finite
    extra = jnp.inf if flag["bad"] else 0.0
    return real(model, tokens) + jax.lax.stop_gradient(jnp.float32(extra))

  monkeypatch.setattr(trainlib.gpt_lib, "loss_fn", loss_fn)
  cfg = trainlib.TrainConfig(recipe="fp32", model="tiny", steps=4, batch=2, seq=16,
                             warmup=1, progress=False)
  corpus = data_lib.load_corpus()
  tokens, _ = data_lib.sample_batch(corpus.train, data_lib.init_sampler(0), 2, 16)
  flag["bad"] = True
  run, state = trainlib.init_state(cfg)
  compiled = trainlib.compile_step(run, state, tokens)
  state, metrics = trainlib.step_once(compiled, state, tokens)
  assert not np.isfinite(metrics["loss"])
  assert metrics["skipped_steps"] == 1 and metrics["nonfinite_steps"] == 1
  assert bit_identical(state.params, trainlib.init_state(cfg)[1].params)  # not applied
