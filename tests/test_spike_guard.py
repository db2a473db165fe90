"""precision.optim.spike_guard and Recipe.spike_guard: a loss or grad-norm spike is skipped
bit-exactly, at most max_consecutive in a row, never in the warm-up or on a non-finite step;
the z-scores match a float64 NumPy reference; checkpoints resume across a skip; the recipe
field round-trips and is validated; the false-skip rate on Gaussian noise is the
Student-t tail the window estimate implies."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats

import precision as mp
import precision.optim  # noqa: F401
from precision import checkpoint
from _asserts import assert_bit_identical, bit_identical

SG = mp.SpikeGuardConfig(window=16, threshold=4.0, max_consecutive=3, min_history=8)


def _recipe(name, sg=SG):
  return mp.get_recipe(name).replace(name=f"{name}_sg", spike_guard=sg)


def _params(recipe):
  w = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
  return recipe.policy.cast_to_param({"w": w, "b": jnp.full((4,), 0.5, jnp.float32)})


def _inputs(t, opt, params, loss_boost=1.0, grad_boost=1.0):
  """Step t's (scaled grads, loss): a noisy loss near 2 and grads of norm near 1."""
  rng = np.random.default_rng(t)
  loss = np.float32((2.0 + 0.05 * rng.standard_normal()) * loss_boost)
  scale = mp.optim.loss_scale_of(opt)
  grads = jax.tree.map(
      lambda p: (jnp.asarray(rng.standard_normal(p.shape) * 0.3 * grad_boost, jnp.float32)
                 * scale).astype(p.dtype), params)
  return grads, jnp.float32(loss)


def _stepper(tx):
  @jax.jit
  def step(params, opt, grads, loss):
    updates, new_opt = tx.update(grads, opt, params, value=loss)
    return mp.optim.apply_updates(params, updates), new_opt
  return step


def _run(recipe, steps, boosts=None, params=None, opt=None, start=0):
  """`steps` updates from step `start`; boosts: {t: (loss_boost, grad_boost)}."""
  tx = mp.optim.build_optimizer(recipe, optax.adam(1e-2), seed=1)
  params = _params(recipe) if params is None else params
  opt = tx.init(params) if opt is None else opt
  step, history = _stepper(tx), []
  for t in range(start, start + steps):
    grads, loss = _inputs(t, opt, params, *(boosts or {}).get(t, (1.0, 1.0)))
    new_params, new_opt = step(params, opt, grads, loss)
    history.append((params, opt, new_params, new_opt))
    params, opt = new_params, new_opt
  return params, opt, history


@pytest.mark.parametrize("name,boost", [("fp32", (50.0, 1.0)), ("bf16_master", (1.0, 100.0)),
                                        ("f16_mixed", (50.0, 100.0))])
def test_a_spike_is_skipped_with_params_and_inner_state_bit_identical(name, boost):
  recipe = _recipe(name)
  _, _, hist = _run(recipe, 14, boosts={12: boost})
  for t, (params, opt, new_params, new_opt) in enumerate(hist):
    skipped = t == 12
    assert bool(mp.optim.step_skipped(opt, new_opt)) == skipped, t
    assert bit_identical(new_params, params) == skipped, t
    assert bit_identical(new_opt.inner_state, opt.inner_state) == skipped, t
  params, opt, new_params, new_opt = hist[12]
  m = mp.optim.optimizer_metrics(new_opt)
  assert int(m["spike_skipped_steps"]) == 1 and int(m["skipped_steps"]) == 1
  assert int(m["nonfinite_steps"]) == 0 and int(m["consecutive_spike_skips"]) == 1
  z = float(m["loss_z"]) if boost[0] > 1 else float(m["grad_norm_z"])
  assert z > SG.threshold
  # The rejected values stay out of the window; the step after is measured against it.
  for field in ("losses", "grad_norms", "filled", "position"):
    assert_bit_identical(getattr(new_opt, field), getattr(opt, field))
  assert int(mp.optim.optimizer_metrics(hist[13][3])["consecutive_spike_skips"]) == 0


