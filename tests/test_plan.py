"""precision.bind and the Plan every entry point takes: one interpretation of a recipe, so
a model marked with overrides and trained through data_parallel runs the same GEMMs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import precision as mp

F32 = jnp.float32


class Net(nnx.Module):
  """A body and a head, written with no dtype in mind."""

  def __init__(self, rngs):
    self.body = nnx.Linear(8, 16, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.body(x)))


def _batch():
  x = jax.random.normal(jax.random.key(1), (4, 8), F32)
  y = jax.random.normal(jax.random.key(2), (4, 4), F32)
  return {"x": x, "y": y}


def _loss(m, b):
  return jnp.mean(jnp.square(m(b["x"]) - b["y"]))


def _signatures(report, pattern):
  return {(g.lhs_dtype, g.rhs_dtype) for g in report.gemms_in_scope(pattern)}


def _dp(model, **kwargs):
  """A data-parallel step on 2 devices whose loss_fn merges the (marked) model."""
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params, batch):
    m = nnx.merge(graphdef, params)
    return jnp.mean(jnp.square(m(batch["x"]) - batch["y"]))

  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  dp = mp.parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh, **kwargs)
  return dp, params


def _dp_report(model, **kwargs):
  dp, params = _dp(model, **kwargs)
  state = dp.init(params)
  return mp.audit.audit(dp.step, state, _batch())


def _own_report(model):
  return mp.audit.audit(nnx.grad(_loss), model, _batch())


@pytest.mark.parametrize("how", ["same_recipe", "plan", "overrides"])
def test_data_parallel_keeps_the_models_overrides(how):
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), "bf16_mixed", overrides={"head": "f32"})
  own = _own_report(model)
  assert _signatures(own, "head*") == {("float32", "float32")}
  assert _signatures(own, "body*") == {("bfloat16", "bfloat16")}
  kwargs = {"same_recipe": {"recipe": "bf16_mixed"},
            "plan": {"recipe": mp.bind("bf16_mixed", overrides={"head": "f32"})},
            "overrides": {"recipe": "bf16_mixed", "overrides": {"head": "f32"}}}[how]
  report = _dp_report(model, **kwargs)
  assert _signatures(report, "*head*") == {("float32", "float32")}
  assert _signatures(report, "*body*") == {("bfloat16", "bfloat16")}


def test_data_parallel_refuses_a_model_marked_with_another_recipe():
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), "bf16_master")
  with pytest.raises(ValueError, match="bf16_master.*bf16_sr"):
    _dp_report(model, recipe="bf16_sr")
  plan = mp.bind("bf16_mixed", overrides={"head": "f32"})
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), plan)
  with pytest.raises(ValueError, match="'head'.*'body'"):
    _dp_report(model, recipe=mp.bind("bf16_mixed", overrides={"body": "f32"}))


def test_data_parallel_overrides_need_a_recipe_and_no_plan():
  with pytest.raises(ValueError, match="without a recipe"):
    _dp(Net(nnx.Rngs(0)), overrides={"head": "f32"})
  with pytest.raises(ValueError, match="already bound"):
    _dp(Net(nnx.Rngs(0)), recipe=mp.bind("bf16_mixed"), overrides={"head": "f32"})


@pytest.mark.parametrize("recipe", ["plan", "bf16_mixed"])
def test_data_parallel_loss_is_the_models_own(recipe):
  plan = mp.bind("bf16_mixed", overrides={"head": "f32"})
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), plan)
  batch = _batch()
  # The marked model's own calls on each device's half of the batch, then the mean.
  halves = [{k: v[i * 2:(i + 1) * 2] for k, v in batch.items()} for i in range(2)]
  own = np.mean([float(jax.jit(_loss)(model, h)) for h in halves])
  dp, params = _dp(model, recipe=plan if recipe == "plan" else recipe)
  _, metrics = dp.step(dp.init(params), batch)
  np.testing.assert_allclose(float(metrics["loss"]), own, rtol=1e-6)
  # Every GEMM in bf16 (the overrides lost) gives another loss.
  plain = mp.flax.apply_recipe(Net(nnx.Rngs(0)), "bf16_mixed")
  all_bf16 = np.mean([float(jax.jit(_loss)(plain, h)) for h in halves])
  assert abs(all_bf16 - own) > 1e-5 * abs(own)


# ----------------------------------------------------------------------------- bind


def test_bind_holds_what_the_recipe_means():
  plan = mp.bind("bf16_master", overrides={"*head*": "f32"})
  recipe = mp.get_recipe("bf16_master")
  assert plan.recipe == recipe and plan.policy == recipe.policy
  assert (plan.param_dtype, plan.compute_dtype, plan.output_dtype, plan.reduce_dtype) == (
      np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16), np.dtype(F32), np.dtype(F32))
  assert plan.fp8 is None and mp.bind("fp8_hybrid").fp8 == mp.get_recipe("fp8_hybrid").fp8
  assert plan.fp32_ops == recipe.fp32_ops
  assert plan.overrides == {"*head*": mp.get_policy("f32")}
  assert plan.bytes_per_param == mp.optim.bytes_per_param(recipe) == 16.0
  assert plan.memory_ledger("sgd") == mp.optim.memory_ledger(recipe, "sgd")
  assert plan.autocast_spec.recipe == recipe
  assert mp.bind(recipe, {"*head*": "f32"}) == plan and hash(plan) == hash(
      mp.bind(recipe, {"*head*": "f32"}))
  # The optimizer: build_optimizer's, from the plan or from the recipe.
  params = {"w": jnp.ones((3,), jnp.bfloat16)}
  grads = {"w": jnp.full((3,), 0.5, jnp.bfloat16)}
  for tx in (plan.optimizer(optax.adamw(1e-2)), mp.optim.build_optimizer(plan, optax.adamw(1e-2))):
    ref = mp.optim.build_optimizer(recipe, optax.adamw(1e-2))
    u, _ = tx.update(grads, tx.init(params), params)
    u_ref, _ = ref.update(grads, ref.init(params), params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), u, u_ref))


def test_bind_errors_name_the_bad_value():
  with pytest.raises(ValueError, match="Unknown recipe 'bf17'"):
    mp.bind("bf17")
  with pytest.raises(ValueError, match="Override 'head'.*'f33'"):
    mp.bind("bf16_mixed", overrides={"head": "f33"})
  with pytest.raises(ValueError, match="already bound"):
    mp.bind(mp.bind("bf16_mixed"))
  with pytest.raises(ValueError, match="already bound"):
    mp.autocast(lambda x: x, mp.bind("bf16_mixed"), overrides={"head": "f32"})
  with pytest.raises(ValueError, match="fp32_ops"):
    mp.bind("bf16_mixed", fp32_ops=["softmax", "no_such_op"])


def test_entry_points_take_a_plan_as_they_take_recipe_and_overrides():
  plan = mp.bind("bf16_mixed", overrides={"head": "f32"})
  by_plan = mp.flax.apply_recipe(Net(nnx.Rngs(0)), plan)
  by_args = mp.flax.apply_recipe(Net(nnx.Rngs(0)), "bf16_mixed", overrides={"head": "f32"})
  assert mp.flax.spec_of(by_plan) == mp.flax.spec_of(by_args) == plan.autocast_spec
  with pytest.raises(ValueError, match="already bound"):
    mp.flax.apply_recipe(Net(nnx.Rngs(0)), plan, overrides={"body": "f32"})
  rep = mp.audit.audit(nnx.grad(_loss), by_plan, _batch())
  assert rep.gemm_signatures() == mp.audit.audit(nnx.grad(_loss), by_args,
                                                 _batch()).gemm_signatures()
  rep.check(plan)                               # the plan brings its overrides
  rep.check("bf16_mixed", {"head": "f32"})      # a preset name is a recipe
  with pytest.raises(mp.PrecisionViolation, match="head"):
    rep.check("bf16_mixed")
  # autocast: a pure function with a named scope, the plan's override on it.
  def f(w, x):
    with jax.named_scope("head"):
      return jnp.sum(x @ w)
  w, x = jnp.ones((4, 4), F32), jnp.ones((2, 4), F32)
  sig = lambda fn: mp.audit.audit(jax.grad(fn), w, x).gemm_signatures()
  assert sig(mp.autocast(f, plan)) == sig(mp.autocast(f, "bf16_mixed", {"head": "f32"}))
  assert set(sig(mp.autocast(f, plan))) == {("f32", "f32", "f32", "f32")}
  # The lowered program's check: override dtypes accepted (it has no module scopes).
  prog = mp.audit.lower(jax.grad(mp.autocast(f, plan)), w, x, platform="cpu")
  prog.check(plan)
  with pytest.raises(mp.PrecisionViolation):
    prog.check("bf16_mixed")
