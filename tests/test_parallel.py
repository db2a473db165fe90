"""precision.parallel on 8 forced host CPU devices: ZeRO 0-3 against single-device
training, collective dtypes, memory, overflow in the reduction, pmap and jax.distributed,
checkpoints resumed on the same and on another device count, host batches."""

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision as mp
from precision import optim
from precision import parallel
from _asserts import assert_bit_identical
from _parallel_worker import (GLOBAL_BATCH, LR, STEPS, STEPS_MP, loss_fn, make_batches,
                              make_params)

STAGES = (0, 1, 2, 3)
LAYER = "3layer"          # stage 3 with gather="layer" (layered_loss_fn)
WORKER = os.path.join(os.path.dirname(__file__), "_parallel_worker.py")


def _hidden(p, x):
  dt = p["w1"].dtype
  h = jnp.dot(x.astype(dt), p["w1"], preferred_element_type=jnp.float32)
  return jnp.tanh(h + p["b1"].astype(jnp.float32)[None, :])


def _output(p, h):
  y = jnp.dot(h.astype(p["w2"].dtype), p["w2"], preferred_element_type=jnp.float32)
  return y + p["b2"].astype(jnp.float32)[None, :]


def layered_loss_fn(params, batch):
  """loss_fn's model written as two ZeRO-3 layers (same math, same rounding)."""
  h = parallel.gathered_layer(_hidden)({"w1": params["w1"], "b1": params["b1"]}, batch["x"])
  y = parallel.gathered_layer(_output)({"w2": params["w2"], "b2": params["b2"]}, h)
  return jnp.mean(jnp.square(y - batch["y"]))


