"""The one value_and_grad (`precision.value_and_grad`) and the one fp8 merge
(`precision.fp8.merge_grad_state`): each deprecated alias warns, naming its replacement,
and gives the same bits as the replacement call."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp

F32 = jnp.float32
DELAYED = mp.Fp8Config(scaling="delayed", amax_history_len=4)


def _same_bits(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert len(la) == len(lb) and la
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def _params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return [{"w": 0.3 * jax.random.normal(k1, (8, 16), F32), "b": jnp.zeros((16,), F32)},
          {"w": 0.3 * jax.random.normal(k2, (16, 4), F32), "b": jnp.zeros((4,), F32)}]


def _data(seed=1):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (6, 8), F32), jax.random.normal(ky, (6, 4), F32)


def mlp_loss(params, x, y):
  h = x
  for i, p in enumerate(params):
    h = h @ p["w"] + p["b"][None, :]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return jnp.mean((h - y) ** 2)


def _f16_opt_state(params, scale=2.0 ** 10):
  tx = mp.optim.loss_scaling(optax.sgd(0.1), mp.StaticLossScale(scale))
  return tx.init(params)


def _fp8_model(seed=0):
  model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(seed)),
                         nnx.Linear(16, 4, rngs=nnx.Rngs(seed + 1)))
  return mp.fp8.apply_fp8(model, DELAYED)


def _model_loss(model, x, y):
  return jnp.mean((model(x).astype(F32) - y) ** 2)


def test_scaled_value_and_grad_alias_same_bits():
  params, (x, y) = _params(), _data()
  opt_state = _f16_opt_state(params)
  bf16_loss = lambda p, x, y: mlp_loss(p, x, y).astype(jnp.bfloat16)  # returned as bf16
  with pytest.warns(DeprecationWarning, match=r"precision\.value_and_grad\(loss_fn, opt_state\)"):
    old = mp.optim.scaled_value_and_grad(bf16_loss)
  loss_old, g_old = jax.jit(old)(opt_state, params, x, y)
  loss_new, g_new = jax.jit(mp.value_and_grad(bf16_loss, opt_state))(params, x, y)
  _same_bits(g_old, g_new)
  assert loss_old.dtype == jnp.bfloat16 and loss_new.dtype == F32  # the same number
  assert float(loss_old) == float(loss_new)
  with_aux = lambda p, x, y: (mlp_loss(p, x, y), jnp.sum(x))
  with pytest.warns(DeprecationWarning):
    (l_a, aux_a), ga = mp.optim.scaled_value_and_grad(with_aux, has_aux=True)(
        opt_state, params, x, y)
  (l_b, aux_b), gb = mp.value_and_grad(with_aux, opt_state, has_aux=True)(params, x, y)
  _same_bits((l_a, aux_a, ga), (l_b, aux_b, gb))


def test_loss_scaling_scales_gradients_exactly():
  params, (x, y) = _params(), _data()
  _, plain = mp.value_and_grad(mlp_loss)(params, x, y)
  loss, scaled = mp.value_and_grad(mlp_loss, _f16_opt_state(params, 2.0 ** 12))(params, x, y)
  # A power-of-two scale of an f32 backward pass away from overflow/underflow is exact.
  _same_bits(scaled, jax.tree.map(lambda g: g * 2.0 ** 12, plain))
  assert loss.dtype == F32 and float(loss) == float(mlp_loss(params, x, y))


def test_fp8_value_and_grad_alias_same_bits():
  x, y = _data()
  a, b = _fp8_model(), _fp8_model()
  step_new = nnx.jit(lambda m, x, y: mp.value_and_grad(_model_loss)(m, x, y))
  with pytest.warns(DeprecationWarning, match=r"call precision\.value_and_grad\(fn\)"):
    vg_old = mp.fp8.value_and_grad(_model_loss)
  step_old = nnx.jit(lambda m, x, y: vg_old(m, x, y))
  for _ in range(2):  # the second step reads the gradient state the first one stored
    out_old, out_new = step_old(a, x, y), step_new(b, x, y)
    _same_bits(out_old, out_new)
    _same_bits(nnx.state(a, mp.fp8.Fp8State), nnx.state(b, mp.fp8.Fp8State))
  gs = nnx.state(b, mp.fp8.Fp8GradState)
  assert any(float(v[...].max()) > 0 for v in jax.tree.leaves(
      gs, is_leaf=lambda v: isinstance(v, nnx.Variable)))  # the grad state was stored


def test_nnx_value_and_grad_scaled_with_fp8_state():
  """The one call scales the loss AND carries the fp8 gradient state (the old fp8 helper
  did not scale): scaled gradients are 2**10 x the unscaled ones, fp8 state alike."""
  x, y = _data()
  a, b = _fp8_model(), _fp8_model()
  opt_state = _f16_opt_state(nnx.state(a, nnx.Param))
  _, g_plain = mp.value_and_grad(_model_loss)(a, x, y)
  _, g_scaled = mp.value_and_grad(_model_loss, opt_state)(b, x, y)
  for p, s in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_scaled)):
    np.testing.assert_allclose(np.asarray(s), np.asarray(p) * 2.0 ** 10, rtol=0.05, atol=1e-3)
  ga, gb = nnx.state(a, mp.fp8.Fp8GradState), nnx.state(b, mp.fp8.Fp8GradState)
  # The gradient operand's amax is 2**10 x larger under the scaled loss.
  amax = lambda s: max(float(np.max(np.asarray(v[...]))) for p, v in nnx.to_flat_state(s)
                       if p[-1] == "grad_amax_history")
  assert amax(gb) > 100 * amax(ga) > 0


def test_autocast_value_and_grad_alias_same_bits():
  params, (x, y) = _params(), _data()
  recipe = mp.Recipe("fp8_test", "p=f32,c=bf16,o=f32", fp8=mp.Fp8Config(
      scaling="delayed", amax_history_len=2, keep_first_last=False))
  with_aux = lambda p, x, y: (mlp_loss(p, x, y), jnp.sum(x))
  with pytest.warns(DeprecationWarning, match=r"precision\.autocast\(fn, recipe, fp8_state=True\)"):
    old = mp.fp8.autocast_value_and_grad(with_aux, recipe, argnums=(0, 1), has_aux=True)
  g = mp.autocast(with_aux, recipe, fp8_state=True)
  new = mp.value_and_grad(g, argnums=(0, 1), has_aux=True)
  state = g.init_state(params, x, y)
  assert state and old.init_state(params, x, y).keys() == state.keys()
  s_old = s_new = state
  for _ in range(2):
    (v_old, a_old), gr_old, s_old = jax.jit(old)(s_old, params, x, y)
    (v_new, a_new), gr_new, s_new = jax.jit(new)(s_new, params, x, y)
    _same_bits((v_old, a_old, gr_old, s_old), (v_new, a_new, gr_new, s_new))
  assert float(s_new[next(iter(s_new))].grad.amax_history[0]) > 0
  # With an optimizer state the explicit-state path scales the loss too.
  opt_state = _f16_opt_state(params)
  (v_s, _), (g_s, _), _ = mp.value_and_grad(g, opt_state, argnums=(0, 1), has_aux=True)(
      state, params, x, y)
  (v_u, _), (g_u, _), _ = new(state, params, x, y)
  assert float(v_s) == float(v_u)
  for s, u in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_u)):
    np.testing.assert_allclose(np.asarray(s), np.asarray(u) * 2.0 ** 10, rtol=0.05, atol=1e-3)


def test_merge_aliases_same_bits():
  params, (x, y) = _params(), _data()
  recipe = mp.Recipe("fp8_test", "p=f32,c=bf16,o=f32", fp8=mp.Fp8Config(
      scaling="delayed", amax_history_len=2, keep_first_last=False))
  g = mp.autocast(mlp_loss, recipe, fp8_state=True)
  state = g.init_state(params, x, y)
  (_, new), (_, cts) = jax.value_and_grad(g, (1, 0), has_aux=True)(state, params, x, y)
  with pytest.warns(DeprecationWarning, match="merge_grad_state"):
    old = mp.fp8.merge_state_grads(new, cts)
  _same_bits(old, mp.fp8.merge_grad_state(new, cts))
  with pytest.raises(ValueError, match="same keys"):
    mp.fp8.merge_grad_state(new, {k: cts[k] for k in list(cts)[:1]})

  # Linen: the fp8_grad_state collection.
  dg = functools.partial(mp.fp8.LinenFp8DotGeneral, config=DELAYED)
  dense = nn.Dense(4, dot_general_cls=dg)
  v = dense.init(jax.random.key(0), x)

  def loss(p, gstate):
    out, upd = dense.apply({**v, "params": p, mp.fp8.GRAD_COLLECTION: gstate}, x,
                           mutable=[mp.fp8.STATE_COLLECTION])
    return jnp.sum(out ** 2), upd

  _, (_, gg) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      v["params"], v[mp.fp8.GRAD_COLLECTION])
  with pytest.warns(DeprecationWarning, match="merge_grad_state"):
    old = mp.fp8.merge_fp8_grad_state(v[mp.fp8.GRAD_COLLECTION], gg)
  new_l = mp.fp8.merge_grad_state(v[mp.fp8.GRAD_COLLECTION], gg)
  _same_bits(old, new_l)
  assert any(float(np.max(np.asarray(l))) > 0 for l in jax.tree.leaves(new_l))

  # NNX: in place into a module (update_fp8_grad_state) vs the functional merge.
  a, b = _fp8_model(), _fp8_model()
  vg = nnx.value_and_grad(_model_loss, argnums=nnx.DiffState(
      0, nnx.Any(nnx.Param, mp.fp8.Fp8GradState)))
  _, grads_a = vg(a, x, y)
  _, grads_b = vg(b, x, y)
  with pytest.warns(DeprecationWarning, match="merge_grad_state"):
    rest = mp.fp8.update_fp8_grad_state(a, grads_a)
  nnx.update(b, mp.fp8.merge_grad_state(nnx.state(b, mp.fp8.Fp8GradState),
                                        nnx.filter_state(grads_b, mp.fp8.Fp8GradState)))
  _same_bits(nnx.state(a, mp.fp8.Fp8State), nnx.state(b, mp.fp8.Fp8State))
  _same_bits(rest, nnx.filter_state(grads_b, nnx.Not(mp.fp8.Fp8GradState)))
  with pytest.raises(ValueError, match="accepted"):
    mp.fp8.merge_grad_state([1, 2], [1, 2])


def test_bad_arguments_are_named():
  params, (x, y) = _params(), _data()
  with pytest.raises(ValueError, match=r"argnums=-1; accepted"):
    mp.value_and_grad(mlp_loss, argnums=-1)
  with pytest.raises(ValueError, match="argnums=1 with an nnx.Module"):
    mp.value_and_grad(_model_loss, argnums=1)(_fp8_model(), x, y)
  g = mp.autocast(mlp_loss, "fp8_hybrid", fp8_state=True)
  with pytest.raises(ValueError, match="fp8 state first"):
    mp.value_and_grad(g)()
  with pytest.raises(ValueError, match="telemetry=True.*argnums"):
    mp.value_and_grad(mlp_loss, telemetry=True, argnums=1)
