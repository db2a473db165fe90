"""precision.optim: state dtypes, memory ledger, moment dtypes, f32 norms, non-finite guard,
scaled_value_and_grad, master_params, sharded (axis_name) guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import precision
from precision import optim as po


def _params(dtype, n=(64, 512)):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, n, jnp.float32).astype(dtype),
          "b": jax.random.normal(k2, (n[1],), jnp.float32).astype(dtype)}


def _nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", list(precision.PRESETS))
def test_state_dtypes_stable_and_ledger_matches(name):
  recipe = precision.PRESETS[name]
  params = _params(recipe.policy.param_dtype)
  tx = po.build_optimizer(recipe, optax.adamw(1e-3))
  state = tx.init(params)

  @jax.jit
  def step(p, s):
    scale = po.loss_scale_of(s)
    g = jax.grad(lambda q: jnp.sum(jnp.square(q["w"].astype(jnp.float32))) * scale
                 + jnp.sum(q["b"].astype(jnp.float32)) * scale)(p)
    u, s = tx.update(g, s, p)
    return po.apply_updates(p, u), s, g

  dtypes0 = (po._tree.dtype_of(params), po._tree.dtype_of(state))
  p, s = params, state
  for _ in range(3):
    p, s, g = step(p, s)
    assert (po._tree.dtype_of(p), po._tree.dtype_of(s)) == dtypes0
    assert jax.tree.structure(s) == jax.tree.structure(state)
  n = sum(x.size for x in jax.tree.leaves(params))
  measured = (_nbytes(p) + _nbytes(g) + _nbytes(s)) / n
  assert abs(measured - po.bytes_per_param(recipe)) <= 0.01 * po.bytes_per_param(recipe), (
      measured, po.memory_ledger(recipe))


def test_ledger_values():
  got = {name: po.bytes_per_param(name) for name in precision.PRESETS}
  assert got == {"fp32": 16.0, "bf16_mixed": 16.0, "bf16_master": 16.0, "bf16_sr": 12.0,
                 "bf16_kahan": 14.0, "pure_bf16": 8.0, "f16_mixed": 16.0, "fp8_hybrid": 16.0,
                 "mxfp8": 16.0, "nvfp4": 16.0}
  assert po.bytes_per_param("bf16_master", inner="sgd") == 8.0
  with pytest.raises(ValueError, match="accepted"):
    po.bytes_per_param("fp32", inner="adagrad")


def test_moment_dtypes_separate_and_f32_is_identity():
  params = _params(jnp.float32, (4, 8))
  grads = jax.tree.map(lambda x: 0.3 * x, params)
  tx = po.moment_dtypes(optax.adamw(1e-2), mu_dtype=jnp.bfloat16, nu_dtype=jnp.float16)
  state = tx.init(params)
  _, state = jax.jit(tx.update)(grads, state, params)
  adam = state[0]
  assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float16)}
  assert adam.count.dtype == jnp.int32
  same = po.moment_dtypes(optax.adamw(1e-2))
  s1, s2 = same.init(params), None
  u1, s1 = same.update(grads, s1, params)
  with jax.numpy_dtype_promotion("standard"):
    ref = optax.adamw(1e-2)
    s2 = ref.init(params)
    u2, s2 = ref.update(grads, s2, params)
  for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adam_eps_added_in_f32_with_f16_moments():
  """optax computes Adam in the moments' dtype: eps=1e-8 is 0 in f16, so a zero gradient
  gives 0/0 = NaN (optax PR 1755). Here the update runs in f32: 0 / (0 + 1e-8) = 0."""
  params = {"w": jnp.ones((4,), jnp.float16)}
  grads = {"w": jnp.zeros((4,), jnp.float16)}
  tx = po.f32_update(po.moment_dtypes(optax.adam(1e-3, eps=1e-8), jnp.float16, jnp.float16))
  state = tx.init(params)
  u, state = tx.update(grads, state, params)
  assert u["w"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(u["w"]), 0.0)
  grads = {"w": jnp.full((4,), 1e-4, jnp.float16)}  # g**2 = 1e-8 underflows f16's nu to 0
  u, state = tx.update(grads, state, params)
  assert np.all(np.isfinite(np.asarray(u["w"])))
  assert float(jnp.max(jnp.abs(u["w"]))) < 1.0


def test_global_norm_and_clip_in_f32():
  g16 = {"a": jnp.full((16,), 300.0, jnp.float16), "b": jnp.full((4,), -2.0, jnp.float16)}
  want = np.sqrt(16 * 300.0 ** 2 + 4 * 4.0)
  assert float(po.global_norm(g16)) == pytest.approx(want, rel=1e-6)  # f16 sum would be inf
  clipped, _ = po.clip_by_global_norm(1.0).update(g16, optax.EmptyState())
  assert clipped["a"].dtype == jnp.float16
  assert float(po.global_norm(clipped)) == pytest.approx(1.0, rel=2e-3)
  g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g16)
  ours, _ = po.clip_by_global_norm(10.0).update(g32, optax.EmptyState())
  with jax.numpy_dtype_promotion("standard"):
    ref, _ = optax.clip_by_global_norm(10.0).update(g32, optax.EmptyState())
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  small, _ = po.clip_by_global_norm(1e6).update(g16, optax.EmptyState())
  np.testing.assert_array_equal(np.asarray(small["a"]), np.asarray(g16["a"]))
  with pytest.raises(ValueError, match="max_norm"):
    po.clip_by_global_norm(0.0)


def test_skip_nonfinite_counts_and_host_check_raises():
  params = {"w": jnp.ones((3,), jnp.float32)}
  tx = po.skip_nonfinite(optax.sgd(0.1))
  state = tx.init(params)
  update = jax.jit(tx.update)
  seq = [1.0, np.nan, np.inf, 1.0, np.nan, np.nan, np.nan]
  for i, v in enumerate(seq):
    u, state = update({"w": jnp.full((3,), v, jnp.float32)}, state, params)
    new = po.apply_updates(params, u)
    assert bool(po._tree.all_finite(new))
    params = new
    if i == 5:
      assert po.check_nonfinite_streak(state, max_consecutive=3) == 2
  m = po.optimizer_metrics(state)
  assert int(m["nonfinite_steps"]) == 5 and int(m["skipped_steps"]) == 5
  assert int(m["consecutive_nonfinite"]) == 3 and int(m["consecutive_finite"]) == 0
  with pytest.raises(po.NonFiniteStreakError, match="3 consecutive"):
    po.check_nonfinite_streak(state, max_consecutive=3)
  counting = po.skip_nonfinite(optax.sgd(0.1), skip=False)
  s = counting.init(params)
  u, s = counting.update({"w": jnp.full((3,), np.nan, jnp.float32)}, s, params)
  assert int(s.skipped_steps) == 0 and int(s.nonfinite_steps) == 1
  assert np.isnan(np.asarray(u["w"])).all()


def test_scaled_value_and_grad():
  """The deprecated alias of precision.value_and_grad(loss_fn, opt_state) still works."""
  params = {"w": jnp.asarray([1.0, -2.0], jnp.float32)}
  tx = po.loss_scaling(optax.sgd(1.0), po.StaticLossScale(1024.0))
  state = tx.init(params)
  loss_fn = lambda p, c: jnp.sum(jnp.square(p["w"])) * c
  loss, grads = po.scaled_value_and_grad(loss_fn)(state, params, jnp.float32(0.5))
  assert float(loss) == 2.5
  np.testing.assert_array_equal(np.asarray(grads["w"]), [1024.0, -2048.0])
  (loss, aux), _ = po.scaled_value_and_grad(lambda p: (loss_fn(p, 1.0), 7), has_aux=True)(
      state, params)
  assert float(loss) == 5.0 and aux == 7
  u, state = tx.update(grads, state, params)
  np.testing.assert_array_equal(np.asarray(u["w"]), [-1.0, 2.0])  # unscaled


@pytest.mark.parametrize("name", ["fp32", "bf16_master", "bf16_sr", "bf16_kahan"])
def test_master_params(name):
  recipe = precision.PRESETS[name]
  params = _params(recipe.policy.param_dtype, (4, 8))
  tx = po.build_optimizer(recipe, optax.sgd(1e-3))
  state = tx.init(params)
  u, state = tx.update(jax.tree.map(lambda x: x.astype(jnp.float32), params), state, params)
  params = po.apply_updates(params, u)
  master = po.master_params(state, params)
  assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
  if recipe.master_dtype is not None:
    assert master is po._query.find_state(state, po.MasterState).master
  else:
    for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(m), np.asarray(p.astype(jnp.float32)))


def test_axis_name_guard_agrees_across_shards():
  """Inside shard_map on 8 shards, an inf in one shard makes every rank skip, and the grad
  norm is the norm of the whole (unsharded) gradient."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
  tx = po.build_optimizer("f16_mixed", optax.sgd(0.1), axis_name="d")
  params = jnp.arange(64, dtype=jnp.float32)
  state = jax.jit(tx.init)(params)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return po.apply_updates(p, u), s.skipped_steps[None], s.grad_norm[None]

  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), P(), P("d")),
                                  out_specs=(P("d"), P("d"), P("d"))))
  scale = float(po.loss_scale_of(state))
  g = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32) * scale
  p1, skipped, norm = sharded(params, state, g)
  np.testing.assert_allclose(np.asarray(norm), np.linalg.norm(np.asarray(g) / scale), rtol=1e-6)
  assert np.all(np.asarray(skipped) == 0)
  p2, skipped, _ = sharded(params, state, g.at[5].set(jnp.inf))
  assert np.all(np.asarray(skipped) == 1)
  np.testing.assert_array_equal(np.asarray(p2), np.asarray(params))
  assert not np.array_equal(np.asarray(p1), np.asarray(params))


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="accepted: nearest, stochastic"):
    po.master_weights(optax.sgd(1.0), rounding="up")
  with pytest.raises(ValueError, match="f32 master"):
    po.master_weights(optax.sgd(1.0), master_dtype=jnp.float16, rounding="stochastic")
  with pytest.raises(ValueError, match="bf16"):
    po.remainder_master_weights(optax.sgd(1.0)).init({"w": jnp.ones((2,), jnp.float32)})
  with pytest.raises(ValueError, match="needs params"):
    tx = po.master_weights(optax.sgd(1.0))
    tx.update({"w": jnp.ones((2,))}, tx.init({"w": jnp.ones((2,), jnp.bfloat16)}))
  with pytest.raises(ValueError, match="Unknown recipe"):
    po.build_optimizer("bf17", optax.sgd(1.0))
  with pytest.raises(ValueError, match="max_consecutive"):
    po.check_nonfinite_streak(None, 0)
