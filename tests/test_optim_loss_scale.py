"""precision.optim loss scales: pytree round trips, GradScaler/Megatron rules, skipping."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import precision
from precision import optim as po
from _asserts import assert_bit_identical

# These tests drive the loss-scaling transform with synthetic gradients, not with a loss
# scaled by loss_scale_of: the warning meant for training loops says nothing here.
pytestmark = pytest.mark.filterwarnings("ignore::precision.optim.UnscaledGradientsWarning")

F32_TINY = float(np.finfo(np.float32).tiny)


def _fields(ls):
  return {f.name: np.asarray(getattr(ls, f.name)).tolist() for f in dataclasses.fields(ls)}


CUSTOM = dict(growth_factor=3.0, backoff_factor=0.25, growth_interval=7, min_scale=0.5,
              max_scale=2.0 ** 20, hysteresis=2)


@pytest.fixture(scope="module")
def custom_scale():
  return po.DynamicLossScale(2.0 ** 10, **CUSTOM).adjust(jnp.asarray(False))


@pytest.mark.parametrize("make", [
    lambda: po.NoOpLossScale(),
    lambda: po.StaticLossScale(128.0),
    lambda: po.DynamicLossScale(2.0 ** 10, **CUSTOM).adjust(jnp.asarray(False)),
])
def test_flatten_unflatten_tree_map_jit_keep_every_field(make):
  ls = make()
  leaves, treedef = jax.tree.flatten(ls)
  assert _fields(jax.tree.unflatten(treedef, leaves)) == _fields(ls)
  assert _fields(jax.tree.map(lambda x: x, ls)) == _fields(ls)
  assert _fields(jax.jit(lambda s: s)(ls)) == _fields(ls)
  adjusted = jax.jit(lambda s: s.adjust(jnp.asarray(True)))(ls)
  for f in dataclasses.fields(ls):
    if f.name not in ("loss_scale", "growth_tracker", "hysteresis_tracker"):
      assert getattr(adjusted, f.name) == getattr(ls, f.name), f.name


def test_custom_settings_survive(custom_scale):
  fields = _fields(custom_scale)
  for k, v in CUSTOM.items():
    assert fields[k] == v, k
  assert fields["hysteresis_tracker"] == 1 and fields["loss_scale"] == 2.0 ** 10


def test_orbax_save_restore_keeps_every_field(tmp_path, custom_scale):
  state = po.build_optimizer(
      precision.get_recipe("f16_mixed").replace(loss_scale=precision.LossScaleConfig(
          kind="dynamic", initial_scale=2.0 ** 10, **CUSTOM)),
      optax.adam(1e-3)).init({"w": jnp.ones((3,), jnp.float32)})
  state = state._replace(loss_scale=custom_scale)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "s", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "s", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert _fields(restored.loss_scale) == _fields(custom_scale)
  assert_bit_identical(restored, state)


def test_invalid_settings_raise():
  with pytest.raises(ValueError, match="backoff_factor"):
    po.DynamicLossScale(1.0, backoff_factor=2.0)
  with pytest.raises(ValueError, match="min_scale"):
    po.DynamicLossScale(1.0, min_scale=0.0)
  with pytest.raises(ValueError, match="must be finite"):
    po.StaticLossScale(float("inf"))
  with pytest.raises(ValueError, match="accepted"):
    po.loss_scaling(optax.sgd(1.0), 2.0 ** 15)


def gradscaler_reference(found_inf, scale, growth_factor, backoff_factor, growth_interval):
  """PyTorch's GradScaler update rule (torch._amp_update_scale_), written out in f32."""
  tracker, out = 0, []
  scale = np.float32(scale)
  for inf in found_inf:
    if inf:
      scale = np.float32(scale * np.float32(backoff_factor))
      tracker = 0
    else:
      successful = tracker + 1
      if successful == growth_interval:
        with np.errstate(over="ignore"):
          new_scale = np.float32(scale * np.float32(growth_factor))
        if np.isfinite(new_scale):
          scale = new_scale
        tracker = 0
      else:
        tracker = successful
    out.append((scale, tracker))
  return out


