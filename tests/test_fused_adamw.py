"""Fused AdamW + stochastic rounding: the XLA reference and the Pallas kernel (interpret
mode) are bit-identical to each other and, over 20 steps, to the unfused path built from
precision.optim around optax.adamw."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp
from precision import checkpoint
from _asserts import assert_allclose
from _asserts import assert_bit_identical
from _asserts import bit_identical
from _asserts import bits
from precision.rounding import FusedAdamW
from precision.rounding import FusedAdamWState
from precision.rounding import llmc_decay_mask

STEPS = 20
SEED = 3
WD = 0.1
BLOCK = 256


def _params():
  rng = np.random.default_rng(0)
  return {
      "emb": jnp.asarray(rng.standard_normal((33, 16)), jnp.bfloat16),  # 528: partial block
      "w": jnp.asarray(rng.standard_normal((16, 8, 3)) * 0.02, jnp.bfloat16),
      "b": jnp.asarray(rng.standard_normal((17,)), jnp.bfloat16),  # vector: no decay
      "h": jnp.asarray(rng.standard_normal((5, 7)), jnp.float16),  # an f16 leaf
      "gain": jnp.asarray(1.5, jnp.bfloat16),  # scalar leaf
  }


def _grads(params, steps):
  rng = np.random.default_rng(1)
  return [jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-5, 0), p.dtype),
      params) for _ in range(steps)]


def _adam_state(opt_state):
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(
      s, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
  assert len(found) == 1
  return found[0]


@pytest.fixture(scope="module")
def params():
  return _params()


@pytest.fixture(scope="module")
def grads(params):
  return _grads(params, STEPS)


CASES = {
    # bf16_sr: no master, params rounded stochastically straight from f32(p) + u.
    "no_master": dict(
        unfused=lambda params: mp.optim.build_optimizer(
            mp.get_recipe("bf16_sr"),
            optax.adamw(3e-3, weight_decay=WD, mask=llmc_decay_mask(params)), seed=SEED),
        fused=dict(learning_rate=3e-3, weight_decay=WD, keep_master=False)),
    # f32 master rounded stochastically into the params.
    "master": dict(
        unfused=lambda params: mp.optim.master_weights(
            optax.adamw(1e-2, weight_decay=WD, mask=llmc_decay_mask(params)),
            rounding="stochastic", seed=SEED),
        fused=dict(learning_rate=1e-2, weight_decay=WD, keep_master=True)),
    # The same with a learning-rate schedule (a runtime step size).
    "master_schedule": dict(
        unfused=lambda params: mp.optim.master_weights(
            optax.adamw(optax.linear_schedule(1e-2, 1e-3, STEPS), weight_decay=WD,
                        mask=llmc_decay_mask(params)),
            rounding="stochastic", seed=SEED),
        fused=dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, STEPS), weight_decay=WD,
                   keep_master=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_matches_unfused_over_20_steps(case, params, grads):
  tx = CASES[case]["unfused"](params)
  # Default mask (None) is llm.c's rule; the unfused optax.adamw gets it explicitly.
  xla = FusedAdamW(seed=SEED, impl="xla", **CASES[case]["fused"])
  pallas = FusedAdamW(seed=SEED, impl="pallas", block_size=BLOCK, **CASES[case]["fused"])

  @jax.jit
  def unfused_step(p, s, g):
    u, s = tx.update(g, s, p)
    return mp.optim.apply_updates(p, u), s

  def fused_step(opt):
    return jax.jit(lambda p, s, g: opt.update(g, s, p))

  xla_step, pallas_step = fused_step(xla), fused_step(pallas)
  p_u = p_x = p_p = params
  s_u, s_x, s_p = tx.init(params), xla.init(params), pallas.init(params)
  for g in grads:
    p_u, s_u = unfused_step(p_u, s_u, g)
    p_x, s_x = xla_step(p_x, s_x, g)
    p_p, s_p = pallas_step(p_p, s_p, g)
    assert_bit_identical(p_x, p_u)
    if case == "no_master":
      assert_bit_identical(p_p, p_x)
  if case == "no_master":
    assert_bit_identical(s_p, s_x)
  else:
    # Known limitation: XLA CPU contracts a*b + c into FMAs depending on how it fuses a
    # program, and the interpret-mode kernel (a while loop over blocks) fuses differently
    # from the reference: with an f32 master a few masters differ by f32 ulps, flipping a
    # few stochastic roundings. Bounded here; bit-identity holds without a master.
    assert_allclose(s_p.master, s_x.master, rtol=1e-4, atol=1e-7)
    flipped = [np.mean(bits(a) != bits(b)) for a, b in zip(jax.tree.leaves(p_p),
                                                              jax.tree.leaves(p_x))]
    assert max(flipped) < 0.05, flipped
  adam = _adam_state(s_u)
  assert_bit_identical((s_x.mu, s_x.nu), (adam.mu, adam.nu))
  assert int(s_x.count) == int(adam.count) == STEPS
  if s_x.master is not None:
    assert_bit_identical(s_x.master, s_u.master)
  # The params moved, and stochastically: not what nearest rounding of the master gives.
  assert not bit_identical(p_x, params)


def test_pallas_in_place_outputs_keep_dtypes(params, grads):
  opt = FusedAdamW(1e-3, impl="pallas", block_size=256, keep_master=True)
  state = opt.init(params)
  new_params, new_state = jax.jit(opt.update)(grads[0], state, params)
  assert jax.tree.map(lambda a: a.dtype, new_params) == jax.tree.map(lambda a: a.dtype, params)
  assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, state)
  assert new_state.count.dtype == jnp.int32


def test_weight_decay_mask_llmc_default_and_custom(params):
  zero = jax.tree.map(jnp.zeros_like, params)
  # Zero grads: Adam's update is 0, only decoupled weight decay moves a weight.
  default = FusedAdamW(0.1, weight_decay=0.5, impl="xla")
  p1, _ = jax.jit(default.update)(zero, default.init(params), params)
  for name in ("b", "gain"):  # vectors and scalars: no decay, bit-identical
    assert_bit_identical(p1[name], params[name])
  for name in ("emb", "w", "h"):  # matrices / embeddings shrink by 5% in expectation
    ratio = float(jnp.sum(jnp.abs(p1[name].astype(jnp.float32))) /
                  jnp.sum(jnp.abs(params[name].astype(jnp.float32))))
    assert 0.93 < ratio < 0.97, (name, ratio)
  everything = FusedAdamW(0.1, weight_decay=0.5, impl="xla",
                          mask=lambda p: jax.tree.map(lambda _: True, p))
  p2, _ = jax.jit(everything.update)(zero, everything.init(params), params)
  assert not bit_identical(p2["b"], params["b"])


def test_bad_arguments(params):
  with pytest.raises(ValueError, match="impl"):
    FusedAdamW(1e-3, impl="triton")
  with pytest.raises(ValueError, match="weight_decay"):
    FusedAdamW(1e-3, weight_decay=lambda c: 0.1)
  with pytest.raises(ValueError, match="power of two"):
    FusedAdamW(1e-3, block_size=300)
  opt = FusedAdamW(1e-3)
  with pytest.raises(ValueError, match="16-bit params"):
    opt.init({"w": jnp.zeros((2, 2), jnp.float32)})
  state = opt.init(params)
  with pytest.raises(ValueError, match="keep_master"):
    FusedAdamW(1e-3, keep_master=True).update(params, state, params)
  bf16_moments = FusedAdamWState(state.count, jax.tree.map(
      lambda m: m.astype(jnp.bfloat16), state.mu), state.nu, None)
  with pytest.raises(ValueError, match="float32"):
    opt.update(params, bf16_moments, params)
  with pytest.raises(ValueError, match="mask"):
    FusedAdamW(1e-3, mask=jax.tree.map(lambda _: 1, params)).update(params, state, params)


# ---------------------------------------------------------------------------------------
# Through a recipe: `fused_adamw` selected by ``Recipe.fused``, inside the recipe's guard.
#
# The fused path and the unfused ``bf16_sr`` path draw the same random bits (leaf i at step
# t: leaf_seed(seed, i), counter t, flat index), so without a master they are bit-identical
# by construction, and the updates of both are the f32 deltas that apply_updates turns into
# exactly the rounded params.

FUSED_SR = mp.get_recipe("bf16_sr").replace(name="bf16_sr_fused", fused=True)
LR = 3e-3


class _MLP(nnx.Module):
  """8 -> 32 -> 4 with biases: matrices decay, biases do not (llm.c's rule)."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(8, 32, rngs=rngs)
    self.out = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.gelu(self.hidden(x)))