def rel_diff(a, b) -> float:
  """max |a - b| / max |b| over a leaf (f64)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def single_device(recipe, steps=STEPS):
  """The reference: the optim train-step protocol on the global batch, one device."""
  recipe = mp.get_recipe(recipe)
  tx = optim.build_optimizer(recipe, optax.adamw(LR))
  params = recipe.policy.cast_to_param(jax.tree.map(jnp.asarray, make_params()))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    scale = optim.loss_scale_of(opt_state)
    compute = recipe.policy.cast_to_compute(params)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch) * scale)(compute)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optim.apply_updates(params, updates), opt_state, loss / scale

  losses = []
  for batch in make_batches(steps):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  return np.array(losses), jax.tree.map(np.asarray, params)


def train(dp, steps=STEPS, snapshot=None):
  state = dp.init(make_params())
  losses, snap = [], None
  for i, batch in enumerate(make_batches(steps)):
    state, metrics = dp.step(state, dp.shard_batch(batch))
    losses.append(float(metrics["loss"]))
    if snapshot is not None and i + 1 == snapshot:
      snap = jax.tree.map(np.asarray, dp.params(state))
  return {"losses": np.array(losses), "params": jax.tree.map(np.asarray, dp.params(state)),
          "state": state, "dp": dp, "snapshot": snap}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def runs(mesh):
  out = {}
  for recipe in ("fp32", "bf16_master"):
    out[recipe, "ref"] = single_device(recipe)
    for stage in STAGES:
      dp = parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=stage,
                                  recipe=recipe)
      out[recipe, stage] = train(dp, snapshot=STEPS_MP)
    dp = parallel.data_parallel(layered_loss_fn, optax.adamw(LR), mesh, zero_stage=3,
                                recipe=recipe, gather="layer")
    out[recipe, LAYER] = train(dp)
  return out


@pytest.mark.parametrize("stage", STAGES + (LAYER,))
def test_fp32_matches_single_device(runs, stage):
  ref_losses, ref_params = runs["fp32", "ref"]
  run = runs["fp32", stage]
  assert rel_diff(run["losses"], ref_losses) <= 1e-6
  for k in ref_params:
    assert run["params"][k].dtype == np.float32
    assert rel_diff(run["params"][k], ref_params[k]) <= 1e-6, k


@pytest.mark.parametrize("stage", STAGES + (LAYER,))
def test_bf16_master_matches_single_device(runs, stage):
  ref_losses, ref_params = runs["bf16_master", "ref"]
  run = runs["bf16_master", stage]
  # bf16 tolerance: bf16 GEMM inputs summed in a different order (8 slices + reduction vs
  # one batch) move the f32 grads by ~2**-8 relative; after 20 Adam steps the params sit
  # within a few bf16 ulps (2**-8 relative at the leaf's largest magnitude).
  assert rel_diff(run["losses"], ref_losses) <= 2.0 ** -8
  for k in ref_params:
    assert run["params"][k].dtype == jnp.bfloat16
    assert rel_diff(run["params"][k], ref_params[k]) <= 4 * 2.0 ** -8, k


@pytest.mark.parametrize("recipe", ["fp32", "bf16_master"])
def test_stages_1_and_2_bit_identical(runs, recipe):
  one, two = runs[recipe, 1], runs[recipe, 2]
  np.testing.assert_array_equal(one["losses"], two["losses"])
  for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(two["params"])):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(one["state"].opt_state), jax.tree.leaves(two["state"].opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_divisible_sizes_are_padded(runs):
  state = runs["fp32", 3]["state"]
  layout = state.layout
  assert layout.param_count == 4755 and sum(l.size % 8 != 0 for l in layout.leaves) == 3
  for lay, flat in zip(layout.leaves, jax.tree.leaves(state.params)):
    assert flat.shape == (lay.padded_size,)
    assert flat.sharding.shard_shape(flat.shape) == (lay.shard_size,)
    np.testing.assert_array_equal(np.asarray(flat)[lay.size:], 0)   # padding stays 0
  params = runs["fp32", 3]["params"]
  assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in make_params().items()}


@pytest.fixture(scope="module")
def reports(runs):
  out = {}
  for stage in STAGES:
    run = runs["fp32", stage]
    batch = run["dp"].shard_batch(make_batches(1)[0])
    out[stage] = (run["dp"].memory_report(run["state"], batch),
                  run["dp"].collective_report(run["state"], batch))
  return out


def test_memory_sharded_per_zero_stage(reports):
  m = {s: reports[s][0] for s in STAGES}
  assert m[1].opt_state_bytes <= 1.05 / 8 * m[0].opt_state_bytes
  assert m[2].opt_state_bytes <= 1.05 / 8 * m[0].opt_state_bytes
  assert m[3].params_bytes <= 1.05 / 8 * m[0].params_bytes
  assert m[1].params_bytes == m[0].params_bytes == 4755 * 4
  for s in STAGES:
    # What each device holds (from the compiled shardings) is what the executable takes.
    # (XLA may drop an unused 4-byte scalar of the optimizer state from the arguments.)
    held = m[s].params_bytes + m[s].opt_state_bytes + m[s].batch_bytes
    assert m[s].argument_bytes <= held <= m[s].argument_bytes + 16
    # ZeRO paper model: sharded terms within the padding (<= 7 elements per leaf).
    assert m[s].params_bytes == pytest.approx(m[s].formula_params, rel=0.02)
    assert m[s].opt_state_bytes == pytest.approx(m[s].formula_opt_state, rel=0.05)


def test_hlo_reduce_scatter_and_all_gather_in_stages_1_2(reports):
  leaves = 4
  full_grads = 4755 * 4
  for stage in (1, 2):
    c = reports[stage][1]
    assert c.count("reduce-scatter") >= leaves and c.count("all-gather") >= leaves
    assert c.largest("all-reduce") <= 16      # scalars only: loss, finite flag, grad norm
  assert reports[0][1].largest("all-reduce") >= full_grads   # stage 0: the full all-reduce
  assert reports[0][1].count("reduce-scatter") == 0


def test_bytes_moved_per_stage_follow_zero_paper(reports):
  sent = {s: reports[s][1].sent_bytes for s in STAGES}
  # ZeRO paper sec. 7: stages 1-2 move what DP moves (2 Psi: reduce-scatter + all-gather
  # = all-reduce). Stage 3 with gather="step" gathers each leaf once and keeps it for
  # backward, so it moves 2 Psi too; gather="layer" re-gathers: 3 Psi (tested below).
  assert sent[1] == sent[2]
  for s in (1, 3):
    assert sent[s] / sent[0] == pytest.approx(1.0, rel=0.02)


def test_collectives_move_compute_and_reduce_dtypes(mesh):
  state_batch = None
  kinds = {}
  for stage, reduce_dtype in ((3, "bf16"), (LAYER, "bf16"), (1, "f32")):
    recipe = mp.get_recipe("bf16_mixed").replace(reduce_dtype=reduce_dtype)
    dp = parallel.data_parallel(layered_loss_fn if stage == LAYER else loss_fn,
                                optax.adamw(LR), mesh, zero_stage=3 if stage == LAYER else stage,
                                recipe=recipe, gather="layer" if stage == LAYER else "step")
    state = dp.init(make_params())
    state_batch = dp.shard_batch(make_batches(1)[0])
    c = dp.collective_report(state, state_batch, compiled=False)
    kinds[stage] = {k: {t for op in c.ops if op.kind == k for t in op.dtypes}
                    for k in ("reduce-scatter", "all-gather")}
  # f32 params move bf16. (Lowered program: XLA's CPU backend widens 16-bit collectives to
  # f32 when it compiles; NCCL on GPU moves them as asked.)
  assert kinds[3] == kinds[LAYER] == {"reduce-scatter": {"bf16"}, "all-gather": {"bf16"}}
  assert kinds[1] == {"reduce-scatter": {"f32"}, "all-gather": {"f32"}}


def _overflow_setup():
  """Per-rank grads finite in f16, their 8-rank sum not: element 0 of w is 10000 * scale 2
  = 20000 on every rank (f16 max 65504); the sum is 160000."""
  recipe = mp.Recipe("f16_sum", "p=f32,c=f16,o=f32", reduce_dtype="f16",
                     loss_scale=mp.LossScaleConfig(kind="dynamic", initial_scale=2.0))
  g = np.ones((GLOBAL_BATCH, 13), np.float32)
  g[:, 0] = 10000.0

  def linear_loss(params, batch):
    # d loss / d w = mean over rows of g: 10000 for element 0, 1 elsewhere.
    out = jnp.dot(batch["g"].astype(params["w"].dtype), params["w"],
                  preferred_element_type=jnp.float32)
    return jnp.mean(out)

  return recipe, linear_loss, {"w": np.full((13,), 0.5, np.float32)}, {"g": g}


@pytest.mark.parametrize("stage", STAGES)
def test_overflow_in_reduction_skipped_on_every_rank(mesh, stage):
  recipe, loss, params, batch = _overflow_setup()
  local = jax.grad(lambda w: loss({"w": w}, {"g": batch["g"][:4]}) * 2.0)(
      jnp.asarray(params["w"], jnp.float16))
  assert bool(jnp.all(jnp.isfinite(local)))                    # finite on each rank
  dp = parallel.data_parallel(loss, optax.sgd(1e-3), mesh, zero_stage=stage, recipe=recipe)
  state = dp.init(params)
  state, metrics = dp.step(state, dp.shard_batch(batch))
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == 1.0                   # backed off from 2
  full = dp.params(state)["w"]
  for shard in full.addressable_shards:                        # every rank kept the params
    np.testing.assert_array_equal(np.asarray(shard.data), params["w"])
  for leaf in jax.tree.leaves(state.opt_state):                # and agrees on the state
    if leaf.sharding.is_fully_replicated:
      first = np.asarray(leaf.addressable_shards[0].data)
      for shard in leaf.addressable_shards[1:]:
        np.testing.assert_array_equal(np.asarray(shard.data), first)


def test_overflow_needs_the_f16_reduction(mesh):
  recipe, loss, params, batch = _overflow_setup()
  dp = parallel.data_parallel(loss, optax.sgd(1e-3), mesh, zero_stage=1,
                              recipe=recipe.replace(reduce_dtype="f32"))
  state, metrics = dp.step(dp.init(params), dp.shard_batch(batch))
  assert int(metrics["skipped_steps"]) == 0
  assert float(np.asarray(dp.params(state)["w"])[0]) < 0.5


@pytest.mark.parametrize("stage", (0, 1))
def test_stochastic_rounding_agrees_across_ranks(mesh, stage):
  dp = parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=stage,
                              recipe="bf16_sr", seed=7)
  state = dp.init(make_params())
  for batch in make_batches(3):
    state, _ = dp.step(state, dp.shard_batch(batch))
  for leaf in jax.tree.leaves(state.params):
    first = np.asarray(leaf.addressable_shards[0].data)
    assert first.dtype == jnp.bfloat16
    for shard in leaf.addressable_shards[1:]:
      np.testing.assert_array_equal(np.asarray(shard.data), first)


@pytest.mark.parametrize("stage", (0, 1))
def test_pmap_matches_shard_map(runs, stage):
  dp = parallel.data_parallel_pmap(loss_fn, optax.adamw(LR), zero_stage=stage, recipe="fp32")
  run = train(dp, steps=STEPS)
  ref = runs["fp32", stage]
  np.testing.assert_array_equal(run["losses"], ref["losses"])
  for k in ref["params"]:
    np.testing.assert_array_equal(run["params"][k], ref["params"][k])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(runs, tmp_path):
  out = tmp_path / "mp.npz"
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
  procs = [subprocess.Popen([sys.executable, WORKER, str(pid), "2", str(port), "4", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for pid in range(2)]
  logs = [p.communicate(timeout=120)[0].decode() for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
  got = np.load(out)
  ref = runs["fp32", 1]
  # gloo's all-reduce adds in another order than the in-process CPU collectives: the
  # loss mean can differ in the last bit, hence a tolerance rather than bit equality.
  assert rel_diff(got["losses"], ref["losses"][:STEPS_MP]) <= 1e-6
  for k, v in ref["snapshot"].items():
    assert rel_diff(got[k], v) <= 1e-6, k


def test_bad_arguments(mesh):
  with pytest.raises(ValueError, match="zero_stage=4"):
    parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh, zero_stage=4)
  with pytest.raises(ValueError, match="axis_name='batch'"):
    parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh, axis_name="batch")
  with pytest.raises(ValueError, match="zero_stage=2 under pmap"):
    parallel.data_parallel_pmap(loss_fn, optax.sgd(0.1), zero_stage=2)


@pytest.mark.parametrize("recipe", ["fp32", "bf16_master"])
def test_layer_gather_bit_identical_to_step_gather(runs, recipe):
  # Same GEMMs on the same gathered values, the same reduce-scatters: regathering in
  # backward changes when params are fetched, not what is computed.
  step, layer = runs[recipe, 3], runs[recipe, LAYER]
  np.testing.assert_array_equal(layer["losses"], step["losses"])
  for k in step["params"]:
    np.testing.assert_array_equal(layer["params"][k], step["params"][k])


# ---- ZeRO-3 layer by layer -------------------------------------------------------------
DEEP_D = 256


def _deep_params(layers: int):
  r = np.random.default_rng(0)
  # b has D + 3 elements (not divisible by 8; the layer reads the first D).
  return {"layers": [{"w": (r.normal(size=(DEEP_D, DEEP_D)) / 16).astype(np.float32),
                      "b": np.zeros((DEEP_D + 3,), np.float32)} for _ in range(layers)]}


def _deep_layer(p, x):
  h = jnp.dot(x.astype(p["w"].dtype), p["w"], preferred_element_type=jnp.float32)
  return x + jnp.tanh(h + p["b"][:DEEP_D].astype(jnp.float32)[None, :])


def _deep_loss(params, batch):
  # gathered_layer is a no-op on full params: the same loss serves both gather modes.
  x = batch["x"]
  for p in params["layers"]:
    x = parallel.gathered_layer(_deep_layer)(p, x)
  return jnp.mean(jnp.square(x - batch["y"]))


@pytest.fixture(scope="module")
def deep_reports(mesh):
  r = np.random.default_rng(1)
  batch = {k: r.normal(size=(16, DEEP_D)).astype(np.float32) for k in ("x", "y")}
  out = {}
  for gather in ("step", "layer"):
    for layers in (2, 6):
      dp = parallel.data_parallel(_deep_loss, optax.adamw(LR), mesh,
                                  zero_stage=3, recipe="fp32", gather=gather)
      state = dp.init(_deep_params(layers))
      gbatch = dp.shard_batch(batch)
      out[gather, layers] = (dp.memory_report(state, gbatch),
                             dp.collective_report(state, gbatch))
  return out


def test_layer_gather_holds_one_layer_at_a_time(deep_reports):
  layer_bytes = (DEEP_D * DEEP_D + DEEP_D + 3) * 4
  growth = {g: (deep_reports[g, 6][0].temp_bytes - deep_reports[g, 2][0].temp_bytes) / 4
            for g in ("step", "layer")}
  print({g: round(v / layer_bytes, 3) for g, v in growth.items()})
  # gather="step": every extra layer adds its gathered params to the temporaries (measured
  # 0.97 of a layer's bytes: XLA reuses a few small buffers once the optimizer's update
  # runs in place; before it did, copies of the state added more on top).
  assert growth["step"] >= 0.9 * layer_bytes
  # gather="layer": an extra layer adds only sharded state (its grad shard, optimizer
  # intermediates) and an activation: well under its full params.
  assert growth["layer"] <= 0.5 * layer_bytes


def test_layer_gather_regathers_in_backward(deep_reports):
  for layers in (2, 6):
    step, layer = deep_reports["step", layers][1], deep_reports["layer", layers][1]
    leaves = 2 * layers
    assert step.count("all-gather") == leaves and layer.count("all-gather") == 2 * leaves
    assert step.count("reduce-scatter") == layer.count("reduce-scatter") == leaves
    # ZeRO paper sec. 7.2.2: 3 Psi (gather, re-gather, reduce-scatter) against 2 Psi; the
    # extra n elements per gather carry the ordering dependency (see _fsdp._gather_now).
    assert layer.sent_bytes / step.sent_bytes == pytest.approx(1.5, rel=0.01)


def test_gpt_layer_by_layer_matches_stage_0(mesh):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from models import gpt  # pylint: disable=g-import-not-at-top

  model = gpt.GPT(gpt.CONFIGS["tiny"], rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, tokens):
    return gpt.loss_fn(nnx.merge(graphdef, params, rest), tokens)

  tokens = np.random.default_rng(0).integers(0, 256, size=(8, 33)).astype(np.int32)
  out = {}
  for stage, gather in ((0, "step"), (3, "layer")):
    dp = parallel.data_parallel(loss, optax.adamw(1e-3), mesh, zero_stage=stage,
                                recipe="fp32", gather=gather)
    state = dp.init(jax.tree.map(np.asarray, params))
    losses = []
    for _ in range(2):
      state, metrics = dp.step(state, dp.shard_batch(tokens))
      losses.append(float(metrics["loss"]))
    out[stage] = (np.array(losses), jax.tree.leaves(jax.tree.map(np.asarray, dp.params(state))),
                  dp.collective_report(state, dp.shard_batch(tokens)))
  assert rel_diff(out[3][0], out[0][0]) <= 1e-6
  for a, b in zip(out[3][1], out[0][1]):
    assert rel_diff(a, b) <= 1e-5
  # embed + 2 blocks + final norm + head, each gathered forward and again in backward,
  # except the embedding table: its gradient (a scatter-add of the cotangent) does not
  # read the table, so XLA drops that re-gather as dead code.
  n_leaves = len(out[0][1])
  assert out[3][2].count("all-gather") == 2 * n_leaves - 1


def test_layer_gather_errors(mesh):
  with pytest.raises(ValueError, match="gather='layer' with zero_stage=1"):
    parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh, zero_stage=1, gather="layer")
  with pytest.raises(ValueError, match="gather='block'"):
    parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh, zero_stage=3, gather="block")

  def forgets_b2(params, batch):
    h = parallel.gathered_layer(_hidden)({"w1": params["w1"], "b1": params["b1"]}, batch["x"])
    w2 = parallel.gather(params["w2"])
    return jnp.mean(jnp.dot(h, w2, preferred_element_type=jnp.float32))

  batch = make_batches(1)[0]
  dp = parallel.data_parallel(forgets_b2, optax.sgd(0.1), mesh, zero_stage=3, gather="layer")
  state = dp.init(make_params())
  with pytest.raises(ValueError, match=r"never gathered the params \[\"\['b2'\]\"\]"):
    dp.step(state, dp.shard_batch(batch))
  dp = parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh, zero_stage=3, gather="layer")
  with pytest.raises(TypeError, match="is a ZeRO-3 shard"):
    dp.step(dp.init(make_params()), dp.shard_batch(batch))


def test_layer_helpers_are_identity_without_shards():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  p = {k: jnp.asarray(v) for k, v in make_params().items()}
  batch = make_batches(1)[0]
  np.testing.assert_array_equal(layered_loss_fn(p, batch), loss_fn(p, batch))
  assert parallel.gather(p) is not None and parallel.gather(p)["w1"] is p["w1"]
  lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  x = jnp.ones((2, 4), jnp.float32)
  np.testing.assert_array_equal(parallel.call_layer(lin, x), lin(x))


# ---- fp8 scaling state across ranks ------------------------------------------------------
def _fp8_setup():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  recipe = mp.get_recipe("fp8_hybrid").replace(
      fp8=mp.Fp8Config(scaling="delayed", amax_history_len=4))
  model = nnx.Sequential(nnx.Linear(16, 32, use_bias=False, rngs=nnx.Rngs(0)),
                         nnx.Linear(32, 8, use_bias=False, rngs=nnx.Rngs(1)))
  mp.flax.apply_recipe(model, recipe)      # bf16 policy GEMMs, then fp8 ones
  graphdef, params, fp8_state = nnx.split(model, nnx.Param, mp.fp8.Fp8State)

  def loss(params, fp8_state, batch):
    m = nnx.merge(graphdef, params, fp8_state)
    y = m(batch["x"]).astype(jnp.float32)
    return jnp.mean(jnp.square(y - batch["y"])), nnx.state(m, mp.fp8.Fp8State)

  r = np.random.default_rng(3)
  x = r.normal(size=(GLOBAL_BATCH, 16)).astype(np.float32)
  x *= np.repeat(np.arange(1, 9, dtype=np.float32), GLOBAL_BATCH // 8)[:, None]  # rank r: ~r
  batch = {"x": x, "y": r.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32)}
  return recipe, model, params, fp8_state, loss, batch


def _amax(state, layer, op):
  return np.asarray(state["layers"][layer]["dot_general"][f"{op}_amax_history"][...])


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_fp8_state_synchronised_in_every_stage(mesh):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  recipe, model, params, fp8_state, loss, batch = _fp8_setup()
  # Reference: one device, the global batch, precision.value_and_grad (data_parallel
  # hands loss_fn the params in their param dtype, f32 here: so does the reference).
  # Stage 3 moves params in the compute dtype: its reference runs on the bf16-rounded
  # params (handed to loss_fn in f32, as stage 3 does).
  def reference(round_params):
    ref = nnx.clone(model)
    if round_params:
      p = nnx.state(ref, nnx.Param)
      nnx.update(ref, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), p))
    mp.value_and_grad(lambda m: loss(nnx.state(m, nnx.Param),
                                         nnx.state(m, mp.fp8.Fp8State), batch)[0])(ref)
    return nnx.state(ref, mp.fp8.Fp8State)

  refs = {False: reference(False), True: reference(True)}
  states = {}
  for stage in STAGES:
    dp = parallel.data_parallel(loss, optax.adamw(LR), mesh, zero_stage=stage, recipe=recipe,
                                fp8_state=True)
    state = dp.init(jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, fp8_state))
    state, metrics = dp.step(state, dp.shard_batch(batch))
    assert np.isfinite(float(metrics["loss"]))
    for leaf in jax.tree.leaves(state.fp8_state):     # one value on every device
      first = np.asarray(leaf.addressable_shards[0].data)
      for shard in leaf.addressable_shards[1:]:
        np.testing.assert_array_equal(np.asarray(shard.data), first)
    states[stage] = state.fp8_state
  for stage in STAGES:
    for layer in (0, 1):
      # Forward operands: the synchronised amax is the global batch's (the max over the
      # ranks' slices), exactly what one device computes on the whole batch.
      ref_state = refs[stage == 3]
      for op in ("lhs", "rhs"):
        np.testing.assert_array_equal(_amax(states[stage], layer, op), _amax(ref_state, layer, op))
      # Gradient operand: each rank differentiates the mean over ITS 4 rows, so its output
      # cotangent is 8x the one of the mean over 32 rows (exact: a power of two).
      np.testing.assert_array_equal(_amax(states[stage], layer, "grad"),
                                    8 * _amax(ref_state, layer, "grad"))
  # Rank 0 alone saw inputs ~8x smaller: without the sync its history would disagree.
  x0 = batch["x"][:GLOBAL_BATCH // 8]
  assert _amax(states[1], 0, "lhs")[0] > 4 * float(np.max(np.abs(x0)))


def test_fp8_state_arguments(mesh):
  recipe, _, params, fp8_state, loss, _ = _fp8_setup()
  with pytest.raises(ValueError, match="gather='layer' with fp8_state=True"):
    parallel.data_parallel(loss, optax.sgd(0.1), mesh, zero_stage=3, recipe=recipe,
                           gather="layer", fp8_state=True)
  dp = parallel.data_parallel(loss, optax.sgd(0.1), mesh, zero_stage=1, recipe=recipe,
                              fp8_state=True)
  with pytest.raises(ValueError, match="init\\(fp8_state=None\\)"):
    dp.init(jax.tree.map(np.asarray, params))


# ---- one TrainState: checkpoints across device counts, host batches ------------------------
CKPT_RECIPE, CKPT_K = "bf16_master", 3     # save after K steps, then K more


def _dp_on(n, stage, loss=loss_fn, **kw):
  mesh_n = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  return parallel.data_parallel(loss, optax.adamw(LR), mesh_n, zero_stage=stage,
                                recipe=CKPT_RECIPE, **kw)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _run(dp, state, batches):
  losses = []
  for b in batches:
    state, metrics = dp.step(state, b)         # host numpy batches, split by step
    losses.append(float(metrics["loss"]))
  return state, np.array(losses)


@pytest.mark.parametrize("stage", (1, 3))
def test_checkpoint_resume_on_the_same_device_count_is_bit_exact(tmp_path, stage):
  """4 devices: K steps, save, restore into a fresh state, K steps == 2K steps straight,
  bit for bit (params, master, moments, counters, padding)."""
  batches = make_batches(2 * CKPT_K)
  dp = _dp_on(4, stage)
  straight, straight_losses = _run(dp, dp.init(make_params()), batches)
  half, _ = _run(dp, dp.init(make_params()), batches[:CKPT_K])
  rng = jax.random.key_data(jax.random.key(7))
  recipe = mp.get_recipe(CKPT_RECIPE)
  with mp.checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(CKPT_K, dp.state_for_checkpoint(half, rng=rng), recipe=recipe)
    # The target has the saved structure: a fresh state, with an rng of the same shape.
    r = ckpt.restore(dp.state_for_checkpoint(dp.init(make_params()), rng=rng * 0))
  np.testing.assert_array_equal(r.state.rng, rng)
  resumed = dp.state_from_checkpoint(r.state)
  assert resumed.layout == straight.layout
  resumed, losses = _run(dp, resumed, batches[CKPT_K:])
  np.testing.assert_array_equal(losses, straight_losses[CKPT_K:])
  assert_bit_identical((resumed.params, resumed.opt_state), (straight.params, straight.opt_state))


@pytest.mark.parametrize("stage", (1, 3))
def test_checkpoint_of_8_devices_resumes_on_4(tmp_path, stage):
  """8 devices: K steps, save; restore onto 4 devices and K more steps there, against the
  same K steps continued on 8.

  The restored state is the saved one bit for bit (full-shape params, flat unpadded
  optimizer leaves: the form does not depend on the device count), and the 4-device state
  holds exactly it. Training then continues within a tolerance, not bit for bit: each
  device sums its slice of the batch's gradients (4 rows on 8 devices, 8 rows on 4) and
  the devices' sums are added in a tree of 8 or 4 addends, so the f32 gradients differ
  in their last bits. Adam divides each element by its running RMS, which amplifies that
  noise most where a gradient element nearly cancels over the batch (a step of up to
  ~lr). Measured after K=3 continued steps: losses within 1e-5 relative, master weights
  within 1.9e-5 = 0.0063*K*lr; allowed: 1e-4 and 0.1*K*lr (bf16 params: that plus one
  bf16 rounding, 2**-7 relative). For scale: whole runs on 8 and on 4 devices (no
  checkpoint) differ by 1.1e-4 in the loss and 1e-3 in the master after 2K steps.
  """
  batches = make_batches(2 * CKPT_K)
  dp8, dp4 = _dp_on(8, stage), _dp_on(4, stage)
  s8, _ = _run(dp8, dp8.init(make_params()), batches[:CKPT_K])
  saved = dp8.state_for_checkpoint(s8)
  recipe = mp.get_recipe(CKPT_RECIPE)
  mp.checkpoint.save(tmp_path, CKPT_K, saved, recipe=recipe)
  r = mp.checkpoint.restore(tmp_path, dp4.state_for_checkpoint(dp4.init(make_params())))
  assert_bit_identical((r.state.params, r.state.opt_state), (saved.params, saved.opt_state))
  s4 = dp4.state_from_checkpoint(r.state)
  assert s4.layout.devices == 4 and s8.layout.devices == 8
  back = dp4.state_for_checkpoint(s4)
  assert_bit_identical((back.params, back.opt_state), (saved.params, saved.opt_state))

  s8, losses8 = _run(dp8, s8, batches[CKPT_K:])
  s4, losses4 = _run(dp4, s4, batches[CKPT_K:])
  np.testing.assert_allclose(losses4, losses8, rtol=1e-4)
  f8, f4 = _host(dp8.state_for_checkpoint(s8)), _host(dp4.state_for_checkpoint(s4))
  tol = 0.1 * CKPT_K * LR
  for k in f8.params:
    np.testing.assert_allclose(f4.opt_state.inner_state.master[k],
                               f8.opt_state.inner_state.master[k], rtol=0, atol=tol)
    np.testing.assert_allclose(f4.params[k].astype(np.float32),
                               f8.params[k].astype(np.float32), rtol=2 ** -7, atol=tol)
  assert int(f4.opt_state.inner_state.count) == int(f8.opt_state.inner_state.count) == 2 * CKPT_K


def test_checkpoint_form_is_shared_by_stages_1_to_3_and_refused_across_stage_0(mesh):
  dp1 = parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=1,
                               recipe=CKPT_RECIPE)
  s1, _ = _run(dp1, dp1.init(make_params()), make_batches(1))
  full = dp1.state_for_checkpoint(s1)
  dp3 = _dp_on(4, 3)
  assert_bit_identical(dp3.state_for_checkpoint(dp3.state_from_checkpoint(full)), full)
  dp0 = _dp_on(4, 0)
  with pytest.raises(ValueError, match=r"opt_state leaf .*w1.* is float32\[4000\]; this "
                                       r"DataParallel expects float32\[32, 125\]"):
    dp0.state_from_checkpoint(full)
  with pytest.raises(ValueError, match="is bfloat16.*keeps params in float32"):
    parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=1,
                           recipe="fp32").state_from_checkpoint(full)


def test_sharded_state_is_refused_by_checkpoint_and_full_form_by_step(tmp_path, mesh):
  dp = parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=3,
                              recipe=CKPT_RECIPE)
  state = dp.init(make_params())
  assert isinstance(state, mp.TrainState) and mp.TrainState is mp.checkpoint.TrainState
  assert mp.parallel.TrainState is mp.TrainState
  recipe = mp.get_recipe(CKPT_RECIPE)
  with pytest.raises(ValueError, match=r"sharded over 8 devices.*dp.state_for_checkpoint"):
    mp.checkpoint.save(tmp_path, 1, state, recipe=recipe)
  with pytest.raises(ValueError, match=r"sharded over 8 devices.*dp.state_for_checkpoint"):
    mp.checkpoint.restore(tmp_path, state)
  with pytest.raises(ValueError, match="in full form.*state_from_checkpoint"):
    dp.step(dp.state_for_checkpoint(state), make_batches(1)[0])


def test_fp8_state_round_trips_through_the_full_form():
  recipe, _, params, fp8_state, loss, _ = _fp8_setup()
  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  dp = parallel.data_parallel(loss, optax.adamw(LR), mesh4, zero_stage=3, recipe=recipe,
                              fp8_state=True)
  state = dp.init(_host(params), _host(fp8_state))
  full = dp.state_for_checkpoint(state)
  assert_bit_identical(full.model_state, state.fp8_state)
  back = dp.state_from_checkpoint(full)
  assert_bit_identical((back.params, back.opt_state, back.model_state),
                       (state.params, state.opt_state, state.model_state))
  with pytest.raises(ValueError, match="holds no arrays for a DataParallel built with "
                                       "fp8_state=True"):
    dp.state_from_checkpoint(full._replace(model_state={}))


def test_step_takes_host_arrays(mesh):
  """numpy batches, a single-device jax array and shard_batch's global arrays give the
  same step bit for bit; a batch that does not split over the devices is refused."""
  dp = parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=1,
                              recipe=CKPT_RECIPE, donate=False)
  state = dp.init(make_params())
  batch = make_batches(1)[0]
  ref, ref_metrics = dp.step(state, dp.shard_batch(batch))
  for given in (batch, {"x": jnp.asarray(batch["x"]), "y": batch["y"]}):
    got, metrics = dp.step(state, given)
    assert_bit_identical((got.params, got.opt_state, metrics),
                         (ref.params, ref.opt_state, ref_metrics))
  with pytest.raises(ValueError, match=r"\['x'\] has shape \(12, 32\); accepted: a leading "
                                       r"\(batch\) axis divisible by the 8 devices"):
    dp.step(state, {"x": batch["x"][:12], "y": batch["y"][:12]})


# ---- RNG state (nnx.Rngs, Dropout) in the model state -------------------------------------
def _keys_as_data(tree):
  """Typed PRNG keys as their uint32 data (numpy cannot hold keys)."""
  is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def test_readme_block_with_dropout_trains_and_round_trips_a_checkpoint(mesh, tmp_path):
  """The README's data-parallel block (`dp_loss` merging params with `rest`) on a model
  with a Dropout: `rest` holds its typed key and counter. init places them on the mesh
  (no numpy round trip), each step advances the counter alike on every rank (the same
  replicated stream), and state_for_checkpoint -> save -> restore -> state_from_checkpoint
  gives back the state bit for bit, which then steps as the original does."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class TinyLM(nnx.Module):
    def __init__(self, vocab=64, d=16, *, rngs):
      self.embed = nnx.Embed(vocab, d, rngs=rngs)
      self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
      self.head = nnx.Linear(d, vocab, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens)
      return self.head(x + self.drop(self.down(jax.nn.gelu(self.up(x)))))

  def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  recipe = mp.get_recipe("bf16_master")
  model = mp.flax.apply_recipe(TinyLM(rngs=nnx.Rngs(0)), recipe)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def dp_loss(params, rest, tokens):
    m = nnx.merge(graphdef, params, rest)
    return loss_fn(m, tokens), nnx.state(m, nnx.Not(nnx.Param))

  dp = parallel.data_parallel(dp_loss, optax.adamw(3e-3), mesh, zero_stage=1, recipe=recipe,
                              fp8_state=True)
  tokens = np.random.default_rng(0).integers(0, 64, (16, 9)).astype(np.int32)
  state = dp.init(params, rest)
  assert int(rest["drop"]["rngs"]["count"][...]) == 0       # the caller's rest survives
  losses = []
  for _ in range(3):
    state, metrics = dp.step(state, tokens)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert int(state.model_state["drop"]["rngs"]["count"][...]) == 3   # one draw per step
  for leaf in jax.tree.leaves(_keys_as_data(state.model_state)):   # replicated
    for shard in leaf.addressable_shards[1:]:
      np.testing.assert_array_equal(shard.data, leaf.addressable_shards[0].data)

  full = dp.state_for_checkpoint(state)
  mp.checkpoint.save(tmp_path, 3, full, recipe=recipe)
  r = mp.checkpoint.restore(tmp_path, dp.state_for_checkpoint(dp.init(params, rest)))
  assert_bit_identical(r.state, full)
  assert r.state.model_state["drop"]["rngs"]["key"][...].dtype == rest["drop"]["rngs"][
      "key"][...].dtype
  resumed = dp.state_from_checkpoint(r.state)
  a, metrics_a = dp.step(state, tokens)
  b, metrics_b = dp.step(resumed, tokens)
  assert_bit_identical((a.params, a.opt_state, a.model_state, metrics_a),
                       (b.params, b.opt_state, b.model_state, metrics_b))
  # A key among the params is named, with where it belongs (not numpy's TypeError).
  plain = parallel.data_parallel(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), mesh)
  with pytest.raises(ValueError, match=r"dtype key<fry>; .* keep integer and PRNG-key "
                                       r"state \(nnx.Rngs\) out of the params"):
    plain.init({"k": jax.random.key(0), "w": np.zeros((3,), np.float32)})
