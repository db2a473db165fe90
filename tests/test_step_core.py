"""The one training-step core (precision._step_core): `train_step` on an NNX model, the
study's programs and the data-parallel per-device step end each step there.

`test_every_path_takes_the_same_step_bit_for_bit`: on the same initial params and the
same batches, under a recipe with dynamic loss scaling (f16_mixed) and one with fp8
delayed-scaling state (fp8_hybrid), with a batch holding an inf (the step is skipped),
the params, the optimizer state (loss scale, skip counters, moments) and the fp8 scaling
state after the steps are the same bits through `jit_train_step`, the study's cell step
(`Program.step`), the study's seed-batched program as it runs on CPU (`Program.core`
looped over the slots, `study._batched.batched_step(..., "loop")`; under `jax.vmap` one
f32 param of f16_mixed came out 1 ulp apart on an AVX2-only CPU (AMD EPYC), bit-equal on
an AVX-512 one: the vmapped program is other code), the
study's params-kind cell (a param pytree under `precision.autocast`; f16 only, see the
test) and the data-parallel step on one device. The optimizer is SGD with a power-of-two
learning rate: its update ``p - lr * g`` then holds no rounded product, so the FMA
contraction XLA:CPU makes fusion by fusion (tests/test_optim_inplace.py) cannot change a
bit. With Adam the same arithmetic compiles to different code in these programs (measured
with adamw(1e-2), 3 steps: the data-parallel fp8 step's second moments ``b2 * nu + (1 - b2)
* g * g`` differ from train_step's while its first moments, hence its gradients, are
equal; a vmapped study program's params differ with all moments equal), which the core
does not decide.

`test_train_step_and_the_data_parallel_step_take_the_same_step`: the eager `train_step`
(each op compiled apart, so its params are not compared bit for bit: measured up to 36 ulp
after 3 fp8 steps) skips the same step as the data-parallel step and rolls its fp8 scaling
state back (the data-parallel step kept a skipped step's amax histories before it took the
core)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import precision as mp
from precision import parallel
from precision.study import Task
from precision.study import _batched as study_batched
from precision.study import _models as study_models

STEPS = 3
NONFINITE_AT = 1   # the step whose batch holds an inf: the optimizer skips it


def _recipe():
  return mp.get_recipe("fp8_hybrid").replace(
      fp8=mp.Fp8Config(scaling="delayed", amax_history_len=4))


def _model(recipe):
  model = nnx.Sequential(nnx.Linear(16, 32, use_bias=False, rngs=nnx.Rngs(0)),
                         nnx.Linear(32, 8, use_bias=False, rngs=nnx.Rngs(1)))
  return mp.flax.apply_recipe(model, recipe)


def _batches():
  r = np.random.default_rng(5)
  out = []
  for t in range(STEPS):
    x = r.normal(size=(8, 16)).astype(np.float32)
    if t == NONFINITE_AT:
      x[2, 3] = np.inf
    out.append({"x": x, "y": r.normal(size=(8, 8)).astype(np.float32)})
  return out


def _mse(y, batch):
  return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))


def _bits(tree):
  return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def _assert_same_bits(a, b, what):
  for i, (x, y) in enumerate(zip(_bits(a), _bits(b), strict=True)):
    np.testing.assert_array_equal(x, y, err_msg=f"{what} leaf {i}")


def test_train_step_and_the_data_parallel_step_take_the_same_step():
  recipe = _recipe()
  tx = mp.optim.build_optimizer(recipe, optax.adamw(1e-2))

  # train_step on the NNX model.
  model = _model(recipe)
  opt_state = tx.init(nnx.state(model, nnx.Param))
  fp8_before_skip = None
  for t, batch in enumerate(_batches()):
    if t == NONFINITE_AT:
      fp8_before_skip = jax.tree.map(np.asarray, nnx.state(model, mp.fp8.Fp8State))
    _, opt_state = mp.train_step(model, tx, opt_state, lambda m, b: _mse(m(b["x"]), b),
                                 batch)
    if t == NONFINITE_AT:
      # The skipped step left the fp8 state (amax histories, scales) as it was.
      _assert_same_bits(nnx.state(model, mp.fp8.Fp8State), fp8_before_skip,
                        "train_step fp8 state after the skipped step")
  assert int(mp.optim.optimizer_metrics(opt_state)["skipped_steps"]) == 1

  # The data-parallel step on one device, from the same initial model.
  graphdef, params, fp8_state = nnx.split(_model(recipe), nnx.Param, mp.fp8.Fp8State)

  def loss(params, fp8_state, batch):
    m = nnx.merge(graphdef, params, fp8_state)
    return _mse(m(batch["x"]), batch), nnx.state(m, mp.fp8.Fp8State)

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  dp = parallel.data_parallel(loss, optax.adamw(1e-2), mesh, zero_stage=0, recipe=recipe,
                              fp8_state=True)
  state = dp.init(jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, fp8_state))
  for t, batch in enumerate(_batches()):
    before = jax.tree.map(np.asarray, state.fp8_state)
    state, _ = dp.step(state, dp.shard_batch(batch))
    if t == NONFINITE_AT:
      _assert_same_bits(state.fp8_state, before,
                        "data-parallel fp8 state after the skipped step")

  assert int(mp.optim.optimizer_metrics(state.opt_state)["skipped_steps"]) == 1


# --------------------------------------------------------------- every path, bit for bit

SGD_LR = 2.0 ** -6   # a power of two: lr * g is exact, so no contraction changes a bit


def _recipe_of(name):
  if name == "f16_mixed":
    return mp.get_recipe("f16_mixed")
  # Both GEMMs in fp8 (not the first and last kept in bf16), so every path has fp8 state.
  return mp.get_recipe("fp8_hybrid").replace(fp8=mp.Fp8Config(
      scaling="delayed", amax_history_len=4, keep_first_last=False))


def _f32_model(seed):
  del seed  # one model for every path
  return nnx.Sequential(nnx.Linear(16, 32, use_bias=False, rngs=nnx.Rngs(0)),
                        nnx.Linear(32, 8, use_bias=False, rngs=nnx.Rngs(1)))


def _nnx_loss(m, batch):
  return _mse(m(batch["x"]), batch)


def _params_loss(params, batch):
  # The same GEMMs as the NNX model's, on its kernels as a list.
  return _mse(jnp.dot(jnp.dot(batch["x"], params[0]), params[1]), batch)


def _task(init, loss):
  return Task(init=init, loss=loss, batches=lambda seed: iter(_batches()),
              optimizer=optax.sgd(SGD_LR), eval_batches=lambda: _batches()[:1])


def _through_jit_train_step(recipe):
  model = mp.flax.apply_recipe(_f32_model(0), recipe)
  tx = mp.optim.build_optimizer(recipe, optax.sgd(SGD_LR))
  opt_state = tx.init(nnx.state(model, nnx.Param))
  step = mp.jit_train_step(model, tx, _nnx_loss)
  for batch in _batches():
    _, opt_state = step(opt_state, batch)
  return (nnx.state(model, nnx.Param), opt_state,
          jax.tree.map(np.asarray, nnx.state(model, mp.fp8.Fp8State)))


def _fp8_of(prog, state):
  return nnx.state(nnx.merge(prog.graphdef, state.params, state.model_state),
                   mp.fp8.Fp8State)


def _through_study_step(recipe):
  prog = study_models.build(_task(_f32_model, _nnx_loss), recipe, 0)
  state = prog.state
  for t, batch in enumerate(_batches()):
    state, _ = prog.step(state, batch, jnp.asarray(t, jnp.int32))
  return state.params, state.opt_state, _fp8_of(prog, state)


def _through_study_seed_batch(recipe):
  # The study's seed-batched program as it runs on CPU (precision.study._batched, "loop":
  # the one-seed step once per slot inside one program): the seed and a padding slot
  # that never steps. (A vmapped step sums its GEMMs in another order; the study states
  # that difference, tests/test_study_batched.py.)
  prog = study_models.build(_task(_f32_model, _nnx_loss), recipe, 0)
  # The core the study runs in each slot: the one-seed step's own trace.
  _, core = study_batched.one_seed_step(prog, prog.state, _batches()[0])
  state = study_batched._stack([prog.state, prog.state])
  step = jax.jit(study_batched.batched_step(core, None, "loop"))
  for t, batch in enumerate(_batches()):
    state, _ = step(state, study_batched._stack([batch, batch]), jnp.int32(t),
                    jnp.asarray([0, 0], jnp.uint32), jnp.asarray([True, False]))
  state = jax.tree.map(lambda x: x[0], state)
  return state.params, state.opt_state, _fp8_of(prog, state)


def _through_study_params_kind(recipe):
  kernels = lambda seed: [np.asarray(k) for k in
                          jax.tree.leaves(nnx.state(_f32_model(seed), nnx.Param))]
  prog = study_models.build(_task(kernels, _params_loss), recipe, 0)
  state = prog.state
  for t, batch in enumerate(_batches()):
    state, _ = prog.step(state, batch, jnp.asarray(t, jnp.int32))
  return state.params, state.opt_state, None


def _through_data_parallel(recipe):
  model = mp.flax.apply_recipe(_f32_model(0), recipe)
  graphdef, params, fp8_state = nnx.split(model, nnx.Param, mp.fp8.Fp8State)
  has_fp8 = bool(jax.tree.leaves(fp8_state))
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  if has_fp8:
    def loss(params, fp8_state, batch):
      m = nnx.merge(graphdef, params, fp8_state)
      return _nnx_loss(m, batch), nnx.state(m, mp.fp8.Fp8State)
    dp = parallel.data_parallel(loss, optax.sgd(SGD_LR), mesh, zero_stage=0, recipe=recipe,
                                fp8_state=True)
    state = dp.init(jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, fp8_state))
  else:
    loss = lambda params, batch: _nnx_loss(nnx.merge(graphdef, params, fp8_state), batch)
    dp = parallel.data_parallel(loss, optax.sgd(SGD_LR), mesh, zero_stage=0, recipe=recipe)
    state = dp.init(jax.tree.map(np.asarray, params))
  for batch in _batches():
    state, _ = dp.step(state, dp.shard_batch(batch))
  return state.params, state.opt_state, state.fp8_state if has_fp8 else fp8_state


@pytest.mark.parametrize("name", ["f16_mixed", "fp8_delayed"])
def test_every_path_takes_the_same_step_bit_for_bit(name):
  recipe = _recipe_of(name)
  params, opt_state, fp8_state = _through_jit_train_step(recipe)
  metrics = mp.optim.optimizer_metrics(opt_state)
  assert int(metrics["skipped_steps"]) == 1 and int(metrics["nonfinite_steps"]) == 1
  if name == "f16_mixed":
    # Dynamic loss scaling: the skipped step halved the scale.
    init_scale = mp.optim.optimizer_metrics(mp.optim.build_optimizer(
        recipe, optax.sgd(SGD_LR)).init(params))["loss_scale"]
    assert float(metrics["loss_scale"]) == float(init_scale) / 2
  else:
    assert len(jax.tree.leaves(fp8_state)) == 24   # 2 GEMMs x 3 operands x 4 fields
  paths = {"study step": _through_study_step, "study seed batch": _through_study_seed_batch,
           "data-parallel step": _through_data_parallel}
  if name == "f16_mixed":
    # Not under fp8: the study's params kind runs the recipe through precision.autocast,
    # whose fp8 GEMMs return the compute dtype (bf16), while an NNX fp8 layer under
    # apply_recipe returns its f32 accumulator (Fp8DotGeneral's out_dtype under autocast):
    # the next GEMM then quantises different values. A difference of the two
    # interpreters, not of the step core.
    paths["study params kind"] = _through_study_params_kind
  for what, through in paths.items():
    p, o, f = through(recipe)
    _assert_same_bits(p, params, f"{what} params")
    _assert_same_bits(o, opt_state, f"{what} optimizer state")
    if f is not None:
      _assert_same_bits(f, fp8_state, f"{what} fp8 state")
