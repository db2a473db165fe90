"""The policy under explicit sharding and in data_parallel: same numbers as one device."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import precision as mp
import _zoo

F32 = jnp.float32
STEPS = 3


def _mesh(n: int):
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])


def _train(recipe: str, mesh) -> list[float]:
  """STEPS steps of the zoo's ShardedLM under `mesh`; the losses."""
  with jax.set_mesh(mesh), _zoo.user_code():
    model = _zoo.ShardedLM(rngs=nnx.Rngs(0))
    r = mp.get_recipe(recipe)
    mp.flax.apply_recipe(model, r)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = mp.optim.build_optimizer(r, optax.adam(1e-2))
    opt = tx.init(params)
    tokens = jax.device_put(_zoo._tokens(batch=8), NamedSharding(mesh, P("data", None)))

    @jax.jit
    def step(params, rest, opt, tokens):
      scale = mp.optim.loss_scale_of(opt)

      def scaled(m):
        logits = m(tokens[:, :-1])
        loss = _zoo._xent(logits.astype(F32), tokens[:, 1:])
        return loss * scale, loss

      m = nnx.merge(graphdef, params, rest, copy=True)
      (_, loss), grads = mp.value_and_grad(scaled, has_aux=True)(m)
      updates, opt = tx.update(grads, opt, params)
      return mp.optim.apply_updates(params, updates), nnx.state(m, nnx.Not(nnx.Param)), opt, loss

    losses = []
    for _ in range(STEPS):
      params, rest, opt, loss = step(params, rest, opt, tokens)
      losses.append(float(loss))
  return losses


@pytest.mark.parametrize("recipe", list(mp.PRESETS))
def test_sharded_model_trains_under_every_recipe(recipe):
  losses = _train(recipe, _mesh(2))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  if recipe == "fp32":
    # fp32, batch sharded over 2 devices: the one-device losses within 1e-6 (only the
    # order of the cross-device sums differs).
    np.testing.assert_allclose(losses, _train(recipe, _mesh(1)), rtol=1e-6)


class Captured(NamedTuple):
  grads: Any


def _capture() -> optax.GradientTransformation:
  """An optimizer that keeps the gradients it is given as its state (and moves nothing)."""
  init = lambda params: Captured(jax.tree.map(jnp.zeros_like, params))
  update = lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads),
                                               Captured(grads))
  return optax.GradientTransformation(init, update)


def _mlp_loss(params, batch):
  h = jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"][None, :])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel_gradients_keep_the_param_dtype(stage):
  """Each rank differentiates w.r.t. the f32 params under the recipe's autocast: the mean
  gradient equals one device's autocast gradient on the global batch within reduction
  order, f32 throughout (a gradient rounded to bf16 anywhere would miss by ~1e-3)."""
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], (16, 32)) / 4, "b1": jnp.full((32,), 0.1),
            "w2": jax.random.normal(k[1], (32, 4)) / 6}
  batch = {"x": jax.random.normal(k[2], (32, 16)), "y": jax.random.normal(k[3], (32, 4))}
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  dp = mp.parallel.data_parallel(_mlp_loss, _capture(), mesh, zero_stage=stage,
                                 recipe="bf16_mixed")
  state, _ = dp.step(dp.init(params), dp.shard_batch(batch))
  (captured,) = [x for x in jax.tree.leaves(state.opt_state,
                                            is_leaf=lambda x: isinstance(x, Captured))
                 if isinstance(x, Captured)]
  # Stage 3 moves the params in bf16: its gradients are those at the bf16-rounded params
  # (reduced in f32).
  at = params if stage < 3 else jax.tree.map(
      lambda x: x.astype(jnp.bfloat16).astype(F32), params)
  want = jax.grad(mp.autocast(_mlp_loss, "bf16_mixed"))(at, batch)
  for name, ref in want.items():
    got = np.asarray(captured.grads[name])
    # Stages 1-3 hold each leaf as the flat, zero-padded concatenation of the shards.
    got = got.reshape(-1)[:ref.size].reshape(ref.shape)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.asarray(ref), rtol=2e-5, atol=1e-7, err_msg=name)
    # Rounded to bf16, the same gradient would miss the tolerance: the test can fail.
    rounded = np.asarray(ref.astype(jnp.bfloat16).astype(F32))
    assert not np.allclose(rounded, np.asarray(ref), rtol=2e-5, atol=1e-7)