def _mlp_loss(model, x, y):
  return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))


def _fused_kwargs(impl):
  return dict(impl=impl, block_size=BLOCK) if impl == "pallas" else dict(impl=impl)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fused_recipe_train_step_bit_identical_to_bf16_sr(impl):
  """Five `precision.train_step`s of an NNX model: the fused recipe (Pallas kernel in
  interpret mode, or its XLA reference) and bf16_sr around optax.adamw end with the same
  params, moments and losses, bit for bit."""
  r = np.random.default_rng(0)
  x = jnp.asarray(r.normal(size=(64, 8)), jnp.float32)
  y = jnp.asarray(np.tanh(r.normal(size=(64, 4))), jnp.float32)
  step = nnx.jit(mp.train_step, static_argnums=(1, 3))

  def train(recipe, inner):
    model = mp.flax.apply_recipe(_MLP(nnx.Rngs(0)), recipe)
    tx = mp.optim.build_optimizer(recipe, inner, seed=SEED)
    opt_state = tx.init(nnx.state(model, nnx.Param))
    losses = []
    for _ in range(5):
      loss, opt_state = step(model, tx, opt_state, _mlp_loss, x, y)
      losses.append(loss)
    return nnx.state(model, nnx.Param), opt_state, losses

  params0 = nnx.state(mp.flax.apply_recipe(_MLP(nnx.Rngs(0)), "bf16_sr"), nnx.Param)
  p_f, s_f, l_f = train(FUSED_SR, mp.optim.fused_adamw(LR, weight_decay=WD,
                                                       **_fused_kwargs(impl)))
  p_u, s_u, l_u = train("bf16_sr", optax.adamw(LR, weight_decay=WD,
                                               mask=llmc_decay_mask(params0)))
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(p_f))
  assert_bit_identical(p_f, p_u)
  assert_bit_identical(l_f, l_u)
  fused = mp.optim._query.find_state(s_f, FusedAdamWState)
  adam = _adam_state(s_u)
  assert_bit_identical((fused.mu, fused.nu), (adam.mu, adam.nu))
  assert int(fused.count) == 5
  assert not bit_identical(p_f, params0)