def test_never_more_than_max_consecutive_skips_and_a_lasting_shift_becomes_the_baseline():
  recipe = _recipe("fp32")
  shift = {t: (5.0, 1.0) for t in range(12, 60)}
  _, _, hist = _run(recipe, 60, boosts=shift)
  skipped = [bool(mp.optim.step_skipped(o, n)) for _, o, _, n in hist]
  runs, run = [], 0
  for s in skipped:
    run = run + 1 if s else 0
    runs.append(run)
  assert max(runs) == SG.max_consecutive
  # Exactly the rule: the first shifted steps are skipped 3 in a row, the 4th is applied.
  assert skipped[12:16] == [True, True, True, False]
  assert not any(skipped[40:]), "the shifted level never became the baseline"
  # Each applied step entered the window: filled only ever grows by accepted steps.
  filled = [int(n.filled) for _, _, _, n in hist]
  assert filled[-1] == SG.window


def test_no_skip_in_the_warm_up():
  recipe = _recipe("fp32")
  huge = {t: (1e4 * (t + 1), 1e3 * (t + 1)) for t in range(SG.min_history)}
  _, _, hist = _run(recipe, SG.min_history, boosts=huge)
  for t, (_, opt, _, new_opt) in enumerate(hist):
    assert not bool(mp.optim.step_skipped(opt, new_opt)), t
    assert np.isnan(float(new_opt.loss_z)) and np.isnan(float(new_opt.grad_norm_z))
    assert int(new_opt.filled) == t + 1


@pytest.mark.parametrize("bad", ["loss_inf", "grad_nan"])
def test_a_nonfinite_step_is_the_guards_and_does_not_enter_the_window(bad):
  recipe = _recipe("f16_mixed")
  params, opt, _ = _run(recipe, 10)
  tx = mp.optim.build_optimizer(recipe, optax.adam(1e-2), seed=1)
  grads, loss = _inputs(10, opt, params)
  if bad == "loss_inf":
    loss = jnp.float32(np.inf)
  else:
    grads = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
  new_params, new_opt = _stepper(tx)(params, opt, grads, loss)
  assert_bit_identical(new_params, params)
  m = mp.optim.optimizer_metrics(new_opt)
  assert int(m["nonfinite_steps"]) == 1 and int(m["skipped_steps"]) == 1
  assert int(m["spike_skipped_steps"]) == 0 and np.isnan(float(m["loss_z"]))
  for field in ("losses", "grad_norms", "filled", "position", "consecutive_skipped"):
    assert_bit_identical(getattr(new_opt, field), getattr(opt, field))
  assert float(new_opt.inner_state.loss_scale.loss_scale) < float(
      opt.inner_state.loss_scale.loss_scale)   # the guard backed the scale off


def test_resume_across_a_skip_is_bit_exact(tmp_path):
  recipe = _recipe("bf16_master")
  boosts = {12: (50.0, 1.0), 13: (50.0, 1.0)}
  params, opt, _ = _run(recipe, 13, boosts=boosts)       # step 12 skipped
  assert int(opt.consecutive_skipped) == 1
  state = checkpoint.TrainState(params, opt, {}, jax.random.key_data(jax.random.key(0)))
  checkpoint.save(tmp_path, 13, state, recipe=recipe)
  tx = mp.optim.build_optimizer(recipe, optax.adam(1e-2), seed=1)
  fresh = checkpoint.TrainState(_params(recipe), tx.init(_params(recipe)), {},
                                jax.random.key_data(jax.random.key(1)))
  r = checkpoint.restore(tmp_path, fresh)
  assert r.recipe == recipe and r.recipe.spike_guard == SG
  assert_bit_identical(r.state, state)
  cont = _run(recipe, 8, boosts=boosts, params=params, opt=opt, start=13)
  resumed = _run(recipe, 8, boosts=boosts, params=r.state.params, opt=r.state.opt_state,
                 start=13)
  assert int(cont[1].skipped_steps) == 2                 # step 13 was a spike too
  assert_bit_identical(resumed[:2], cont[:2])


