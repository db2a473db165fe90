"""What `precision.bind` decides, as data on the Plan (optimizer chain, memory ledger, the
GEMM dtypes a lowering must show), and the entry points that take a Plan besides a
recipe or a preset name: fp8's explicit state, the checkpoint (which records the plan's
overrides, compared on restore), numerics and the audit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision as mp
import precision.optim  # noqa: F401
from precision import checkpoint
from precision._plan import GemmDtypes, OptimizerDecisions

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)

# Each preset's optimizer chain, written out by hand from the presets' definitions
# (precision._recipe._presets): (updates, moment dtypes or None, loss scale kind or None).
CHAINS = {
    "fp32": ("as_is", None, None),
    "bf16_mixed": ("as_is", None, None),
    "bf16_master": ("master", None, None),
    "bf16_sr": ("stochastic", None, None),
    "bf16_kahan": ("kahan", None, None),
    "pure_bf16": ("f32_update", (BF16, BF16), None),
    "f16_mixed": ("as_is", None, "dynamic"),
    "fp8_hybrid": ("as_is", None, None),
    "mxfp8": ("as_is", None, None),
    "nvfp4": ("as_is", None, None),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_optimizer_decisions_of_every_preset(name):
  opt = mp.bind(name).optimizer_decisions
  assert isinstance(opt, OptimizerDecisions)
  updates, moments, scale = CHAINS[name]
  assert (opt.updates, opt.moment_dtypes) == (updates, moments)
  assert (None if opt.loss_scale is None else opt.loss_scale.kind) == scale
  assert opt.fused is False and opt.spike_guard is None and opt.recipe_name == name
  assert opt.seeds_rounding == (name == "bf16_sr")


def test_fused_and_spike_guard_decisions_and_the_ledger_reads_them():
  recipe = mp.get_recipe("bf16_sr").replace(
      name="sr_fused", fused=True, spike_guard=mp.SpikeGuardConfig())
  plan = mp.bind(recipe)
  opt = plan.optimizer_decisions
  assert opt.fused and opt.seeds_rounding and opt.spike_guard == mp.SpikeGuardConfig()
  # bf16 params and grads, no master, f32 moments: 2 + 2 + 4 + 4.
  assert plan.memory_ledger() == {"params": 2.0, "grads": 2.0, "master": 0.0,
                                  "compensation": 0.0, "mu": 4.0, "nu": 4.0}
  assert plan.bytes_per_param == mp.optim.bytes_per_param(plan) == 12.0
  # Kahan: a compensation buffer in the param dtype; sgd keeps no moment.
  assert mp.optim.memory_ledger("bf16_kahan", "sgd") == {
      "params": 2.0, "grads": 2.0, "master": 0.0, "compensation": 2.0, "mu": 0.0,
      "nu": 0.0}
  with pytest.raises(ValueError, match="inner='adagrad'; accepted: adamw"):
    plan.memory_ledger("adagrad")


def test_gemm_dtypes_the_lowering_must_show():
  g = mp.bind("bf16_mixed", overrides={"*head*": "f32"}).gemms
  assert isinstance(g, GemmDtypes)
  assert (g.compute, g.allowed, g.fwd8, g.micro) == (
      "bfloat16", frozenset({"bfloat16", "float32"}), None, None)
  g = mp.bind("fp8_hybrid").gemms
  assert (g.fwd8, g.bwd8, g.micro) == ("float8_e4m3fn", "float8_e5m2", None)
  g = mp.bind("mxfp8").gemms
  assert (g.fwd8, g.micro, g.micro_elements, g.micro_scale, g.micro_block) == (
      None, "mxfp8", ("float8_e4m3fn", "float8_e4m3fn"), "float8_e8m0fnu", 32)
  g = mp.bind("nvfp4").gemms
  assert (g.micro_elements, g.micro_scale, g.micro_block) == (
      ("float4_e2m1fn", "float4_e2m1fn"), "float8_e4m3fn", 16)


# ----------------------------------------------------------------------- checkpoint


def _state(recipe):
  plan = mp.bind(recipe) if not isinstance(recipe, mp.Plan) else recipe
  params = plan.policy.cast_to_param({"w": jnp.ones((4, 2), jnp.float32)})
  tx = mp.optim.build_optimizer(plan, optax.adamw(1e-2))
  return checkpoint.TrainState(params, tx.init(params), {},
                               jax.random.key_data(jax.random.key(0)))


def test_checkpoint_records_the_plans_overrides_and_restore_compares_them(tmp_path):
  plan = mp.bind("bf16_mixed", overrides={"*head*": "f32"})
  state = _state(plan)
  checkpoint.save(tmp_path, 1, state, recipe=plan)
  # The same plan, the recipe alone and the preset name restore it.
  for given in (plan, mp.bind("bf16_mixed", overrides={"*head*": "f32"}),
                plan.recipe, "bf16_mixed", None):
    r = checkpoint.restore(tmp_path, state, recipe=given)
    assert r.recipe == plan.recipe and r.converted == ()
  # A plan with other overrides (or none) is another configuration: refused.
  for other in (mp.bind("bf16_mixed"), mp.bind("bf16_mixed", overrides={"*head*": "bf16"})):
    with pytest.raises(checkpoint.CheckpointMismatchError, match="plan overrides"):
      checkpoint.restore(tmp_path, state, recipe=other)
  with pytest.raises(checkpoint.CheckpointMismatchError, match="plan fp32_ops"):
    checkpoint.restore(tmp_path, state, recipe=mp.bind(
        "bf16_mixed", overrides={"*head*": "f32"}, fp32_ops=["softmax"]))
  with pytest.raises(ValueError, match="recipe=3.*accepted: None .* a Plan"):
    checkpoint.restore(tmp_path, state, recipe=3)


def test_checkpoint_of_a_recipe_records_no_overrides(tmp_path):
  state = _state("bf16_mixed")
  checkpoint.save(tmp_path, 1, state, recipe="bf16_mixed")  # a preset name is a recipe
  checkpoint.restore(tmp_path, state, recipe=mp.bind("bf16_mixed"))
  with pytest.raises(checkpoint.CheckpointMismatchError, match="plan overrides"):
    checkpoint.restore(tmp_path, state, recipe=mp.bind("bf16_mixed", {"*head*": "f32"}))
  with pytest.raises(ValueError, match="recipe=1.5 .*accepted: a precision.Recipe"):
    checkpoint.save(tmp_path, 2, state, recipe=1.5)


# -------------------------------------------------------------------------- fp8


def _loss(ws, x):
  for i, w in enumerate(ws):
    with jax.named_scope(f"l{i}"):
      x = jnp.tanh(x @ w)
  return jnp.mean(x ** 2)


def test_fp8_state_functions_take_a_plan():
  ws, x = [jnp.full((4, 4), 0.1)] * 4, jnp.ones((2, 4))
  plan = mp.bind("fp8_hybrid", overrides={"l2": "f32"})
  by_plan = mp.fp8.init_state(_loss, plan, ws, x)
  by_args = mp.fp8.init_state(_loss, "fp8_hybrid", ws, x, overrides={"l2": "f32"})
  assert sorted(by_plan) == sorted(by_args) == ["1:l1"]  # first, last and l2 stay out
  assert mp.fp8.autocast_gemms(_loss, plan, ws, x) == mp.fp8.autocast_gemms(
      _loss, "fp8_hybrid", ws, x, overrides={"l2": "f32"})
  vg = mp.fp8.autocast_value_and_grad(_loss, plan)
  value, _, new = vg(by_plan, ws, x)
  ref = mp.fp8.autocast_value_and_grad(_loss, "fp8_hybrid", overrides={"l2": "f32"})
  value_ref, _, new_ref = ref(by_args, ws, x)
  assert float(value) == float(value_ref)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new, new_ref))
  with pytest.raises(ValueError, match="already bound"):
    mp.fp8.init_state(_loss, plan, ws, x, overrides={"l1": "f32"})
  with pytest.raises(ValueError, match="recipe=1; accepted: .* a Plan"):
    mp.fp8.autocast_gemms(_loss, 1, ws, x)


# --------------------------------------------------------------- numerics, audit


def test_numerics_and_audit_take_a_plan():
  ws, x = [jnp.full((4, 4), 0.1)] * 2, jnp.ones((2, 4))
  plan = mp.bind("bf16_mixed", overrides={"l1": "f32"})
  by_plan = mp.numerics.inspect(_loss, plan, ws, x)
  by_recipe = mp.numerics.inspect(_loss, "bf16_mixed", ws, x)
  dtypes = {r.scope: r.dtype for r in by_plan.rows if r.scope}
  assert dtypes and {dtypes[s] for s in dtypes if s.startswith("l1")} == {"float32"}
  assert {dtypes[s] for s in dtypes if s.startswith("l0")} == {"bfloat16"}
  # Without the plan's override, l1 runs in bf16 too.
  assert {r.dtype for r in by_recipe.rows if r.scope.startswith("l1")} == {"bfloat16"}
  rep = mp.audit.audit(jax.grad(mp.autocast(_loss, plan)), ws, x)
  assert rep.violations(plan) == rep.violations("bf16_mixed", {"l1": "f32"}) == []
  assert rep.violations("bf16_mixed")  # without the override, l1's f32 GEMMs offend
  with pytest.raises(ValueError, match="bisect sets the overrides itself"):
    mp.numerics.bisect(lambda recipe, overrides: None, plan, state=None, batches=[],
                       steps=1, tolerance=0.1)