def megatron_reference(found_inf, scale, growth_factor, backoff_factor, growth_interval,
                       min_scale, hysteresis):
  """Megatron-LM's DynamicGradScaler.update, written out in f32."""
  growth, hyst, out = 0, hysteresis, []
  scale = np.float32(scale)
  for inf in found_inf:
    if inf:
      growth = 0
      hyst -= 1
      if hyst <= 0:
        scale = max(np.float32(scale * np.float32(backoff_factor)), np.float32(min_scale))
    else:
      growth += 1
      if growth == growth_interval:
        growth, hyst = 0, hysteresis
        scale = np.float32(scale * np.float32(growth_factor))
    out.append((scale, growth))
  return out


def _trajectory(ls, found_inf):
  def body(s, inf):
    s = s.adjust(~inf)
    return s, (s.loss_scale, s.growth_tracker)

  _, (scales, trackers) = jax.jit(lambda s, f: jax.lax.scan(body, s, f))(
      ls, jnp.asarray(found_inf))
  return list(zip(np.asarray(scales).tolist(), np.asarray(trackers).tolist()))


def test_trajectory_equals_gradscaler_rule():
  rng = np.random.default_rng(0)
  found_inf = rng.random(6000) < 0.12
  found_inf[4000:4300] = False  # a long finite run: growth to the f32 ceiling and beyond
  ls = po.DynamicLossScale(2.0 ** 100, growth_factor=2.0, backoff_factor=0.5,
                           growth_interval=3, min_scale=F32_TINY)
  got = _trajectory(ls, found_inf)
  want = gradscaler_reference(found_inf, 2.0 ** 100, 2.0, 0.5, 3)
  assert [(float(s), t) for s, t in want] == got
  scales = np.array([s for s, _ in got])
  assert scales.max() == 2.0 ** 127  # grew until the next step would overflow f32
  assert (np.diff(scales) < 0).sum() > 100 and (np.diff(scales) > 0).sum() > 100


def test_trajectory_equals_megatron_hysteresis_rule():
  rng = np.random.default_rng(1)
  found_inf = rng.random(4000) < 0.3
  ls = po.DynamicLossScale(64.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=4,
                           min_scale=1.0, hysteresis=3)
  got = _trajectory(ls, found_inf)
  want = megatron_reference(found_inf, 64.0, 2.0, 0.5, 4, 1.0, 3)
  assert [(float(s), t) for s, t in want] == got
  assert min(s for s, _ in got) == 1.0  # the floor was hit


def test_max_scale_caps_growth():
  ls = po.DynamicLossScale(2.0 ** 18, growth_interval=1, max_scale=2.0 ** 20)
  for _ in range(5):
    ls = ls.adjust(jnp.asarray(True))
  assert float(ls.loss_scale) == 2.0 ** 20


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_skipped_step_is_bit_identical(bad):
  params = {"w": jnp.asarray([1.5, -0.0, 0.0, -2.25], jnp.bfloat16),
            "b": jnp.asarray([0.125, -3.0], jnp.bfloat16)}
  tx = po.loss_scaling(po.master_weights(optax.adamw(1e-2, weight_decay=0.1)),
                       po.DynamicLossScale(2.0 ** 15))
  state = tx.init(params)
  good = {"w": jnp.asarray([1.0, 2.0, -1.0, 0.5], jnp.float32) * 2.0 ** 15,
          "b": jnp.asarray([3.0, -1.0], jnp.float32) * 2.0 ** 15}
  update = jax.jit(tx.update)
  u, state = update(good, state, params)
  params = po.apply_updates(params, u)
  bad_grads = {"w": good["w"].at[2].set(bad), "b": good["b"]}
  u, new_state = update(bad_grads, state, params)
  assert_bit_identical(po.apply_updates(params, u), params)
  assert_bit_identical(new_state.inner_state, state.inner_state)
  m = po.optimizer_metrics(new_state)
  assert float(m["loss_scale"]) == 2.0 ** 14
  assert int(m["skipped_steps"]) == 1 and int(m["nonfinite_steps"]) == 1
  assert int(m["consecutive_finite"]) == 0
  assert not np.isfinite(float(m["grad_norm"]))