def _reference(losses, norms, window, threshold, max_consecutive, min_history):
  """float64 NumPy reference of the rule: (skipped, loss_z, norm_z) per step."""
  buf_l, buf_g, consecutive, out = [], [], 0, []
  for x, g in zip(losses, norms):
    zl = zg = np.nan
    if np.isfinite(x) and np.isfinite(g) and len(buf_l) >= min_history:
      zs = []
      for v, buf in ((x, buf_l), (g, buf_g)):
        mean, std = np.mean(buf), np.std(buf, ddof=1)
        zs.append(0.0 if v == mean else (v - mean) / std)
      zl, zg = zs
    skip = (zl > threshold or zg > threshold) and consecutive < max_consecutive
    if skip:
      consecutive += 1
    elif np.isfinite(x) and np.isfinite(g):
      consecutive = 0
      buf_l, buf_g = (buf_l + [x])[-window:], (buf_g + [g])[-window:]
    out.append((skip, zl, zg))
  return out


def _scan_guard(tx, losses, grads):
  """Runs `tx` (on params {"w": f32[k]}) over the steps; per-step skip flags and z-scores."""
  params = {"w": jnp.zeros(grads.shape[1:], jnp.float32)}

  def body(opt, xs):
    loss, g = xs
    _, new = tx.update({"w": g}, opt, params, value=loss)
    m = mp.optim.spike_metrics(new)
    return new, (m["spike_skipped_steps"] > mp.optim.spike_metrics(opt)["spike_skipped_steps"],
                 m["loss_z"], m["grad_norm_z"])

  return jax.lax.scan(body, tx.init(params), (losses, grads))[1]