def test_fused_recipe_updates_apply_to_the_kernels_params(params, grads):
  """tx.update + apply_updates of the fused recipe gives, each step, exactly the params
  (and state) of FusedAdamW.update itself: the f32 deltas lose nothing."""
  tx = mp.optim.build_optimizer(FUSED_SR, mp.optim.fused_adamw(LR, weight_decay=WD),
                                seed=SEED)
  ref = FusedAdamW(LR, weight_decay=WD, seed=SEED, impl="xla")
  update, ref_update = jax.jit(tx.update), jax.jit(lambda g, s, p: ref.update(g, s, p))
  p, s = params, tx.init(params)
  p_ref, s_ref = params, ref.init(params)
  for g in grads[:6]:
    u, s = update(g, s, p)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(u))
    p = mp.optim.apply_updates(p, u)
    p_ref, s_ref = ref_update(g, s_ref, p_ref)
    assert_bit_identical(p, p_ref)
    assert_bit_identical(s.inner_state, s_ref)


def test_fused_recipe_under_loss_scaling_bit_identical_to_unfused(params, grads):
  """f16 params with dynamic loss scaling and a non-finite step: the fused recipe and the
  same recipe unfused (optax.adamw) give the same params and moments, bit for bit, and
  the guard skips the non-finite step alike (params and fused state unchanged).

  The comparison is with the unfused recipe, not the bare FusedAdamW on unscaled grads:
  XLA CPU contracts AdamW's multiply-adds into FMAs depending on the program around
  them, and the guard's unscale changes that program (moments then differ by f32 ulps)."""
  recipe = mp.Recipe("f16_sr_fused", "p=f16,c=f16,o=f32", rounding="stochastic",
                     loss_scale=mp.LossScaleConfig(kind="dynamic", initial_scale=2.0 ** 4),
                     fused=True)
  fused = mp.optim.build_optimizer(recipe, mp.optim.fused_adamw(LR, weight_decay=WD),
                                   seed=SEED)
  unfused = mp.optim.build_optimizer(recipe.replace(fused=False), optax.adamw(
      LR, weight_decay=WD, mask=llmc_decay_mask(params)), seed=SEED)

  def run(tx):
    update = jax.jit(tx.update)
    p, s = params, tx.init(params)
    for t, g in enumerate(grads[:6]):
      scale = mp.optim.loss_scale_of(s)  # the grads of a loss multiplied by the scale
      g32 = jax.tree.map(lambda a: a.astype(jnp.float32) * scale, g)
      if t == 2:
        g32 = dict(g32, b=g32["b"].at[0].set(jnp.nan))
      old_p, old_s = p, s
      u, s = update(g32, s, p)
      p = mp.optim.apply_updates(p, u)
      assert bool(mp.optim.step_skipped(old_s, s)) == (t == 2)
      if t == 2:
        assert_bit_identical(p, old_p)
        assert_bit_identical(s.inner_state, old_s.inner_state)
    assert int(mp.optim.optimizer_metrics(s)["skipped_steps"]) == 1
    return p, s

  p_f, s_f = run(fused)
  p_u, s_u = run(unfused)
  assert_bit_identical(p_f, p_u)
  state = mp.optim._query.find_state(s_f, FusedAdamWState)
  adam = _adam_state(s_u)
  assert_bit_identical((state.mu, state.nu), (adam.mu, adam.nu))
  assert int(state.count) == int(adam.count) == 5