def test_f16_model_tiny_scale_with_injected_overflows():
  """f16 compute, f32 params, f16_mixed with a tiny initial scale that grows every 2 steps
  until the f16 backward overflows on its own; inf/NaN injected at chosen steps too."""
  recipe = precision.get_recipe("f16_mixed").replace(loss_scale=precision.LossScaleConfig(
      kind="dynamic", initial_scale=2.0 ** -8, growth_interval=2, min_scale=2.0 ** -8))
  policy = recipe.policy
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": 0.5 * jax.random.normal(k1, (8, 16), jnp.float32),
            "w2": 0.5 * jax.random.normal(k2, (16, 1), jnp.float32)}
  x = jax.random.normal(k3, (32, 8), jnp.float32)
  y = jnp.sum(x, axis=1, keepdims=True)

  def loss_fn(p, x, y):
    p16, x16 = policy.cast_to_compute(p), policy.cast_to_compute(x)
    out = jnp.tanh(x16 @ p16["w1"]) @ p16["w2"]
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y))  # loss in f32

  tx = po.build_optimizer(recipe, optax.adam(1e-2))
  grad_fn = lambda state, params, x, y: precision.value_and_grad(loss_fn, state)(params, x, y)
  inject = {7: np.inf, 19: np.nan, 33: -np.inf}

  @jax.jit
  def step(params, state, poison):
    loss, grads = grad_fn(state, params, x, y)
    grads = {"w1": grads["w1"].at[0, 0].add(poison), "w2": grads["w2"]}
    finite = po._tree.all_finite(grads)
    u, state = tx.update(grads, state, params)
    return po.apply_updates(params, u), state, finite, loss

  state = tx.init(params)
  nonfinite, natural = [], []
  for t in range(70):
    new_params, state, finite, loss = step(params, state, jnp.float32(inject.get(t, 0.0)))
    assert po._tree.all_finite(new_params)
    if not bool(finite):
      nonfinite.append(t)
      natural.append(t not in inject)
      assert_bit_identical(new_params, params)
    params = new_params
    assert int(po.optimizer_metrics(state)["skipped_steps"]) == len(nonfinite)
  assert set(inject) <= set(nonfinite)
  print("non-finite steps", nonfinite, "final scale", float(po.loss_scale_of(state)))
  assert any(natural), "the growing scale never overflowed f16 on its own"
  assert np.isfinite(float(loss)) and float(loss) < 20.0


# ----------------------------------------------- dtypes, tree maps, validation (issue B1-B6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_adjust_keeps_scale_and_counter_dtypes(dtype):
  """An array scale keeps its dtype through both branches of `adjust`, under jit and as a
  lax.scan carry; counters keep theirs (int16 here)."""
  ls = po.DynamicLossScale(jnp.asarray(2.0 ** 10, dtype), growth_interval=2,
                           growth_tracker=jnp.asarray(0, jnp.int16),
                           hysteresis_tracker=jnp.asarray(1, jnp.int16))
  traces = []

  @jax.jit
  def adjust(s, f):
    traces.append(1)
    return s.adjust(f)

  for flag in (True, True, False, True, False):
    ls = adjust(ls, jnp.asarray(flag))
    assert ls.loss_scale.dtype == dtype
    assert ls.growth_tracker.dtype == ls.hysteresis_tracker.dtype == jnp.int16
  assert len(traces) == 1  # one trace: nothing drifted
  assert float(ls.loss_scale) == 2.0 ** 9  # 2^10 -> 2^11 -> 2^10 -> 2^10 -> 2^9
  final, scales = jax.lax.scan(lambda s, f: (s.adjust(f), s.loss_scale), ls,
                               jnp.asarray([True] * 6 + [False]))
  assert scales.dtype == final.loss_scale.dtype == dtype
  assert float(final.loss_scale) == 2.0 ** 11


def test_f16_scale_stops_growing_below_f16_overflow():
  ls = po.DynamicLossScale(jnp.asarray(2.0 ** 12, jnp.float16), growth_interval=1)
  for _ in range(6):
    ls = ls.adjust(jnp.asarray(True))
  assert ls.loss_scale.dtype == jnp.float16 and float(ls.loss_scale) == 2.0 ** 15