def test_z_scores_and_decisions_match_a_numpy_reference():
  rng = np.random.default_rng(0)
  steps, cfg = 400, dict(window=16, threshold=2.0, max_consecutive=2, min_history=5)
  losses = (3.0 - np.linspace(0, 1, steps) + 0.1 * rng.standard_normal(steps)
            + np.where(rng.random(steps) < 0.05, 2.0, 0.0)).astype(np.float32)
  losses[[50, 51, 200]] = [np.inf, np.nan, np.inf]       # non-finite: left to the guard
  grads = (rng.standard_normal((steps, 5)) * np.where(
      rng.random((steps, 1)) < 0.05, 10.0, 1.0)).astype(np.float32)
  grads[120, 0] = np.nan
  tx = mp.optim.spike_guard(mp.optim.skip_nonfinite(optax.sgd(0.1)), **cfg)
  skip, zl, zg = jax.jit(lambda l, g: _scan_guard(tx, l, g))(losses, grads)
  norms = np.sqrt(np.sum(grads.astype(np.float64) ** 2, axis=1))
  ref = _reference(losses.astype(np.float64), norms, **cfg)
  ref_skip = np.array([r[0] for r in ref])
  # Skips (forced acceptances among them) and 9 unmeasured steps: 5 of warm-up, 4 non-finite.
  assert ref_skip.sum() >= 15 and np.isnan([r[1] for r in ref]).sum() == 9
  np.testing.assert_array_equal(np.asarray(skip), ref_skip)
  for got, col in ((zl, 1), (zg, 2)):
    want = np.array([r[col] for r in ref])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    # f32 window statistics against float64: a few ulp of the spread, relative to |z|+1.
    np.testing.assert_allclose(np.asarray(got)[ok], want[ok], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("max_consecutive", [0, 1000])
def test_false_skip_rate_on_gaussian_noise_is_the_window_t_tail(max_consecutive):
  """i.i.d. N(0, 1) losses, zero grads (norm 0, z 0): after the window fills, a step is
  flagged when (x - mean) / std > t over the n = 100 window values. For a new value
  independent of the window, z / sqrt(1 + 1/n) is Student-t with n - 1 degrees of
  freedom, so p = P(T_99 > t / sqrt(1 + 1/n)) = 1.786e-3 at t = 3 (the plain Gaussian
  tail, 1.350e-3, ignores the window estimate). With max_consecutive=0 (measure only)
  every value enters the window and p is exact: tolerance 4 binomial standard errors of
  the 800k counted steps (9.5% of p). With skipping on, the window holds only accepted
  values, a sample truncated near mean + t std: to first order a normal truncated at t
  (mean -phi(t)/Phi(t), std sqrt(1 - t phi(t)/Phi(t))), which gives 1.921e-3 (+7.5%);
  tolerance 4 standard errors plus 3% of it for that approximation. Measured (seed 42):
  1.770e-3 and 1.970e-3. The Gaussian tail falls outside both tolerances."""
  chains, steps, window, t = 1000, 900, 100, 3.0
  tx = mp.optim.spike_guard(optax.sgd(0.1), window=window, threshold=t,
                            max_consecutive=max_consecutive, min_history=window)
  losses = jax.random.normal(jax.random.key(42), (chains, steps), jnp.float32)
  grads = jnp.zeros((chains, steps, 1), jnp.float32)
  skip, zl, _ = jax.jit(jax.vmap(lambda l, g: _scan_guard(tx, l, g)))(losses, grads)
  flagged = np.asarray(skip if max_consecutive else zl > t)[:, window:]
  n, rate = flagged.size, flagged.mean()
  mean, std = 0.0, 1.0
  if max_consecutive:
    phi, cdf = scipy.stats.norm.pdf(t), scipy.stats.norm.cdf(t)
    mean, std = -phi / cdf, np.sqrt(1 - t * phi / cdf)
  p = scipy.stats.t.sf((mean + t * std) / np.sqrt(1 + 1 / window), window - 1)
  tol = 4 * np.sqrt(p * (1 - p) / n) + (0.03 * p if max_consecutive else 0.0)
  assert abs(rate - p) < tol, (rate, p, tol)
  assert abs(scipy.stats.norm.sf(t) - p) > tol


def test_recipe_field_round_trip_and_old_dicts():
  r = _recipe("bf16_master")
  d = json.loads(json.dumps(r.to_dict()))
  assert d["spike_guard"] == {"window": 16, "threshold": 4.0, "max_consecutive": 3,
                              "min_history": 8}
  assert mp.Recipe.from_dict(d) == r
  plain = mp.get_recipe("bf16_master")
  assert "spike_guard" not in plain.to_dict()               # old dicts are unchanged
  assert mp.Recipe.from_dict(plain.to_dict()).spike_guard is None
  assert mp.Recipe.from_dict({**plain.to_dict(), "spike_guard": None}) == plain
  assert mp.Recipe("x", "p=f32,c=f32,o=f32", spike_guard={"window": 50}).spike_guard == \
      mp.SpikeGuardConfig(window=50)
  assert mp.SpikeGuardConfig().history == 20 and mp.SpikeGuardConfig(window=8).history == 8
  assert "loss-spike" in r.description


@pytest.mark.parametrize("field,value", [
    ("window", 1), ("window", 2.0), ("window", True), ("window", 65537),
    ("threshold", 0.0), ("threshold", -1.0), ("threshold", float("nan")),
    ("threshold", float("inf")), ("threshold", "6"), ("threshold", 1e39),
    ("max_consecutive", -1), ("max_consecutive", 1.5),
    ("min_history", 1), ("min_history", 17), ("min_history", 4.0)])
def test_bad_values_name_the_field(field, value):
  good = SG.to_dict()
  with pytest.raises(ValueError, match=rf"spike_guard\.{field}="):
    mp.SpikeGuardConfig(**{**good, field: value})
  with pytest.raises(ValueError, match=rf"spike_guard\.{field}="):
    mp.Recipe.from_dict({**_recipe("fp32").to_dict(), "spike_guard": {**good, field: value}})
  with pytest.raises(ValueError, match=rf"spike_guard\.{field}="):
    mp.optim.spike_guard(optax.sgd(0.1), **{**good, field: value})


def test_schema_errors_and_a_missing_value():
  d = _recipe("fp32").to_dict()
  with pytest.raises(ValueError, match=r"unknown field\(s\) spike_guard\.windw"):
    mp.Recipe.from_dict({**d, "spike_guard": {**SG.to_dict(), "windw": 3}})
  with pytest.raises(ValueError, match=r"missing field\(s\) spike_guard\.min_history"):
    mp.Recipe.from_dict({**d, "spike_guard": {"window": 16, "threshold": 4.0,
                                              "max_consecutive": 3}})
  with pytest.raises(ValueError, match=r"spike_guard=5"):
    mp.get_recipe("fp32").replace(name="x", spike_guard=5)
  tx = mp.optim.build_optimizer(_recipe("fp32"), optax.sgd(0.1))
  params = _params(_recipe("fp32"))
  with pytest.raises(ValueError, match="value=loss"):
    tx.update(params, tx.init(params), params)
  with pytest.raises(ValueError, match=r"value is float32\[2\]"):
    tx.update(params, tx.init(params), params, value=jnp.ones(2, jnp.float32))


def test_train_step_passes_the_loss():
  from flax import nnx
  recipe = _recipe("bf16_master", mp.SpikeGuardConfig(window=8, threshold=4.0))
  model = mp.flax.apply_recipe(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), recipe)
  tx = mp.optim.build_optimizer(recipe, optax.sgd(0.05))
  opt = tx.init(nnx.state(model, nnx.Param))
  step = nnx.jit(mp.train_step, static_argnums=(1, 3))

  def loss_fn(m, x, y, boost):
    return jnp.mean(jnp.square(m(x).astype(jnp.float32) - y)) * boost

  rng = np.random.default_rng(0)
  for t in range(12):
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)
    # A tree map holds the arrays: the step updates the model's Variables in place.
    before = jax.tree.map(lambda v: v, nnx.state(model, nnx.Param))
    _, new = step(model, tx, opt, loss_fn, x, y, jnp.float32(1e3 if t == 10 else 1.0))
    assert bool(mp.optim.step_skipped(opt, new)) == (t == 10), t
    assert bit_identical(nnx.state(model, nnx.Param), before) == (t == 10), t
    opt = new
  assert int(mp.optim.spike_metrics(opt)["spike_skipped_steps"]) == 1


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_data_parallel_skips_alike_on_every_rank(stage):
  """The optimizer gets the global mean loss, and (stages 1-3) the guard's grad norm is
  reduced over the shards: every rank skips the spike, and the result is the single-device
  one on the same global batches."""
  from precision import parallel
  recipe = _recipe("bf16_master", mp.SpikeGuardConfig(window=8, threshold=4.0))
  mesh = jax.make_mesh((8,), ("data",))

  def loss(params, batch):
    out = jnp.dot(batch["x"].astype(params["w"].dtype), params["w"],
                  preferred_element_type=jnp.float32)
    return jnp.mean(jnp.square(out - batch["y"]))

  rng = np.random.default_rng(0)
  batches = [{"x": rng.standard_normal((16, 5)).astype(np.float32),
              "y": rng.standard_normal((16, 3)).astype(np.float32) * (30.0 if t == 10 else 1.0)}
             for t in range(12)]
  params = {"w": np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)}
  dp = parallel.data_parallel(loss, optax.sgd(0.02), mesh, zero_stage=stage, recipe=recipe)
  state, skipped = dp.init(params), []
  tx = mp.optim.build_optimizer(recipe, optax.sgd(0.02))
  p1 = recipe.policy.cast_to_param(jax.tree.map(jnp.asarray, params))
  o1 = tx.init(p1)
  for batch in batches:
    state, metrics = dp.step(state, dp.shard_batch(batch))
    skipped.append(int(metrics["spike_skipped_steps"]))
    l, g = jax.value_and_grad(lambda p: loss(p, batch))(p1)
    u, o1 = tx.update(g, o1, p1, value=l)
    p1 = mp.optim.apply_updates(p1, u)
  assert skipped[9] == 0 and skipped[10:] == [1, 1]
  assert int(o1.skipped_steps) == 1
  full = dp.params(state)["w"]
  # Every rank holds the same params and the same replicated state (windows, counters).
  for leaf in [full] + [x for x in jax.tree.leaves(state.opt_state)
                        if x.sharding.is_fully_replicated]:
    first = np.asarray(leaf.addressable_shards[0].data)
    for shard in leaf.addressable_shards[1:]:
      assert bit_identical(np.asarray(shard.data), first)
  # f32 reductions in another order than one device: close, not bitwise.
  np.testing.assert_allclose(np.asarray(full, np.float32), np.asarray(p1["w"], np.float32),
                             rtol=2e-2, atol=2e-2)