def test_fused_recipe_with_master_bit_identical_to_master_weights(params, grads):
  """A stochastic-rounding recipe with an f32 master, fused (XLA reference) and not:
  bit-identical params and masters; `master_params` reads the fused state's master."""
  base = mp.Recipe("bf16_sr_master", "p=bf16,c=bf16,o=f32", master_dtype="f32",
                   rounding="stochastic")
  fused = mp.optim.build_optimizer(base.replace(fused=True),
                                   mp.optim.fused_adamw(LR, weight_decay=WD, impl="xla"),
                                   seed=SEED)
  unfused = mp.optim.build_optimizer(
      base, optax.adamw(LR, weight_decay=WD, mask=llmc_decay_mask(params)), seed=SEED)

  def run(tx):
    p, s = params, tx.init(params)
    update = jax.jit(tx.update)
    for g in grads[:5]:
      u, s = update(g, s, p)
      p = mp.optim.apply_updates(p, u)
    return p, s

  p_f, s_f = run(fused)
  p_u, s_u = run(unfused)
  assert_bit_identical(p_f, p_u)
  assert_bit_identical(mp.optim.master_params(s_f, p_f), mp.optim.master_params(s_u, p_u))
  assert mp.optim._query.find_state(s_f, FusedAdamWState).master is not None


