"""precision.numerics.bisect: seeded faults in one direction of one layer of a 4-layer MLP
(8 groups: each layer's forward and backward GEMMs) found from a checkpoint saved before
the divergence, within the stated replay bound, with a baseline bit-identical to the
original run; a divergence no single group explains, one no group explains, checkpoints
of other runs, and bad arguments refused."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision as mp
from precision.numerics import _bisect
from precision.numerics import _bisect_groups

DIMS = (8, 16, 16, 16, 4)
LAYERS = tuple(f"l{i}" for i in range(len(DIMS) - 1))
BATCH = 16
SAVE_AT, REPLAY = 3, 6
TOL = 2e-3   # promoted culprits reach <= 8e-4, the diverged baselines >= 8e-3
# f16 compute without loss scaling: small cotangents flush to zero.
F16_NO_SCALE = mp.Recipe("f16_no_scale", "p=f32,c=f16,o=f32",
                         allow_f16_without_loss_scale=True)
GRAD_SCALE = 1e-8   # a cotangent of ~1e-2 becomes ~1e-10, below f16's 6e-8 subnormal
BIG = 1e5           # the unscoped GEMM's kernel 1e5 times too large (it passes 65504)
WIDE = 300.0        # a layer's input and kernel both 300 times too large: the operands
                    # fit in f16, their GEMM's output (~9e4 times too large) does not
GROUPS = tuple(f"{name}:{d}" for name in LAYERS for d in ("fwd", "bwd"))


def _grad_scaled(y, s):
  """`y` forward; its cotangent times `s` backward (s * y + stop_gradient((1 - s) * y))."""
  return y * s + jax.lax.stop_gradient(y * (1.0 - s))


def make_loss(tiny_grad=(), big=(), unscoped_big=False, big_on_batch=()):
  """A 4-layer MLP, layer i in jax.named_scope(f"l{i}"). Layers in `tiny_grad` scale the
  cotangent of their output by GRAD_SCALE (forward unchanged: the f16 backward GEMMs see
  an underflowing cotangent); layers in `big` multiply their input and their kernel by
  WIDE and their output by 1/WIDE**2 (the same function in exact arithmetic: the f16
  forward GEMM's result overflows, its backward GEMMs stay in range); `unscoped_big` adds
  a GEMM outside any scope before the head whose kernel is BIG times too large; layers in
  `big_on_batch` multiply their kernel by WIDE and their input by the batch's "wide"
  (1: the GEMM result is ~WIDE times too large and fits in f16; WIDE: it overflows), so
  the fault appears only at the steps whose batch says so."""

  def loss(params, batch):
    h = batch["x"]
    for i, name in enumerate(LAYERS):
      if unscoped_big and i == len(LAYERS) - 1:
        h = (h @ (params["extra"] * BIG)) * (1.0 / BIG)
      with jax.named_scope(name):
        w, b = params[name]["w"], params[name]["b"]
        if name in big:
          h = ((h * WIDE) @ (w * WIDE)) * (1.0 / WIDE ** 2) + b
        elif name in big_on_batch:
          h = ((h * batch["wide"]) @ (w * WIDE)) * (1.0 / (WIDE * batch["wide"])) + b
        else:
          h = h @ w + b
        if name in tiny_grad:
          h = _grad_scaled(h, GRAD_SCALE)
      if i < len(LAYERS) - 1:
        h = jax.nn.relu(h)
    return jnp.mean((h - batch["y"]) ** 2)

  return loss


def init_params(seed=0):
  keys = jax.random.split(jax.random.key(seed), len(LAYERS) + 1)
  p = {name: {"w": jax.random.normal(k, (i, o), jnp.float32) / np.float32(math.sqrt(i)),
              "b": jnp.zeros((o,), jnp.float32)}
       for name, k, i, o in zip(LAYERS, keys, DIMS[:-1], DIMS[1:])}
  p["extra"] = jax.random.normal(keys[-1], (16, 16), jnp.float32) / np.float32(4.0)
  return p


def batches(n, seed=1):
  keys = jax.random.split(jax.random.key(seed), 2 * n)
  return [{"x": jax.random.normal(keys[2 * i], (BATCH, DIMS[0]), jnp.float32),
           "y": jax.random.normal(keys[2 * i + 1], (BATCH, DIMS[-1]), jnp.float32)}
          for i in range(n)]


def step_maker(loss, lr=3e-2):
  """make_step(recipe, overrides) of a user's training loop (Adam; eps tiny so that the
  1e-10 gradients of a scaled-down cotangent still give full-size updates in f32), and
  tx_of(recipe). Eager: under jit every replay would compile a new program (seconds
  each), while eager ops are compiled once per process and reused (the study test
  replays jitted steps)."""
  inner = optax.adam(lr, eps=1e-20)

  def make_step(recipe, overrides):
    plan = mp.bind(recipe, overrides=overrides)
    tx = mp.optim.build_optimizer(plan, inner)
    fn = mp.autocast(loss, plan)

    def step(state, batch):
      guarded = lambda p, b: mp.optim.nonfinite_loss_guard(fn(p, b))
      value, grads = mp.value_and_grad(guarded, state.opt_state)(state.params, batch)
      updates, opt = tx.update(grads, state.opt_state, state.params)
      return state._replace(params=mp.optim.apply_updates(state.params, updates),
                            opt_state=opt), value

    return step

  def tx_of(recipe):
    return mp.optim.build_optimizer(mp.bind(recipe), inner)

  return make_step, tx_of


def original_run(tmp_path, loss, recipe, seed=0, data=None):
  """Trains SAVE_AT steps, saves a checkpoint, continues REPLAY steps (the original
  run's losses). Returns (make_step, initial state, ckpt dir, replayed batches, losses)."""
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    make_step, tx_of = step_maker(loss)
    params = init_params()
    state0 = mp.TrainState(params, tx_of(recipe).init(params), {}, None)
    step = make_step(recipe, None)
    data = batches(SAVE_AT + REPLAY) if data is None else data
    state = state0
    for b in data[:SAVE_AT]:
      state, _ = step(state, b)
    ckpt = str(tmp_path / "ckpt")
    mp.checkpoint.save(ckpt, SAVE_AT, state, recipe=recipe, seed=seed)
    losses = []
    for b in data[SAVE_AT:]:
      state, value = step(state, b)
      losses.append(float(value))
  return make_step, state0, ckpt, data[SAVE_AT:], losses


def run_bisect(make_step, recipe, state0, ckpt, data, losses, loss, **kw):
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    return mp.numerics.bisect(make_step, recipe, state0, data, checkpoint=ckpt,
                              step=SAVE_AT, steps=REPLAY, tolerance=TOL, loss=loss,
                              original_losses=losses, **kw)


def single_bound(n):
  return math.ceil(math.log2(n)) + 3


@pytest.mark.slow
def test_underflowing_backward_cotangent_is_found(tmp_path):
  loss = make_loss(tiny_grad=("l0",))
  run = original_run(tmp_path, loss, F16_NO_SCALE)
  result = run_bisect(*run[:1], F16_NO_SCALE, *run[1:], loss=loss)
  assert result.groups == GROUPS
  assert result.baseline_bit_identical is True and result.baseline_mismatch is None
  assert result.diverged and result.single and result.culprits == ("l0:bwd",)
  # Halving {l0, l1} passes, {l0} passes, {l0:fwd} fails: l0:bwd is inferred, so it is
  # replayed alone; the worst case of the bound.
  assert [r.kind for r in result.replays] == [
      "baseline", "reference", "halve", "halve", "halve", "verify"]
  assert [r.promoted for r in result.replays[2:]] == [
      GROUPS[:4], ("l0:fwd", "l0:bwd"), ("l0:fwd",), ("l0:bwd",)]
  assert result.n_replays == single_bound(len(GROUPS))
  forward_only = result.replays[4]
  assert not forward_only.within and forward_only.max_gap > TOL
  fixed = [r for r in result.replays if r.promoted == ("l0:bwd",)]
  assert fixed and fixed[0].within and fixed[0].max_gap <= TOL < result.replays[0].max_gap
  worst = result.telemetry[0]
  assert (worst.scope, worst.direction, worst.role, worst.dtype) == (
      "l0", "bwd", "cotangent", "float16")
  assert worst.underflow > 0.9
  # Only backward rows: l0's forward tensors are fine.
  assert all(r.direction == "bwd" and r.scope == "l0" for r in result.telemetry)
  text = str(result)
  assert "bit-identical" in text and "layer 'l0' backward GEMMs: promoting them" in text
  assert "l0, backward GEMM cotangent, float16:" in text and "underflow" in text


@pytest.mark.slow
@pytest.mark.parametrize("layer,kinds", [
    # {l0, l1} fails, {l2} passes, {l2:fwd} passes: found by halving alone.
    ("l2", ["halve", "halve", "halve"]),
    # {l0, l1} fails, {l2} fails, {l3:fwd} passes.
    ("l3", ["halve", "halve", "halve"]),
])
def test_overflowing_activation_is_found(tmp_path, layer, kinds):
  # f16 with dynamic loss scaling: the forward overflow of `layer` makes every loss
  # non-finite, and the guard skips the steps (the state saved stays finite).
  recipe = mp.get_recipe("f16_mixed")
  loss = make_loss(big=(layer,))
  run = original_run(tmp_path, loss, recipe)
  result = run_bisect(*run[:1], recipe, *run[1:], loss=loss)
  assert not np.isfinite(run[-1]).any()
  assert result.baseline_bit_identical is True   # inf and NaN compared bit for bit
  assert result.culprits == (f"{layer}:fwd",) and result.single
  assert [r.kind for r in result.replays] == ["baseline", "reference"] + kinds
  assert result.n_replays == single_bound(len(GROUPS)) - 1  # the last halving passed
  assert all(r.direction == "fwd" and r.scope == layer for r in result.telemetry)
  worst = result.telemetry[0]
  assert (worst.scope, worst.direction, worst.dtype) == (layer, "fwd", "float16")
  assert worst.overflow > 0
  assert f"layer '{layer}' forward GEMMs" in str(result) and "overflow" in str(result)


@pytest.mark.slow
def test_overflow_from_a_later_step_is_named_at_that_step(tmp_path):
  """l2's forward GEMM result overflows f16 from the second replayed step on (the first
  is finite). The original losses went through a JSON log, as a study's steps.jsonl:
  every NaN comes back as +NaN, whatever sign the replay's NaN has; the baseline still
  counts as bit-identical (a NaN equals a NaN). The culprit's worst tensor is read at
  the step where the baseline leaves tolerance: the overflowing l2 forward GEMM result,
  not a finite operand ranked by SQNR on the first batch."""
  recipe = mp.get_recipe("f16_mixed")
  loss = make_loss(big_on_batch=("l2",))
  data = [dict(b, wide=jnp.float32(WIDE if i > SAVE_AT else 1.0))
          for i, b in enumerate(batches(SAVE_AT + REPLAY))]
  make_step, state0, ckpt, replayed, losses = original_run(tmp_path, loss, recipe,
                                                           data=data)
  assert np.isfinite(losses[0]) and not np.isfinite(losses[1:]).any()
  logged = json.loads(json.dumps(losses))
  result = run_bisect(make_step, recipe, state0, ckpt, replayed, logged, loss=loss)
  assert result.baseline_bit_identical is True and result.baseline_mismatch is None
  assert result.culprits == ("l2:fwd",) and result.single
  assert result.telemetry_step == 2
  worst = result.telemetry[0]
  assert (worst.scope, worst.direction, worst.role, worst.dtype) == (
      "l2", "fwd", "out", "float16")
  assert worst.overflow > 0
  text = str(result)
  assert "baseline bit-identical" in text
  assert "worst GEMM tensor (replayed step 2): l2, forward GEMM out, float16:" in text
  assert "overflow" in text


@pytest.mark.slow
def test_two_layers_needed_no_false_culprit(tmp_path):
  recipe = mp.get_recipe("f16_mixed")
  loss = make_loss(big=("l1", "l3"))
  run = original_run(tmp_path, loss, recipe)
  result = run_bisect(*run[:1], recipe, *run[1:], loss=loss)
  assert not result.single and result.culprits == ("l1:fwd", "l3:fwd")
  for r in result.replays:   # no single group passed
    if len(r.promoted) == 1:
      assert not r.within
  assert [r.kind for r in result.replays] == (
      ["baseline", "reference", "halve", "halve", "halve", "verify", "all"]
      + ["shrink"] * len(GROUPS))
  assert "no single group explains it" in str(result)
  assert "'l1' forward GEMMs + 'l3' forward GEMMs" in str(result)
  n = len(GROUPS)
  assert result.n_replays <= math.ceil(math.log2(n)) + n + 4


@pytest.mark.slow
def test_cause_outside_the_groups_names_no_culprit(tmp_path):
  recipe = mp.get_recipe("f16_mixed")
  loss = make_loss(unscoped_big=True)
  run = original_run(tmp_path, loss, recipe)
  result = run_bisect(*run[:1], recipe, *run[1:], loss=loss)
  assert result.diverged and not result.explained and result.culprits == ()
  assert result.telemetry == () and result.unscoped == 9   # one GEMM and its 2 backward GEMMs, 3 tensors each
  assert result.replays[-1].kind == "all" and not result.replays[-1].within
  assert "outside the GEMM scopes" in str(result)


@pytest.mark.slow
def test_no_divergence_stops_after_two_replays(tmp_path):
  recipe = mp.get_recipe("f16_mixed")
  loss = make_loss()
  run = original_run(tmp_path, loss, recipe)
  result = run_bisect(*run[:1], recipe, *run[1:], loss=loss)
  assert not result.diverged and result.culprits == () and result.n_replays == 2
  assert "no divergence" in str(result)


@pytest.mark.slow
def test_non_finite_reference_stops(tmp_path):
  loss = make_loss(tiny_grad=("l0",))
  make_step, state0, ckpt, data, losses = original_run(tmp_path, loss, F16_NO_SCALE)
  data = [dict(b, x=jnp.full_like(b["x"], jnp.nan)) for b in data]
  result = run_bisect(make_step, F16_NO_SCALE, state0, ckpt, data, None, loss)
  assert result.n_replays == 2 and result.culprits == ()
  assert result.baseline_bit_identical is None
  assert "reference itself is not finite" in str(result)
  assert "not compared with the original run" in str(result)


@pytest.mark.slow
def test_baseline_mismatch_is_reported(tmp_path):
  loss = make_loss(tiny_grad=("l0",))
  make_step, state0, ckpt, data, losses = original_run(tmp_path, loss, F16_NO_SCALE)
  other = list(losses)
  other[2] = float(np.nextafter(np.float32(other[2]), np.float32(np.inf)))
  result = run_bisect(make_step, F16_NO_SCALE, state0, ckpt, data, other, loss,
                      groups=["l0", "l1"])
  assert result.baseline_bit_identical is False
  assert result.baseline_mismatch.startswith("replayed step 3")
  assert result.groups == ("l0:fwd", "l0:bwd", "l1:fwd", "l1:bwd")
  assert result.culprits == ("l0:bwd",)
  assert "NOT bit-identical" in str(result)


def test_checkpoint_of_another_run_is_refused(tmp_path):
  loss = make_loss()
  make_step, state0, ckpt, data, losses = original_run(tmp_path, loss, F16_NO_SCALE)
  with pytest.raises(ValueError, match="another run.*recipe"):
    run_bisect(make_step, mp.get_recipe("f16_mixed"), state0, ckpt, data, losses, loss)
  with pytest.raises(ValueError, match="another run.*seed"):
    run_bisect(make_step, F16_NO_SCALE, state0, ckpt, data, losses, loss, seed=1)
  small = jax.tree.map(lambda x: x[:1] if x.ndim else x, state0)
  with pytest.raises(ValueError, match="another run.*does not fit"):
    run_bisect(make_step, F16_NO_SCALE, small, ckpt, data, losses, loss)


@pytest.mark.parametrize("kw,match", [
    (dict(steps=0), "steps=0"), (dict(steps=-2), "steps=-2"),
    (dict(tolerance=-1e-3), "tolerance=-0.001"), (dict(tolerance=math.nan), "tolerance=nan"),
    (dict(groups=[]), "groups=.. is empty"), (dict(groups="l0"), "groups='l0'"),
    (dict(groups=["l0", "l0:bwd"]), "repeats a scope or a direction"),
    (dict(groups=[":bwd"]), "groups holds ':bwd'"),
])
def test_bad_arguments(kw, match):
  loss = make_loss()
  make_step, _ = step_maker(loss)
  args = dict(steps=2, tolerance=1e-3, loss=loss)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    mp.numerics.bisect(make_step, F16_NO_SCALE, object(), batches(2), **args)


def test_loss_without_scoped_gemms_is_refused():
  def flat(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
  make_step, tx_of = step_maker(flat)
  params = {"w": jnp.ones((DIMS[0], DIMS[-1]), jnp.float32)}
  state = mp.TrainState(params, tx_of(F16_NO_SCALE).init(params), {}, None)
  with pytest.raises(ValueError, match="empty groups"):
    mp.numerics.bisect(make_step, F16_NO_SCALE, state, batches(2), steps=2,
                       tolerance=1e-3, loss=flat)


def test_overrides_promote_exactly_the_group():
  recipe = mp.get_recipe("bf16_mixed")
  up, base = "p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32"
  scopes = ["blocks/0", "blocks/0/mlp", "blocks/1"]
  # A plain scope is both directions: the plain f32 policy.
  got = _bisect.overrides_for(["blocks/0"], scopes, recipe)
  assert got == {"blocks/0": up, "blocks/0/mlp": base}
  assert _bisect.overrides_for(["blocks/0:fwd", "blocks/0:bwd"], scopes, recipe) == got
  # One direction: a direction-specific rule; the nested group keeps the recipe's policy
  # in that direction only (the other falls through to the enclosing rule, i.e. none).
  got = _bisect.overrides_for(["blocks/0:bwd"], scopes, recipe)
  assert got == {"blocks/0": {"bwd": up}, "blocks/0/mlp": {"bwd": base}}
  got = _bisect.overrides_for(["blocks/0:bwd", "blocks/0/mlp:fwd"], scopes, recipe)
  assert got == {"blocks/0": {"bwd": up}, "blocks/0/mlp": {"fwd": up, "bwd": base}}
  assert _bisect.overrides_for(["blocks/0:fwd"], _bisect.expand(scopes)[:3], recipe) == {
      "blocks/0": {"fwd": up}, "blocks/0/mlp": {"fwd": base}}
  assert _bisect.expand(["a", "b:bwd"]) == ("a:fwd", "a:bwd", "b:bwd")
  assert _bisect.split_group("x:y:bwd") == ("x:y", "bwd")
  assert _bisect.split_group("x:y") == ("x:y", None)
  assert _bisect_groups.describe_group("l0:fwd") == "'l0' forward GEMMs"
  # The overrides bind (and parse back to the same rules).
  mp.bind(recipe, overrides=got)
  assert _bisect.literal("a*/b[1]") == "a[*]/b[[]1[]]"
  with pytest.raises(ValueError, match="computes in f32 already"):
    _bisect.f32_counterpart(mp.get_recipe("fp32"))


def _task(init_seed_offset=0):
  def stream(seed):
    i = 0
    while True:
      yield batches(1, seed=1000 * seed + i)[0]
      i += 1

  return mp.study.Task(init=lambda seed: init_params(seed + init_seed_offset),
                       loss=make_loss(tiny_grad=("l0",)), batches=stream,
                       optimizer=optax.adam(3e-2, eps=1e-20), name="mlp")


@pytest.mark.slow
def test_study_cell_is_bisected_from_its_checkpoint(tmp_path):
  out = str(tmp_path / "study")
  task = _task()
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    mp.study.run(task, [F16_NO_SCALE], seeds=2, steps=SAVE_AT + REPLAY,
                 save_every=SAVE_AT, out=out, timing_rounds=0, progress=False)
    ckpt = f"{out}/cells/f16_no_scale__s1/ckpt"
    result = mp.numerics.bisect(task, F16_NO_SCALE, checkpoint=ckpt, step=SAVE_AT,
                                steps=REPLAY, tolerance=TOL, groups=["l0", "l1"])
    assert result.start_step == SAVE_AT
    # The original losses are the cell's steps.jsonl; the replay uses the study's step
    # and the task's stream advanced to the checkpoint's step.
    assert result.baseline_bit_identical is True
    # {l0} passes, {l0:fwd} fails, {l0:bwd} verified.
    assert result.culprits == ("l0:bwd",) and result.n_replays == 5
    assert result.telemetry[0].role == "cotangent"
    with pytest.raises(ValueError, match="another run.*task digest"):
      mp.numerics.bisect(_task(init_seed_offset=7), F16_NO_SCALE, checkpoint=ckpt,
                         steps=REPLAY, tolerance=TOL)
    with pytest.raises(ValueError, match="another run.*recipe"):
      mp.numerics.bisect(task, "f16_mixed", checkpoint=ckpt, steps=REPLAY, tolerance=TOL)
    with pytest.raises(ValueError, match="another run.*seed"):
      mp.numerics.bisect(task, F16_NO_SCALE, checkpoint=ckpt, seed=0, steps=REPLAY,
                         tolerance=TOL)


def test_study_overrides_keep_the_direction_bisect_leaves_out():
  from precision.study import _bisect_cell
  study = {"l0": "p=f32,c=bf16,o=f32", "head": "p=f32,c=f32,o=f32"}
  got = _bisect_cell._merged(study, {"l0": {"bwd": "p=f32,c=f32,o=f32"}, "l1": "f32"})
  assert got == {"l0": {"fwd": "p=f32,c=bf16,o=f32", "bwd": "p=f32,c=f32,o=f32"},
                 "head": "p=f32,c=f32,o=f32", "l1": "f32"}
  assert _bisect_cell._merged(study, None) == study