def test_value_reaches_inner_transformations_that_take_it_and_no_other():
  seen = {}

  def strict_update(updates, state, params=None):         # takes no extra arguments
    return updates, state

  def value_update(updates, state, params=None, *, value=None):
    seen["value"] = value
    return updates, state

  params = {"w": jnp.ones((2,), jnp.float32)}
  for update, expect in ((strict_update, None), (value_update, 3.0)):
    seen.clear()
    inner = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    tx = mp.optim.spike_guard(inner)
    tx.update(params, tx.init(params), params, value=jnp.float32(3.0))
    assert (None if not seen else float(seen["value"])) == expect
  # An extra-args inner (optax.contrib.reduce_on_plateau reads the loss) gets it too.
  tx = mp.optim.spike_guard(optax.chain(optax.sgd(1.0),
                                        optax.contrib.reduce_on_plateau(patience=0)))
  opt = tx.init(params)
  for loss in (1.0, 2.0, 3.0):
    _, opt = tx.update(params, opt, params, value=jnp.float32(loss))
  assert float(opt.inner_state[1].scale) < 1.0             # the plateau saw rising losses


def test_train_step_calls_other_transformations_as_before():
  """A transformation that is not GradientTransformationExtraArgs gets no `value`: its
  update, which takes none, would raise if it did."""
  from flax import nnx
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = mp.optim.build_optimizer("fp32", optax.sgd(0.1))
  assert not isinstance(tx, optax.GradientTransformationExtraArgs)
  strict = optax.GradientTransformation(tx.init, lambda u, s, p=None: tx.update(u, s, p))
  opt = strict.init(nnx.state(model, nnx.Param))
  x = jnp.ones((4, 3), jnp.float32)
  loss, _ = mp.train_step(model, strict, opt, lambda m, x: jnp.mean(m(x) ** 2), x)
  assert np.isfinite(float(loss))
  assert mp.bind(_recipe("fp32")).recipe.spike_guard == SG  # a spike recipe binds to a Plan