def test_fused_recipe_refuses_mismatched_optimizers(params):
  with pytest.raises(ValueError, match=r"fused=True.*inner=precision\.optim\.fused_adamw"):
    mp.optim.build_optimizer(FUSED_SR, optax.adamw(LR))
  with pytest.raises(ValueError, match=r"'bf16_sr' \(fused=False\)"):
    mp.optim.build_optimizer("bf16_sr", mp.optim.fused_adamw(LR))
  with pytest.raises(ValueError, match=r"fused_adamw\(seed=4\) but build_optimizer\(seed=3\)"):
    mp.optim.build_optimizer(FUSED_SR, mp.optim.fused_adamw(LR, seed=4), seed=3)
  with pytest.raises(ValueError, match=r"keep_master=True.*keeps no f32 master"):
    mp.optim.build_optimizer(FUSED_SR, mp.optim.fused_adamw(LR, keep_master=True))
  with pytest.raises(ValueError, match=r"axis_name='data'.*mask=None"):
    mp.optim.build_optimizer(FUSED_SR, mp.optim.fused_adamw(LR), axis_name="data")
  # Equal explicit values are accepted.
  tx = mp.optim.build_optimizer(FUSED_SR, mp.optim.fused_adamw(LR, seed=3), seed=3)
  assert isinstance(tx.init(params).inner_state, FusedAdamWState)
  f32 = {"w": jnp.zeros((2, 2), jnp.float32)}
  state = tx.init(f32)  # a state on f32 master values (checkpoint conversion) ...
  with pytest.raises(ValueError, match="16-bit params"):  # ... but no f32 params to update
    tx.update(f32, state, f32)
  with pytest.raises(ValueError, match=r"fused_adamw: a int32 leaf"):
    tx.init({"n": jnp.zeros((2,), jnp.int32)})


def test_checkpoint_of_another_recipe_restores_into_the_fused_recipe(tmp_path):
  """A bf16_master run's checkpoint restored into the fused recipe with an f32 master:
  params the master rounded to nearest, the fused state's master the saved master bit for
  bit (its moments start fresh: not an optax state), and training goes on."""
  saved_r = mp.get_recipe("bf16_master")
  fused_r = mp.Recipe("bf16_sr_master_fused", "p=bf16,c=bf16,o=f32", master_dtype="f32",
                      rounding="stochastic", fused=True)
  optimizer_for = {
      saved_r: lambda: mp.optim.build_optimizer(saved_r, optax.adamw(LR, weight_decay=WD)),
      fused_r: lambda: mp.optim.build_optimizer(
          fused_r, mp.optim.fused_adamw(LR, weight_decay=WD, impl="xla"), seed=SEED)}
  r = np.random.default_rng(4)
  p32 = {"w": jnp.asarray(r.normal(size=(8, 4)), jnp.float32),
         "b": jnp.asarray(r.normal(size=(4,)), jnp.float32)}
  params = saved_r.policy.cast_to_param(p32)
  tx = optimizer_for[saved_r]()
  opt = tx.init(params)
  for _ in range(3):
    u, opt = tx.update(jax.tree.map(lambda p: jnp.full_like(p, 0.1), params), opt, params)
    params = mp.optim.apply_updates(params, u)
  rng = jax.random.key_data(jax.random.key(0))
  checkpoint.save(tmp_path, 3, checkpoint.TrainState(params, opt, {}, rng), recipe=saved_r)
  master = mp.optim.master_params(opt, params)

  target_params = fused_r.policy.cast_to_param(p32)
  target = checkpoint.TrainState(target_params, optimizer_for[fused_r]().init(target_params),
                                 {}, rng)
  restored = checkpoint.restore(tmp_path, target, recipe=fused_r,
                                optimizer_for=lambda recipe: optimizer_for[recipe]())
  assert any("bf16_master -> bf16_sr_master_fused" in n for n in restored.converted)
  assert_bit_identical(restored.state.params, fused_r.policy.cast_to_param(master))
  assert_bit_identical(mp.optim.master_params(restored.state.opt_state,
                                              restored.state.params), master)
  tx = optimizer_for[fused_r]()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), restored.state.params)
  u, _ = tx.update(grads, restored.state.opt_state, restored.state.params)
  assert not bit_identical(mp.optim.apply_updates(restored.state.params, u),
                           restored.state.params)
