"""precision.optim: master weights, apply_updates, remainders, swamping, build_optimizer."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import precision
from precision import optim as po
from precision.rounding import leaf_seed
from precision.rounding import stochastic_round
from _asserts import assert_bit_identical
from _asserts import bits


def _params(dtype=jnp.bfloat16, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, (16, 8), jnp.float32).astype(dtype),
          "b": (0.1 * jax.random.normal(k2, (8,), jnp.float32)).astype(dtype)}


def _grads(step, like):
  # Drawn with numpy, outside any jit: jax.random.normal's erf_inv polynomial may be
  # fused differently in two programs, which would make the grads, not the optimizers,
  # differ in the last bit.
  rng = np.random.default_rng(1000 + step)
  return {k: jnp.asarray(rng.standard_normal(like[k].shape), jnp.float32) for k in sorted(like)}


def _grad_seq(steps, like):
  seq = [_grads(t, like) for t in range(steps)]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *seq)


def _run(tx, params, steps):
  """`steps` jitted updates with f32 grads; returns (params, state)."""

  def body(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return (po.apply_updates(p, u), s), None

  @jax.jit
  def run(p, gs):
    (p, s), _ = jax.lax.scan(body, (p, tx.init(p)), gs)
    return p, s

  return run(params, _grad_seq(steps, params))


def _optax_reference(inner, params32, steps):
  """Plain optax on f32 params (standard promotion, as optax users run it)."""

  def body(carry, g):
    p, s = carry
    u, s = inner.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  @jax.jit
  def run(p, gs):
    with jax.numpy_dtype_promotion("standard"):
      (p, s), _ = jax.lax.scan(body, (p, inner.init(p)), gs)
    return p, s

  return run(params32, _grad_seq(steps, params32))


def test_master_50_adamw_steps_bit_identical_to_optax():
  inner = optax.adamw(1e-2, weight_decay=0.1)
  params = _params(jnp.bfloat16)
  p, state = _run(po.master_weights(inner), params, 50)
  ref, ref_state = _optax_reference(inner, precision.cast_floating(params, jnp.float32), 50)
  assert_bit_identical(state.master, ref)
  assert_bit_identical(state.inner_state, ref_state)
  assert_bit_identical(p, precision.cast_floating(ref, jnp.bfloat16))
  assert_bit_identical(po.master_params(state, p), ref)


def _eager(tx, params, steps, apply):
  state = tx.init(params)
  for g in (_grads(t, params) for t in range(steps)):
    u, state = tx.update(g, state, params)
    params = apply(params, u)
  return params, state


UNSCALED_F32_PARAMS = [n for n, r in precision.PRESETS.items()
                       if r.policy.param_dtype == np.float32 and r.loss_scale.kind == "none"]


@pytest.mark.parametrize("name", UNSCALED_F32_PARAMS)
def test_fp32_params_bit_identical_to_inner(name):
  """f32-param recipes without loss scaling add no arithmetic to `inner`'s update.

  Compared op by op (eager): inside one jit, XLA:CPU may evaluate adam's bias-correction
  power in a vectorised or a scalar loop depending on how the surrounding program fuses,
  which moves single elements by an ulp between ANY two different programs, so a jitted
  comparison is made with SGD-momentum (no transcendental) below.
  """
  recipe = precision.PRESETS[name]
  inner = optax.adamw(1e-2, weight_decay=0.1)
  params = _params(jnp.float32)
  p, state = _eager(po.build_optimizer(recipe, inner), params, 20, po.apply_updates)
  with jax.numpy_dtype_promotion("standard"):
    ref, ref_state = _eager(inner, params, 20, optax.apply_updates)
  assert_bit_identical(p, ref)
  assert_bit_identical(state.inner_state, ref_state)
  assert int(po.optimizer_metrics(state)["consecutive_finite"]) == 20


def test_fp32_recipe_jitted_bit_identical_sgd_momentum():
  inner = optax.sgd(1e-2, momentum=0.9, nesterov=True)
  params = _params(jnp.float32)
  p, state = _run(po.build_optimizer("fp32", inner), params, 30)
  ref, ref_state = _optax_reference(inner, params, 30)
  assert_bit_identical(p, ref)
  assert_bit_identical(state.inner_state, ref_state)


def test_stochastic_master_follows_rounding_convention():
  seed = 7
  tx = po.master_weights(optax.sgd(0.05), rounding="stochastic", seed=seed)
  params = _params(jnp.bfloat16)
  state = tx.init(params)
  for t in range(3):
    u, state = jax.jit(tx.update)(_grads(t, params), state, params)
    params = po.apply_updates(params, u)
    leaves = jax.tree.leaves(state.master)
    want = [stochastic_round(m, jnp.bfloat16, key=leaf_seed(seed, i), step=t)
            for i, m in enumerate(leaves)]
    assert_bit_identical(jax.tree.leaves(params), want)
  assert int(state.count) == 3


def test_apply_updates_matches_optax():
  p32, p16 = _params(jnp.float32), _params(jnp.bfloat16)
  u = _grads(3, p32)
  with jax.numpy_dtype_promotion("standard"):
    ref32 = optax.apply_updates(p32, u)
    ref16 = optax.apply_updates(p16, u)
  assert_bit_identical(po.apply_updates(p32, u), ref32)
  assert_bit_identical(po.apply_updates(p16, u), ref16)
  assert po.apply_updates({"a": None}, {"a": None}) == {"a": None}


@pytest.mark.parametrize("dtype,ratio_bits", [(jnp.bfloat16, 15), (jnp.float16, 12)])
def test_deltas_round_trip_exactly(dtype, ratio_bits):
  """apply_updates(old, deltas(new, old)) == new for |old| < 2**ratio_bits * |new|."""
  rng = np.random.default_rng(0)
  old = (rng.standard_normal(20000) * 2.0 ** rng.integers(-8, 8, 20000)).astype(np.float32)
  shrink = 2.0 ** rng.uniform(-ratio_bits + 0.01, 6, 20000)
  new = (old * shrink * rng.choice([-1, 1], 20000)).astype(np.float32)
  old, new = jnp.asarray(old).astype(dtype), jnp.asarray(new).astype(dtype)
  new = new.at[:10].set(0)
  got = po.apply_updates(old, po._apply.deltas(new, old, new))
  normal = (np.abs(np.asarray(new, np.float32)) >= float(jnp.finfo(dtype).tiny)) | (bits(new) == 0)
  assert normal.mean() > 0.85
  np.testing.assert_array_equal(bits(got)[normal], bits(new)[normal])
  # Past the bound (a weight shrinking 2**(ratio_bits + 2)-fold) exactness is not promised:
  # the f32 delta cannot carry the few bits of `new` below old's f32 ulp.
  far_old, far_new = jnp.asarray([2.0 ** 30], dtype), jnp.asarray([2.0 ** -10], dtype)
  if dtype == jnp.bfloat16:
    far = po.apply_updates(far_old, po._apply.deltas(far_new, far_old, far_new))
    assert float(far[0]) != 2.0 ** -10


def test_remainder_split_merge_bit_exact():
  rng = np.random.default_rng(1)
  pattern = np.concatenate([rng.integers(0, 2 ** 32, 200000, dtype=np.uint64).astype(np.uint32),
                            np.arange(2 ** 16, dtype=np.uint32) + np.uint32(0x3F800000),
                            np.arange(2 ** 16, dtype=np.uint32) + np.uint32(0xBF800000)])
  master = jnp.asarray(pattern.view(np.float32))
  param, rem = jax.jit(po.split_master)(master)
  assert param.dtype == jnp.bfloat16 and rem.dtype == jnp.int16
  np.testing.assert_array_equal(bits(jax.jit(po.merge_master)(param, rem)), pattern)
  # The param is the master rounded to nearest; only exact ties differ from bf16's
  # ties-to-even (they go away from zero), and only for finite values.
  finite = np.isfinite(pattern.view(np.float32))
  ref = pattern.view(np.float32).astype(ml_dtypes.bfloat16)
  tie = (pattern & 0xFFFF) == 0x8000
  np.testing.assert_array_equal(bits(param)[finite & ~tie], bits(ref)[finite & ~tie])
  np.testing.assert_array_equal(bits(param)[finite & tie],
                                ((pattern[finite & tie] >> 16) + 1).astype(np.uint16))


def test_remainder_master_matches_master_weights():
  inner = optax.adamw(1e-2, weight_decay=0.1)
  params = _params(jnp.bfloat16)
  p_full, s_full = _run(po.master_weights(inner), params, 20)
  p_lean, s_lean = _run(po.remainder_master_weights(inner), params, 20)
  master = po.master_params(s_lean, p_lean)
  assert_bit_identical(master, s_full.master)
  assert_bit_identical(s_lean.inner_state, s_full.inner_state)
  tie = jax.tree.map(lambda m: (bits(m) & 0xFFFF) == 0x8000, master)
  for a, b, t in zip(jax.tree.leaves(p_lean), jax.tree.leaves(p_full), jax.tree.leaves(tie)):
    np.testing.assert_array_equal(bits(a)[~t], bits(b)[~t])
  assert all(r.dtype == jnp.int16 for r in jax.tree.leaves(s_lean.remainder))


# Swamping: weight 1.0, update +1e-5 per step, 100,000 steps.
SWAMP_STEPS = 100_000
SWAMP_LR = 1e-5


def _swamp(tx, n, steps=SWAMP_STEPS):
  """Runs `tx` for `steps` steps on n bf16 weights at 1.0 with grad -1 (update +1e-5)."""
  params = jnp.ones((n,), jnp.bfloat16)
  grads = jnp.full((n,), -1.0, jnp.float32)

  @jax.jit
  def run(p):
    def body(_, carry):
      p, s = carry
      u, s = tx.update(grads, s, p)
      return po.apply_updates(p, u), s

    return jax.lax.fori_loop(0, steps, body, (p, tx.init(p)))

  return run(params)


@pytest.fixture(scope="module")
def swamping():
  sgd = optax.sgd(SWAMP_LR)
  return {
      "nearest": _swamp(po.f32_update(sgd), 4),
      "master": _swamp(po.master_weights(sgd), 4),
      "kahan": _swamp(po.kahan_updates(sgd), 4),
      "kahan_half": _swamp(po.kahan_updates(sgd), 4, SWAMP_STEPS // 2),
      "stochastic": _swamp(po.stochastic_updates(sgd, seed=0), 1024),
  }


def test_swamping_pure_bf16_nearest_stays_at_one(swamping):
  p, _ = swamping["nearest"]
  np.testing.assert_array_equal(np.asarray(p, np.float32), 1.0)


def test_swamping_master_reaches_two(swamping):
  p, state = swamping["master"]
  # The master is exactly the f32 running sum: f32(1e-5) is 83.89 ulps of f32 in [1, 2),
  # so each add rounds to 84 ulps and 100k adds land at 2.001358, 1.36e-3 above 2.0. That
  # is f32's own rounding, identical in plain f32 training; "within 1e-3 of 2.0" is not
  # reachable by any f32 accumulator of these increments. Bound: 100k * ulp(1)/2 = 6e-3.
  ref = np.float32(1.0)
  for _ in range(SWAMP_STEPS):
    ref = np.float32(ref + np.float32(SWAMP_LR))
  np.testing.assert_array_equal(np.asarray(state.master), ref)
  assert abs(float(state.master[0]) - 2.0) < 1.5e-3
  np.testing.assert_array_equal(np.asarray(p, np.float32),
                                np.float32(ref.astype(ml_dtypes.bfloat16)))


def test_swamping_kahan_tracks_the_sum(swamping):
  """Half-way (50k steps, exact sum 1.5) Kahan is where the sum is, within its documented
  drift: param + compensation runs ahead of the exact sum by at most 16 bf16 ulps of 1
  (2**-7 each; see the limit test below), so it is neither swamped at 1.0 nor stalled at
  2.0. The end point alone would prove nothing: after 100k steps the weight is at 2.0,
  but from 2.0 on it stalls (test_kahan_bf16_compensation_limit), so any update that
  overshoots would land there too."""
  p, state = swamping["kahan_half"]
  assert state.compensation.dtype == jnp.bfloat16
  exact = 1.0 + (SWAMP_STEPS // 2) * SWAMP_LR
  p, c = np.asarray(p, np.float64), np.asarray(state.compensation, np.float64)
  assert np.all((p + c - exact >= 0) & (p + c - exact <= 16 * 2.0 ** -7)), (p, c)
  assert np.all(np.abs(p - exact) <= 17 * 2.0 ** -7), p
  p_end, _ = swamping["kahan"]
  np.testing.assert_array_equal(np.asarray(p_end, np.float32), 2.0)


def test_kahan_bf16_compensation_limit():
  """The limit of a bf16 compensation buffer (optimi / AnyPrecisionAdamW keep it in bf16
  too): the buffer rounds what it carries to 8 significant bits, so p + c runs ahead of the
  exact sum (by up to ~14 ulps of 2**-7 here, bound 16), and once |c| reaches 2**-8 an increment of
  1e-5 is below half its ulp and vanishes in c itself: from 2.0 on, the weight stalls.
  The 100k-step gate above lands on 2.0 because that is where the stall begins, so this
  records the trajectory: effective precision is about 16 bits (8 + 8), and updates below
  ~2**-16 of the weight are not carried faithfully."""
  tx = po.kahan_updates(optax.sgd(SWAMP_LR))
  g = -jnp.ones((4,), jnp.bfloat16)

  @jax.jit
  def chunk(p, s):
    def body(_, c):
      p, s = c
      u, s = tx.update(g, s, p)
      return po.apply_updates(p, u), s
    return jax.lax.fori_loop(0, 25_000, body, (p, s))

  p = jnp.ones((4,), jnp.bfloat16)
  s = tx.init(p)
  ahead = []
  for k in range(1, 7):
    p, s = chunk(p, s)
    exact = 1.0 + k * 25_000 * SWAMP_LR
    total = float(p[0]) + float(s.compensation[0])
    ahead.append(total - exact)
    if k <= 4:
      assert 0.0 <= total - exact <= 16 * 2.0 ** -7, (k, total, exact)
  assert float(p[0]) == 2.0  # 150k steps: stalled at 2.0 where the exact sum is 2.5


def test_swamping_stochastic_reaches_two_within_statistical_bound(swamping):
  """Each weight makes ~Binomial jumps of one bf16 ulp (2**-7 in [1, 2)), unbiased: the
  expected end is 1 + 100k * f32(1.0 + 1e-5 - 1) = 2.00136 (f32 rounding of the sum before
  stochastic rounding, as for the master) and the standard deviation per weight is
  sqrt(2**-7 * 1e-5 * 1e5) = 0.088. Over 1024 independent weights the mean's standard
  deviation is 0.0028: we require the mean within 5 sigma (0.014) of 2.0014 and every weight
  within 6 sigma (0.53)."""
  p, _ = swamping["stochastic"]
  x = np.asarray(p, np.float32)
  expected = 1.0 + SWAMP_STEPS * float(np.float32(1.0) + np.float32(SWAMP_LR) - np.float32(1.0))
  sigma = np.sqrt(2.0 ** -7 * SWAMP_LR * SWAMP_STEPS)
  assert abs(x.mean() - expected) < 5 * sigma / np.sqrt(x.size)
  assert np.all(np.abs(x - expected) < 6 * sigma)
  assert 0.5 * sigma < x.std() < 1.5 * sigma