def test_study_step_passes_the_loss():
  """A study cell (a param-pytree task) under a spike-guard recipe: its step hands the
  loss to the optimizer, and the metrics carry the spike counters."""
  import itertools
  import os
  from precision import study
  from precision.study import _models
  path = os.path.join(os.path.dirname(__file__), "study_tasks", "params_mlp.py:task")
  recipe = _recipe("bf16_mixed", mp.SpikeGuardConfig(window=8, threshold=4.0))
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    task = study.load_task(path)
    program = _models.build(task, recipe, seed=0)
    state, counts = program.state, []
    for t, batch in enumerate(itertools.islice(task.batches(0), 12)):
      if t == 10:
        batch = {**batch, "y": batch["y"] * 100.0}
      before = jax.tree.map(np.asarray, state.params)     # the step donates its state
      state, metrics = program.step(state, batch, jnp.int32(t))
      counts.append(int(metrics["spike_skipped_steps"]))
      assert bit_identical(jax.tree.map(np.asarray, state.params), before) == (t == 10), t
  assert counts[9] == 0 and counts[10:] == [1, 1]
  assert int(metrics["skipped_steps"]) == 1 and int(metrics["spike_window"]) == 8


def test_the_skip_is_a_select_not_a_cond():
  """No conditional in the update (on GPU a cond reads its predicate on the host)."""
  recipe = _recipe("f16_mixed")
  tx = mp.optim.build_optimizer(recipe, optax.adam(1e-2))
  params = _params(recipe)
  opt = tx.init(params)
  grads, loss = _inputs(0, opt, params)
  text = str(jax.make_jaxpr(lambda g, o, p, v: tx.update(g, o, p, value=v))(
      grads, opt, params, loss))                       # nested jaxprs are printed inline
  assert "select_n" in text and "cond[" not in text and "while[" not in text