def test_tree_map_and_unflatten_pass_leaves_through():
  ls = po.DynamicLossScale(2.0 ** 15, growth_interval=7, hysteresis=3)
  zeros = jax.tree.map(lambda _: 0, ls)
  assert (zeros.loss_scale, zeros.growth_tracker, zeros.hysteresis_tracker) == (0, 0, 0)
  sizes = jax.tree.map(lambda x: x.size, ls)
  assert all(type(x) is int for x in jax.tree.leaves(sizes))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ls)
  assert abstract.loss_scale == jax.ShapeDtypeStruct((), jnp.float32)
  assert (abstract.growth_interval, abstract.hysteresis) == (7, 3)
  assert jax.tree.map(lambda _: 0, po.StaticLossScale(4.0)).loss_scale == 0
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
  assert paths == [".loss_scale", ".growth_tracker", ".hysteresis_tracker"]


@pytest.mark.parametrize("make,match", [
    (lambda: po.StaticLossScale(jnp.asarray(0.0)), "StaticLossScale.loss_scale=0.0"),
    (lambda: po.StaticLossScale(np.float32(np.inf)), "loss_scale=inf"),
    (lambda: po.DynamicLossScale(jnp.asarray(-2.0, jnp.bfloat16)), "loss_scale=-2.0"),
    (lambda: po.DynamicLossScale(jnp.asarray(np.nan)), "DynamicLossScale.loss_scale=nan"),
    (lambda: po.DynamicLossScale(jnp.asarray(4, jnp.int32)), "dtype int32"),
    (lambda: po.DynamicLossScale(jnp.ones(2)), r"shape \(2,\)"),
    (lambda: po.DynamicLossScale(True), "accepted: a Python number"),
    (lambda: po.DynamicLossScale(2.0, growth_tracker=jnp.asarray(-1)), "growth_tracker=-1"),
    (lambda: po.DynamicLossScale(2.0, growth_interval=2.5), "growth_interval=2.5"),
])
def test_array_inputs_are_validated(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_traced_scale_is_accepted():
  out = jax.jit(lambda s: po.DynamicLossScale(s).adjust(jnp.asarray(False)).loss_scale)(
      jnp.asarray(8.0, jnp.bfloat16))
  assert out.dtype == jnp.bfloat16 and float(out) == 4.0


def test_settings_are_keyword_only():
  with pytest.raises(TypeError, match="positional"):
    po.DynamicLossScale(1.0, jnp.zeros([], jnp.int32), 2000, 2)  # jmp's positional order


@pytest.mark.parametrize("ls", [po.StaticLossScale(8.0), po.DynamicLossScale(8.0)])
def test_scale_and_unscale_treat_the_same_leaves(ls):
  tree = {"f16": jnp.asarray([3.0], jnp.float16), "i": jnp.asarray([3], jnp.int32),
          "key": jax.random.key(0)}
  scaled, unscaled = ls.scale(tree), ls.unscale(tree)
  assert scaled["i"] is tree["i"] and unscaled["i"] is tree["i"]
  assert scaled["key"] is tree["key"] and unscaled["key"] is tree["key"]
  assert scaled["f16"].dtype == unscaled["f16"].dtype == jnp.float32
  assert float(scaled["f16"][0]) == 24.0 and float(unscaled["f16"][0]) == 0.375


def test_custom_loss_scale_protocol():
  """Any pytree with loss_scale/scale/unscale/adjust is a LossScale and drives the guard."""

  @jax.tree_util.register_static
  class Fixed:
    """A fixed scale held as static metadata: a loss scale of one's own."""

    def __init__(self, s=1024.0):
      self.s = s

    @property
    def loss_scale(self):
      return jnp.asarray(self.s, jnp.float32)

    def scale(self, tree):
      return jax.tree.map(lambda x: x * self.loss_scale, tree)

    def unscale(self, tree):
      return jax.tree.map(lambda g: g / self.loss_scale, tree)

    def adjust(self, grads_finite):
      del grads_finite
      return self

  assert isinstance(Fixed(), precision.LossScale)
  assert isinstance(po.DynamicLossScale(2.0), po.LossScale)
  assert not isinstance(2.0, po.LossScale)
  tx = po.loss_scaling(optax.sgd(1.0), Fixed())
  state = tx.init({"w": jnp.ones(2)})
  u, state = tx.update({"w": jnp.full(2, 512.0)}, state)
  np.testing.assert_array_equal(np.asarray(u["w"]), [-0.5, -0.5])
